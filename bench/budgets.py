"""plan=auto under per-device memory budgets from loose to tight: the plan chosen, its predicted
step and peak against the measured ones, and whether any rank went over the budget.

    python bench/budgets.py                                  # gpt_bench pp=4, four budgets
    python bench/budgets.py --caps 400e6 150e6 --steps 4

Each budget is one `python train.py plan=auto memory=budget memory.cap_bytes=<cap> ...` (the search,
then real ranks, gloo, CPU). Measured peaks: each rank's tensors (`peak_tensor_bytes` of metrics.json,
counted like CUDA's allocated peak), against the cap less `memory.reserve_bytes`; and its resident
rise above what its process held apart from its tensors (`peak_above_start_bytes`), against the cap.
Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20
COMMON = ["model=gpt_bench", "data=synthetic", "batch_size=32", "optimizer=adamw", "threads=1", "pp=4",
          "warmup_steps=2", "timeout_s=900", "log_every=100", "plan=auto", "memory=budget"]


def run(cap: float, steps: int, out: Path, extra: list[str]) -> dict:
    run_dir = out / f"cap_{int(cap)}"
    cmd = [sys.executable, "train.py", *COMMON, f"memory.cap_bytes={cap:.0f}", f"steps={steps}", *extra,
           f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        return {"cap": cap, "error": proc.stderr.strip().splitlines()[-1:]}
    m = json.loads((run_dir / "metrics.json").read_text())
    return {"cap": cap, "plan": m["plan_search"]["chosen"]["label"], "measured_s": m["step_time_s"],
            "planned_s": m["planned_step_time_s"], "search_s": m["plan_search"]["seconds"],
            "candidates": m["plan_search"]["candidates"],
            "over_budget": m["plan_search"]["over_budget"],
            "predicted_peak": [r["predicted_peak_bytes"] for r in m["ranks"]],
            "reserve": m["config"]["memory"]["reserve_bytes"],
            "tensor_peak": [r["peak_tensor_bytes"] for r in m["ranks"]],
            "measured_peak": [r["peak_above_start_bytes"] for r in m["ranks"]]}


def _share(measured: float, cap: float) -> str:
    """measured / cap, or a dash where there is no cap."""
    return f"{measured / cap:.2f}" if cap < 1e11 else "—"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--caps", type=float, nargs="+", default=[1e12, 200e6, 120e6, 80e6])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", type=Path)
    parser.add_argument("extra", nargs="*", help="more overrides for every run")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [run(cap, args.steps, Path(tmp), args.extra) for cap in args.caps]
    print("| cap MiB | plan chosen | candidates (over budget) | predicted step ms | measured ms | predicted peak "
          "MiB per device | tensors MiB | fullest tensors / (cap - reserve) | resident MiB | fullest resident / cap |"
          "\n|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        cap = f"{r['cap'] / MIB:.0f}" if r["cap"] < 1e11 else "none"
        if "error" in r:
            print(f"| {cap} | failed: {r['error']} | | | | | | | | |")
            continue
        print(f"| {cap} | {r['plan']} | {r['candidates']} ({r['over_budget']}) | {r['planned_s'] * 1e3:.0f} | "
              f"{r['measured_s'] * 1e3:.0f} | {' / '.join(f'{p / MIB:.0f}' for p in r['predicted_peak'])} | "
              f"{' / '.join(f'{p / MIB:.0f}' for p in r['tensor_peak'])} | "
              f"{_share(max(r['tensor_peak']), r['cap'] - r['reserve'])} | "
              f"{' / '.join(f'{p / MIB:.0f}' for p in r['measured_peak'])} | "
              f"{_share(max(r['measured_peak']), r['cap'])} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
