"""The folders show the flow: a rank receives the Plan and builds from it, importing no planning code."""

from __future__ import annotations

import subprocess
import sys

from tests.harness import ROOT

PLANNING = ("pipeline.planner", "pipeline.planner.partition", "pipeline.planner.schedules", "pipeline.planner.profile",
            "launcher.validate", "scipy")


def test_a_rank_imports_no_planning_code() -> None:
    """What a spawned rank loads: its entry point, the Plan it unpickles, its stage builder."""
    code = ("import sys, pipeline.runtime.rank, pipeline.core.plan, pipeline.runtime.stage, pipeline.runtime.trainer; "
            f"print(sorted(m for m in sys.modules if m.startswith({PLANNING!r})))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def _imports(path) -> set[str]:
    """Every module a file imports, at its top or inside a function."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
    return found


def test_the_library_never_imports_the_launcher() -> None:
    """pipeline/ and models/ sit below launcher/: the launcher drives them, never the reverse."""
    offenders = {str(p.relative_to(ROOT)): sorted(m for m in _imports(p) if m.split(".")[0] == "launcher")
                 for folder in ("pipeline", "models") for p in (ROOT / folder).rglob("*.py")}
    assert {k: v for k, v in offenders.items() if v} == {}
