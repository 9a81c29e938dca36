"""Fewer full garbage collections while the launcher plans (and, in a dry run, draws) a run.

Why: a pp=64 plan of 256 micro-batches makes millions of small objects (actions, events,
messages), most of which live until the plan is written. CPython runs a full collection whenever
the objects that survived the young generations grow by a quarter, and each one walks every
tracked object, the ~600k that importing torch, Hydra and matplotlib left included: 1.7 s of
`mode=plan` with 1F1B and 4 s with ZB-H1 went into them (5 and 9 full collections). A plain
pause would only defer the work: the first full collection after it, or the one at interpreter
exit, walks the same objects (0.1-0.5 s at pp=64).

So, around the planning: what is alive on entry is frozen (`gc.freeze`: no collection walks it)
and full collections wait for 1000 second-generation ones instead of 10, while the young
generations, which free the reference cycles planning drops (fx graphs, modules, figures), run as
before. On exit the thresholds come back and what survived is frozen too: the plan is held until
the process ends or spawns its ranks. Reference cycles among frozen objects that die later are not
freed until the next block, which starts with one full collection (a sweep's next job), so at
most one job's worth is held (42k objects, 30 MB at pp=64). Blocks do not nest.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

#: second-generation collections between two full ones inside the block (CPython's default: 10)
FULL_EVERY = 1000
#: whether a block ended in this process (its survivors are frozen)
_held = False


@contextmanager
def few_full_collections() -> Iterator[None]:
    """Plan inside this block: everything alive on entry, then everything alive on exit, frozen;
    full collections spaced out in between. From the second block of a process on, what the
    previous one froze is first unfrozen and collected."""
    global _held
    if _held:
        gc.unfreeze()
        gc.collect()
    gc.freeze()
    before = gc.get_threshold()
    gc.set_threshold(before[0], before[1], max(before[2], FULL_EVERY))
    try:
        yield
    finally:
        gc.set_threshold(*before)
        gc.freeze()
        _held = True
