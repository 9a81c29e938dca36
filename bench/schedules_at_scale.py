"""Every schedule, ours and torch.distributed.pipelining's, simulated on the same costs from 4 to 64 ranks.

    python bench/schedules_at_scale.py --summary                  # the default grid, one line per point
    python bench/schedules_at_scale.py --summary --p 4 8 16 32 64 --m 1 2 4 8 --jobs 8   # the full grid
    python bench/schedules_at_scale.py --p 16 --shapes zb-arxiv-16-48   # one profile (hop 0 and as published), every schedule

Why: our orders were tuned at p=2 with F = I = W; users pipeline over 8 to 64 ranks with a cheaper W and
a latency on every hop (issue #26). torch's orders are lowered into our IR
(pipeline/planner/schedules/torch_orders.py), so both run on one simulator and one cost model.

Grid: p in {4, 8, 16, 32, 64}, m in {p, 2p, 4p, 8p} (`--m` takes the multiples). The default leaves out
p = 64 and m = 8p (`--p 4 8 16 32 64 --m 1 2 4 8` adds them): on a 2-core machine the default takes about
10 CPU minutes, p = 64 up to m = 4p 9 more, and m = 8p doubles what it is added to; `--jobs` spreads points
over cores. Per-stage cost shapes
F:I:W in {1:1:1, 1:1:0.5, 1:1.2:0.7} (F = 1), hop latency in {0, 5%, 10% of F}; and the Zero Bubble
paper's published profiles (bench/_zb_profiles.py, source cited there) at their own p and m, hop latency
0 or as published (`paper`). Schedules: every training option of the scheduler config group, found as
tests/schedules.py finds them (a schedule added by YAML appears here), with the variants
conf/plan/auto.yaml lists (an option with `stages_per_rank` and no variant listed: 2 and 4), except
`torch`; and every torch class (interleaved ones at 2 and 4 stages per rank). A schedule with v stages per rank runs chunks of 1/v of a stage: its F, I, W per chunk are the
stage's divided by v, given to cost-aware generators as `ScheduleCosts` with the hop on every cut
between ranks (`hop`). The simulator charges every such cut the hop latency (CostModel.latency_s).

Columns:
- bubble: the idle share of the step, averaged over ranks: mean of (makespan - busy_r) / makespan
  (SimResult.mean_bubble). Every schedule does the same work per rank, so it orders them as the step does.
- paper: the Zero Bubble paper's metric: max over ranks of (span_r - busy_r) / span_r, span_r from the
  rank's first action start to its last action end (SimResult.internal_bubble).
- mem: peak activation memory in stage-micro-batches: a (chunk, micro-batch) holds 1/v of a stage's
  activations from its F until its W or B ends, counted per rank in program order; the max over ranks.
- closed forms, at zero latency, in the paper's metric (an idle time as idle / (idle + a rank's work
  m(F+I+W))): 1F1B and GPipe (p-1)/(m+p-1); ZB-H1 (p-1)(F+I-W); ZB-H2 (p-1)(F+I-2W) (0 if negative);
  DualPipe's (p/2-1)(F&B+B-3W) with chunk costs, B = I+W and F&B = F+B (the simulator does not overlap);
  memory: 1F1B p, GPipe m, V-Half ceil(p/2)+1, V-Min ceil(p/3)+1.

`--summary`: per point, our best bubble, torch's best, and ours at no more peak memory than torch's best;
LOSS where some torch order has a bubble no schedule of ours matches at no more memory than it holds.
"""

from __future__ import annotations

import argparse
import math
import resource
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from functools import cache
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from _zb_profiles import PROFILES  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from pipelaunch.launcher.config import group_configs  # noqa: E402
from pipelaunch.launcher.plugins import build_plugin, is_search  # noqa: E402
from pipelaunch.pipeline.core.errors import ConfigError  # noqa: E402
from pipelaunch.pipeline.core.ir import Schedule  # noqa: E402
from pipelaunch.pipeline.planner.placement import placement_for  # noqa: E402
from pipelaunch.pipeline.planner.predict.simulate import CostModel, simulate, validate  # noqa: E402
from pipelaunch.pipeline.planner.schedules import build_schedule  # noqa: E402
from pipelaunch.pipeline.planner.schedules.base import ScheduleCosts, ScheduleGenerator  # noqa: E402
from pipelaunch.pipeline.planner.schedules.torch_orders import SHAPES, TorchSchedule  # noqa: E402
from pipelaunch.pipeline.planner.search.choose import scheduler_variants  # noqa: E402
from pipelaunch.pipeline.planner.search.screen import held_stage_microbatches  # noqa: E402

