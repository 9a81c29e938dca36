"""Predicted against measured, for every training schedule at pp=2 and pp=4: step time and the
peak memory of each device.

    python bench/predictions.py                      # every schedule, pp 2 and 4, 6 steps (2 warm-up)
    python bench/predictions.py --pp 2 --schedules 1f1b zbv --steps 8
    python bench/predictions.py --pp 8 --schedules 1f1b v_half v_min --steps 4 model.layers=32 microbatches=32 batch_size=64

Each configuration is one `python train.py model=gpt_bench ...` (real ranks, gloo, CPU). The
prediction is the one the plan made before any rank started (`planned_step_time_s` of metrics.json:
the simulated schedule on the profile, ranks sharing too few cores taking turns, plus the optimizer
step; each run profiles afresh, since this machine's speed drifts by 10-20% over minutes); measured
is rank 0's median step after warm-up. Memory: the planner's peak per device
(parameters, gradients, optimizer state, simulated activation peak) against each rank's measured
peak above what its process held before building its stages (`peak_above_start_bytes`, resident
memory: with the launcher's host allocator, freed blocks stay in the process, so it carries the
allocator's fragmentation too), and its tensors' own peak as CUDA's allocator counts them
(`peak_tensor_bytes`) against the prediction less `memory.reserve_bytes` (the share set aside for
what a process holds beyond its tensors). Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20
SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "hanayo", "zb_h1", "zb_h2", "zbv"]
COMMON = ["model=gpt_bench", "data=synthetic", "batch_size=32", "microbatches=8", "optimizer=sgd", "threads=1",
          "warmup_steps=2", "timeout_s=600", "log_every=100", "predict=true"]


def run(schedule: str, pp: int, steps: int, out: Path, extra: list[str]) -> dict:
    run_dir = out / f"{schedule}_pp{pp}"
    cmd = [sys.executable, "train.py", *COMMON, f"scheduler={schedule}", f"pp={pp}", f"steps={steps}", *extra,
           f"hydra.run.dir={run_dir}"]
    # a fresh profile per run: the machine's speed drifts, so profile and run are measured together
    env = {**os.environ, "PIPELAUNCH_CACHE": str(run_dir / "profile-cache")}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800, env=env)
    if proc.returncode != 0:
        return {"schedule": schedule, "pp": pp, "error": proc.stderr.strip().splitlines()[-1:]}
    m = json.loads((run_dir / "metrics.json").read_text())
    predicted_peak = [r.get("predicted_peak_bytes") or 0.0 for r in m["ranks"]]
    measured_peak = [r["peak_above_start_bytes"] for r in m["ranks"]]
    tensor_peak = [r.get("peak_tensor_bytes") for r in m["ranks"]]
    # what the prediction adds for the process beyond its tensors (memory.reserve_bytes)
    reserve = float(json.loads((run_dir / "plan.json").read_text())["meta"].get("reserve_bytes") or 0.0)
    return {"schedule": schedule, "pp": pp, "measured_s": m["step_time_s"], "planned_s": m["planned_step_time_s"],
            "planned_schedule_s": m["planned_schedule_s"], "measured_schedule_s": m.get("measured_schedule_s"),
            "predicted_peak": predicted_peak, "measured_peak": measured_peak, "tensor_peak": tensor_peak,
            "predicted_tensors": [p - reserve if p else 0.0 for p in predicted_peak]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--schedules", nargs="+", default=SCHEDULES)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("extra", nargs="*", help="more overrides for every run")
    args = parser.parse_args()
    rows = []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for pp in args.pp:
            for schedule in args.schedules:
                rows.append(run(schedule, pp, args.steps, Path(tmp), args.extra))
                print(f"  done {schedule} pp={pp} ({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
    print("| pp | schedule | predicted step ms | measured ms | measured / predicted | predicted peak MiB per "
          "device | measured MiB | measured / predicted | tensors MiB (CUDA's count) | tensors / predicted less the "
          "reserve |\n"
          "|---|---|---|---|---|---|---|---|---|---|")
    step_err, mem_err = [], []
    for r in rows:
        if "error" in r:
            print(f"| {r['pp']} | {r['schedule']} | failed: {r['error']} | | | | | |")
            continue
        ratio = r["measured_s"] / r["planned_s"]
        mem = [m / p for m, p in zip(r["measured_peak"], r["predicted_peak"], strict=True) if p]
        step_err.append(abs(ratio - 1))
        mem_err += [abs(x - 1) for x in mem]
        print(f"| {r['pp']} | {r['schedule']} | {r['planned_s'] * 1e3:.0f} | {r['measured_s'] * 1e3:.0f} | "
              f"{ratio:.2f} | {' / '.join(f'{p / MIB:.0f}' for p in r['predicted_peak'])} | "
              f"{' / '.join(f'{m / MIB:.0f}' for m in r['measured_peak'])} | "
              f"{' / '.join(f'{x:.2f}' for x in mem)} | "
              f"{' / '.join(f'{t / MIB:.0f}' if t else '-' for t in r['tensor_peak'])} | "
              f"{' / '.join(f'{t / p:.2f}' if t and p else '-' for t, p in zip(r['tensor_peak'], r['predicted_tensors'], strict=True))} |")
    if step_err:
        print(f"\nstep time: median |error| {statistics.median(step_err):.1%}, worst {max(step_err):.1%}; "
              f"peak memory: median |error| {statistics.median(mem_err):.1%}, worst {max(mem_err):.1%} "
              f"({time.perf_counter() - start:.0f} s)")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
