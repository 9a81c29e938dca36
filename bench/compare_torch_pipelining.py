"""Our pipeline runtime against torch.distributed.pipelining and single-process training.

Workload (every configuration alike): model=gpt_bench (8 pre-LN blocks, dim 256, seq 128, vocab
4096), synthetic tokens, global batch 32 x 128 tokens in 8 micro-batches, SGD, CPU, one thread per
rank. Configurations:

* ours: `python train.py ... pp=2 threads=1 scheduler=<s>` as a subprocess; tokens/s from
  metrics.json (median step time over the steps after warm-up, measured on rank 0).
* torch: torch.distributed.pipelining with the matching schedule class, the SAME stages and
  placement as our plan (built by our own planner, checked against our run's plan.json), gloo,
  two spawned ranks, SGD step and a loss all-reduce inside the timed step, as our trainer does.
* single: one process, gradient accumulation over the 8 micro-batches + SGD, 1 and 2 threads.

Rounds are interleaved (each round runs every configuration once, in an order rotated by one per
round) so that machine noise hits all configurations alike; the table shows the median over
rounds. Run: `python bench/compare_torch_pipelining.py [--rounds 3 --steps 12 --warmup 3]`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _torch_pp import (  # noqa: E402
    ROOT,
    TORCH_SCHEDULES,
    BenchConfig,
    PipelineJob,
    compose_our_run,
    run_single_process,
    run_torch_pipeline,
    workload_overrides,
)

DEFAULT_SCHEDULES = ["1f1b", "zbv", "gpipe"]


@dataclass(frozen=True)
class Config:
    """One row of the table: `kind` is ours, torch or single; `arg` the schedule or thread count."""

    kind: str
    arg: str

    @property
    def label(self) -> str:
        if self.kind == "single":
            return f"single process, {self.arg} thread{'s' if self.arg != '1' else ''}"
        if self.kind == "ours-op":
            return f"ours {self.arg}, operator-level split (pp=2)"
        if self.kind == "ours-auto":
            return "ours plan=auto, warm cache (pp=2)"
        if self.kind == "ours-auto-cold":
            return "ours plan=auto, cold cache (pp=2)"
        if self.kind == "ours-balanced":
            return f"ours {self.arg}, partitioner=balanced (pp=2)"
        return f"{self.kind} {self.arg} (pp=2)"


def our_plan(schedule: str, cfg: BenchConfig) -> tuple[list[int], list[list[str]]]:
    """Placement and stage blocks exactly as `train.py` plans them (Hydra compose + our planner)."""
    _, plan = compose_our_run(schedule, cfg)
    return list(plan.schedule.placement), [list(s.blocks) for s in plan.stages]


def run_ours(schedule: str, cfg: BenchConfig, run_dir: Path, extra: tuple[str, ...] = (),
             cache: Path | None = None) -> dict:
    """One `train.py` run; returns its metrics.json (and the plan it wrote). `cache`: the profile
    cache it plans on (PIPELAUNCH_CACHE), else the caller's."""
    groups = {e.split("=")[0] for e in extra}
    workload = [o for o in workload_overrides(cfg) if o.split("=")[0] not in groups]
    cmd = [
        sys.executable, "train.py", *workload, f"scheduler={schedule}", f"steps={cfg.steps}",
        f"warmup_steps={cfg.warmup}", "logger=console", f"hydra.run.dir={run_dir}", *extra,
    ]
    if cfg.host_setup == "none":
        cmd += ["host_allocator=system", "huge_pages=false", "cpu_affinity=none"]
    env = {**os.environ, "PIPELAUNCH_CACHE": str(cache)} if cache is not None else None
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    if proc.returncode:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-15:])
        raise RuntimeError(f"train.py scheduler={schedule} failed ({proc.returncode}):\n{tail}")
    metrics = json.loads((run_dir / "metrics.json").read_text())
    metrics["plan_json"] = json.loads((run_dir / "plan.json").read_text())
    return metrics


@dataclass
class Measured:
    tokens_per_s: float
    final_loss: float
    #: tokens/s our simulator predicts for this schedule and split from the action times measured in the
    #: run's last step (no idle time beyond what the schedule implies), plus the measured optimizer step
    simulated: float | None = None


#: our best configuration has no torch peer: stages cut between operators, not blocks
OP_LEVEL = ("model.granularity=op", "partitioner=balanced")
#: what each kind of our rows adds to the command line
EXTRA = {"ours": (), "ours-op": OP_LEVEL, "ours-auto": ("plan=auto",), "ours-auto-cold": ("plan=auto",),
         "ours-balanced": ("partitioner=balanced",)}


