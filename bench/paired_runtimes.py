"""Our runtime and torch.distributed.pipelining in the same two processes, step by step.

Why: on a shared VM the speed of the machine drifts by 10-20% from one minute to the next, so two
runs one after the other differ by more than the runtimes do (compare_torch_pipelining.py needs
many rounds to see through that). Here each of the two ranks builds both runtimes (each its own
copy of the model: same initial weights, same batches, same stage split and placement, as our
planner gives them) and alternates steps: ours then torch's, torch's then ours, and so on. Both
see the machine at nearly the same moment, and the ratio of each adjacent pair of steps cancels
the drift. Both runtimes share the process (malloc tuning, huge pages, core binding: our
launcher's setup unless --plain), so the ratio compares the pipeline runtimes alone.

It also prints the ceiling of that ratio: our schedule simulated on the compute times our own
actions measured in the same steps, with free communication and no runtime overhead, plus the
time outside the schedule (optimizer step). That is the step of a perfect runtime running the
same kernels in the same order, so torch's step divided by it is the most any runtime could gain
over torch on this split and schedule. It is taken as the paired ratio times our step over the
perfect one, two factors measured in the same steps, so the drift cancels as in the ratio.

Run: `python bench/paired_runtimes.py [--schedules 1f1b zbv --pairs 20 --warmup 2]`.
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import sys
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hydra.utils import instantiate

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _torch_pp import (  # noqa: E402
    TORCH_SCHEDULES,
    BenchConfig,
    PipelineJob,
    TorchRank,
    apply_host_setup,
    compose_our_run,
    free_port,
)

from pipelaunch.launcher.initial_weights import launcher_initial_weights  # noqa: E402
from pipelaunch.launcher.plugins import build_plugins  # noqa: E402
from pipelaunch.launcher.run_spec import run_spec  # noqa: E402
from pipelaunch.launcher.spawn import environment  # noqa: E402
from pipelaunch.pipeline.compute.host_allocator import rank_environment  # noqa: E402
from pipelaunch.pipeline.core.config import TrainConfig  # noqa: E402
from pipelaunch.pipeline.core.plan import Plan  # noqa: E402
from pipelaunch.pipeline.planner.predict.costs import cost_model_from_events  # noqa: E402
from pipelaunch.pipeline.planner.predict.simulate import simulate  # noqa: E402
from pipelaunch.pipeline.runtime.context import RankContext, make_mesh  # noqa: E402
from pipelaunch.pipeline.runtime.trainer import RankTrainer  # noqa: E402


@dataclass
class PairedJob:
    """One schedule: our resolved config and plan, and torch's job on the same split."""

    cfg: TrainConfig
    plan: Plan
    torch_job: PipelineJob
    steps: int  # warm-up included
    host_setup: bool
    warmup: int = 0  # leading steps left out of our events and overheads
    #: the constructor's weights as the launcher writes them (run_pair fills it in): torch's stages
    #: start from the same model (`ModelSpec.build_full`)
    initial_weights: str | None = None


def perfect_step_s(plan: Plan, events: list[dict], overheads_s: list[float]) -> float:
    """The step a runtime with no overhead of its own would take running our measured actions in
    our schedule's order: simulated makespan with free links, plus the median time the critical
    rank spent outside the schedule (gradient sync, optimizer step, loss all-reduce)."""
    cost = cost_model_from_events(plan, events, 0.0, math.inf)
    return simulate(plan.schedule, cost).makespan_s + statistics.median(overheads_s)


def _paired_rank(rank: int, job: PairedJob, port: int, out: mp.SimpleQueue) -> None:
    world = job.plan.pp
    if job.host_setup:
        apply_host_setup(rank, world, threads=1)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        ctx = RankContext(rank, world, rank, world, job.plan.layout, torch.device("cpu"))
        ctx.mesh = make_mesh(ctx)
        ours = RankTrainer(run_spec(job.cfg, build_plugins(job.cfg), None), job.plan, ctx,
                           initial_weights=job.initial_weights)
        theirs = TorchRank(job.torch_job, rank)

        events: list[dict] = []
        outside: list[float] = []  # per timed step: this rank's time outside the schedule

        def our_step(step: int) -> tuple[float, float]:
            outcome = ours.step(step)
            if step >= job.warmup:
                events.extend(outcome.events)
                outside.append(outcome.elapsed_s - outcome.schedule_s)
            return outcome.elapsed_s, outcome.loss

        runtimes = {"ours": our_step, "torch": theirs.step}
        times: dict[str, list[float]] = {"ours": [], "torch": []}
        losses: dict[str, list[float]] = {"ours": [], "torch": []}
        for step in range(job.steps):
            for who in (("ours", "torch") if step % 2 == 0 else ("torch", "ours")):
                seconds, loss = runtimes[who](step)
                times[who].append(seconds)
                losses[who].append(loss)
        gathered: list | None = [None] * world if rank == 0 else None
        dist.gather_object((events, outside), gathered, dst=0)
        if rank == 0:
            all_events = [e for rank_events, _ in gathered for e in rank_events]
            # the critical rank is the one that waits least after its schedule
            overheads = [min(per_step) for per_step in zip(*(o for _, o in gathered), strict=True)]
            perfect = perfect_step_s(job.plan, all_events, overheads) if all_events else math.nan
            out.put({"times": times, "losses": losses, "perfect_step_s": perfect})
    finally:
        dist.destroy_process_group()


