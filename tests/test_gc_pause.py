"""launcher/gc_pause.py: full collections spaced out while a run is planned, nothing lost after."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from pipelaunch.launcher.gc_pause import FULL_EVERY, few_full_collections


@pytest.fixture(autouse=True)
def _unfrozen_after() -> Iterator[None]:
    yield
    gc.unfreeze()  # leave the test process's collector as it was


class _Node:
    """An object in a reference cycle: only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self


def test_full_collections_wait_inside_the_block_and_the_thresholds_come_back() -> None:
    before = gc.get_threshold()
    with few_full_collections():
        assert gc.get_threshold() == (before[0], before[1], max(before[2], FULL_EVERY))
        assert gc.get_freeze_count() > 0  # what existed on entry: no collection walks it
    assert gc.get_threshold() == before


def test_the_next_block_frees_the_cycles_the_previous_one_froze() -> None:
    """What a block leaves alive is frozen (the plan, held until the process ends); a cycle of it
    that dies later is freed when the next block starts (a sweep's next job), not before."""
    with few_full_collections():
        node = _Node()
        alive = weakref.ref(node)
    del node
    gc.collect()
    assert alive() is not None
    with few_full_collections():
        assert alive() is None
