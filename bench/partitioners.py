"""tokens/s of gpt_bench pp=2 1f1b with each partitioner, interleaved rounds, one thread per rank.

The embedding and the LM head (vocab 4096, plus the loss) make an equal-blocks split lopsided;
`balanced` and `milp` cut on the measured block profile instead. Each run is
`python train.py model=gpt_bench ... partitioner=<p>`; the table shows the median over rounds,
the split each partitioner chose, and its predicted bottleneck against the lower bound.

Run: `python bench/partitioners.py [--rounds 3 --steps 10 --warmup 3]`.
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
WORKLOAD = ["model=gpt_bench", "data=synthetic", "batch_size=32", "microbatches=8", "pp=2", "dp=1",
            "threads=1", "optimizer=sgd", "scheduler=1f1b"]


def run(partitioner: str, steps: int, warmup: int, run_dir: Path) -> dict:
    cmd = [sys.executable, "train.py", *WORKLOAD, f"partitioner={partitioner}", f"steps={steps}",
           f"warmup_steps={warmup}", f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"partitioner={partitioner} failed:\n{proc.stderr[-2000:]}")
    return json.loads((run_dir / "metrics.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--partitioners", nargs="+", default=["uniform", "balanced", "milp"])
    args = parser.parse_args()
    tps: dict[str, list[float]] = {p: [] for p in args.partitioners}
    info: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench_part_") as tmp:
        for r in range(args.rounds):
            order = args.partitioners[r % len(args.partitioners):] + args.partitioners[: r % len(args.partitioners)]
            for p in order:
                m = run(p, args.steps, args.warmup, Path(tmp) / f"{p}_{r}")
                tps[p].append(m["tokens_per_s"])
                info[p] = m
                print(f"round {r}: {p:<9} {m['tokens_per_s']:8.0f} tokens/s", flush=True)
    base = statistics.median(tps[args.partitioners[0]])
    print("\n| partitioner | split (blocks per stage) | predicted bottleneck / bound | tokens/s (median) | runs | vs uniform |")
    print("|---|---|---:|---:|---|---:|")
    for p in args.partitioners:
        stages = info[p]["stages"]
        split = " / ".join(str(len(s["blocks"])) for s in stages)
        part = info[p].get("partition") or {}
        bound = f"{part['bottleneck_s'] / part['lower_bound_s']:.2f}" if part else "—"
        med = statistics.median(tps[p])
        runs = ", ".join(f"{x:.0f}" for x in tps[p])
        print(f"| {p} | {split} | {bound} | {med:.0f} | {runs} | {med / base:.2f} |")


if __name__ == "__main__":
    main()
