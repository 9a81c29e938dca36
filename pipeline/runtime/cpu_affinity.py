"""Bind each local rank to its own cores (`cpu_affinity=auto`).

Why: left to the OS, the compute threads of the ranks on one machine migrate between cores and
share them unevenly, so a rank's caches go cold and one stage can be slowed by another's threads;
a pipeline runs at the pace of its slowest rank. When the cores this process may use cover
`local ranks x threads`, rank i gets the i-th block of `threads` cores. Otherwise (more threads
than cores, or a scheduler such as SLURM already gave each task its own cores) nothing is changed.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

CPU_AFFINITY_CHOICES = ("auto", "none")


def rank_cores(allowed: Sequence[int], local_rank: int, local_world: int, threads: int) -> list[int] | None:
    """The cores local rank `local_rank` should run on, or None to leave placement to the OS."""
    cores = sorted(allowed)
    if threads < 1 or local_world * threads > len(cores):
        return None
    return cores[local_rank * threads:(local_rank + 1) * threads]


def bind_rank_to_cores(choice: str, local_rank: int, local_world: int, threads: int) -> list[int] | None:
    """Apply `cpu_affinity` to every thread of this process; returns the cores bound, or None."""
    if choice != "auto" or not hasattr(os, "sched_setaffinity"):
        return None
    cores = rank_cores(os.sched_getaffinity(0), local_rank, local_world, threads)
    if cores is None:
        return None
    # sched_setaffinity(0) binds the calling thread only; threads started earlier (torch's, if any)
    # are bound one by one, threads started later inherit the mask.
    for tid in _thread_ids():
        try:
            os.sched_setaffinity(tid, cores)
        except OSError:  # the thread ended meanwhile
            pass
    return cores


def _thread_ids() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [0]