RATIOS = {"1:1:1": (1.0, 1.0, 1.0), "1:1:0.5": (1.0, 1.0, 0.5), "1:1.2:0.7": (1.0, 1.2, 0.7)}
LATENCIES = {"0": 0.0, "5%": 0.05, "10%": 0.10, "paper": math.nan}
EPS = 1e-9


class Case(NamedTuple):
    """One (costs, p, m), at each of its hop latencies."""

    shape: str
    p: int
    m: int
    fiw: tuple[float, float, float]  # per stage
    hops: tuple[tuple[str, float], ...]  # (label, seconds)
    published: dict[str, float]


class Entry(NamedTuple):
    label: str
    source: str  # "ours" or "torch"
    make: Callable[[], ScheduleGenerator]


class Row(NamedTuple):
    label: str
    source: str
    bubble: float
    paper: float
    mem: float
    makespan: float


def cases(ps: list[int], multiples: list[int], shapes: list[str], latencies: list[str]) -> Iterator[Case]:
    """The grid's points, grouped by what an order depends on (not the latency)."""
    for shape in shapes:
        if shape in RATIOS:
            hops = tuple((lat, LATENCIES[lat] * RATIOS[shape][0]) for lat in latencies if lat != "paper")
            for p in ps:
                for k in multiples:
                    if hops:
                        yield Case(shape, p, k * p, RATIOS[shape], hops, {})
            continue
        chosen = [pr for name, pr in PROFILES.items() if name == shape or name.startswith(shape + "-")]
        if not chosen:
            raise SystemExit(f"unknown shape {shape!r}; valid: {', '.join(RATIOS)}, zb, zb-iclr, zb-arxiv, "
                             f"or a profile: {', '.join(PROFILES)}")
        for pr in chosen:
            hops = tuple((lat, 0.0 if lat == "0" else pr.hop) for lat in latencies if lat in ("0", "paper"))
            if pr.p in ps and hops:
                yield Case(pr.name, pr.p, pr.m, (pr.f, pr.i, pr.w), hops, pr.published)


@cache
def entries() -> list[Entry]:
    """Our training schedules (with plan=auto's variants) and torch's classes, each as a factory."""
    options = {}
    for name, cfg in group_configs("scheduler").items():
        if is_search(cfg):
            continue
        option = build_plugin("scheduler", cfg, name)
        if not (isinstance(option.fn, type) and issubclass(option.fn, TorchSchedule)):
            options[name] = option
    variants = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "plan" / "auto.yaml"))["variants"]
    for name, cfg in options.items():  # stages per rank 2 and 4, as torch's interleaved classes run below
        if "stages_per_rank" in cfg.kwargs and name not in variants:
            variants[name] = {"stages_per_rank": [2, 4]}
    out = []
    for label, option in scheduler_variants(options, None, variants):
        if option().training:
            out.append(Entry(label, "ours", option))
    for name, shape in SHAPES.items():
        for v in (2, 4) if shape.stages_per_rank is None else (None,):
            label = f"torch:{name}" + (f"(v={v})" if v else "")
            out.append(Entry(label, "torch", lambda name=name, v=v: TorchSchedule(schedule=name, stages_per_rank=v)))
    return out


def build(entry: Entry, case: Case, hop: float) -> Schedule | None:
    """The entry's order for this case and hop latency, or None where it is not valid (its own
    ConfigError)."""
    try:
        gen = entry.make()
        placement = placement_for(gen, case.p)
        n = len(placement)
        v = n / case.p
        f, i, w = (x / v for x in case.fiw)
        hops = [hop if placement[s] != placement[s + 1] else 0.0 for s in range(n - 1)]
        schedule = build_schedule(gen, placement, case.m, costs=ScheduleCosts.of([f] * n, [i] * n, [w] * n, hop=hops))
    except ConfigError:
        return None
    validate(schedule)
    return schedule


def measure(entry: Entry, schedule: Schedule, case: Case, hop: float) -> Row:
    n = schedule.num_stages
    v = n / case.p
    f, i, w = (x / v for x in case.fiw)
    result = simulate(schedule, CostModel([f] * n, [i] * n, [w] * n, latency_s=hop), check=False)
    return Row(entry.label, entry.source, result.mean_bubble, max(result.internal_bubble),
               held_stage_microbatches(schedule), result.makespan_s)


