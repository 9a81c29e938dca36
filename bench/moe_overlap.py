"""DualPipeV's overlap of the expert all-to-alls (`moe.overlap`): the step with and without it,
measured in one interleaved run, beside the simulator's prediction of each.

    python bench/moe_overlap.py                 # gpt with 8 experts top-2, pp=2 dp=2 ep=2 dualpipev, 3 rounds x 6 steps
    python bench/moe_overlap.py --quick         # 2 rounds x 4 steps
    python bench/moe_overlap.py model.layers=12 # more overrides for every run

Each (round, setting) is one `python train.py moe.overlap=<true|false> predict=true ...` (real
ranks, gloo, CPU), the settings interleaved (on off on off ...), so the ratio comes from runs side
by side. Per setting: rank 0's median step after the warm-up (`step_time_s`), its ratio to the
run without overlap (the median of the rounds' ratios), the planned step (`planned_step_time_s`:
the simulator on the profile, pairs priced by `CostModel.overlap_exchange_s`) and its ratio to the
measured one. Run it on an otherwise idle machine.
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
SETTINGS = ("true", "false")
COMMON = ["model=gpt", "model.dim=128", "model.layers=8", "model.seq_len=64", "model.vocab_size=512",
          "model.experts=8", "model.top_k=2", "model.expert_dim=256", "model.dense_layers=1", "data=synthetic",
          "pp=2", "dp=2", "ep=2", "scheduler=dualpipev", "microbatches=8", "batch_size=64", "optimizer=sgd",
          "threads=1", "predict=true", "timeout_s=900", "log_every=100"]


def run(overlap: str, steps: int, warmup: int, out: Path, extra: list[str]) -> dict:
    """One training run: rank 0's median step and the planned one."""
    run_dir = out / f"overlap_{overlap}"
    given = {e.split("=", 1)[0] for e in extra}
    common = [c for c in COMMON if c.split("=", 1)[0] not in given]
    cmd = [sys.executable, "train.py", *common, f"moe.overlap={overlap}", f"steps={steps}", f"warmup_steps={warmup}",
           *extra, f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"moe.overlap={overlap} failed:\n{proc.stderr[-3000:]}")
    m = json.loads((run_dir / "metrics.json").read_text())
    return {"step_s": m["step_time_s"], "predicted_s": m.get("planned_step_time_s")}


def table(rounds: list[dict[str, dict]]) -> list[str]:
    lines = ["| moe.overlap | median step ms | every round ms | step / off's | planned step ms | planned / measured |",
             "|---|---:|---|---:|---:|---:|"]
    for setting in rounds[0]:
        times = [r[setting]["step_s"] for r in rounds]
        ratio = statistics.median(r[setting]["step_s"] / r["false"]["step_s"] for r in rounds)
        planned = statistics.median(r[setting]["predicted_s"] for r in rounds)
        lines.append(f"| {setting} | {statistics.median(times) * 1e3:.0f} | "
                     f"{', '.join(f'{t * 1e3:.0f}' for t in times)} | {ratio:.2f} | {planned * 1e3:.0f} | "
                     f"{planned / statistics.median(times):.2f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    round_options(parser)
    args = parser.parse_args()
    rounds = interleaved(args, SETTINGS, run, lambda s: f"overlap={s}", "moe_overlap_")
    print(f"\n{' '.join(COMMON)} {' '.join(args.extra)}, {args.rounds} rounds x {args.steps} steps "
          f"({args.warmup} warm-up)\n")
    print("\n".join(table(rounds)))


if __name__ == "__main__":
    main()
