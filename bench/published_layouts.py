"""The GPT models of the Megatron-LM SC21 paper's Table 1, planned on `hardware=a100_80gb` with the
paper's own layouts, against the throughput the paper published.

    python bench/published_layouts.py               # every row (minutes: the largest are pp=64, 512 micro-batches)
    python bench/published_layouts.py --rows 0 4    # some rows
    python bench/published_layouts.py --search --rows 4 9   # plan=auto's layout on the row's GPUs against the paper's
    python bench/published_layouts.py --nemo        # NVIDIA NeMo 24.12's rows (without context parallelism)

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
NEMO = ROOT / "bench" / "data" / "nemo_24_12.csv"

#: NeMo's models as this launcher builds them, from their published configs: Llama 2's
#: config.json (meta-llama/Llama-2-13b-hf, -70b-hf: hidden, MLP width, layers, heads, key/value
#: heads, vocabulary, positions), GPT-3 175B from Brown et al. 2020 (Table 2.1: 96 layers, d 12288,
#: 96 heads, 2048 positions) with Megatron's padded GPT-2 vocabulary (51200)
NEMO_MODELS = {
    "LLAMA2-70B": ["model=hf", "+model.config.model_type=llama", "+model.config.hidden_size=8192",
                   "+model.config.intermediate_size=28672", "+model.config.num_hidden_layers=80",
                   "+model.config.num_attention_heads=64", "+model.config.num_key_value_heads=8",
                   "+model.config.vocab_size=32000", "+model.config.max_position_embeddings=4096"],
    "LLAMA2-13B": ["model=hf", "+model.config.model_type=llama", "+model.config.hidden_size=5120",
                   "+model.config.intermediate_size=13824", "+model.config.num_hidden_layers=40",
                   "+model.config.num_attention_heads=40", "+model.config.num_key_value_heads=40",
                   "+model.config.vocab_size=32000", "+model.config.max_position_embeddings=4096"],
    "GPT3-175B": ["model=gpt", "model.layers=96", "model.dim=12288", "model.heads=96", "model.vocab_size=51200"],
}
#: the global batch of a row that gives none (NeMo's Llama 2 13B recipe is not on that page):
#: 128 sequences, the Llama 2 70B row's
NEMO_DEFAULT_BATCH = 128


def rows() -> list[dict]:
    with TABLE.open() as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


def overrides(row: dict, remat: str = "full") -> list[str]:
    """The paper's layout of one row as this launcher's command line. remat=full recomputes every
    layer's forward inside its backward, keeping only the layer's input, as the paper's Megatron
    does (its count includes it), on the A100's own 80 GB. remat=auto recomputes, layer by layer,
    only what the 80 GB need."""
    tp, pp, gpus = int(row["tp"]), int(row["pp"]), int(row["gpus"])
    dp = gpus // (tp * pp)
    micro, batch, layers = int(row["micro_batch"]), int(row["global_batch"]), int(row["layers"])
    out = ["mode=plan", "hardware=a100_80gb", "model=gpt", f"model.layers={layers}", f"model.dim={row['hidden']}",
           f"model.heads={row['heads']}", "model.vocab_size=51200", "model.seq_len=2048", f"batch_size={batch}",
           f"microbatches={batch // (dp * micro)}", f"pp={pp}", f"dp={dp}", f"tp={tp}", "precision=bf16",
           f"remat={remat}", "partitioner=uniform", "eval.every=0", "model.attention=math"]
    virtual = row["layers_per_virtual_stage"]
    if virtual:
        out += ["scheduler=interleaved_1f1b", f"scheduler.stages_per_rank={layers // (pp * int(virtual))}"]
    else:
        out += ["scheduler=1f1b"]
    return out


def nemo_rows() -> list[dict]:
    """The NeMo 24.12 rows without context parallelism (cp=1), whose model is one of NEMO_MODELS."""
    with NEMO.open() as f:
        found = list(csv.DictReader(line for line in f if not line.startswith("#")))
    return [r for r in found if r["cp"] == "1" and r["model"] in NEMO_MODELS]


def nemo_overrides(row: dict) -> list[str]:
    """A NeMo row's published layout as this launcher's command line: its tp, pp and virtual
    stages (interleaved 1F1B), dp = GPUs / (tp x pp), micro- and global batch, sequence length;
    what NeMo runs besides: sequence parallelism with tp, the distributed optimizer (zero=1), and
    bf16 (the FP8 figures cannot be priced here). NeMo's recipes recompute nothing; this runtime
    holds more per device (fp32 parameters and a residual stream under autocast), so remat=auto
    recomputes, block by block, what 80 GB need."""
    tp, pp, gpus, vp = int(row["tp"]), int(row["pp"]), int(row["gpus"]), int(row["vp"] or 1)
    dp = gpus // (tp * pp)
    micro, batch = int(row["micro_batch"]), int(row["global_batch"] or NEMO_DEFAULT_BATCH)
    out = ["mode=plan", "hardware=h100_sxm", *NEMO_MODELS[row["model"]], f"model.seq_len={row['seq_len']}",
           f"batch_size={batch}", f"microbatches={batch // (dp * micro)}", f"pp={pp}", f"dp={dp}", f"tp={tp}",
           "zero=1", "precision=bf16", "remat=auto", "partitioner=uniform", "eval.every=0"]
    if tp > 1:
        out.append("sequence_parallel=true")
    out += ["scheduler=interleaved_1f1b", f"scheduler.stages_per_rank={vp}"] if vp > 1 else ["scheduler=1f1b"]
    return out


def nemo(rows_: list[dict]) -> int:
    """Each NeMo row planned with its published layout on hardware=h100_sxm: the predicted
    tokens/s per GPU beside the published one (FP8), and both as ratios to the first row."""
    from pipelaunch.launcher.overrides import compose_checked
    from pipelaunch.launcher.validate import prepare

    print(f"{'model':>11} {'gpus':>5} {'layout':>22} {'m':>4} {'step s':>7} {'tok/s/GPU':>9} {'NeMo fp8':>8} "
          f"{'pred/pub':>8} {'ratio':>6} {'NeMo':>6} {'off':>6} {'peak GB':>7} {'recomputed':>16} {'plan s':>6}")
    first = None
    for row in rows_:
        ov = nemo_overrides(row)
        started = time.perf_counter()
        prepared = prepare(compose_checked(ov))
        seconds = time.perf_counter() - started
        plan, step = prepared.plan, prepared.prediction.step_s
        tokens = plan.micro_batch_size * plan.microbatches * plan.dp * int(row["seq_len"])
        per_gpu = tokens / step / int(row["gpus"])
        published = float(row["tokens_per_s_per_gpu"])
        first = first or (per_gpu, published)
        ratio, nemo_ratio = per_gpu / first[0], published / first[1]
        full = sum(len(s.recompute) for s in plan.stages)
        selective = sum(len(s.selective) for s in plan.stages)
        layout = f"tp{row['tp']} pp{row['pp']} dp{plan.dp} vp{row['vp'] or 1}"
        print(f"{row['model']:>11} {row['gpus']:>5} {layout:>22} {plan.microbatches:>4} {step:>7.2f} {per_gpu:>9.0f} "
              f"{published:>8.0f} {per_gpu / published:>8.3f} {ratio:>6.3f} {nemo_ratio:>6.3f} "
              f"{ratio / nemo_ratio - 1:>+6.1%} {prepared.prediction.peak_bytes / 1e9:>7.1f} "
              f"{f'{full} full {selective} sel':>16} {seconds:>6.1f}", flush=True)
    return 0


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
    parser.add_argument("--nemo", action="store_true", help="NeMo 24.12's published layouts instead of SC21's")
    args = parser.parse_args(argv)
    if args.nemo:
        found = nemo_rows()
        return nemo([found[i] for i in args.rows] if args.rows else found)
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
