"""The V schedule three ways on one split, interleaved: our runtime with our zbv order, our runtime
with torch's ZBVZeroBubble order (`scheduler=torch`), and torch.distributed.pipelining's runtime.

Why: it separates what the order costs from what the runtime costs (bench/compare_torch_pipelining.py
compares ours and torch's each on its own order). Workload as in that bench (gpt_bench pp=2, batch
32 in 8 micro-batches, SGD, one thread a rank). Run: `python bench/zbv_orders.py [--rounds 3]`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _torch_pp import BenchConfig, PipelineJob, run_torch_pipeline  # noqa: E402
from compare_torch_pipelining import our_plan, run_ours  # noqa: E402

VARIANTS = ("ours, our zbv order", "ours, torch's ZBVZeroBubble order", "torch.distributed.pipelining")


def measure(variant: str, cfg: BenchConfig, placement: list[int], blocks: list[list[str]], run_dir: Path) -> float:
    """tokens/s of one run of one variant."""
    if variant == VARIANTS[2]:
        out = run_torch_pipeline(PipelineJob("zbv", placement, blocks, cfg))
        return cfg.tokens_per_step / out["step_time_s"]
    if variant == VARIANTS[0]:
        return float(run_ours("zbv", cfg, run_dir)["tokens_per_s"])
    metrics = run_ours("torch", cfg, run_dir, ("scheduler.schedule=ZBVZeroBubble",))
    if [s["blocks"] for s in metrics["plan_json"]["stages"]] != blocks:
        raise RuntimeError("scheduler=torch split the model otherwise than zbv: the comparison needs one split")
    return float(metrics["tokens_per_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the table shows the median")
    args = parser.parse_args()
    cfg = BenchConfig()
    placement, blocks = our_plan("zbv", cfg)
    found: dict[str, list[float]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for v in VARIANTS[r % 3:] + VARIANTS[:r % 3]:  # the order rotates: drift hits each alike
                found[v].append(measure(v, cfg, placement, blocks, Path(tmp) / f"{r}-{time.time_ns()}"))
                print(f"round {r + 1}: {v}: {found[v][-1]:.0f} tokens/s", flush=True)
    print("\n| runtime, order | tokens/s per round | median |\n|---|---|---:|")
    for v, runs in found.items():
        print(f"| {v} | {', '.join(f'{x:.0f}' for x in runs)} | {statistics.median(runs):.0f} |")


if __name__ == "__main__":
    main()
