"""Data-parallel reductions placed in the schedule and per block, against one flat reduction after it, simulated at p=8 dp=8.

    python bench/dp_overlap.py                      # the ZB paper's 1.5B and 6.2B GPT profiles, 50 GB/s links
    python bench/dp_overlap.py --bandwidth 25e9     # 200 Gb/s InfiniBand per GPU

Why: before #36 the replicas all-reduced every gradient in one flat collective after the step; #36
placed a REDUCE_GRAD per stage right after its last backward (planner/passes/data_parallel.py),
and #43 cut each stage into blocks, each reduced as soon as the backward has finished it
(runtime/stage_driver.py), as DDP's buckets are. This prices all three on the same simulated compute
(predict/data_parallel.py: ring collectives on the dp group's link, reductions in flight while
compute goes on, in issue order on one channel).

Costs: the Zero Bubble paper's published per-stage F, I, W at p=8 (bench/_zb_profiles.py cites the
source), for GPT models of 1.5B and 6.2B parameters, i.e. 1.5e9/8 and 6.2e9/8 parameters per stage
in `--blocks` equal blocks (default 3 and 4: the models' 24 and 30-32 layers over 8 stages);
gradients reduced in fp32 (4 bytes a parameter; the reduce dtype FSDP2's bf16 policy keeps too).
Links: `--bandwidth` bytes/s per rank (default 50e9: 400 Gb/s NICs, replicas on other nodes) and
`--latency` seconds per ring hop. A schedule with v stages per rank runs chunks of 1/v of a stage.

Columns: the compute-only step (the simulator's makespan), then per level the step with the
reductions flat after it, per stage (#36), per block (#43), and the share of the flat step's
communication tail the per-block placement hides.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from _zb_profiles import ICLR  # noqa: E402

from pipelaunch.launcher.config import group_configs  # noqa: E402
from pipelaunch.launcher.plugins import build_plugin  # noqa: E402
from pipelaunch.pipeline.core.errors import ConfigError  # noqa: E402
from pipelaunch.pipeline.core.plan_records import UnitCost  # noqa: E402
from pipelaunch.pipeline.planner.passes.data_parallel import place_data_parallel  # noqa: E402
from pipelaunch.pipeline.planner.placement import placement_for  # noqa: E402
from pipelaunch.pipeline.planner.predict.data_parallel import Collectives, Sharded, data_parallel_step  # noqa: E402
from pipelaunch.pipeline.planner.predict.simulate import CostModel, compute_spans, simulate  # noqa: E402
from pipelaunch.pipeline.planner.schedules import build_schedule  # noqa: E402
from pipelaunch.pipeline.planner.schedules.base import ScheduleCosts  # noqa: E402

SCHEDULES = ("1f1b", "zb_h1", "interleaved_1f1b", "zbv", "v_half")
#: (profile row in bench/_zb_profiles.ICLR, model parameters)
MODELS = ((0, 1.5e9), (3, 6.2e9))


def step_with(schedule, cost: CostModel, zero: int, dp: int, units: list[list[UnitCost]], links: Collectives,
              flat: bool) -> float:
    """The step: the slowest rank's last compute, its gathers' delay and its reductions' tail."""
    placed = place_data_parallel(schedule, zero, dp)
    spans = compute_spans(placed, cost)
    priced = data_parallel_step(placed, spans, Sharded(zero, units), None, links, flat=flat)
    return max((e[-1][1] if e else 0.0) + g + t for e, g, t in zip(spans, priced.gather_s, priced.tail_s, strict=True))


def blocks(n: int, stage_bytes: float, f: float, i: float, w: float, count: int) -> list[list[UnitCost]]:
    """Each of `n` stages as `count` equal blocks sharing its bytes and times."""
    return [[UnitCost(f"block{k}", stage_bytes / count, f / count, (i + w) / count, i / count, w / count)
             for k in range(count)] for _ in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bandwidth", type=float, default=50e9, help="bytes/s per rank on the dp links")
    parser.add_argument("--latency", type=float, default=10e-6, help="seconds per ring hop")
    parser.add_argument("--dp", type=int, default=8)
    parser.add_argument("--blocks", type=int, nargs=2, default=[3, 4], help="blocks per stage of the two models")
    args = parser.parse_args()
    links = Collectives(args.dp, args.latency, args.bandwidth)
    configs = group_configs("scheduler")
    print(f"dp={args.dp}, {args.bandwidth / 1e9:.0f} GB/s per rank, {args.latency * 1e6:.0f} us per hop; "
          "step in ms (flat -> per stage -> per block, the share of the flat tail per-block hides)\n")
    print("| model (p, m, blocks) | schedule | compute | zero=0 | zero=2 |")
    print("|---|---|---:|---:|---:|")
    for (row, params), count in zip(MODELS, args.blocks, strict=True):
        prof = ICLR[row]
        for name in SCHEDULES:
            gen = build_plugin("scheduler", configs[name], name)()
            try:
                placement = placement_for(gen, prof.p)
            except ConfigError:
                continue
            n = len(placement)
            v = n / prof.p
            f, i, w = prof.f / v / 1e3, prof.i / v / 1e3, prof.w / v / 1e3
            hops = [prof.hop / 1e3 if placement[s] != placement[s + 1] else 0.0 for s in range(n - 1)]
            schedule = build_schedule(gen, placement, prof.m, costs=ScheduleCosts.of([f] * n, [i] * n, [w] * n, hop=hops))
            cost = CostModel([f] * n, [i] * n, [w] * n, latency_s=prof.hop / 1e3)
            compute = simulate(schedule, cost, check=False, memory=False).makespan_s
            stage_bytes = 4.0 * params / n
            per_stage, per_block = blocks(n, stage_bytes, f, i, w, 1), blocks(n, stage_bytes, f, i, w, max(1, round(count / v)))
            cells = []
            for zero in (0, 2):
                flat = step_with(schedule, cost, zero, args.dp, per_stage, links, flat=True)
                staged = step_with(schedule, cost, zero, args.dp, per_stage, links, flat=False)
                blocked = step_with(schedule, cost, zero, args.dp, per_block, links, flat=False)
                hidden = (flat - blocked) / (flat - compute) if flat > compute else 0.0
                cells.append(f"{flat * 1e3:.0f} -> {staged * 1e3:.0f} -> {blocked * 1e3:.0f} ({hidden:.0%})")
            print(f"| {params / 1e9:.1f}B ({prof.p}, {prof.m}, {count}) | {name} | {compute * 1e3:.0f} | "
                  + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
