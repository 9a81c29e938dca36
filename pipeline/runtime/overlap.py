"""DualPipe's overlap on one rank: a forward and the backward of another stage's micro-batch run
as a pair, each one's expert all-to-alls in flight while the other computes.

Why a pair of threads with a baton, not two streams alone: the two actions are issued by the host,
layer by layer, and each exchange's sizes are read on the host (`runtime/experts.py`), so the
host must interleave them. Only one side runs at a time; a side hands over when it has just
issued an exchange (`exchange`), and the other side computes until it issues its own, then hands
back. The order in which the two sides issue their collectives is therefore fixed by the program
alone (forward's first, backward's first, forward's second, ...; a side that has finished no
longer takes turns): every rank of an ep group runs the same program, so they issue the same
all-to-alls in the same order on the group's communicator, as NCCL needs; the data-parallel
reductions a backward starts come in a fixed order the same way. The time a side waits on its
exchange is what the other side's compute did not cover.

The forward side runs in a worker thread (its CUDA device set there), the backward side in the
rank's own; an error in either is raised in the rank's thread once both have stopped.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

#: the pair running now on this rank (None: actions run one at a time)
_CURRENT: list[Pair | None] = [None]
#: when set (a list), every exchange is recorded in it: (label, issued, waited) on the host clock
_RECORD: list[list | None] = [None]


class Pair:
    """One forward and one backward of different stages, run as DualPipe's overlapped pair."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._turn = "F"
        self._done: set[str] = set()
        self._forward_ident: int | None = None
        self._error: BaseException | None = None
        #: per side, the seconds it waited while the other ran (its span less its own work)
        self.idle_s = {"F": 0.0, "B": 0.0}

    def _side(self) -> str:
        return "F" if threading.get_ident() == self._forward_ident else "B"

    def hand_over(self) -> None:
        """Let the other side run until it hands back (at once when it has finished)."""
        side = self._side()
        other = "B" if side == "F" else "F"
        with self._cond:
            if other in self._done:
                return
            self._turn = other
            self._cond.notify_all()
            start = time.perf_counter()
            self._cond.wait_for(lambda: self._turn == side)
            self.idle_s[side] += time.perf_counter() - start

    def _finish(self, side: str) -> None:
        with self._cond:
            self._done.add(side)
            self._turn = "B" if side == "F" else "F"
            self._cond.notify_all()

    def run(self, forward: Callable[[], None], backward: Callable[[], None], device: torch.device) -> None:
        """Run `forward` (first, in a worker thread) and `backward` (here), taking turns."""

        def forward_side() -> None:
            self._forward_ident = threading.get_ident()
            try:
                if device.type == "cuda":
                    torch.cuda.set_device(device)
                forward()
            except BaseException as err:  # noqa: BLE001 - re-raised in the rank's thread
                self._error = err
            finally:
                self._finish("F")

        worker = threading.Thread(target=forward_side, name="pipelaunch-overlap-forward", daemon=True)
        with self._cond:
            _CURRENT[0] = self
            worker.start()
            start = time.perf_counter()
            self._cond.wait_for(lambda: self._turn == "B")
            self.idle_s["B"] += time.perf_counter() - start
        try:
            backward()
        finally:
            self._finish("B")
            worker.join()
            _CURRENT[0] = None
        if self._error is not None:
            raise self._error


def exchange(out: torch.Tensor, x: torch.Tensor, out_splits: list[int] | None, in_splits: list[int] | None,
             group: dist.ProcessGroup, label: str) -> None:
    """`all_to_all_single` on the ep group; inside a pair, issued, handed over, then waited on."""
    record = _RECORD[0]
    start = time.perf_counter() if record is not None else 0.0
    pair = _CURRENT[0]
    if pair is None:
        dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
    else:
        work = dist.all_to_all_single(out, x, out_splits, in_splits, group=group, async_op=True)
        pair.hand_over()
        work.wait()
    if record is not None:
        record.append((label, start, time.perf_counter()))


def record_exchanges(into: list | None) -> None:
    """Record every exchange that follows in `into` (None: stop); host clock (CPU ranks)."""
    _RECORD[0] = into
