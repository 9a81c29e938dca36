"""Llama-3-405B-sized plans on 16,384 H100s at 131,072 and 8,192 tokens: the published layouts
priced (mode=plan), and with --search what plan=auto plan.devices=16384 chooses, nothing allocated.

    python bench/llama3_405b.py             # both published layouts (about 20 s each here)
    python bench/llama3_405b.py --search    # and both searches

The model is `model=gpt` at Llama 3 405B's sizes (126 layers of 16384, 128 heads, vocabulary
128256). model=gpt has multi-head attention (Llama: 8 key/value heads), a GELU MLP of mlp_ratio x
dim (Llama: SwiGLU of 53248; mlp_ratio=4 gives 3.22e9 parameters a layer against Llama's 3.19e9)
and learned position embeddings (Llama: rotary), so the ring moves 16x the keys and values Llama's
would and stage 0 holds a 131072 x 16384 position table. The layouts are Llama 3's (arXiv
2407.21783, Table 4): tp=8 cp=16 pp=16 dp=8 at 131072 tokens, tp=8 pp=16 dp=128 at 8192, a global
batch of 16M tokens (128 and 2048 sequences), bf16, zero=1 over dp x cp, one sequence a
micro-batch, remat=auto where 80 GB need it.

TFLOP/s per GPU counts 6 FLOPs per matmul parameter and token (the input embeddings left out)
plus causal attention's 6 x layers x dim x seq per token (forward and backward), over the step.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEVICES, TOKENS = 16384, 2 ** 24
LAYERS, DIM, VOCAB = 126, 16384, 128256
MODEL = ["mode=plan", "model=gpt", f"model.layers={LAYERS}", f"model.dim={DIM}", "model.heads=128",
         f"model.vocab_size={VOCAB}", "model.mlp_ratio=4", "hardware=h100_sxm", "precision=bf16", "zero=1",
         "eval.every=0"]
#: Llama 3's layouts (Table 4); the schedule is what the search chooses at 131072
PUBLISHED = {131072: ["tp=8", "cp=16", "pp=16", "dp=8"], 8192: ["tp=8", "cp=1", "pp=16", "dp=128"]}
SCHEDULE = ["scheduler=interleaved_1f1b", "scheduler.stages_per_rank=4", "partitioner=uniform", "remat=auto"]
#: what the searches compare (the rest as plan=auto's defaults)
SEARCH = ["plan=auto", f"plan.devices={DEVICES}", "'plan.schedulers=[1f1b,interleaved_1f1b]'",
          "'plan.partitioners=[uniform]'", "'plan.tp=[8]'"]


def flops_per_token(seq: int) -> float:
    """Matmul parameters x 6 (the blocks' and the head's; tied nothing) plus causal attention."""
    block = 4 * DIM * DIM + 2 * 4 * DIM * DIM
    return 6.0 * (LAYERS * block + DIM * VOCAB) + 6.0 * LAYERS * DIM * seq


def figures(seq: int, prediction) -> str:  # noqa: ANN001 - a Prediction
    step = prediction.step_s
    tokens = TOKENS / step / DEVICES
    return (f"step {step:.2f} s, {tokens:.0f} tokens/s per GPU, {tokens * flops_per_token(seq) / 1e12:.0f} TFLOP/s "
            f"per GPU ({tokens * flops_per_token(seq) / 989e12:.1%} of the H100's bf16 peak), fullest GPU "
            f"{prediction.peak_bytes / 1e9:.1f} GB")


def main(argv: list[str] | None = None) -> int:
    import warnings

    from pipelaunch.launcher.overrides import compose_checked
    from pipelaunch.launcher.validate import prepare

    warnings.filterwarnings("ignore", message="model gpt: no initialiser")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--search", action="store_true", help="also run plan=auto plan.devices=16384")
    args = parser.parse_args(argv)
    for seq, layout in PUBLISHED.items():
        batch = [f"model.seq_len={seq}", f"batch_size={TOKENS // seq}"]
        dp = int(layout[-1].split("=")[1])
        started = time.perf_counter()
        fixed = prepare(compose_checked([*MODEL, *batch, *layout, *SCHEDULE, f"microbatches={TOKENS // seq // dp}"]))
        print(f"{seq:>6} {' '.join(layout)}: {figures(seq, fixed.prediction)} ({time.perf_counter() - started:.1f} s)",
              flush=True)
        if not args.search:
            continue
        started = time.perf_counter()
        found = prepare(compose_checked([*MODEL, *batch, *(s.strip("'") for s in SEARCH)]))
        win = found.search.winner
        print(f"{seq:>6} searched {win.candidate.label}: {figures(seq, win.prediction)} "
              f"({time.perf_counter() - started:.1f} s)\n       why: {found.search.why()}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
