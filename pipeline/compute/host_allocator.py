"""Keep freed host memory in the process instead of handing it back to the kernel after each op.

Why: glibc serves large blocks with mmap and returns them on free (or trims the heap), so the next
tensor of the same size page-faults its memory back in, page by page. A CPU training step allocates
and frees the same activation-sized buffers hundreds of times, and the split backward of zero-bubble
schedules keeps more of them alive at once: one split backward of three gpt_bench blocks took about
3,000-5,500 minor page faults with glibc's defaults and almost none with this setting. Raising the mmap threshold
to its ceiling and the trim threshold far above it makes freed blocks reusable; the peak resident
memory is the same, it is just kept. glibc only (mallopt); elsewhere it is a no-op.

`huge_pages=true` additionally asks glibc (tunable `glibc.malloc.hugetlb=1`) to back the heap with
transparent huge pages: 512 times fewer pages to fault in and to keep in the TLB for the
megabyte-sized activations of a CPU rank. glibc reads tunables only at process start, so the
launcher sets it in the environment of the ranks it spawns (`rank_environment`); ranks started by
torchrun or SLURM get it when it is exported in their environment.
"""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

#: mallopt parameter numbers (glibc malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
#: the largest mmap threshold glibc accepts on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
MMAP_THRESHOLD_MAX = 32 * 2**20
TRIM_THRESHOLD = 2**30

HOST_ALLOCATOR_CHOICES = ("retain", "system")
#: glibc tunable: madvise(MADV_HUGEPAGE) on the memory malloc gets from the kernel (glibc >= 2.35)
HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb=1"
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def retain_freed_memory() -> bool:
    """Tune glibc malloc to keep freed blocks; True when it took effect."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1


def release_free_memory() -> bool:
    """Hand the heap's free pages back to the kernel now (glibc `malloc_trim(0)`, every arena); True
    when it ran. For a measurement to start from what is live, not from what earlier work freed."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return False
    malloc_trim.argtypes = [ctypes.c_size_t]
    malloc_trim(0)
    return True


def configure_host_allocator(choice: str) -> bool:
    """Apply `host_allocator` (retain | system) in this process; True when malloc was tuned."""
    return retain_freed_memory() if choice == "retain" else False


def transparent_huge_pages_available() -> bool:
    """True when the kernel hands out transparent huge pages on request ([always] or [madvise])."""
    try:
        return "[never]" not in THP_SETTING.read_text()
    except OSError:
        return False


def rank_environment(huge_pages: bool, environ: dict[str, str] | None = None) -> dict[str, str]:
    """Variables to set for spawned ranks: the huge-page tunable, merged into any GLIBC_TUNABLES
    already set (a hugetlb value the user chose is kept)."""
    if not huge_pages or not sys.platform.startswith("linux") or not transparent_huge_pages_available():
        return {}
    current = (os.environ if environ is None else environ).get("GLIBC_TUNABLES", "")
    if "glibc.malloc.hugetlb=" in current:
        return {}
    return {"GLIBC_TUNABLES": f"{current}:{HUGE_PAGES_TUNABLE}" if current else HUGE_PAGES_TUNABLE}


def huge_pages_active() -> bool:
    """Whether this process started with the huge-page tunable (what `huge_pages` did here)."""
    return HUGE_PAGES_TUNABLE in os.environ.get("GLIBC_TUNABLES", "").split(":")
