"""The GPT models of the Megatron-LM SC21 paper's Table 1, planned on `hardware=a100_80gb` with the
paper's own layouts, against the throughput the paper published.

    python bench/published_layouts.py               # every row (minutes: the largest are pp=64, 512 micro-batches)
    python bench/published_layouts.py --rows 0 4    # some rows
    python bench/published_layouts.py --search --rows 4 9   # plan=auto's layout on the row's GPUs against the paper's

Each row (bench/data/sc21_table1.csv, from Narayanan et al. SC21, arXiv 2104.04473, and Megatron-LM's
examples/academic_paper_scripts/sc21/run_table_1.sh) is planned as the paper ran it: its tp, pp and
dp = GPUs / (tp x pp), its micro-batch and global batch, the interleaved schedule where it gives
layers per virtual stage (1F1B otherwise), full activation recomputation, bf16 with fp32 master
weights. The project's GPT stands in for Megatron's (pre-LayerNorm blocks, separate q/k/v
projections, a 4x GELU MLP, learned positions), its attention computed as the paper's Megatron-LM
computed it, before fused (flash) attention: the scores materialised (`model.attention=math`), each
of a layer's b x heads x s x s scores written and read by every step. The planner prices every layer on the A100 file's
figures (`pipeline/planner/measure/analytic_profile.py`) and simulates the step; the predicted
TFLOP/s per GPU uses the paper's own count (its appendix: 96 B s l h^2 (1 + s/6h + V/16lh) per
iteration, recomputation's extra forward included), so the two columns compare like for like
under --remat full.
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TABLE = ROOT / "bench" / "data" / "sc21_table1.csv"


def rows() -> list[dict]:
    with TABLE.open() as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


def overrides(row: dict, remat: str = "full") -> list[str]:
    """The paper's layout of one row as this launcher's command line. remat=full recomputes every
    stage's forward, as the paper does (its count includes it); this runtime recomputes a stage
    whole where Megatron checkpoints each layer, so its peak can pass 80 GB where Megatron's does
    not: the device's memory is lifted (the peak column says what it would need). remat=auto
    recomputes only what the 80 GB need."""
    tp, pp, gpus = int(row["tp"]), int(row["pp"]), int(row["gpus"])
    dp = gpus // (tp * pp)
    micro, batch, layers = int(row["micro_batch"]), int(row["global_batch"]), int(row["layers"])
    out = ["mode=plan", "hardware=a100_80gb", "model=gpt", f"model.layers={layers}", f"model.dim={row['hidden']}",
           f"model.heads={row['heads']}", "model.vocab_size=51200", "model.seq_len=2048", f"batch_size={batch}",
           f"microbatches={batch // (dp * micro)}", f"pp={pp}", f"dp={dp}", f"tp={tp}", "precision=bf16",
           f"remat={remat}", "partitioner=uniform", "eval.every=0", "model.attention=math"]
    if remat == "full":
        out.append("hardware.memory_bytes=1e13")
    virtual = row["layers_per_virtual_stage"]
    if virtual:
        out += ["scheduler=interleaved_1f1b", f"scheduler.stages_per_rank={layers // (pp * int(virtual))}"]
    else:
        out += ["scheduler=1f1b"]
    return out


def paper_flops(row: dict) -> float:
    """FLOPs of one iteration as the paper counts them (recomputation's forward included)."""
    b, s, v = int(row["global_batch"]), 2048, 51200
    layers, h = int(row["layers"]), int(row["hidden"])
    return 96.0 * b * s * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))


def main(argv: list[str] | None = None) -> int:
    from pipelaunch.launcher.overrides import compose_checked
    from pipelaunch.launcher.validate import prepare

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="*", help="row indices (0-9); default all")
    parser.add_argument("--remat", choices=("full", "auto"), default="full",
                        help="full: as the paper (every forward recomputed); auto: only what 80 GB need")
    parser.add_argument("--search", action="store_true",
                        help="also let plan=auto choose the layout on the row's GPUs (plan.devices) and compare")
    args = parser.parse_args(argv)
    table = rows()
    chosen = args.rows if args.rows else range(len(table))
    if args.search:
        return searched(table, chosen, args.remat)
    print(f"{'params':>7} {'layout':>18} {'mbs':>4} {'m':>4} {'sched':>9} {'step s':>8} {'TFLOP/s/GPU':>11} "
          f"{'paper':>6} {'ratio':>6} {'peak GB':>8} {'plan s':>7}")
    for i in chosen:
        row = table[i]
        ov = overrides(row, args.remat)
        started = time.perf_counter()
        prepared = prepare(compose_checked(ov))
        seconds = time.perf_counter() - started
        step = prepared.prediction.step_s
        predicted = paper_flops(row) / step / int(row["gpus"]) / 1e12
        paper = float(row["tflops_per_gpu"])
        layout = f"tp{row['tp']} pp{row['pp']} dp{int(row['gpus']) // (int(row['tp']) * int(row['pp']))}"
        sched = "inter" if row["layers_per_virtual_stage"] else "1f1b"
        print(f"{row['params_b']:>6}B {layout:>18} {row['micro_batch']:>4} {prepared.plan.microbatches:>4} "
              f"{sched:>9} {step:>8.2f} {predicted:>11.0f} {paper:>6.0f} {predicted / paper:>6.2f} "
              f"{prepared.prediction.peak_bytes / 1e9:>8.1f} {seconds:>7.1f}", flush=True)
    return 0


def searched(table: list[dict], chosen, remat: str) -> int:
    """Each row planned twice on the same cost model: with the paper's layout, and with plan=auto
    choosing tp, pp, dp, the schedule and the micro-batch count on the row's GPUs (the partition
    uniform and the recomputation the same, so the two steps compare like for like)."""
    from pipelaunch.launcher.overrides import compose_checked
    from pipelaunch.launcher.validate import prepare

    fixed_keys = ("microbatches=", "pp=", "dp=", "tp=", "scheduler=", "scheduler.", "partitioner=")
    print(f"{'params':>7} {'paper layout':>26} {'step s':>8} {'planner layout':>44} {'step s':>8} "
          f"{'ratio':>6} {'plan s':>7}")
    for i in chosen:
        row = table[i]
        ov = overrides(row, remat)
        paper = prepare(compose_checked(ov)).prediction.step_s
        auto = [o for o in ov if not o.startswith(fixed_keys)] + [
            "plan=auto", f"plan.devices={row['gpus']}", "plan.partitioners=[uniform]", f"plan.remat=[{remat}]"]
        started = time.perf_counter()
        found = prepare(compose_checked(auto))
        seconds = time.perf_counter() - started
        win = found.search.winner
        c = win.candidate
        dp = int(row["gpus"]) // (int(row["tp"]) * int(row["pp"]))
        given = f"tp{row['tp']} pp{row['pp']} dp{dp} m{int(row['global_batch']) // (dp * int(row['micro_batch']))}"
        chose = f"tp{c.tp or 1} pp{c.pp} dp{c.dp} m{c.microbatches} {c.scheduler}"
        print(f"{row['params_b']:>6}B {given:>26} {paper:>8.2f} {chose:>44} {win.prediction.step_s:>8.2f} "
              f"{win.prediction.step_s / paper:>6.2f} {seconds:>7.1f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
