"""How many CPU threads a process computes with: the cores it may run on, shared fairly between
the ranks of a machine (the planner profiles with the count a rank will train with)."""

from __future__ import annotations

import os


def available_cores() -> int:
    """Cores this process may run on (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def cpu_threads(requested: int, local_world_size: int) -> int:
    """Cores shared fairly between the ranks of this machine, at least one each."""
    if requested > 0:
        return requested
    return max(1, available_cores() // max(1, local_world_size))
