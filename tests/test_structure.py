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
    "pipelaunch.pipeline.graph": {"pipelaunch.pipeline.core", "pipelaunch.pipeline.compute"},
    "pipelaunch.pipeline.compute": {"pipelaunch.pipeline.core"},
    # (models read pipeline.compute's attention under context parallelism: compute is below graph)
    "pipelaunch.models": {"pipelaunch.pipeline.core", "pipelaunch.pipeline.graph", "pipelaunch.pipeline.compute"},
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


def test_no_product_function_is_over_80_lines() -> None:
    """Every function of the product (decorators excluded) fits on a screen: a longer one is split."""
    import ast

    long = {}
    for folder in ("pipeline", "launcher", "models", "pipelaunch"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 80:
                    long[f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"] = node.end_lineno - node.lineno + 1
    assert long == {}


def test_schedule_generators_are_frozen_values() -> None:
    """Every schedule option of conf/scheduler/ builds a frozen dataclass holding only its options:
    computing actions on measured-looking costs (and in first-order mode) leaves it equal, with the
    same hash, to one freshly built from the YAML, and adds no attribute beyond its fields."""
    import random
    from dataclasses import fields, is_dataclass

    from hydra.utils import get_class, instantiate
    from omegaconf import OmegaConf

    from pipelaunch.pipeline.planner.placement import placement_for
    from pipelaunch.pipeline.planner.schedules.base import ScheduleCosts, ScheduleGenerator
    from pipelaunch.pipeline.planner.schedules.weight_fill import StageMemory

    assert ScheduleGenerator.__dataclass_params__.frozen and fields(ScheduleGenerator) == ()
    checked = []
    for path in sorted((ROOT / "conf" / "scheduler").glob("*.yaml")):
        if path.stem == "auto":  # the search over the others, not a schedule
            continue
        cfg = OmegaConf.to_container(OmegaConf.load(path))
        cls = get_class(cfg["_target_"])
        if not issubclass(cls, ScheduleGenerator):
            continue
        assert is_dataclass(cls) and cls.__dataclass_params__.frozen, f"{path.name}: {cls.__name__} is not frozen"
        gen, twin = instantiate(cfg), instantiate(cfg)
        pp, m = 4, 8
        placement = placement_for(gen, pp)
        n, rnd = len(placement), random.Random(path.stem)
        f = [rnd.uniform(0.5, 2.0) for _ in range(n)]
        costs = ScheduleCosts.of(f, [1.1 * x for x in f], [0.6 * x for x in f], backward=[1.6 * x for x in f],
                                 hop=[0.05 * (placement[s] != placement[s + 1]) for s in range(n - 1)],
                                 memory=StageMemory(tuple(3.0 for _ in f), tuple(2.0 for _ in f)))
        gen.check(pp, m, placement)
        gen.compute_actions(placement, m, costs)
        gen.compute_actions(placement, m, first_order=True)
        assert gen == twin and hash(gen) == hash(twin), f"{path.name}: computing changed the generator"
        assert vars(gen).keys() == {f.name for f in fields(gen)}, f"{path.name}: state beyond its options"
        checked.append(path.stem)
    assert len(checked) >= 10, checked


def test_no_target_or_dictconfig_below_the_launcher() -> None:
    """Plug-ins are built once, at the edge (launcher/plugins.py): below the launcher nothing reads
    how an option names its callable, nor holds an OmegaConf node; the planner and the ranks see
    the typed objects the launcher built (pipelaunch.pipeline.core.plugins). Comments and
    docstrings count: they would describe a mechanism that is not there."""
    target, node = "_target_", "DictConfig"
    offenders = sorted(str(p.relative_to(ROOT)) for folder in ("pipeline", "models") for p in (ROOT / folder).rglob("*.py")
                       if target in p.read_text() or node in p.read_text())
    assert offenders == []
