"""The folders show the flow: a rank receives the Plan and builds from it, importing no planning code."""

from __future__ import annotations

import subprocess
import sys

from tests.harness import ROOT

PLANNING = ("pipelaunch.pipeline.planner", "pipelaunch.pipeline.planner.partition", "pipelaunch.pipeline.planner.schedules", "pipelaunch.pipeline.planner.measure.profile",
            "pipelaunch.launcher.validate", "scipy")


def test_a_rank_imports_no_planning_code() -> None:
    """What a spawned rank loads: its entry point, the Plan it unpickles, its stage builder."""
    code = ("import sys, pipelaunch.pipeline.runtime.rank, pipelaunch.pipeline.core.plan, pipelaunch.pipeline.runtime.stage, pipelaunch.pipeline.runtime.trainer; "
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
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def test_the_library_never_imports_the_launcher() -> None:
    """pipeline/ and models/ sit below launcher/: the launcher drives them, never the reverse."""
    offenders = {str(p.relative_to(ROOT)): sorted(m for m in _imports(p) if m.startswith("pipelaunch.launcher"))
                 for folder in ("pipeline", "models") for p in (ROOT / folder).rglob("*.py")}
    assert {k: v for k, v in offenders.items() if v} == {}


#: package -> the packages it may import: the flow's layers, each above the ones it lists
#: (planner and runtime both stand on pipeline.compute, the backward split, threads, allocator and
#: tensor peaks, so the planner measures what a rank runs without importing the runtime, and the
#: runtime never reads the planner)
LAYERS = {
    "pipelaunch.pipeline.core": set(),
    "pipelaunch.pipeline.graph": {"pipelaunch.pipeline.core"},
    "pipelaunch.pipeline.compute": {"pipelaunch.pipeline.core"},
    "pipelaunch.models": {"pipelaunch.pipeline.core", "pipelaunch.pipeline.graph"},
    "pipelaunch.pipeline.data": {"pipelaunch.pipeline.core", "pipelaunch.pipeline.graph"},
    "pipelaunch.pipeline.runtime": {"pipelaunch.pipeline.core", "pipelaunch.pipeline.graph", "pipelaunch.pipeline.compute", "pipelaunch.models",
                                    "pipelaunch.pipeline.data"},
    "pipelaunch.pipeline.planner": {"pipelaunch.pipeline.core", "pipelaunch.pipeline.graph", "pipelaunch.pipeline.compute", "pipelaunch.models"},
    "pipelaunch.pipeline.report": {"pipelaunch.pipeline.core", "pipelaunch.pipeline.planner"},
    "pipelaunch.launcher": {"pipelaunch.pipeline.core", "pipelaunch.pipeline.graph", "pipelaunch.pipeline.compute", "pipelaunch.models", "pipelaunch.pipeline.data", "pipelaunch.pipeline.runtime",
                 "pipelaunch.pipeline.planner", "pipelaunch.pipeline.report"},
}


def _module_graph():
    """Every import between the product's modules (at a file's top or inside a function)."""
    import networkx as nx

    def name(path) -> str:
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        return ".".join(["pipelaunch", *(parts[:-1] if parts[-1] == "__init__" else parts)])

    modules = {name(p): p for folder in ("pipeline", "launcher", "models") for p in (ROOT / folder).rglob("*.py")}
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for module, path in modules.items():
        for imported in _imports(path):
            if imported in modules and imported != module:
                graph.add_edge(module, imported)
    return graph


def _package(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:3]) if parts[1] == "pipeline" and len(parts) > 2 else ".".join(parts[:2])


def test_packages_import_only_the_layers_below_them_and_no_module_cycles() -> None:
    import networkx as nx

    graph = _module_graph()
    assert list(nx.simple_cycles(graph)) == []
    upward = sorted(f"{a} -> {b}" for a, b in graph.edges
                    if _package(a) != _package(b) and _package(b) not in LAYERS[_package(a)])
    assert upward == []
    assert {_package(m) for m in graph} <= set(LAYERS) | {"pipelaunch.pipeline"}


def test_no_product_module_is_used_only_by_the_tests() -> None:
    """Everything under pipeline/ is reached from an entry point (the launcher, a module run as a
    command, a plug-in conf/ names), not only from tests."""
    import networkx as nx

    graph = _module_graph()
    targets = {line.split(":", 1)[1].strip().rsplit(".", 1)[0] for path in (ROOT / "conf").rglob("*.yaml")
               for line in path.read_text().splitlines() if line.strip().startswith("_target_:")}
    files = {m: ROOT / (m.removeprefix("pipelaunch.").replace(".", "/") + ".py") for m in graph}
    commands = {m for m, f in files.items() if f.is_file() and "__main__" in f.read_text()}
    roots = {m for m in graph if m.startswith("pipelaunch.launcher")} | {t for t in targets if t in graph} | commands
    reached = roots | {d for r in roots for d in nx.descendants(graph, r)}
    assert sorted(m for m in graph if m.startswith("pipelaunch.pipeline.") and files[m].is_file() and m not in reached) == []


def test_the_design_table_lists_every_package_and_module() -> None:
    """docs/design.md's package table names every module of each package it lists, and no other."""
    import re

    text = (ROOT / "docs" / "design.md").read_text()
    rows = re.findall(r"^\| `(pipeline/[\w/]+/|launcher/|models/)` \|[^|]*\| (.*) \|$", text, re.M)
    assert {folder for folder, _ in rows} >= {"pipeline/core/", "pipeline/graph/", "pipeline/data/",
                                              "pipeline/runtime/", "pipeline/planner/", "pipeline/report/",
                                              "launcher/", "models/"}
    for folder, modules in rows:
        named = set(re.findall(r"`([\w/]+(?:\.py|/))`", modules))
        files = {p.name for p in (ROOT / folder).glob("*.py") if p.name != "__init__.py"}
        files |= {f"{p.name}/" for p in (ROOT / folder).iterdir() if (p / "__init__.py").is_file()}
        assert named == files, (folder, sorted(files - named), sorted(named - files))


def test_no_target_or_dictconfig_below_the_launcher() -> None:
    """Plug-ins are built once, at the edge (launcher/plugins.py): below the launcher nothing reads
    how an option names its callable, nor holds an OmegaConf node; the planner and the ranks see
    the typed objects the launcher built (pipelaunch.pipeline.core.plugins). Comments and
    docstrings count: they would describe a mechanism that is not there."""
    target, node = "_target_", "DictConfig"
    offenders = sorted(str(p.relative_to(ROOT)) for folder in ("pipeline", "models") for p in (ROOT / folder).rglob("*.py")
                       if target in p.read_text() or node in p.read_text())
    assert offenders == []
