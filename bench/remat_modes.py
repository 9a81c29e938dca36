"""Recomputation per mode: what the fullest rank holds and how long a step takes under remat=none,
selective, full (a block at a time) and stage (a whole stage at once), measured against the
planner's prediction.

    python bench/remat_modes.py                  # gpt_bench pp=2, 2 micro-batches of 16 sequences, SGD, 3 rounds x 6 steps
    python bench/remat_modes.py --quick          # 2 rounds x 4 steps
    python bench/remat_modes.py model.attention=math scheduler=zbv   # more overrides for every run

Each (round, mode) is one `python train.py remat=<mode> predict=true ...` (real ranks, gloo, CPU),
the modes interleaved (none selective full stage none ...), so every step-time ratio comes from
runs side by side. Per mode: rank 0's median step after the warm-up (`step_time_s`), its ratio to
remat=none's (the median of the rounds' ratios), the predicted step; the fullest rank's tensors'
peak (`peak_tensor_bytes`, counted like CUDA's allocated peak: the same in every run), against the
predicted peak less `memory.reserve_bytes`. Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from _rounds import interleaved, round_options

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20
MODES = ("none", "selective", "full", "stage")
COMMON = ["model=gpt_bench", "data=synthetic", "batch_size=32", "microbatches=2", "pp=2", "optimizer=sgd",
          "threads=1", "predict=true", "timeout_s=900", "log_every=100"]


def run(remat: str, steps: int, warmup: int, out: Path, extra: list[str]) -> dict:
    """One training run: rank 0's median step, its prediction, every rank's measured and predicted peak."""
    run_dir = out / remat
    given = {e.split("=", 1)[0] for e in extra}
    common = [c for c in COMMON if c.split("=", 1)[0] not in given]
    cmd = [sys.executable, "train.py", *common, f"remat={remat}", f"steps={steps}", f"warmup_steps={warmup}", *extra,
           f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"remat={remat} failed:\n{proc.stderr[-3000:]}")
    m = json.loads((run_dir / "metrics.json").read_text())
    reserve = float(m["config"]["memory"]["reserve_bytes"])
    ranks = [(r["peak_tensor_bytes"], r["predicted_peak_bytes"] - reserve) for r in m["ranks"]]
    return {"step_s": m["step_time_s"], "predicted_s": m.get("planned_step_time_s"), "ranks": ranks}


def table(rounds: list[dict[str, dict]]) -> list[str]:
    lines = ["| remat | median step ms | every round ms | step / none's | predicted step ms | fullest rank's "
             "tensors MiB | predicted MiB | tensors / predicted |", "|---|---:|---|---:|---:|---:|---:|---:|"]
    for mode in rounds[0]:
        times = [r[mode]["step_s"] for r in rounds]
        ratio = statistics.median(r[mode]["step_s"] / r["none"]["step_s"] for r in rounds) if "none" in rounds[0] \
            else float("nan")
        tensors, predicted = max(rounds[-1][mode]["ranks"])
        planned = rounds[-1][mode]["predicted_s"]
        lines.append(f"| {mode} | {statistics.median(times) * 1e3:.0f} | {', '.join(f'{t * 1e3:.0f}' for t in times)} "
                     f"| {ratio:.2f} | {planned * 1e3 if planned else float('nan'):.0f} | {tensors / MIB:.1f} | "
                     f"{predicted / MIB:.1f} | {tensors / predicted:.2f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    round_options(parser)
    args = parser.parse_args()
    rounds = interleaved(args, args.modes, run, lambda m: m, "remat_modes_")
    print(f"\ngpt_bench {' '.join(COMMON[2:6])} {' '.join(args.extra)}, {args.rounds} rounds x {args.steps} steps "
          f"({args.warmup} warm-up)\n")
    print("\n".join(table(rounds)))


if __name__ == "__main__":
    main()
