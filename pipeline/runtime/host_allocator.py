"""Keep freed host memory in the process instead of handing it back to the kernel after each op.

Why: glibc serves large blocks with mmap and returns them on free (or trims the heap), so the next
tensor of the same size page-faults its memory back in, page by page. A CPU training step allocates
and frees the same activation-sized buffers hundreds of times, and the split backward of zero-bubble
schedules keeps more of them alive at once: one split backward of three gpt_bench blocks took about
3,000-5,500 minor page faults with glibc's defaults and almost none with this setting. Raising the mmap threshold
to its ceiling and the trim threshold far above it makes freed blocks reusable; the peak resident
memory is the same, it is just kept. glibc only (mallopt); elsewhere it is a no-op.
"""

from __future__ import annotations

import ctypes
import sys

#: mallopt parameter numbers (glibc malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
#: the largest mmap threshold glibc accepts on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
MMAP_THRESHOLD_MAX = 32 * 2**20
TRIM_THRESHOLD = 2**30

HOST_ALLOCATOR_CHOICES = ("retain", "system")


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


def configure_host_allocator(choice: str) -> bool:
    """Apply `host_allocator` (retain | system) in this process; True when malloc was tuned."""
    return retain_freed_memory() if choice == "retain" else False