def measure(config: Config, cfg: BenchConfig, plans: dict, tmp: Path, round_no: int) -> Measured:
    """tokens/s, final loss and (ours) the simulator's prediction of one run of one configuration."""
    if config.kind.startswith("ours"):
        # plan=auto on a cache of its own: one it warmed before the rounds, or an empty one per run
        cache = {"ours-auto": tmp / "warm-cache", "ours-auto-cold": tmp / f"cold-cache-r{round_no}"}.get(config.kind)
        metrics = run_ours(config.arg, cfg, tmp / f"{config.kind}_{config.arg}_r{round_no}", EXTRA[config.kind], cache)
        if config.kind.startswith("ours-auto"):
            search = metrics["plan_search"]
            print(f"  plan=auto chose {search['winner']['label']} after {search['candidates']} candidates in "
                  f"{search['seconds']:.1f} s", flush=True)
        written = metrics["plan_json"]
        if config.kind == "ours":
            placement, blocks = plans[config.arg]
            if [s["blocks"] for s in written["stages"]] != blocks or [s["rank"] for s in written["stages"]] != placement:
                print(f"  warning: plan.json of ours {config.arg} differs from the plan given to torch", flush=True)
        predicted = metrics.get("predicted_step_time_s")
        simulated = cfg.tokens_per_step / predicted if predicted else None
        return Measured(float(metrics["tokens_per_s"]), float(metrics["losses"][-1]), simulated)
    if config.kind == "torch":
        placement, blocks = plans[config.arg]
        result = run_torch_pipeline(PipelineJob(config.arg, placement, blocks, cfg))
    else:
        result = run_single_process(int(config.arg), cfg)
    return Measured(cfg.tokens_per_step / result["step_time_s"], float(result["final_loss"]))


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a and b else "—"


