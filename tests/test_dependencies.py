"""The one statement of the schedule IR's dependency rules, and the import order around it."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from pipelaunch.pipeline.core.ir import Kind
from pipelaunch.pipeline.planner.passes.dependencies import (
    COMPLETES,
    READS,
    Progress,
    Step,
    needs,
    released_stage,
    wait_table,
)

ROOT = Path(__file__).resolve().parents[1]


def test_rules_as_the_docstring_states_them() -> None:
    n = 4
    assert needs(Kind.F, 0, n) == ()
    assert [(x.step, x.stage, x.cut) for x in needs(Kind.F, 2, n)] == [(Step.FORWARD, 1, 1)]
    for kind in (Kind.B, Kind.I):
        assert [(x.step, x.stage, x.cut) for x in needs(kind, 1, n)] == [
            (Step.FORWARD, 1, None), (Step.INPUT_GRAD, 2, 1)]
        assert [(x.step, x.stage, x.cut) for x in needs(kind, 1, n, remat=True)] == [
            (Step.FORWARD, 1, None), (Step.RECOMPUTE, 1, None), (Step.INPUT_GRAD, 2, 1)]
        assert [x.stage for x in needs(kind, n - 1, n)] == [n - 1]  # the last stage starts the backward
    assert [(x.step, x.stage, x.label) for x in needs(Kind.W, 3, n)] == [(Step.INPUT_GRAD, 3, "I")]
    assert [(x.step, x.stage) for x in needs(Kind.R, 3, n)] == [(Step.FORWARD, 3)]
    for kind in (Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B):
        assert needs(kind, 1, n) == ()
    assert set(COMPLETES) == {Kind.F, Kind.B, Kind.I, Kind.W, Kind.R}
    assert COMPLETES[Kind.B] is COMPLETES[Kind.I] is Step.INPUT_GRAD
    assert READS == {Kind.RECV_F: Step.FORWARD, Kind.RECV_B: Step.INPUT_GRAD}


@pytest.mark.parametrize("num_stages", [1, 2, 5])
def test_released_stage_is_the_converse_of_needs_across_a_cut(num_stages: int) -> None:
    for kind in COMPLETES:
        for stage in range(num_stages):
            waiting = {other for k in COMPLETES for other in range(num_stages) for remat in (False, True)
                       for x in needs(k, other, num_stages, remat)
                       if x.cut is not None and x.step is COMPLETES[kind] and x.stage == stage}
            released = released_stage(kind, stage, num_stages)
            assert waiting == (set() if released is None else {released}), (kind, stage)


def test_wait_table_fills_in_the_transfer_of_the_cut() -> None:
    hop = [0.5, 0.0, 2.0]
    table = wait_table(4, hop)
    assert table[(Kind.F, False)][1] == ((Step.FORWARD, 0, 0.5),)
    assert table[(Kind.I, True)][2] == ((Step.FORWARD, 2, 0.0), (Step.RECOMPUTE, 2, 0.0), (Step.INPUT_GRAD, 3, 2.0))
    assert wait_table(4)[(Kind.F, False)][1] == ((Step.FORWARD, 0, 0.0),)


def test_progress_notes_waiters_and_wakes_them() -> None:
    progress = Progress(num_stages=2, microbatches=3)
    waits = wait_table(2, [1.5])[(Kind.F, False)][1]
    assert progress.earliest_start(waits, 2, 0.0, rank=1) is None
    assert list(progress.finish(Step.FORWARD, 0, 2, 4.0)) == [1]
    assert progress.finished(Step.FORWARD, 0, 2) and not progress.finished(Step.FORWARD, 0, 1)
    assert progress.earliest_start(waits, 2, 0.0, rank=1) == 5.5
    assert progress.earliest_start(waits, 2, 7.0, rank=1) == 7.0
    assert list(progress.finish(Step.FORWARD, 0, 2, 4.0)) == []


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_imports_run_one_way() -> None:
    """dependencies <- simulate <- shared_cores; simulate <- fuse <- base: no module imports back."""
    planner = ROOT / "pipeline" / "planner"
    assert not {m for m in _imports(planner / "passes" / "dependencies.py") if m.startswith("pipelaunch.pipeline.planner")}
    assert {m for m in _imports(planner / "predict" / "simulate.py") if m.startswith("pipelaunch.pipeline.planner")} == {
        "pipelaunch.pipeline.planner.passes.dependencies"}
    assert "pipelaunch.pipeline.planner.schedules.base" not in _imports(planner / "schedules" / "fuse.py")
    for module in ("pipelaunch.pipeline.planner.schedules.fuse", "pipelaunch.pipeline.planner.schedules.base"):  # each imported first
        subprocess.run([sys.executable, "-c", f"import {module}"], check=True, cwd=ROOT)
