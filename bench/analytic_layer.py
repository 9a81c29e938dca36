"""The analytic (roofline) price of one GPT decoder block against the block measured on a GPU.

    python bench/analytic_layer.py                                   # bench/data/h200_layer_times.json
    python bench/analytic_layer.py --measured layer_times.json --hardware h100_sxm

`bench/gpu_layer_times.py` timed `models/gpt.py`'s DecoderBlock on a lent GPU (bf16 autocast,
sequence 2048, SC21's hidden sizes); here the same block runs on meta tensors in bf16 and every
operator is priced by `pipeline/planner/measure/analytic.py` on each hardware file (the datasheet
one and, where there is one, the calibrated one), attention as one fused kernel, and autocast's
casts of the fp32 weights (the measured run's precision) as one memory-bound kernel each way. Prints measured /
predicted per pass: above 1, the device was slower than the roofline says.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main() -> None:
    from pipelaunch.models.gpt import DecoderBlock
    from pipelaunch.pipeline.core.hardware import load_hardware
    from pipelaunch.pipeline.planner.measure.analytic import forward_backward

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--measured", default=str(ROOT / "bench" / "data" / "h200_layer_times.json"))
    parser.add_argument("--hardware", nargs="*", default=["h200", "h200_calibrated"])
    args = parser.parse_args()
    measured = json.loads(Path(args.measured).read_text())
    print(f"measured on {measured['device']} (torch {measured['torch']})")
    print("| hardware file | hidden | micro-batch | forward ms measured / predicted | ratio | backward ms measured / "
          "predicted | ratio |\n|---|---:|---:|---|---:|---|---:|")
    for name in args.hardware:
        hw = load_hardware(name)
        ratios = []
        for row in measured["rows"]:
            with torch.device("meta"):
                block = DecoderBlock(row["hidden"], row["heads"]).to(torch.bfloat16)
                x = torch.empty(row["batch"], row["seq"], row["hidden"], dtype=torch.bfloat16)
            fwd, bwd = forward_backward(block, (x,), hw, master_weights=True)
            rf, rb = row["forward_s"] / fwd.seconds, row["backward_s"] / bwd.seconds
            ratios += [rf, rb]
            print(f"| {name} | {row['hidden']} | {row['batch']} | {row['forward_s'] * 1e3:.2f} / {fwd.seconds * 1e3:.2f} "
                  f"| {rf:.2f} | {row['backward_s'] * 1e3:.2f} / {bwd.seconds * 1e3:.2f} | {rb:.2f} |")
        print(f"{name} ({hw.source}): measured / predicted median {statistics.median(ratios):.2f}, "
              f"range {min(ratios):.2f}-{max(ratios):.2f}")


if __name__ == "__main__":
    main()