def table(configs: list[Config], tps: dict[Config, list[float]], losses: dict[Config, float],
          simulated: dict[Config, list[float]]) -> str:
    """The markdown table: median tokens/s over rounds, ours/torch, ours/single-2-threads, and what
    the simulator predicted from our runs' own action times (torch runs the same schedule and split,
    so it is set against the same prediction)."""
    med = {c: statistics.median(v) if v else None for c, v in tps.items()}
    sim = {c: statistics.median(v) for c, v in simulated.items() if v}
    single2 = med.get(Config("single", "2"))
    ours = [c for c in configs if c.kind.startswith("ours") and med[c]]
    best = max(ours, key=lambda c: med[c]) if ours else None
    lines = [
        "| configuration | tokens/s (median) | runs (tokens/s) | final loss | ours / torch | vs single 2 threads "
        "| simulated | measured / simulated |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for c in configs:
        runs = ", ".join(f"{x:.0f}" for x in tps[c]) or "failed"
        vs_torch = ratio(med[c], med.get(Config("torch", c.arg))) if c.kind == "ours" else ""
        vs_single = ratio(med[c], single2) if c.kind != "single" or c.arg != "2" else "1.00"
        loss = f"{losses[c]:.4f}" if c in losses else "—"
        value = f"{med[c]:.0f}" if med[c] else "—"
        b = sim.get(Config("ours", c.arg) if c.kind == "torch" else c)
        b_text = f"{b:.0f}" if b and c.kind != "single" else ""
        share = ratio(med[c], b) if b and c.kind != "single" else ""
        lines.append(f"| {c.label} | {value} | {runs} | {loss} | {vs_torch} | {vs_single} | {b_text} | {share} |")
    if best is not None:
        lines.append("")
        lines.append(f"best ours: {best.label}, {med[best]:.0f} tokens/s = {ratio(med[best], single2)} x single "
                     f"process with 2 threads")
    torch_rows = [c for c in configs if c.kind == "torch" and med[c]]
    hand = [c for c in configs if c.kind in ("ours", "ours-balanced") and med[c]]
    single1 = med.get(Config("single", "1"))
    for kind, cache in (("ours-auto", "warm"), ("ours-auto-cold", "cold")):
        auto = med.get(Config(kind, next((c.arg for c in configs if c.kind == kind), "")))
        if not auto:
            continue
        if torch_rows:
            top = max(torch_rows, key=lambda c: med[c])
            lines.append(f"plan=auto ({cache} cache) / torch's best ({top.label}): {ratio(auto, med[top])}; per round: "
                         + ", ".join(paired_ratios(tps, Config(kind, next(c.arg for c in configs if c.kind == kind)),
                                                   torch_rows)))
        if hand:
            top = max(hand, key=lambda c: med[c])
            lines.append(f"plan=auto ({cache} cache) / best configuration chosen by hand ({top.label}): "
                         f"{ratio(auto, med[top])}")
        if single1:
            lines.append(f"plan=auto ({cache} cache) efficiency: {auto / (2 * single1):.2f} of twice the one-thread "
                         "single process")
    return "\n".join(lines)


def paired_ratios(tps: dict[Config, list[float]], auto: Config, torch_rows: list[Config]) -> list[str]:
    """Per round, plan=auto's tokens/s over the best torch configuration of the same round."""
    out = []
    for r, value in enumerate(tps[auto]):
        best = max((tps[c][r] for c in torch_rows if r < len(tps[c])), default=None)
        out.append(ratio(value, best))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the table shows the median")
    parser.add_argument("--steps", type=int, default=12, help="training steps per run, warm-up included")
    parser.add_argument("--warmup", type=int, default=3, help="steps excluded from the median step time")
    parser.add_argument("--schedules", nargs="+", default=DEFAULT_SCHEDULES,
                        help=f"our schedulers (conf/scheduler/); torch peers exist for {', '.join(TORCH_SCHEDULES)}")
    parser.add_argument("--no-single", action="store_true", help="skip the single-process baselines")
    parser.add_argument("--partitioner", default="uniform",
                        help="our partitioner (uniform, balanced, milp); torch runs the very same stage split")
    parser.add_argument("--op-level", nargs="*", default=["zbv"],
                        help="our schedules also run with an operator-level balanced split (model.granularity=op); "
                             "torch has no peer for these")
    parser.add_argument("--auto", action="store_true",
                        help="also run ours with plan=auto (the joint search), on a warm profile cache (planned once "
                             "before the rounds) and on an empty one per run, as a first run plans")
    parser.add_argument("--sweep", action="store_true",
                        help="also run each of --schedules with partitioner=balanced: with the default partitioner "
                             "that is the matrix of conf/sweep/schedules.yaml")
    parser.add_argument("--host-setup", choices=("ours", "all", "none"), default="ours",
                        help="which runs get our launcher's process setup (malloc retention, huge pages, one core "
                             "per rank): ours (the default, as train.py runs), all (torch and the single process "
                             "too: compares the runtimes alone), none (ours with it switched off)")
    args = parser.parse_args()
    if args.steps <= args.warmup:
        parser.error("--steps must exceed --warmup")
    unknown = [s for s in args.schedules if not (ROOT / "conf" / "scheduler" / f"{s}.yaml").exists()]
    if unknown:
        parser.error(f"no conf/scheduler/ entry for {unknown}")

    cfg = BenchConfig(steps=args.steps, warmup=args.warmup, partitioner=args.partitioner, host_setup=args.host_setup)
    plans = {s: our_plan(s, cfg) for s in args.schedules}
    configs = [Config("ours", s) for s in args.schedules]
    configs += [Config("torch", s) for s in args.schedules if s in TORCH_SCHEDULES]
    configs += [Config("ours-op", s) for s in args.op_level]
    configs += [Config("ours-balanced", s) for s in args.schedules] if args.sweep else []
    configs += [Config("ours-auto", args.schedules[0]), Config("ours-auto-cold", args.schedules[0])] if args.auto else []
    if not args.no_single:
        configs += [Config("single", "1"), Config("single", "2")]
    # Pair each of our schedules with its torch peer so a noisy minute hits both alike.
    order = sorted(configs, key=lambda c: (args.schedules.index(c.arg) if c.kind in ("ours", "torch") else 99,
                                           c.kind != "single", c.kind))
    tps: dict[Config, list[float]] = {c: [] for c in configs}
    simulated: dict[Config, list[float]] = {c: [] for c in configs}
    losses: dict[Config, float] = {}
    print(f"{platform.node()} | {platform.processor() or platform.machine()} | torch "
          f"{__import__('torch').__version__} | {time.strftime('%Y-%m-%d %H:%M')} | rounds={args.rounds} "
          f"steps={args.steps} warmup={args.warmup} host-setup={args.host_setup}", flush=True)
    for s in args.schedules:
        placement, blocks = plans[s]
        print(f"  {s}: placement {placement}, stages {blocks}", flush=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_pp_") as tmp:
        if args.auto:  # the warm cache: one plan=auto planned on it before the rounds
            run_ours(args.schedules[0], replace(cfg, steps=2, warmup=1),
                     Path(tmp) / "warming", ("plan=auto",), Path(tmp) / "warm-cache")
        for r in range(args.rounds):
            shift = r % len(order)
            for c in order[shift:] + order[:shift]:
                t0 = time.perf_counter()
                try:
                    got = measure(c, cfg, plans, Path(tmp), r)
                except Exception as err:  # noqa: BLE001 - one failing configuration must not lose the table
                    print(f"round {r + 1}: {c.label}: FAILED: {err}", flush=True)
                    continue
                value, loss = got.tokens_per_s, got.final_loss
                tps[c].append(value)
                losses[c] = loss
                if got.simulated:
                    simulated[c].append(got.simulated)
                print(f"round {r + 1}: {c.label:<28} {value:8.0f} tokens/s  loss {loss:.4f}  "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)
    print(f"\ntotal {time.perf_counter() - started:.0f} s\n")
    print(table(order, tps, losses, simulated))


if __name__ == "__main__":
    main()
