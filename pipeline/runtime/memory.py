"""Memory of this rank: the CUDA allocator's counters on GPU, the process's resident set on CPU.

On CPU a process's peak RSS also holds the interpreter, torch's libraries and communication
buffers (hundreds of MB before any tensor of the model exists), so what the planner predicts
(parameters, gradients, optimizer state, activations) is compared with the peak *above* what
the rank held apart from its stages' tensors (`current_memory_bytes` once the stages exist, less
their parameters and buffers: building them imports and traces, which the plan cannot shrink).
"""

from __future__ import annotations

import resource
import sys

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
