"""The folders show the flow: a rank receives the Plan and builds from it, importing no planning code."""

from __future__ import annotations

import subprocess
import sys

from tests.harness import ROOT

PLANNING = ("pipeline.planner", "pipeline.partition", "pipeline.schedules", "pipeline.graph.profile",
            "launcher.validate", "scipy")


def test_a_rank_imports_no_planning_code() -> None:
    """What a spawned rank loads: its entry point, the Plan it unpickles, its stage builder."""
    code = ("import sys, launcher.worker, pipeline.plan, pipeline.stage, pipeline.runtime.trainer; "
            f"print(sorted(m for m in sys.modules if m.startswith({PLANNING!r})))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
