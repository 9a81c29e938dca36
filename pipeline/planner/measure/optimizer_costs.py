"""What the configured optimizer costs beyond its state: time per parameter byte, and the
temporaries its step holds (memory the update phase needs after the backward).

Both are measured on this machine with the optimizer as configured, so that any `torch.optim`
class (or a user's) is priced without a table. The time is a few steps over one tensor at the
ranks' thread count, cached per thread count like the profiles, so that every plan of a job
prices the update alike. The temporaries come from torch's profiler (`TensorPeak`), whose first
use in a process costs about a second, so they are cached per optimizer config, device kind and
torch version beside the profiles (`$PIPELAUNCH_CACHE/optimizer/`).
"""

from __future__ import annotations

import hashlib
import json
import time

import torch

from pipelaunch.pipeline.compute.memory import TensorPeak
from pipelaunch.pipeline.core.plugins import OptimizerSpec
from pipelaunch.pipeline.planner.measure.profile import load_cached, save_cached
from pipelaunch.pipeline.planner.predict.prediction import profiling_threads

#: how the temporaries are measured and stored (part of the cache key)
MEASURE_VERSION = "2-and-4-tensors-v2"


def optimizer_seconds_per_byte(optimizer: OptimizerSpec, threads: int) -> float:
    """One step of the configured optimizer per byte of parameter, at the ranks' thread count;
    cached per optimizer config, thread count and torch version, so that two plans of one job
    price the update alike (a fresh timing varied up to 2.7x between two calls in one process)."""
    digest = hashlib.sha256("|".join([_config(optimizer), str(threads), torch.__version__, "step-time-v1"]).encode())
    key = f"optimizer/time-{digest.hexdigest()[:16]}"
    cached = load_cached(key)
    if cached is not None:
        return float(cached["seconds_per_byte"])
    per_byte = measure_seconds_per_byte(optimizer, threads)
    save_cached(key, {"seconds_per_byte": per_byte})
    return per_byte


def measure_seconds_per_byte(optimizer: OptimizerSpec, threads: int, numel: int = 1 << 20) -> float:
    """Time one step over a parameter of `numel` floats, per byte: its cost grows with the bytes
    it updates, and a stage's parameter bytes are known before any rank exists. The fastest of a
    few steps after the first, since other work on a shared machine only ever adds time."""
    param = torch.nn.Parameter(torch.zeros(numel))
    param.grad = torch.full_like(param, 1e-3)
    with profiling_threads(threads):
        opt = optimizer([param])
        times = []
        for _ in range(6):
            start = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - start)
    return min(times[1:]) / (numel * param.element_size())


def _config(optimizer: OptimizerSpec) -> str:
    return json.dumps([optimizer.factory.path, dict(optimizer.factory.kwargs)], sort_keys=True, default=str)


def optimizer_temporaries(optimizer: OptimizerSpec, cuda: bool) -> tuple[float, float]:
    """What the optimizer's step allocates beyond its state, per parameter byte: (of a rank's largest
    parameter tensor, of all its parameters); cached (module docstring)."""
    digest = hashlib.sha256("|".join([_config(optimizer), str(cuda), torch.__version__, MEASURE_VERSION]).encode())
    key = f"optimizer/{digest.hexdigest()[:16]}"
    cached = load_cached(key)
    if cached is not None:
        return float(cached["per_largest"]), float(cached["per_all"])
    per_largest, per_all = measure_temporaries(optimizer, cuda)
    save_cached(key, {"per_largest": per_largest, "per_all": per_all})
    return per_largest, per_all


def measure_temporaries(optimizer: OptimizerSpec, cuda: bool, numel: int = 1 << 16) -> tuple[float, float]:
    """(per byte of the largest parameter tensor, per byte of all parameters) that one step holds.
    A single-tensor implementation (torch's default on CPU) updates one tensor at a time: AdamW
    holds two temporaries of the tensor it updates and one of the one before, three times the
    largest at most. A foreach one (torch's default on CUDA, asked for here when the run is on
    CUDA) holds one of every parameter at once. One step over two tensors of one size and one over
    four tell them apart: what grows from two to four is per byte of all parameters, the rest of
    the two-tensor step per byte of the largest."""
    size = float(numel * 4)
    two, four = (_step_rise(optimizer, cuda, [numel] * count) for count in (2, 4))
    per_all = max(0.0, (four - two) / (2 * size))
    return max(0.0, two / size - 2 * per_all), per_all


def _step_rise(optimizer: OptimizerSpec, cuda: bool, sizes: list[int]) -> float:
    """The most a step over parameters of `sizes` floats holds at once beyond what it started
    with (a first step makes the optimizer's state, which is not counted)."""
    params = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    try:  # as torch picks on CUDA tensors, unless the config chose
        opt = optimizer(params, foreach=True) if cuda and not optimizer.chooses_implementation else optimizer(params)
    except TypeError:  # an optimizer without the option
        opt = optimizer(params)
    opt.step()
    meter = TensorPeak(torch.device("cpu"), lambda: 0, run_steps=2)
    with meter.measure(0):
        opt.step()
    return float(meter.peak or 0)
