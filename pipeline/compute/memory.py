"""Memory of this rank: the CUDA allocator's counters on GPU, the process's resident set on CPU.

On CPU a process's peak RSS also holds the interpreter, torch's libraries and communication
buffers (hundreds of MB before any tensor of the model exists), so what the planner predicts
(parameters, gradients, optimizer state, activations) is compared with the peak *above* what
the rank held apart from its stages' tensors (`current_memory_bytes` once the stages exist, less
their parameters and buffers: building them imports and traces, which the plan cannot shrink).
"""

from __future__ import annotations

import os
import resource
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch


def _status_kib(*fields: str) -> dict[str, int] | None:
    """Those fields of /proc/self/status in bytes, or None where /proc (or a field) is missing."""
    try:
        with open("/proc/self/status") as f:
            values = {k: int(v.split()[0]) * 1024 for k, _, v in (line.partition(":") for line in f) if k in fields}
    except (OSError, ValueError):
        return None
    return values if len(values) == len(fields) else None


def peak_memory_bytes(device: torch.device) -> int:
    """The most the rank has held since `reset_peak`: CUDA's allocated peak, or on CPU the resident
    set's high-water mark (VmHWM, which `reset_peak` resets on Linux) less the file-backed pages
    resident now. Those are torch's code and mapped files (the first backward alone faults in
    about 13 MB of libtorch), not tensors; they only grow while training, so the subtraction leaves
    the peak of what tensors can hold (anonymous memory) and no device's allocator would count."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    status = _status_kib("VmHWM", "RssFile", "RssShmem")
    if status is not None:
        return status["VmHWM"] - status["RssFile"] - status["RssShmem"]
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB


def current_memory_bytes(device: torch.device) -> int:
    """What the rank holds now: allocated CUDA memory, or on CPU its anonymous resident memory
    (RssAnon: what tensors live in, without code and mapped files; peak RSS where /proc is missing)."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    status = _status_kib("RssAnon")
    return status["RssAnon"] if status is not None else peak_memory_bytes(device)


def reset_peak(device: torch.device) -> None:
    """Start the peak afresh, so that it measures training and not the set-up before it (tracing
    and building the stages can pass the training peak of a small stage). On Linux, writing 5 to
    /proc/self/clear_refs resets the resident set's high-water mark."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:  # not Linux, or a kernel without it: the lifetime peak stands
        pass


class TensorPeak:
    """The most bytes the rank's tensors held at once while training, counted the way CUDA's
    allocator counts (`max_memory_allocated`): on GPU its counter; on CPU, where torch keeps no such
    counter, the allocation events torch's profiler records (`profile_memory`) during each of the
    first `steps` steps, summed in time order above what the tensors held as the step began.
    Evaluation and checkpoints between steps are not counted, as the plan does not price them.
    The resident set (`peak_memory_bytes`) also holds what glibc keeps of freed blocks, which varies
    from run to run with the timing of the frees; this count does not. The profiler's own memory
    is in the resident set, so a CPU rank starts that measure afresh after the counted steps."""

    #: steps counted on CPU: the first allocates gradients and optimizer state, the second is as
    #: every later one (the resident measure takes the steps after them)
    COUNTED_STEPS = 2

    def __init__(self, device: torch.device, held_bytes: Callable[[], int], run_steps: int) -> None:
        self.device, self.held_bytes = device, held_bytes
        # leave at least one step to the resident measure (none counted in a one-step run)
        self.steps = 0 if device.type != "cpu" else max(0, min(self.COUNTED_STEPS, run_steps - 1))
        self.peak: int | None = None

    @contextmanager
    def measure(self, index: int) -> Iterator[None]:
        """Around step `index` of this run (from 0): counted when it is one of the first `steps`."""
        if index >= self.steps:
            yield
            return
        from torch.profiler import ProfilerActivity, profile  # only where it is used

        # kineto prints a line at each start and stop, which would reach rank 0's console; 6 is
        # above its highest level (read when the profiler first starts; a user's setting stands)
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        held = self.held_bytes()
        profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        profiler.start()
        try:
            yield
        finally:
            profiler.stop()
        events = sorted((e.start_ns(), e.nbytes()) for e in profiler.profiler.kineto_results.events()
                        if e.name() == "[memory]" and e.device_type() == torch._C._autograd.DeviceType.CPU)
        live = rise = 0
        for _, nbytes in events:
            live += nbytes
            rise = max(rise, live)
        self.peak = max(self.peak or 0, held + rise)

    def peak_bytes(self) -> int | None:
        """CUDA's allocated peak, or on CPU the counted peak (None before a step was measured)."""
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return self.peak
