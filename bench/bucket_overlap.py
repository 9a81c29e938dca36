"""zero=0's all-reduces per block against one per stage (before #43), measured side by side.

    python bench/bucket_overlap.py                          # gpt_bench pp=2 dp=2 zbv, 5 rounds x 6 steps
    python bench/bucket_overlap.py --rounds 3 -- scheduler=1f1b microbatches=8

Each round runs `python train.py zero=0 ...` twice, once with `dp_bucket_bytes=0` (one bucket per
block, all-reduced as the stage's last backward finishes each) and once with `dp_bucket_bytes=1e12` (each
stage one bucket, all-reduced after its last backward: what the runtime did before), in alternating
order, so that each ratio comes from two runs side by side on a machine whose speed drifts. Per run
rank 0's median step after `--warmup` steps; the table gives every round and the median of the
rounds' ratios. Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMON = ["model=gpt_bench", "data=synthetic", "batch_size=16", "microbatches=4", "pp=2", "dp=2", "scheduler=zbv",
          "optimizer=adamw", "threads=1", "zero=0", "timeout_s=900", "log_every=100"]
VARIANTS = {"per block": ["dp_bucket_bytes=0"], "per stage": ["dp_bucket_bytes=1e12"]}


def run(variant: list[str], steps: int, warmup: int, out: Path, extra: list[str]) -> tuple[float, float]:
    """One training run: rank 0's median step (s) and the final loss."""
    given = {e.split("=", 1)[0] for e in extra}
    common = [c for c in COMMON if c.split("=", 1)[0] not in given]
    cmd = [sys.executable, "train.py", *common, *variant, f"steps={steps}", f"warmup_steps={warmup}", *extra,
           f"hydra.run.dir={out}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(variant) or 'default'} failed:\n{proc.stderr[-3000:]}")
    m = json.loads((out / "metrics.json").read_text())
    return m["step_time_s"], m["losses"][-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("extra", nargs="*", help="more overrides for every run")
    args = parser.parse_args()
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    losses: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="bucket_overlap_") as tmp:
        for i in range(args.rounds):
            order = list(VARIANTS) if i % 2 == 0 else list(VARIANTS)[::-1]
            for name in order:
                step, loss = run(VARIANTS[name], args.steps, args.warmup, Path(tmp) / f"r{i}-{name.replace(' ', '_')}",
                                 args.extra)
                times[name].append(step)
                losses[name] = loss
            print(f"round {i + 1}/{args.rounds}: " + ", ".join(f"{n} {times[n][-1] * 1e3:.0f} ms" for n in VARIANTS),
                  flush=True)
    ratios = [b / s for b, s in zip(times["per block"], times["per stage"], strict=True)]
    print(f"\nzero=0 {' '.join(args.extra) or 'gpt_bench pp=2 dp=2 zbv'}, {args.rounds} rounds x {args.steps} steps\n")
    print("| buckets | median step ms | every round ms | final loss |")
    print("|---|---:|---|---:|")
    for name in VARIANTS:
        print(f"| {name} | {statistics.median(times[name]) * 1e3:.0f} | "
              f"{', '.join(f'{t * 1e3:.0f}' for t in times[name])} | {losses[name]:.4f} |")
    print(f"\nper block / per stage, median of the rounds' ratios: {statistics.median(ratios):.3f} "
          f"(rounds: {', '.join(f'{r:.2f}' for r in ratios)})")


if __name__ == "__main__":
    main()
