"""Interleaved zero bubble (ZB-VPP): Megatron's interleaved 1F1B with the backward split and each W
placed where the rank would otherwise wait.

Why: interleaving v chunks per rank shortens the fill and drain v times; splitting the backward on
top lets the input gradients of the drain run back to back while the weight gradients fill the gaps
(torch.distributed.pipelining's ScheduleInterleavedZeroBubble does the same with a fixed W delay).
Here the order of forwards and input gradients is interleaved 1F1B's, with Megatron's warm-up (two
forwards per hop to the last rank) or torch's (one), and `weight_fill` places the W on the measured
costs within the activation memory interleaved 1F1B itself needs (a W may wait while its
micro-batch's slot is not needed), within the memory of the leaner of interleaved 1F1B and torch's
rule (rank r defers r W: torch's own order is one candidate), so it never holds more than either at
the same settings; the fastest candidate is kept. Same placement and micro-batch rule as `interleaved_1f1b`.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import ClassVar

from pipelaunch.pipeline.core.ir import Action, Kind, action_table
from pipelaunch.pipeline.planner.schedules.base import Candidate, ScheduleCosts
from pipelaunch.pipeline.planner.schedules.interleaved import Interleaved1F1B, interleaved_order
from pipelaunch.pipeline.planner.schedules.weight_fill import deferred_by
from pipelaunch.pipeline.planner.schedules.zero_bubble import ALPHAS

#: per rank, its actions in order
Programs = tuple[tuple[Action, ...], ...]


def peak_held(programs: Sequence[Sequence[Action]]) -> list[int]:
    """Per rank, the most (stage, micro-batch) pairs a program holds at once: from the F to the B
    (to the W with a split backward)."""
    peaks = []
    for acts in programs:
        held = peak = 0
        for a in acts:
            held += 1 if a.kind is Kind.F else -1 if a.kind in (Kind.B, Kind.W) else 0
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


@functools.lru_cache(maxsize=4)
def critical_orders(pp: int, v: int, microbatches: int) -> tuple[dict[int, Programs], dict[int, Programs | None],
                                                                  tuple[int, ...]]:
    """Per warm-up (one or two forwards a hop), interleaved 1F1B's order with I for B, and that order
    with torch's W rule (rank r defers r W) where it stays within the memory bound (else None); and
    the bound: what the busiest rank holds under the leaner of torch's rule and interleaved 1F1B.
    Kept per shape, since none of it depends on the costs: the split is priced on one of these
    orders and the measured costs then choose among them (at pp=64 with 256 micro-batches they take
    0.2 s to write)."""
    plain = {hop: interleaved_order(pp, v, microbatches, hop) for hop in (1, 2)}
    inputs = action_table(Kind.I, pp * v, microbatches)
    orders = {hop: tuple(tuple(inputs[a.stage * microbatches + a.mb] if a.kind is Kind.B else a for a in acts)
                         for acts in programs) for hop, programs in plain.items()}
    references = {hop: tuple(map(tuple, deferred_by(order, list(range(pp))))) for hop, order in orders.items()}
    held = {hop: peak_held(programs) for hop, programs in references.items()}
    bound = (min(max(held[1]), max(peak_held(plain[2]))),) * pp  # interleaved 1F1B warms up two forwards a hop
    fitting = {hop: programs if max(held[hop]) <= bound[0] else None for hop, programs in references.items()}
    return orders, fitting, bound


@dataclass(frozen=True)
class InterleavedZB(Interleaved1F1B):
    """Interleaved 1F1B's order with a split backward and W placed on the measured costs."""

    name: ClassVar[str] = "interleaved_zb"
    split_backward: ClassVar[bool] = True
    #: order and place the W on the measured per-stage costs (else F = I = W units)
    cost_aware: bool = True
    #: run an I and its W as one fused B wherever the simulated step does not grow (schedules/fuse.py)
    fuse_backward: bool = True

    def compute_actions(self, placement: list[int], microbatches: int, costs: ScheduleCosts | None = None,
                        *, first_order: bool = False) -> list[list[Action]]:
        pp = max(placement) + 1
        orders, references, bound = critical_orders(pp, len(placement) // pp, microbatches)
        return self.best_filled(self._candidates(orders, references, bound), placement, microbatches,
                                costs, first_order)

    @staticmethod
    def _candidates(orders: dict, references: dict, bound: Sequence[int]) -> Iterator[Candidate]:
        """Torch's warm-up (one forward a hop to the last rank) and Megatron's (two), each with rank
        r deferring r W (torch's rule) where that stays within `bound`, and with the W placed on the
        costs within it by every ALPHAS, with and without that backlog."""
        backlog = list(range(len(bound)))
        for hop in (1, 2):
            if references[hop] is not None:
                yield Candidate(references[hop])
            yield from (Candidate(orders[hop], bound, alpha, backlog=backlog) for alpha in ALPHAS)
            yield from (Candidate(orders[hop], bound, alpha) for alpha in ALPHAS)
