"""scheduler=auto on the default model against a hand sweep of every training schedule.

    python bench/auto_on_default.py                   # default model, every schedule + auto, 2 rounds
    python bench/auto_on_default.py --rounds 3 --steps 20

Every run is `python train.py scheduler=<name> steps=N warmup_steps=2 predict=true` on the default
config (model=gpt, pp=2, 4 micro-batches, gloo on CPU), in rounds that interleave the
configurations so that the machine's drift hits all alike. All runs share one fresh cache
directory: the profile and the runtime's overheads (`pipeline/planner/measure/overheads.py`) are
measured once, at the start, as a user's first run would. Prints per schedule its planned step
(the prediction the plan made before any rank started) and its measured median step over the
rounds, then what scheduler=auto chose and its measured step against the best hand-run one.
Run it on an otherwise idle machine.
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
#: every training schedule of the scheduler group (torch's orders and the search left out)
SCHEDULES = sorted(p.stem for p in (ROOT / "conf" / "scheduler").glob("*.yaml")
                   if p.stem not in ("auto", "torch", "inference"))


def run(scheduler: str, steps: int, out: Path, cache: Path, extra: list[str]) -> dict:
    run_dir = out / f"{scheduler}_{time.monotonic_ns()}"
    cmd = [sys.executable, "train.py", f"scheduler={scheduler}", f"steps={steps}", "warmup_steps=2", "predict=true",
           "log_every=1000", *extra, f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PIPELAUNCH_CACHE": str(cache)})
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
    m = json.loads((run_dir / "metrics.json").read_text())
    chosen = (m.get("plan_search") or {}).get("chosen", {})
    return {"measured_s": m["step_time_s"], "planned_s": m.get("planned_step_time_s"),
            "chosen": chosen.get("scheduler_option") or chosen.get("scheduler") or m.get("schedule"),
            "latency_s": m.get("link_latency_s"), "action_s": m.get("action_overhead_s")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("extra", nargs="*", help="more overrides for every run")
    args = parser.parse_args()
    names = [*SCHEDULES, "auto"]
    rows: dict[str, list[dict]] = {n: [] for n in names}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "cache"
        for r in range(args.rounds):
            for name in names:
                rows[name].append(run(name, args.steps, Path(tmp), cache, args.extra))
                print(f"  round {r} {name} ({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
    ok = {n: [x for x in rs if "error" not in x] for n, rs in rows.items()}
    first = next((x for rs in ok.values() for x in rs), {})
    print(f"latency {first.get('latency_s', 0) * 1e3:.3f} ms per message, "
          f"{first.get('action_s', 0) * 1e3:.3f} ms per action (measured once, shared by every run)\n")
    print("| schedule | planned step ms | measured ms (median of rounds) | measured / planned |\n|---|---:|---:|---:|")
    measured = {}
    for name in names:
        if not ok[name]:
            print(f"| {name} | failed: {rows[name][0].get('error')} | | |")
            continue
        meas = statistics.median(x["measured_s"] for x in ok[name])
        plan = statistics.median(x["planned_s"] for x in ok[name] if x["planned_s"])
        measured[name] = meas
        label = name if name != "auto" else f"auto (ran {', '.join(sorted({x['chosen'] for x in ok[name]}))})"
        print(f"| {label} | {plan * 1e3:.1f} | {meas * 1e3:.1f} | {meas / plan:.2f} |")
    hand = {n: t for n, t in measured.items() if n != "auto"}
    if hand and "auto" in measured:
        best = min(hand, key=hand.get)
        print(f"\nscheduler=auto measured {measured['auto'] * 1e3:.1f} ms; the best hand-run schedule, {best}, "
              f"{hand[best] * 1e3:.1f} ms: auto / best = {measured['auto'] / hand[best]:.3f}")


if __name__ == "__main__":
    main()
