"""How long `mode=plan` takes at scale (pp=64, 256 micro-batches, 128 layers), and where it goes.

    python bench/plan_speed.py                        # every schedule of the scheduler group, 3 rounds
    python bench/plan_speed.py --schedules 1f1b zbv --rounds 5 --microbatches 128
    python bench/plan_speed.py --cold 1 --no-command  # in-process only, plus one round on an empty cache

Per schedule, three views:

* `command`: the wall time of `python train.py mode=plan ...` as a user types it (interpreter
  start and imports included).
* In one process, once the imports are done and one plan has run (so that what the first plan of
  a process imports lazily is not counted): `compose` (Hydra), `prepare` (validate, build and
  trace the model on meta, read the profile, partition, schedule, lower, check the P2P order,
  simulate) and `write` (plan.json, the stage table, the grid, the simulated timeline), run as
  `pipelaunch.launcher.app.run` runs them (under `few_full_collections`); `total` is the time after imports.
  `--parts` splits them by function: `trace` (trace and profile), `overheads` (the runtime's
  per-message and per-action costs, probed once per machine), `schedule` (the generator: the
  unit-cost order the partitioner counts in-flight micro-batches on, then the one on the measured
  costs, then the evaluation order), `lower`, `p2p` (the NCCL order check), `predict` (simulation,
  cores shared), `timeline`, `plan.json`; `other` is the rest of prepare and write.
* `cold`: the same in-process phases with $PIPELAUNCH_CACHE pointing at an empty directory, so
  that the model is profiled and the runtime's overheads probed again (`--cold N` rounds).

The rounds interleave the schedules; medians are printed. `auto` (a search over the others) is left
out of the default list.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PHASES = ("compose", "prepare", "write", "total")
#: part -> (module, attribute) to time, and the modules that imported it by name
PARTS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "trace": ("pipelaunch.pipeline.planner.measure.traced", "TracedModels.get", ()),
    "overheads": ("pipelaunch.pipeline.planner.measure.overheads", "cached_overheads", ("pipelaunch.pipeline.planner",)),
    "schedule": ("pipelaunch.pipeline.planner.schedules", "build_schedule", ("pipelaunch.pipeline.planner.build", "pipelaunch.pipeline.planner.fit.budget")),
    "lower": ("pipelaunch.pipeline.planner.passes.lowering", "lower", ("pipelaunch.pipeline.planner.build",)),
    "p2p": ("pipelaunch.pipeline.planner.passes.p2p_check", "check_p2p", ("pipelaunch.pipeline.planner.build",)),
    "predict": ("pipelaunch.pipeline.planner.predict.prediction", "predict", ("pipelaunch.pipeline.planner", "pipelaunch.pipeline.planner.fit.under_cap")),
    "timeline": ("pipelaunch.pipeline.report.timeline", "draw_timeline", ("pipelaunch.launcher.app",)),
    "plan.json": ("pipelaunch.pipeline.core.plan", "Plan.write", ()),
}


def scale(args: argparse.Namespace) -> list[str]:
    """The overrides of the measured configuration."""
    return [f"pp={args.pp}", f"microbatches={args.microbatches}", f"model.layers={args.layers}",
            f"batch_size={args.microbatches}", "model.dim=32", "model.seq_len=8", "threads=1"]


def default_schedules() -> list[str]:
    """Every option of the scheduler group but the search."""
    return sorted(p.stem for p in (ROOT / "conf" / "scheduler").glob("*.yaml") if p.stem != "auto")


def command(schedule: str, overrides: list[str], out: Path) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "train.py", "mode=plan", f"scheduler={schedule}", *overrides,
                    f"hydra.run.dir={out}"], cwd=ROOT, check=True, capture_output=True)
    return time.perf_counter() - start


def phases(schedule: str, overrides: list[str], out: Path) -> dict[str, float]:
    """compose, prepare and write in this process, as `pipelaunch.launcher.app.run` runs them."""
    from pipelaunch.launcher.app import dry_run
    from pipelaunch.launcher.gc_pause import few_full_collections
    from pipelaunch.launcher.overrides import compose_checked
    from pipelaunch.launcher.validate import prepare

    out.mkdir(parents=True, exist_ok=True)
    forget_memos()
    t0 = time.perf_counter()
    cfg = compose_checked(["mode=plan", f"scheduler={schedule}", *overrides])
    composed = time.perf_counter() - t0
    with few_full_collections(), contextlib.redirect_stdout(io.StringIO()):
        # not from entry: from a process's second block on, it collects what the previous one
        # froze, which a command (one block) never does
        t1 = time.perf_counter()
        prepared = prepare(cfg)
        t2 = time.perf_counter()
        dry_run(prepared, out)
    t3 = time.perf_counter()
    return {"compose": composed, "prepare": t2 - t1, "write": t3 - t2, "total": composed + t3 - t1}


def forget_memos() -> None:
    """Empty the project's in-process memos (functools caches of orders that do not depend on the
    costs), so that a round pays for them as a command does and not only the first round."""
    for name, module in list(sys.modules.items()):
        if name.split(".")[0] in ("pipeline", "launcher", "models"):
            for value in list(vars(module).values()):
                if callable(getattr(value, "cache_clear", None)):
                    value.cache_clear()


@contextlib.contextmanager
def timed_parts(spent: dict[str, float]) -> Iterator[None]:
    """Add each PARTS function's inclusive seconds to `spent[part]` while the block runs."""
    undo: list[Callable[[], None]] = []
    for part, (module, attr, importers) in PARTS.items():
        owner: object = importlib.import_module(module)
        *path, name = attr.split(".")
        for step in path:
            owner = getattr(owner, step)
        original = getattr(owner, name)
        wrapper = _timer(original, part, spent)
        places = [owner, *(importlib.import_module(m) for m in importers)]
        for place in places:
            if getattr(place, name, None) is original:
                setattr(place, name, wrapper)
                undo.append(lambda place=place, name=name, original=original: setattr(place, name, original))
    try:
        yield
    finally:
        for restore in undo:
            restore()