def closed_forms(label: str, case: Case) -> tuple[float | None, float | None]:
    """(bubble in the paper's metric at zero latency, peak memory) where a closed form exists."""
    p, m = case.p, case.m
    f, i, w = case.fiw
    work = m * (f + i + w)
    base = label.split("(")[0].removeprefix("torch:").lower()
    idle = {"zb_h1": (p - 1) * (f + i - w), "zb_h2": (p - 1) * (f + i - 2 * w)}
    fc, bc, wc = f / 2, (i + w) / 2, w / 2  # DualPipeV's chunks: half a stage
    idle["dualpipev"] = (p / 2 - 1) * ((fc + bc) + bc - 3 * wc)
    if base in ("1f1b", "gpipe"):
        bubble: float | None = (p - 1) / (m + p - 1)
    elif base in idle:
        bubble = max(0.0, idle[base]) / (max(0.0, idle[base]) + work)
    else:
        bubble = None
    mem = {"1f1b": p, "gpipe": m, "v_half": math.ceil(p / 2) + 1, "v_min": math.ceil(p / 3) + 1}.get(base)
    return bubble, None if mem is None else float(mem)


def _fmt(x: float | None, digits: int = 4) -> str:
    return "" if x is None else f"{x:.{digits}f}"


def print_point(case: Case, lat: str, hop: float, rows: list[Row]) -> None:
    print(f"\n### p={case.p} m={case.m} shape={case.shape} F:I:W={':'.join(f'{x:g}' for x in case.fiw)} "
          f"latency={lat} (hop {hop:g})")
    if case.published:
        print("published (paper's metric): " + ", ".join(f"{k} {v:.4f}" for k, v in case.published.items()))
    print("\n| schedule | source | bubble | paper | mem | closed bubble (lat 0) | closed mem |")
    print("|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: (r.bubble, r.mem)):
        cb, cm = closed_forms(r.label, case)
        print(f"| {r.label} | {r.source} | {r.bubble:.4f} | {r.paper:.4f} | {_fmt(r.mem, 2)} | "
              f"{_fmt(cb if hop == 0 else None)} | {_fmt(cm, 0)} |")


def compare(rows: list[Row]) -> tuple[Row, Row, Row | None, list[tuple[Row, Row | None]]]:
    """Ours' best, torch's best, ours' best at no more memory than torch's best, and every torch order
    no order of ours matches (bubble no higher at no more memory), with ours' best under its memory."""
    ours = [r for r in rows if r.source == "ours"]
    theirs = [r for r in rows if r.source == "torch"]

    def best_within(mem: float) -> Row | None:
        fits = [r for r in ours if r.mem <= mem + EPS]
        return min(fits, key=lambda r: (r.bubble, r.mem)) if fits else None

    best_ours = min(ours, key=lambda r: (r.bubble, r.mem))
    best_torch = min(theirs, key=lambda r: (r.bubble, r.mem))
    losses = []
    for t in theirs:
        mine = best_within(t.mem)
        if mine is None or mine.bubble > t.bubble + EPS:
            losses.append((t, mine))
    return best_ours, best_torch, best_within(best_torch.mem), losses


class Tally:
    """Per torch order: the points where no order of ours matches it, and the widest gap."""

    def __init__(self) -> None:
        self.points: dict[str, int] = {}
        self.worst: dict[str, tuple[float, str]] = {}

    def add(self, where: str, losses: list[tuple[Row, Row | None]]) -> None:
        for t, mine in losses:
            self.points[t.label] = self.points.get(t.label, 0) + 1
            gap = mine.bubble - t.bubble if mine else math.inf
            if gap > self.worst.get(t.label, (-1.0, ""))[0]:
                self.worst[t.label] = (gap, f"{where}: {t.bubble:.4f} against ours "
                                            + (f"{mine.label} {mine.bubble:.4f}" if mine else "(none fits)"))

    def print(self, points: int) -> None:
        print(f"\n| torch order | points it beats ours at no more memory (of {points}) | widest gap |\n|---|---|---|")
        for label, count in sorted(self.points.items(), key=lambda kv: -kv[1]):
            gap, where = self.worst[label]
            print(f"| {label} | {count} | {gap:+.4f} ({where}) |")


def print_summary_line(case: Case, lat: str, rows: list[Row], lost: list[str], tally: Tally) -> None:
    best_ours, best_torch, within, losses = compare(rows)
    tally.add(f"p={case.p} m={case.m} {case.shape} lat={lat}", losses)
    worst = max(losses, key=lambda x: x[1].bubble - x[0].bubble if x[1] else math.inf, default=None)
    flag = ""
    if worst:
        t, mine = worst
        flag = (f"LOSS: {t.label} {t.bubble:.4f} at mem {t.mem:.2f}; ours at <= that: "
                + (f"{mine.label} {mine.bubble:.4f}" if mine else "none fits"))
        lost.append(f"p={case.p} m={case.m} {case.shape} lat={lat}: " + flag.removeprefix("LOSS: ")
                    + f" ({len(losses)} torch order(s) unmatched)")
    published = f"{min(case.published.values()):.4f}" if case.published and lat == "paper" else ""
    print(f"| {case.p} | {case.m} | {case.shape} | {lat} | {best_ours.label} {best_ours.bubble:.4f} "
          f"(paper {best_ours.paper:.4f}, mem {best_ours.mem:.2f}) | {best_torch.label} {best_torch.bubble:.4f} "
          f"(mem {best_torch.mem:.2f}) | {within.bubble if within else math.nan:.4f} | {published} | {flag} |")


def run_case(case: Case) -> tuple[int, list[tuple[str, float, list[Row]]]]:
    """Every valid schedule built and simulated at each of the case's hop latencies (cost-aware
    generators order for the hops they are given)."""
    count, results = 0, []
    for lat, hop in case.hops:
        built = [(e, s) for e in entries() if (s := build(e, case, hop)) is not None]
        count = max(count, len(built))
        results.append((lat, hop, [measure(e, s, case, hop) for e, s in built]))
    return count, results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--p", type=int, nargs="+", default=[4, 8, 16, 32], help="ranks (the full grid: 4 8 16 32 64)")
    parser.add_argument("--m", type=int, nargs="+", default=[1, 2, 4],
                        help="micro-batches as multiples of p (the full grid: 1 2 4 8)")
    parser.add_argument("--shapes", nargs="+", default=[*RATIOS, "zb"],
                        help="F:I:W ratios, and zb / zb-iclr / zb-arxiv / one profile's name (bench/_zb_profiles.py)")
    parser.add_argument("--latency", nargs="+", default=list(LATENCIES), choices=list(LATENCIES),
                        help="hop latency as a share of F (`paper`: a profile's published hop)")
    parser.add_argument("--summary", action="store_true", help="one line per point: ours against torch")
    parser.add_argument("--jobs", type=int, default=1, help="processes simulating points side by side")
    args = parser.parse_args()
    start = time.perf_counter()
    todo, lost, points, tally = list(cases(args.p, args.m, args.shapes, args.latency)), [], 0, Tally()
    if args.summary:
        print("| p | m | shape | latency | ours best | torch best | ours at <= torch best's mem | published best "
              "| loses |\n|---|---|---|---|---|---|---|---|---|")
    with ProcessPoolExecutor(args.jobs) if args.jobs > 1 else _Serial() as pool:
        for case, (count, results) in zip(todo, pool.map(run_case, todo), strict=True):
            for lat, hop, rows in results:
                points += 1
                if args.summary:
                    print_summary_line(case, lat, rows, lost, tally)
                else:
                    print_point(case, lat, hop, rows)
            print(f"[{time.perf_counter() - start:7.1f} s] p={case.p} m={case.m} {case.shape}: {count} schedules",
                  file=sys.stderr, flush=True)
    if args.summary:
        print(f"\n{len(lost)} of {points} points where a torch order beats every order of ours at no more memory:")
        print("\n".join(f"- {line}" for line in lost) or "- none")
        tally.print(points)
    cpu = sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
              for f in ("ru_utime", "ru_stime"))
    print(f"\n{points} points in {time.perf_counter() - start:.0f} s wall, {cpu:.0f} s CPU ({args.jobs} job(s))")


class _Serial:
    """`map` in this process, for --jobs 1."""

    def __enter__(self) -> _Serial:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    @staticmethod
    def map(fn, items):
        return map(fn, items)


if __name__ == "__main__":
    main()
