"""Context parallelism's memory: what the fullest rank holds at cp=1 and cp=2 on long sequences,
measured against the planner's prediction.

    python bench/cp_memory.py                     # gpt_bench at 1024 positions, pp=2, 2 micro-batches of 2
    python bench/cp_memory.py model.seq_len=2048  # more overrides for every run

Each cp is one `python train.py cp=<n> predict=true ...` (real ranks, gloo, CPU). Per cp: the
fullest rank's tensors' peak (`peak_tensor_bytes`, counted as CUDA's allocator counts its
allocated peak: the same in every run) against the predicted peak less `memory.reserve_bytes`,
and rank 0's median step. The peaks are deterministic; the step times are one run each (read
them as a rough figure: the 2-core VM drifts).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20
COMMON = ["model=gpt_bench", "model.seq_len=1024", "data=synthetic", "batch_size=4", "microbatches=2", "pp=2",
          "optimizer=sgd", "threads=1", "predict=true", "timeout_s=1800", "steps=3", "warmup_steps=1",
          "log_every=100"]


def run(cp: int, out: Path, extra: list[str]) -> dict:
    """One training run: every rank's measured and predicted tensor peak, rank 0's median step."""
    run_dir = out / f"cp{cp}"
    given = {e.split("=", 1)[0] for e in extra}
    common = [c for c in COMMON if c.split("=", 1)[0] not in given]
    cmd = [sys.executable, "train.py", *common, f"cp={cp}", *extra, f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"cp={cp} failed:\n{proc.stderr[-3000:]}")
    m = json.loads((run_dir / "metrics.json").read_text())
    reserve = float(m["config"]["memory"]["reserve_bytes"])
    return {"step_s": m["step_time_s"], "ranks": [(r["peak_tensor_bytes"], r["predicted_peak_bytes"] - reserve)
                                                  for r in m["ranks"]]}


def main(argv: list[str]) -> None:
    out = ROOT / "outputs" / "bench_cp_memory"
    results = {cp: run(cp, out, argv) for cp in (1, 2)}
    print("| cp | ranks | fullest rank's tensors MiB | predicted MiB | predicted / measured | vs cp=1 | step ms |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    base = max(results[1]["ranks"])[0]
    for cp, r in results.items():
        tensors, predicted = max(r["ranks"])
        print(f"| {cp} | {len(r['ranks'])} | {tensors / MIB:.1f} | {predicted / MIB:.1f} | {predicted / tensors:.2f} | "
              f"{tensors / base:.2f} | {r['step_s'] * 1e3:.0f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
