"""How long `mode=plan` takes at scale (pp=64, 128 micro-batches, 128 layers), and where it goes.

    python bench/plan_speed.py              # 1f1b and zbv, 3 interleaved rounds
    python bench/plan_speed.py --rounds 5 --schedules 1f1b

Two views per schedule. `command`: the wall time of `python train.py mode=plan ...` as a user
types it (interpreter start and imports included). In-process phases (imports already done, the
leaf profile cached by the first round): `compose` (Hydra), `prepare` (validate, build and trace
the model on meta, partition, schedule, lower, simulate) and `write` (plan.json, the stage
table, the simulated timeline). The rounds are interleaved across schedules; medians are printed.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SCALE = ["pp=64", "microbatches=128", "model.layers=128", "batch_size=128", "model.dim=32", "model.seq_len=8",
         "threads=1"]


def command(schedule: str, out: Path) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "train.py", "mode=plan", f"scheduler={schedule}", *SCALE, f"hydra.run.dir={out}"],
                   cwd=ROOT, check=True, capture_output=True)
    return time.perf_counter() - start


def phases(schedule: str, out: Path) -> dict[str, float]:
    from launcher.app import dry_run
    from launcher.overrides import compose_checked
    from launcher.validate import prepare

    t0 = time.perf_counter()
    cfg = compose_checked(["mode=plan", f"scheduler={schedule}", *SCALE])
    t1 = time.perf_counter()
    prepared = prepare(cfg)
    t2 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    dry_run(prepared, out)
    t3 = time.perf_counter()
    return {"compose": t1 - t0, "prepare": t2 - t1, "write": t3 - t2}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--schedules", nargs="+", default=["1f1b", "zbv"])
    args = parser.parse_args()
    runs: dict[str, list[dict[str, float]]] = {s: [] for s in args.schedules}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for s in args.schedules:
                row = {"command": command(s, Path(tmp) / f"cmd_{s}")}
                row.update(phases(s, Path(tmp) / f"in_{s}"))
                runs[s].append(row)
    print("| schedule | command s | compose s | prepare s | write s | rounds |\n|---|---:|---:|---:|---:|---:|")
    for s, rows in runs.items():
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        print(f"| {s} | {med['command']:.2f} | {med['compose']:.2f} | {med['prepare']:.2f} | {med['write']:.2f} | {len(rows)} |")


if __name__ == "__main__":
    main()
