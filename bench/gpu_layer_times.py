"""One GPT decoder block's forward and backward timed on the device, with its FLOPs counted by
torch's flop counter: the ground truth an analytic (roofline) prediction of a layer is held against.

    source .gpu/setup.sh && python3 bench/gpu_layer_times.py --out $OUT     # on a lent GPU
    python bench/gpu_layer_times.py --device cpu --small                    # the script itself, on a CPU

Sizes are Megatron's GPT shapes (SC21 Table 1 hidden sizes, sequence 2048, micro-batch 1-2) in
bf16 autocast, one block of `models/gpt.py` (the project's own GPT: pre-LN, separate q/k/v,
SDPA attention, GELU MLP). Writes `layer_times.json`: per size the counted FLOPs of a forward and a
backward, the median seconds of each (CUDA events) and the achieved FLOP/s, and the allocator's
peak for one block.
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

#: (hidden, heads, micro-batch): SC21 Table 1's rows that fit one block on one GPU untensor-split
SIZES = ((2304, 24, 16), (3072, 32, 16), (4096, 32, 8), (6144, 48, 4), (8192, 64, 2), (12288, 96, 1))
SMALL = ((256, 4, 2), (512, 8, 1))


def time_block(hidden: int, heads: int, batch: int, seq: int, device: torch.device, reps: int) -> dict:
    from torch.utils.flop_counter import FlopCounterMode

    from pipelaunch.models.gpt import DecoderBlock

    block = DecoderBlock(hidden, heads).to(device)
    x = torch.randn(batch, seq, hidden, device=device, requires_grad=True)
    dtype = torch.bfloat16

    def forward():
        with torch.autocast(device.type, dtype=dtype):
            return block(x)

    with FlopCounterMode(display=False) as counter:
        out = forward()
    forward_flops = counter.get_total_flops()
    grad = torch.randn_like(out)
    with FlopCounterMode(display=False) as counter:
        out.backward(grad)
    backward_flops = counter.get_total_flops()

    def timed(fn) -> float:
        times = [timed_once(fn, device) for _ in range(reps + 2)]
        return statistics.median(times[2:])  # two warm-ups

    forward_s = timed(lambda: forward())
    outs = []

    def fwd_keep():
        outs.append(forward())

    def bwd():
        outs.pop().backward(grad)

    backward_times = []
    for _ in range(reps):
        fwd_keep()
        backward_times.append(timed_once(bwd, device))
    backward_s = statistics.median(backward_times)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        forward().backward(grad)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
    else:
        peak = None
    return {"hidden": hidden, "heads": heads, "batch": batch, "seq": seq, "forward_flops": forward_flops,
            "backward_flops": backward_flops, "forward_s": forward_s, "backward_s": backward_s,
            "forward_flops_per_s": forward_flops / forward_s, "backward_flops_per_s": backward_flops / backward_s,
            "peak_bytes_over_inputs": peak}


def timed_once(fn, device: torch.device) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    import time

    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=".", help="where layer_times.json goes")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--small", action="store_true", help="tiny sizes (a CPU check of the script)")
    parser.add_argument("--seq", type=int, default=2048)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    sizes, seq, reps = (SMALL, 128, 3) if args.small else (SIZES, args.seq, 10)
    rows = []
    for hidden, heads, batch in sizes:
        row = time_block(hidden, heads, batch, seq, device, reps)
        rows.append(row)
        print(f"h={hidden:6d} b={batch:3d} s={seq}: forward {row['forward_flops'] / 1e12:7.2f} TFLOP "
              f"{row['forward_s'] * 1e3:8.2f} ms {row['forward_flops_per_s'] / 1e12:6.1f} TFLOP/s | backward "
              f"{row['backward_s'] * 1e3:8.2f} ms {row['backward_flops_per_s'] / 1e12:6.1f} TFLOP/s", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "layer_times.json").write_text(json.dumps(
        {"device": name, "torch": str(torch.__version__), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
