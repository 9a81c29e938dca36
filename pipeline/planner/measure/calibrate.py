"""Calibrate a hardware file on the device at hand: what its matmuls, memory-bound ops, launches and
(with two GPUs) all-reduces actually reach, against the datasheet's peaks.

Why: an analytic prediction is only as good as the efficiencies it applies to the datasheet's
peaks; a vendor's dense bf16 figure is never reached by a training step's GEMMs, and a
memory-bound op reaches a fraction of the HBM's bandwidth that differs per generation. Measured
once on a lent GPU, these fractions turn a datasheet file into a calibrated one.

    python -m pipelaunch.pipeline.planner.measure.calibrate --base h200 --out h200_calibrated.yaml

Writes a hardware file of the same shape as `conf/hardware/<base>.yaml` (the base's datasheet
values, its `efficiency` block replaced by the measured fractions) plus a `calibration` block: the
date, device, torch/CUDA versions and every raw measurement (shape, dtype, seconds, FLOP/s or
bytes/s). Without a base file the measured peaks stand in for the datasheet's (efficiency 1.0 at
the largest shape), which says so. `--device cpu` runs the same measurements on the CPU, only to
check the script without a GPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

#: where the datasheet files live (conf/hardware/<name>.yaml)
HARDWARE_DIR = Path(__file__).resolve().parents[3] / "conf" / "hardware"
#: square GEMM sizes; the efficiency is the best of the two largest (what a transformer's
#: projections at Megatron's sizes reach), the smaller ones show how it falls off
GEMM_SIZES = (512, 1024, 2048, 4096, 8192)
#: transformer-shaped GEMMs (tokens, hidden, 4*hidden): an MLP's first projection
MLP_SHAPES = ((8192, 4096, 16384), (4096, 8192, 32768), (16384, 12288, 49152))
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "tf32": torch.float32, "fp32": torch.float32}
#: elements of the memory-bound probes (bf16: 512 MiB a tensor on a GPU)
MEMORY_ELEMENTS = 1 << 28
ALL_REDUCE_BYTES = (1 << 10, 1 << 16, 1 << 20, 1 << 24, 1 << 28)


def _timer(device: torch.device) -> Callable[[Callable[[], object], int], float]:
    """Median seconds of `fn` over `reps` runs after two warm-ups: CUDA events on a GPU (the
    device's own time, launches overlapped), the wall clock on a CPU."""

    def time_cuda(fn: Callable[[], object], reps: int) -> float:
        for _ in range(2):
            fn()
        torch.cuda.synchronize(device)
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return statistics.median(times)

    def time_cpu(fn: Callable[[], object], reps: int) -> float:
        fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    return time_cuda if device.type == "cuda" else time_cpu


def measure_gemms(device: torch.device, dtypes: list[str], scale: int = 1) -> list[dict]:
    """Achieved FLOP/s of square and MLP-shaped matmuls per dtype (tf32: fp32 with TF32 allowed)."""
    timed = _timer(device)
    rows = []
    shapes = [(n // scale, n // scale, n // scale) for n in GEMM_SIZES]
    shapes += [(m // scale, k // scale, n // scale) for m, k, n in MLP_SHAPES]
    for name in dtypes:
        dtype = DTYPES[name]
        previous = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = name == "tf32"
        try:
            for m, k, n in shapes:
                a = torch.randn(m, k, device=device, dtype=dtype)
                b = torch.randn(k, n, device=device, dtype=dtype)
                seconds = timed(lambda a=a, b=b: a @ b, 10 if device.type == "cuda" else 3)
                flops = 2.0 * m * k * n
                rows.append({"dtype": name, "shape": [m, k, n], "seconds": seconds, "flops_per_s": flops / seconds})
                del a, b
        finally:
            torch.backends.cuda.matmul.allow_tf32 = previous
    return rows


def measure_memory(device: torch.device, elements: int) -> list[dict]:
    """Achieved bytes/s of the memory-bound ops a step runs between its matmuls, in bf16: a copy,
    an add, GELU, softmax over rows and layer norm (each reads its input once and writes once)."""
    timed = _timer(device)
    dtype = torch.bfloat16
    x = torch.randn(elements, device=device, dtype=dtype)
    y = torch.randn(elements, device=device, dtype=dtype)
    out = torch.empty_like(x)
    rows2d = x.view(-1, 4096)
    width = 2  # bytes of a bf16 element
    probes: dict[str, tuple[Callable[[], object], int]] = {
        "copy": (lambda: out.copy_(x), 2),
        "add": (lambda: torch.add(x, y, out=out), 3),
        "gelu": (lambda: torch.nn.functional.gelu(x), 2),
        "softmax": (lambda: torch.softmax(rows2d, dim=-1), 2),
        "layer_norm": (lambda: torch.nn.functional.layer_norm(rows2d, (4096,)), 2),
    }
    rows = []
    for name, (fn, passes) in probes.items():
        seconds = timed(fn, 10 if device.type == "cuda" else 3)
        moved = passes * elements * width
        rows.append({"op": name, "bytes": moved, "seconds": seconds, "bytes_per_s": moved / seconds})
    return rows


def measure_launch(device: torch.device) -> float:
    """Seconds per tiny kernel in a stream of them: the floor under every small op."""
    x = torch.zeros(1, device=device)
    timed = _timer(device)
    count = 200
    return timed(lambda: [x.add_(1.0) for _ in range(count)], 5) / count


def _all_reduce_rank(rank: int, port: int, sizes: tuple[int, ...], queue) -> None:
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    device = torch.device("cuda", rank)
    timed = _timer(device)
    rows = []
    for size in sizes:
        t = torch.ones(size // 2, device=device, dtype=torch.bfloat16)
        seconds = timed(lambda t=t: dist.all_reduce(t), 10)
        # a ring all-reduce moves 2(n-1)/n of the bytes over each link: "bus bandwidth" as nccl-tests says
        rows.append({"bytes": size, "seconds": seconds, "bus_bytes_per_s": size * 2 * (2 - 1) / 2 / seconds})
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def measure_all_reduce(device: torch.device) -> list[dict] | str:
    """Two GPUs' NCCL all-reduce by size; a reason when there are not two."""
    if device.type != "cuda":
        return "not measured: no GPU"
    if torch.cuda.device_count() < 2:
        return "not measured: one GPU visible (a collective needs two)"
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_all_reduce_rank, args=(r, port, ALL_REDUCE_BYTES, queue)) for r in range(2)]
    for p in procs:
        p.start()
    rows = queue.get(timeout=300)
    for p in procs:
        p.join(60)
    return rows


def load_base(name: str | None, device_name: str) -> dict:
    """The datasheet file `conf/hardware/<name>.yaml` as a plain dict (empty without a name);
    `auto`: the file whose `device_name` is this device's (empty when none is)."""
    if not name:
        return {}
    from omegaconf import OmegaConf

    if name == "auto":
        for path in sorted(HARDWARE_DIR.glob("*.yaml")):
            if OmegaConf.load(path).get("device_name") == device_name:
                return OmegaConf.to_container(OmegaConf.load(path), resolve=True)
        return {}

    path = HARDWARE_DIR / f"{name}.yaml"
    if not path.exists():
        known = sorted(p.stem for p in HARDWARE_DIR.glob("*.yaml"))
        raise SystemExit(f"calibrate: --base {name}: no file {path}; known: {', '.join(known)}")
    return OmegaConf.to_container(OmegaConf.load(path), resolve=True)


def calibrated(base: dict, gemms: list[dict], memory: list[dict], launch_s: float,
               all_reduce: list[dict] | str, device_name: str) -> dict:
    """The base file with the measured efficiencies: the best large GEMM over the datasheet peak
    per dtype, the median memory-bound op over the datasheet bandwidth."""
    out = dict(base)
    peaks = dict(base.get("peak_flops") or {})
    best: dict[str, float] = {}
    for row in gemms:
        best[row["dtype"]] = max(best.get(row["dtype"], 0.0), row["flops_per_s"])
    bandwidth = statistics.median(r["bytes_per_s"] for r in memory)
    efficiency = dict(base.get("efficiency") or {})
    matmul = {d: round(best[d] / peaks[d], 3) for d in best if peaks.get(d)}
    if not peaks:  # no datasheet: the measured peaks stand in for it
        out["peak_flops"] = {d: float(f"{v:.4g}") for d, v in best.items()}
        out["memory_bandwidth"] = float(f"{bandwidth:.4g}")
        matmul = {d: 1.0 for d in best}
    efficiency["matmul"] = {**(efficiency.get("matmul") or {}), **matmul}
    sheet_bandwidth = float(base.get("memory_bandwidth") or bandwidth)
    efficiency["memory"] = round(bandwidth / sheet_bandwidth, 3)
    efficiency["memory_ops"] = {r["op"]: round(r["bytes_per_s"] / sheet_bandwidth, 3) for r in memory}
    efficiency["launch_s"] = float(f"{launch_s:.3g}")
    out["efficiency"] = efficiency
    out.setdefault("name", device_name)
    out["sources"] = {**(base.get("sources") or {}),
                      "efficiency": f"calibrated on {device_name}, {time.strftime('%Y-%m-%d')} (see calibration)"}
    out["calibration"] = {
        "date": time.strftime("%Y-%m-%d"),
        "device": device_name,
        "torch": str(torch.__version__),
        "cuda": torch.version.cuda,
        "source": ("measured by pipelaunch.pipeline.planner.measure.calibrate"
                   + (f" against the datasheet file {base.get('name')}" if peaks else ", no datasheet: peaks are the measured ones")),
        "gemm": gemms,
        "memory": memory,
        "all_reduce": all_reduce,
    }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default=None, help="the datasheet file to calibrate (conf/hardware/<base>.yaml; auto: the one naming this device)")
    parser.add_argument("--out", required=True, help="the hardware file to write")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--dtypes", default="bf16,fp16,tf32,fp32")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("calibrate: no CUDA device here (torch.cuda.is_available() is False); use --device cpu to check "
              "the script on a CPU", file=sys.stderr)
        return 2
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    base = load_base(args.base, name)
    scale = 1 if device.type == "cuda" else 8  # a CPU check at 1/8 the sizes
    t0 = time.perf_counter()
    gemms = measure_gemms(device, [d for d in args.dtypes.split(",") if d], scale)
    memory = measure_memory(device, MEMORY_ELEMENTS if device.type == "cuda" else MEMORY_ELEMENTS // 64)
    launch_s = measure_launch(device)
    all_reduce = measure_all_reduce(device)
    result = calibrated(base, gemms, memory, launch_s, all_reduce, name)
    from omegaconf import OmegaConf

    from pipelaunch.pipeline.core.hardware import hardware_from_dict

    record = hardware_from_dict(result, Path(args.out).stem)  # the file written must load as a record

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(f"# calibrated on {name}, {result['calibration']['date']}\n" + OmegaConf.to_yaml(result))
    for row in gemms:
        print(f"gemm {row['dtype']:5s} {'x'.join(map(str, row['shape'])):>18s} {row['flops_per_s'] / 1e12:8.1f} TFLOP/s")
    for row in memory:
        print(f"mem  {row['op']:10s} {row['bytes_per_s'] / 1e9:8.1f} GB/s")
    print(f"launch {launch_s * 1e6:.2f} us; all-reduce: {all_reduce if isinstance(all_reduce, str) else len(all_reduce)}")
    print(f"efficiency: {result['efficiency']}  ({time.perf_counter() - t0:.1f} s)  -> {args.out}")
    print(f"bf16 matmul {record.matmul_flops('bf16') / 1e12:.0f} TFLOP/s, memory-bound {record.bytes_per_s() / 1e9:.0f} "
          f"GB/s: {record.source}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
