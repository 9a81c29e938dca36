"""DeepSeek-V3's dimensions on 2048 H800s: its published layout planned, and the layout plan=auto
chooses on the same devices, side by side.

    python bench/deepseek_v3.py                 # both (about a minute here, nothing allocated)
    python bench/deepseek_v3.py --published     # the published layout only
    python bench/deepseek_v3.py --remat none    # the published layout without recomputation
    python bench/deepseek_v3.py --set KEY=VALUE  # more overrides for both plans

The model is `conf/model/gpt_deepseek_v3.yaml` (61 blocks of 7168, 256 routed experts of width
2048, top-8, one shared expert, 3 dense blocks, vocabulary 129280, 4096 positions), with multi-head
attention in place of MLA (`attention_counts` below gives the difference in parameters and FLOPs).
The published layout is DeepSeek-V3's (technical report, arXiv 2412.19437, §3.2): 16-way pipeline
parallelism with DualPipe (here `scheduler=dualpipev`, its V-shaped variant: the report's own
pipeline schedule is not in the scheduler group), 64-way expert parallelism, ZeRO-1 data
parallelism over the rest (dp = 2048 / 16 = 128), no tensor parallelism, a global batch of 15360
sequences of 4096 tokens (§4.2, after the ramp from 3072), bf16 (the report's FP8 GEMMs cannot be
priced here). The micro-batch is one sequence (the report gives none): 120 micro-batches a replica.
Recomputation is `remat=auto` (blocks recomputed, full or selectively, where 80 GB need it; the
report recomputes RMSNorm and MLA's up-projections only).

Each row: the predicted step, tokens per second per GPU, MFU on the activated parameters (6 FLOPs
per activated parameter and token over the H800's dense bf16 peak), the fullest GPU's predicted
peak, the seconds the busiest pipeline rank spends in the MoE layers' all-to-alls in a step, and
how long planning took. DeepSeek's own figure, for scale: 180K H800 GPU-hours per trillion tokens
(§1), 1543 tokens/s per GPU, in FP8 with its all-to-alls overlapped.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEVICES, BATCH, SEQ = 2048, 15360, 4096
#: what both plans share: the model, the device, the batch, the precision, the sharding level
COMMON = ["mode=plan", "model=gpt_deepseek_v3", "hardware=h800", f"batch_size={BATCH}", "precision=bf16", "zero=1",
          "eval.every=0"]
#: DeepSeek-V3's layout (§3.2): PP16 x EP64 x ZeRO-1 DP, one sequence a micro-batch
PUBLISHED = ["pp=16", f"dp={DEVICES // 16}", "ep=64", "tp=1", "scheduler=dualpipev", "partitioner=uniform",
             f"microbatches={BATCH // (DEVICES // 16)}"]
#: DeepSeek's throughput: 180K H800 GPU-hours per trillion tokens (§1)
DEEPSEEK_TOKENS_PER_GPU_S = 1e12 / (180e3 * 3600)


def attention_counts(hidden: int = 7168, heads: int = 128, seq: int = SEQ, q_rank: int = 1536, kv_rank: int = 512,
                     nope: int = 128, rope: int = 64, v_head: int = 128) -> dict[str, tuple[float, float]]:
    """(MLA, the project's multi-head attention) per block: parameters, and forward FLOPs per token
    at `seq` causal positions (projections 2 per weight; scores and values 2 x heads x (qk + v
    head width) per key, a query seeing (seq + 1) / 2 keys on average)."""
    mla = (hidden * q_rank + q_rank + q_rank * heads * (nope + rope) + hidden * (kv_rank + rope) + kv_rank
           + kv_rank * heads * (nope + v_head) + heads * v_head * hidden)
    mha = 4 * hidden * hidden + 4 * hidden
    keys = (seq + 1) / 2
    head = hidden // heads
    mla_flops = 2 * (mla - q_rank - kv_rank) + 2 * heads * ((nope + rope) + v_head) * keys
    mha_flops = 2 * 4 * hidden * hidden + 2 * heads * (head + head) * keys
    return {"params": (mla, mha), "flops_per_token": (mla_flops, mha_flops)}


def figures(prepared, outcome=None) -> dict:
    """One plan's row: its step, tokens/s and MFU per GPU, the fullest GPU, the all-to-alls."""
    from pipelaunch.pipeline.core.hardware import load_hardware
    from pipelaunch.pipeline.planner import activated_params, expert_facts

    prediction = outcome.prediction if outcome is not None else prepared.prediction
    plan = prediction.plan
    step = prediction.step_s
    tokens = BATCH * SEQ / step / DEVICES
    mfu = 6 * activated_params(prepared.spec) * tokens / load_hardware("h800").peak_flops["bf16"]
    c = outcome.candidate if outcome is not None else None
    label = (f"pp{plan.pp} dp{plan.dp} ep{plan.ep} {c.scheduler if c else plan.schedule.name} m{plan.microbatches} "
             f"{plan.meta.remat}")
    return {"layout": label, "step_s": step, "tokens": tokens, "mfu": mfu, "peak_gb": prediction.peak_bytes / 1e9,
            "exchange_s": expert_facts(prediction)[1]}


def row(name: str, f: dict, seconds: float) -> str:
    return (f"{name:>10} {f['layout']:>44} {f['step_s']:>7.2f} {f['tokens']:>9.0f} {f['mfu']:>6.1%} "
            f"{f['peak_gb']:>7.1f} {f['exchange_s']:>8.2f} {seconds:>6.1f}")


def main(argv: list[str] | None = None) -> int:
    import warnings

    from pipelaunch.launcher.overrides import compose_checked
    from pipelaunch.launcher.validate import prepare

    # what they say is in the module docstring: the experts' state over their expert replicas is
    # priced, not run; the meta model is never initialised
    warnings.filterwarnings("ignore", message="mode=plan prices ep=")
    warnings.filterwarnings("ignore", message="model gpt_deepseek_v3: no initialiser")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--published", action="store_true", help="the published layout only")
    parser.add_argument("--remat", default="auto", help="the published layout's remat (default auto)")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="more overrides for both plans (e.g. hardware.inter_node.bandwidth=1e11)")
    args = parser.parse_args(argv)
    counts = attention_counts()
    (mla_p, mha_p), (mla_f, mha_f) = counts["params"], counts["flops_per_token"]
    print(f"attention per block: MLA {mla_p / 1e6:.1f}M parameters, {mla_f / 1e6:.1f} MFLOP a token forward; "
          f"multi-head (this model) {mha_p / 1e6:.1f}M ({mha_p / mla_p - 1:+.1%}), {mha_f / 1e6:.1f} MFLOP "
          f"({mha_f / mla_f - 1:+.1%})")
    print(f"{'plan':>10} {'layout':>44} {'step s':>7} {'tok/s/GPU':>9} {'MFU':>6} {'peak GB':>7} "
          f"{'a2a s':>8} {'plan s':>6}")
    started = time.perf_counter()
    published = prepare(compose_checked([*COMMON, *PUBLISHED, f"remat={args.remat}", *args.set]))
    print(row("published", figures(published), time.perf_counter() - started), flush=True)
    if args.published:
        return 0
    started = time.perf_counter()
    searched = prepare(compose_checked([*COMMON, "plan=auto", f"plan.devices={DEVICES}", *args.set]))
    seconds = time.perf_counter() - started
    result = searched.search
    print(row("searched", figures(searched, result.winner), seconds), flush=True)
    print(f"{'DeepSeek':>10} {'pp16 dp128 ep64 DualPipe, FP8, overlapped':>44} {'':>7} "
          f"{DEEPSEEK_TOKENS_PER_GPU_S:>9.0f}", flush=True)
    print(f"\nthe search: {len(result.outcomes)} planned of {len(result.outcomes) + len(result.screened)} "
          f"candidates\nwhy: {result.why()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
