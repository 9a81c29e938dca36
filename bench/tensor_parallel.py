"""Tensor parallelism on this machine: pp=2 tp=2 against pp=2, predicted against measured, in
interleaved rounds (each run profiles afresh: the machine's speed drifts over minutes).

    python bench/tensor_parallel.py                   # gpt_bench, 1F1B, 3 rounds of (tp=2, tp=1)
    python bench/tensor_parallel.py --rounds 2 --schedule zbv
    python bench/tensor_parallel.py --sequence        # and tp=2 sequence_parallel=true in each round

Per run: the planned step (`planned_step_time_s`: the simulated schedule on the profile, each
node's cost scaled to a tp rank's share plus its all-reduces, ranks sharing the cores) against
rank 0's measured median step, and each rank's predicted peak against its measured tensors' peak.
Four tp ranks of one thread share this machine's two cores with the pipeline's, so tp buys no
speed here; what this checks is the price.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from predictions import MIB, run  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--sequence", action="store_true", help="also tp=2 sequence_parallel=true in each round")
    parser.add_argument("extra", nargs="*", help="more overrides for every run")
    args = parser.parse_args()
    rows: list[tuple[int, str, dict]] = []
    layouts = {"2": ["tp=2"], "1": ["tp=1"]}
    if args.sequence:
        layouts = {"2 sp": ["tp=2", "sequence_parallel=true"], **layouts}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.rounds):
            for tp, overrides in layouts.items():
                out = Path(tmp) / f"r{k}tp{tp.replace(' ', '')}"
                rows.append((k, tp, run(args.schedule, 2, args.steps, out, [*overrides, *args.extra])))
                print(f"  done round {k} tp={tp} ({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
    print("| round | tp | predicted step ms | measured ms | measured / predicted | predicted peak MiB per rank | "
          "tensors MiB (measured) | tensors / predicted less the reserve |\n|---|---|---|---|---|---|---|---|")
    ratios: dict[str, list[float]] = {tp: [] for tp in layouts}
    for k, tp, r in rows:
        if "error" in r:
            print(f"| {k} | {tp} | failed: {r['error']} | | | | | |")
            continue
        ratio = r["measured_s"] / r["planned_s"]
        ratios[tp].append(ratio)
        print(f"| {k} | {tp} | {r['planned_s'] * 1e3:.0f} | {r['measured_s'] * 1e3:.0f} | {ratio:.2f} | "
              f"{' / '.join(f'{p / MIB:.0f}' for p in r['predicted_peak'])} | "
              f"{' / '.join(f'{t / MIB:.0f}' if t else '-' for t in r['tensor_peak'])} | "
              f"{' / '.join(f'{t / p:.2f}' if t and p else '-' for t, p in zip(r['tensor_peak'], r['predicted_tensors'], strict=True))} |")
    for tp, values in ratios.items():
        if values:
            print(f"tp={tp}: measured / predicted step, median {statistics.median(values):.2f} "
                  f"(range {min(values):.2f}-{max(values):.2f})")


if __name__ == "__main__":
    main()