def run_pair(job: PairedJob) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    spec = instantiate(job.cfg.model)
    with environment(rank_environment(job.host_setup)), launcher_initial_weights(job.cfg, spec, None) as initial:
        job = replace(job, initial_weights=str(initial.path) if initial.path is not None else None)
        mp.start_processes(_paired_rank, args=(job, free_port(), out), nprocs=job.plan.pp, join=True,
                           start_method="spawn")
    return out.get()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schedules", nargs="+", default=["1f1b", "zbv"], choices=sorted(TORCH_SCHEDULES))
    parser.add_argument("--pairs", type=int, default=20, help="timed pairs of steps per schedule")
    parser.add_argument("--warmup", type=int, default=2, help="untimed pairs first")
    parser.add_argument("--partitioner", default="uniform", help="our partitioner; torch runs the same split")
    parser.add_argument("--plain", action="store_true",
                        help="no process setup (glibc malloc defaults, no huge pages, no core binding)")
    args = parser.parse_args()
    bench = BenchConfig(partitioner=args.partitioner)
    steps = args.warmup + args.pairs
    print(f"{platform.node()} | torch {torch.__version__} | {time.strftime('%Y-%m-%d %H:%M')} | pairs={args.pairs} "
          f"warmup={args.warmup} | process setup: {'none' if args.plain else 'ours, shared by both'}", flush=True)
    rows = []
    for schedule in args.schedules:
        cfg, plan = compose_our_run(schedule, bench)
        blocks = [list(s.blocks) for s in plan.stages]
        print(f"  {schedule}: placement {list(plan.schedule.placement)}, stages {blocks}", flush=True)
        torch_job = PipelineJob(schedule, list(plan.schedule.placement), blocks, bench)
        t0 = time.perf_counter()
        got = run_pair(PairedJob(cfg, plan, torch_job, steps, not args.plain, warmup=args.warmup))
        ours, theirs = got["times"]["ours"][args.warmup:], got["times"]["torch"][args.warmup:]
        ratios = [t / o for o, t in zip(ours, theirs, strict=True)]
        loss_gap = max(abs(a - b) for a, b in zip(got["losses"]["ours"], got["losses"]["torch"], strict=True))
        tokens = bench.tokens_per_step
        q1, q2, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
        perfect = got["perfect_step_s"]
        rows.append((schedule, tokens / statistics.median(ours), tokens / statistics.median(theirs), q2, q1, q3,
                     sum(r > 1 for r in ratios), len(ratios), tokens / perfect, q2 * statistics.median(ours) / perfect,
                     got["losses"]["ours"][-1], loss_gap))
        print(f"  {schedule}: {time.perf_counter() - t0:.0f} s", flush=True)
    print("\nceiling = paired median (torch / ours) x our median step / perfect step, factors from the same steps")
    print("| schedule | ours tokens/s | torch tokens/s | ours / torch, paired (median) | middle half of pairs "
          "| pairs ours faster | perfect runtime tokens/s | ceiling: perfect / torch | final loss | largest loss gap |")
    print("|---|---:|---:|---:|---|---:|---:|---:|---:|---:|")
    for s, o, t, med, lo, hi, wins, n, best, ceiling, loss, gap in rows:
        print(f"| {s} | {o:.0f} | {t:.0f} | {med:.3f} | {lo:.3f}-{hi:.3f} | {wins}/{n} | {best:.0f} | {ceiling:.3f} "
              f"| {loss:.4f} | {gap:.1e} |")


if __name__ == "__main__":
    main()
