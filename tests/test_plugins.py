"""A schedule and a partitioner from a package outside the project: one callable and one YAML each,
found through Hydra's search path, run by name, and compared by scheduler=auto with the built-ins.
This is what docs/design.md ("adding a schedule, a partitioner, a model") tells a user to do. A
schedule added by a YAML alone (an existing class with other options) is an option like the others:
the launcher's group listing and the tests' (tests/schedules.py) both see it."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig

from pipelaunch.launcher.config import group_configs, register_configs
from pipelaunch.pipeline.planner.placement import placement_for
from pipelaunch.pipeline.planner.predict.simulate import CostModel, simulate
from pipelaunch.pipeline.planner.schedules import build_schedule
from tests.harness import CONF, FAST, ROOT, compose_cfg
from tests.reference import reference_run
from tests.schedules import schedules
from tests.test_cli import metrics, train

PACKAGE = '''
"""A user's own plug-ins: a schedule and a partitioner."""

from dataclasses import dataclass
from typing import ClassVar

from pipelaunch.pipeline.core.ir import B, F
from pipelaunch.pipeline.planner.partition import evaluate
from pipelaunch.pipeline.planner.partition.common import assignment_from_order, topo_order
from pipelaunch.pipeline.planner.schedules.base import ScheduleGenerator


@dataclass(frozen=True)
class LastInFirstOut(ScheduleGenerator):
    """GPipe's forwards, then the backwards newest micro-batch first."""

    name: ClassVar[str] = "lifo"
    supported_placements: ClassVar[tuple] = ("linear",)

    def compute_actions(self, placement, microbatches, costs=None, *, first_order=False):
        programs = [[] for _ in range(max(placement) + 1)]
        for stage, rank in enumerate(placement):
            programs[rank] += [F(stage, mb) for mb in range(microbatches)]
        for stage in reversed(range(len(placement))):
            programs[placement[stage]] += [B(stage, mb) for mb in reversed(range(microbatches))]
        return programs


def head_first(graph, num_stages, request, head_nodes=1):
    """Every stage but the first gets `head_nodes` nodes; the first takes the rest."""
    order = topo_order(graph)
    first = len(order) - head_nodes * (num_stages - 1)
    starts = [0] + [first + head_nodes * s for s in range(num_stages - 1)]
    return evaluate(graph, assignment_from_order(order, starts), num_stages, method="head_first", **request.pricing())


head_first.needs_profile = False
'''


@pytest.fixture
def user_package(tmp_path: Path) -> tuple[Path, dict]:
    (tmp_path / "myplugins").mkdir()
    (tmp_path / "myplugins" / "__init__.py").write_text(PACKAGE)
    conf = tmp_path / "myconf"
    (conf / "scheduler").mkdir(parents=True)
    (conf / "partitioner").mkdir()
    (conf / "scheduler" / "lifo.yaml").write_text("_target_: myplugins.LastInFirstOut\n")
    (conf / "partitioner" / "head_first.yaml").write_text(textwrap.dedent("""\
        _target_: myplugins.head_first
        head_nodes: 2
    """))
    env = os.environ.copy()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(ROOT), env.get("PYTHONPATH", "")])
    return conf, env


@pytest.mark.timeout(400)
def test_a_users_schedule_and_partitioner_run_by_name_and_in_auto(user_package, tmp_path) -> None:
    conf, env = user_package
    search = f"hydra.searchpath=[file://{conf}]"
    proc = train([*FAST, "pp=2", "microbatches=4", search, "scheduler=lifo", "partitioner=head_first"],
                 tmp_path / "mine", env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    mine = metrics(tmp_path / "mine")
    plan = json.loads((tmp_path / "mine" / "plan.json").read_text())
    assert mine["schedule"] == "lifo"
    assert [len(s["blocks"]) for s in plan["stages"]] == [6, 2]  # FAST: embed, 6 layers, head
    assert plan["meta"]["partitioner"] == "head_first"

    single = reference_run(compose_cfg([*FAST, "pp=2", "microbatches=4"]), capture_state=False)
    assert mine["losses"] == pytest.approx(single["losses"], rel=1e-5)

    proc = train([*FAST, "pp=2", "microbatches=4", search, "scheduler=auto", "partitioner=head_first"],
                 tmp_path / "auto", env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "scheduler=auto planned and simulated" in proc.stdout
    auto = metrics(tmp_path / "auto")
    # every candidate the search compared (the printed table shows the ten fastest, which depend on the profile)
    compared = {row["scheduler"] for row in auto["plan_search"]["top"] + auto["plan_search"]["excluded"]}
    assert {"lifo", "1f1b", "zbv"} <= compared, compared
    assert auto["losses"] == pytest.approx(mine["losses"], rel=1e-5)


def test_a_schedule_added_only_by_yaml_is_an_option_the_launcher_and_the_tests_see(
        user_package, tmp_path, monkeypatch) -> None:
    """`scheduler/interleaved_3.yaml` on the user's search path: no code, an existing class with
    other options. Composed as train.py composes (hydra.searchpath), it is selectable by name and
    listed by `group_configs` (what scheduler=auto and plan=auto compare) beside the user's own
    class and the built-ins; the tests' schedule list, read the same way, builds and simulates it."""
    conf, _ = user_package
    (conf / "scheduler" / "interleaved_3.yaml").write_text(textwrap.dedent("""\
        _target_: pipelaunch.pipeline.planner.schedules.interleaved.Interleaved1F1B
        stages_per_rank: 3
    """))
    monkeypatch.syspath_prepend(str(tmp_path))  # the user's package (myplugins) for `lifo`
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF)):
        cfg = compose(config_name="train", return_hydra_config=True,
                      overrides=[f"hydra.searchpath=[file://{conf}]", "scheduler=interleaved_3"])
    assert cfg.scheduler.stages_per_rank == 3
    assert "interleaved_3" not in group_configs("scheduler")  # outside the app: the project's conf/ only
    HydraConfig.instance().set_config(cfg)
    try:
        options = group_configs("scheduler")
        found = schedules()
    finally:
        HydraConfig.instance().cfg = None
    assert options["interleaved_3"] == {"_target_": "pipelaunch.pipeline.planner.schedules.interleaved.Interleaved1F1B",
                                        "stages_per_rank": 3}
    assert {"interleaved_3", "lifo", "interleaved_1f1b", "1f1b", "auto"} <= set(options)
    assert {"interleaved_3", "lifo", "1f1b"} <= set(found) and "auto" not in found
    gen = found["interleaved_3"]
    assert gen.stages_per_rank() == 3
    sched = build_schedule(gen, placement_for(gen, 2), 4)
    assert sched.num_stages == 6
    assert simulate(sched, CostModel.uniform(6)).makespan_s > 0
