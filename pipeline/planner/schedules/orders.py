"""Critical orders: per rank, the order of its forwards and input-gradient passes (F, I or B).

A zero-bubble schedule is a critical order plus the places of its W (`weight_fill`); these are the
orders the schedules are built from. Each is a pure function of the shape (ranks, micro-batches) and a
few counts, written out as the papers draw them; the W are left out (`weight_fill` places them on the
measured costs).

* `one_f_one_b`: rank r runs `warmup[r]` forwards, then alternates one forward and one backward, then
  drains. 1F1B's warm-up is p - 1 - r; ZB-H2 forwards until its first input gradient comes back.
* `zero_bubble_v`: the ZB-V order (Qi et al., "Zero Bubble Pipeline Parallelism", section 6) on the
  V placement: chunk-0 forwards fill the pipeline, the two chunks' forwards and input gradients then
  alternate, and the cool-down drains both chunks.
* `dualpipe_v`: DeepSeek's DualPipeV (DeepSeek-V3 report; deepseek-ai/DualPipe), whose steady state
  pairs a forward of one chunk with the backward of the other (`DualOrder.overlapped`); written with
  its own W, which `weight_fill` may move.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

from pipelaunch.pipeline.core.ir import Action, B, F, I, Kind


def one_f_one_b(pp: int, microbatches: int, warmup: Sequence[int], backward: Kind = Kind.I) -> list[list[Action]]:
    """Linear placement (stage r on rank r): `warmup[r]` forwards, then forward/backward pairs, then
    the remaining backwards."""
    make = I if backward is Kind.I else B
    orders = []
    for r in range(pp):
        w = min(microbatches, warmup[r])
        acts = [F(r, j) for j in range(w)]
        for j in range(microbatches - w):
            acts += [F(r, w + j), make(r, j)]
        acts += [make(r, j) for j in range(microbatches - w, microbatches)]
        orders.append(acts)
    return orders


def zero_bubble_v(pp: int, microbatches: int, extra_warmup: int = 0, weights: bool = False) -> list[list[Action]]:
    """The ZB-V order (`_zero_bubble_v`), in new lists."""
    return [list(acts) for acts in _zero_bubble_v(pp, microbatches, extra_warmup, weights)]


@functools.lru_cache(maxsize=8)
def _zero_bubble_v(pp: int, microbatches: int, extra_warmup: int, weights: bool) -> tuple[tuple[Action, ...], ...]:
    """Kept per shape, since it does not depend on the costs: the split is priced on one of these
    orders and then the measured costs choose among them (at pp=64 with 256 micro-batches each
    takes 0.05 s to write).

    The ZB-V order on the V placement (rank r holds stages r and 2p-1-r): 2(p-r)-1 chunk-0
    forwards (plus `extra_warmup`), r chunk-1/chunk-0 forward pairs, p-r chunk-1 forward/backward
    pairs, then F0 I0 F1 I1 until the forwards run out, then the backwards of both chunks. With
    `weights`, each W where the paper's ZB-V (and torch's ZBVZeroBubble) puts it: right after its I
    until the drain, whose last p-r chunk-0 input gradients each take one chunk-0 W along, the rest
    at the end (chunk 1's first)."""
    # written for at least 2p - 1 micro-batches (the pattern needs them), those past m then dropped
    m, orders = max(microbatches, 2 * pp - 1), []
    for r in range(pp):
        c0, c1 = r, 2 * pp - 1 - r
        seq = _VSequence(c0, c1, m, eager_weights=weights)
        seq.run((c0,), max(1, 2 * (pp - r) - 1 + extra_warmup), kinds=(Kind.F,))
        seq.run((c1, c0), r, kinds=(Kind.F, Kind.F))
        for _ in range(pp - r):
            seq.add(c1, Kind.F)
            seq.add(c1, Kind.I)
            seq.eager(c1)
        while seq.f[c1] < seq.f[c0] or seq.f[c0] < m:
            for stage in (c0, c1):
                seq.add(stage, Kind.F)
                seq.add(stage, Kind.I)
                seq.eager(stage)
        while seq.b[c0] < m - (pp - r) or seq.b[c1] < m:
            seq.add(c0, Kind.I)
            seq.add(c1, Kind.I)
        while seq.b[c0] < m:
            seq.add(c0, Kind.I)
            seq.eager(c0)
        if weights:
            for stage in (c1, c0):
                while seq.weight(stage):
                    pass
        orders.append(tuple(a for a in seq.acts if a.mb < microbatches))
    return tuple(orders)


class DualOrder(NamedTuple):
    """DualPipeV's programs (W included) and the (forward, backward) pairs it runs as one overlapped
    action."""

    orders: list[list[Action]]
    overlapped: list[tuple[Action, Action]]


def dualpipe_v(pp: int, microbatches: int) -> DualOrder:
    """DualPipeV on the V placement, m >= 2p (steps as in DeepSeek's dualpipev.py), its W where
    DualPipeV runs them: chunk-0 warm-up forwards, forward pairs, chunk-1 input-gradient/W/forward
    triples, the overlapped steady state (a chunk-0 forward with a chunk-1 backward, a chunk-1 forward
    with a chunk-0 backward), then the drain, whose second half splits the backward (I now, W later)
    to fill the cool-down."""
    m, orders, pairs = microbatches, [], []
    for r in range(pp):
        c0, c1 = r, 2 * pp - 1 - r
        seq = _VSequence(c0, c1, m)
        seq.run((c0,), 2 * (pp - r - 1), kinds=(Kind.F,))
        seq.run((c0, c1), r + 1, kinds=(Kind.F, Kind.F))
        for _ in range(pp - r - 1):
            seq.add(c1, Kind.I)
            seq.weight()
            seq.add(c1, Kind.F)
        for step in range(m - 2 * pp + r + 1):
            if step == 0 and r == pp - 1:  # the last rank's first pair is not overlapped (shorter fill)
                seq.add(c0, Kind.F)
                seq.add(c1, Kind.B)
            else:
                pairs.append(seq.pair(c0, c1))
            pairs.append(seq.pair(c1, c0))
        for _ in range(pp - r - 1):
            seq.add(c1, Kind.B)
            pairs.append(seq.pair(c1, c0))
        split = False
        for i in range(r + 1):
            split = split or (i == (r + 1) // 2 and r % 2 == 1)
            seq.add(c1, Kind.I if split else Kind.B)
            split = split or (i == (r + 1) // 2 and r % 2 == 0)
            seq.add(c0, Kind.I if split else Kind.B)
        for _ in range(pp - r - 1):
            seq.weight()
            seq.add(c0, Kind.I if split else Kind.B)
        while seq.pending:
            seq.weight()
        orders.append(seq.acts)
    return DualOrder(orders, [p for p in pairs if p is not None])


class _VSequence:
    """A rank's order on two chunks being written: the next micro-batch of each (chunk, F or backward)."""

    def __init__(self, c0: int, c1: int, microbatches: int, eager_weights: bool = False) -> None:
        self.m = microbatches
        self.eager_weights = eager_weights
        self.f = {c0: 0, c1: 0}
        self.b = {c0: 0, c1: 0}
        self.acts: list[Action] = []
        self.pending: list[Action] = []  # the W of each I, oldest first

    def add(self, stage: int, kind: Kind) -> Action | None:
        """Append the next action of `kind` on `stage`, if that stage has one left."""
        count = self.f if kind is Kind.F else self.b
        if count[stage] >= self.m:
            return None
        act = Action(stage, kind, count[stage])
        count[stage] += 1
        self.acts.append(act)
        if kind is Kind.I:
            self.pending.append(Action(stage, Kind.W, act.mb))
        return act

    def weight(self, stage: int | None = None) -> bool:
        """Append the W of the oldest input-gradient pass (of `stage`, if given) still waiting for
        one; whether there was one."""
        for k, w in enumerate(self.pending):
            if stage is None or w.stage == stage:
                self.acts.append(self.pending.pop(k))
                return True
        return False

    def eager(self, stage: int) -> None:
        """With `eager_weights`, the W of the oldest input gradient of `stage` now."""
        if self.eager_weights:
            self.weight(stage)

    def pair(self, forward: int, backward: int) -> tuple[Action, Action] | None:
        """A forward on one chunk and a full backward on the other, run as one overlapped action."""
        f, b = self.add(forward, Kind.F), self.add(backward, Kind.B)
        return (f, b) if f is not None and b is not None else None

    def run(self, stages: tuple[int, ...], times: int, kinds: tuple[Kind, ...]) -> None:
        """`times` rounds of `kinds[i]` on `stages[i]`."""
        for _ in range(times):
            for stage, kind in zip(stages, kinds, strict=True):
                self.add(stage, kind)