def _timer(fn: Callable, part: str, spent: dict[str, float]) -> Callable:
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[part] += time.perf_counter() - start
    return timed


def in_process(schedule: str, overrides: list[str], out: Path, parts: bool, cache: str | None) -> dict[str, float]:
    """One in-process round (with `cache` as $PIPELAUNCH_CACHE when given), parts included."""
    spent: dict[str, float] = defaultdict(float)
    with cache_at(cache), timed_parts(spent) if parts else contextlib.nullcontext():
        row = phases(schedule, overrides, out)
    if parts:
        row.update({p: spent[p] for p in PARTS})
        row["other"] = row["prepare"] + row["write"] - sum(spent[p] for p in PARTS)
    return row


@contextlib.contextmanager
def cache_at(path: str | None) -> Iterator[None]:
    """$PIPELAUNCH_CACHE set to `path` (unchanged when None) while the block runs."""
    before = os.environ.get("PIPELAUNCH_CACHE")
    if path is not None:
        os.environ["PIPELAUNCH_CACHE"] = path
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PIPELAUNCH_CACHE", None)
        else:
            os.environ["PIPELAUNCH_CACHE"] = before


def table(title: str, runs: dict[str, list[dict[str, float]]]) -> str:
    """A markdown table of each column's median over the rounds."""
    columns = [c for c in ("command", *PHASES, *PARTS, "other") if any(c in r for rows in runs.values() for r in rows)]
    lines = [f"{title}\n", "| schedule | " + " | ".join(f"{c} s" for c in columns) + " | rounds |",
             "|---|" + "---:|" * (len(columns) + 1)]
    for s, rows in runs.items():
        if rows:
            med = {c: statistics.median(r[c] for r in rows) for c in columns}
            lines.append(f"| {s} | " + " | ".join(f"{med[c]:.2f}" for c in columns) + f" | {len(rows)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cold", type=int, default=0, help="rounds on an empty profile cache (in-process)")
    parser.add_argument("--schedules", nargs="+", default=default_schedules())
    parser.add_argument("--pp", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=256)
    parser.add_argument("--layers", type=int, default=128)
    parser.add_argument("--no-command", action="store_true", help="skip the `python train.py` runs")
    parser.add_argument("--parts", action="store_true", help="split prepare and write by function")
    parser.add_argument("--json", type=Path, help="also write every round's figures here")
    args = parser.parse_args()
    overrides = scale(args)
    commands: dict[str, list[dict[str, float]]] = {s: [] for s in args.schedules}
    warm: dict[str, list[dict[str, float]]] = {s: [] for s in args.schedules}
    cold: dict[str, list[dict[str, float]]] = {s: [] for s in args.schedules}
    with tempfile.TemporaryDirectory() as tmp:
        in_process(args.schedules[0], overrides, Path(tmp) / "warm-up", False, None)  # fills the cache too
        for r in range(max(args.rounds, args.cold)):
            for s in args.schedules:
                if r < args.rounds and not args.no_command:
                    commands[s].append({"command": command(s, overrides, Path(tmp) / f"cmd_{s}")})
                if r < args.rounds:
                    warm[s].append(in_process(s, overrides, Path(tmp) / f"in_{s}", args.parts, None))
                if r < args.cold:
                    fresh = tempfile.mkdtemp(dir=tmp, prefix="cache_")
                    cold[s].append(in_process(s, overrides, Path(tmp) / f"cold_{s}", args.parts, fresh))
    if args.json:
        args.json.write_text(json.dumps({"command": commands, "warm": warm, "cold": cold}, indent=1))
    where = f"pp={args.pp}, m={args.microbatches}, {args.layers} layers"
    if not args.no_command:
        print(table(f"`python train.py mode=plan` ({where}), imports included, profile cache warm", commands) + "\n")
    print(table(f"In-process phases after imports ({where}), profile cache warm", warm))
    if args.cold:
        print("\n" + table(f"In-process phases after imports ({where}), empty profile cache", cold))


if __name__ == "__main__":
    main()
