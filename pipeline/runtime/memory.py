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

import torch


def peak_memory_bytes(device: torch.device) -> int:
    """The most the rank has held since `reset_peak`: CUDA's allocated peak, or the resident
    set's high-water mark (VmHWM, which `reset_peak` resets on Linux; else the lifetime peak)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB


def current_memory_bytes(device: torch.device) -> int:
    """What the rank holds now: allocated CUDA memory, or the resident set on CPU (peak RSS where
    /proc is missing)."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return peak_memory_bytes(device)


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
