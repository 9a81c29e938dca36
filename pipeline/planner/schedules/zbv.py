"""ZBV: zero-bubble schedule on the V placement (rank r holds stages r and 2p-1-r).

Why V: the first and the last stage share rank 0, so a micro-batch's backward starts on the rank
that started its forward and the pipeline fills and drains from the same end. With the backward
split into I and W, a greedy play-through that runs forwards first (deepest stage first) under a
cap of 2p (stage, micro-batch) pairs per rank reaches the lower-bound makespan 6m + p - 1 (F = I = W,
m >= 2p, checked for p <= 64 in the tests): no idle time beyond the fill of the first micro-batch.
2p pairs of half-size stages is the activation memory 1F1B needs for p pairs of full-size stages.
Works for any microbatches >= 1; below 2p the pipeline cannot be kept full.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.core.ir import Action
from pipelaunch.pipeline.planner.placement import v_shape
from pipelaunch.pipeline.planner.schedules.base import (
    Candidate,
    ScheduleCosts,
    ScheduleGenerator,
    require_microbatches_at_least,
)
from pipelaunch.pipeline.planner.schedules.orders import zero_bubble_v
from pipelaunch.pipeline.planner.schedules.zero_bubble import ALPHAS, greedy_candidate


@dataclass(frozen=True)
class ZBV(ScheduleGenerator):
    """Zero-bubble V schedule: 2 stages per rank, split backward, 1F1B-like memory."""

    name: ClassVar[str] = "zbv"
    default_placement: ClassVar[str] = "v"
    supported_placements: ClassVar[tuple[str, ...]] = ("v",)
    split_backward: ClassVar[bool] = True
    #: order actions by a play-through on the measured per-stage costs (else F = I = W units)
    cost_aware: bool = True
    #: run an I and its W as one fused B wherever the simulated step does not grow (schedules/fuse.py)
    fuse_backward: bool = True

    def stages_per_rank(self) -> int:
        return 2

    def check(self, pp: int, microbatches: int, placement: list[int]) -> None:
        if list(placement) != v_shape(pp):
            raise ConfigError(
                "placement",
                f"scheduler 'zbv' needs the V placement {v_shape(pp)} (placement=v or auto), got {placement}",
            )
        require_microbatches_at_least(self.name, microbatches, 1, "it needs at least one micro-batch; "
                                      f"zero bubble needs >= {2 * pp}")

    def compute_actions(self, placement: list[int], microbatches: int, costs: ScheduleCosts | None = None,
                        *, first_order: bool = False) -> list[list[Action]]:
        pp = max(placement) + 1
        caps = [2 * pp] * pp
        greedy = greedy_candidate(self, placement, microbatches, costs, cap=caps, forward_first=True)
        return self.best_filled(itertools.chain(greedy, self._templates(pp, microbatches, caps)), placement,
                                microbatches, costs, first_order)

    @staticmethod
    def _templates(pp: int, microbatches: int, caps: list[int]) -> Iterator[Candidate]:
        """The ZB-V order with the paper's own W, then with 0-2 extra warm-up forwards and the W
        placed by every ALPHAS; each order written only when `best_filled` gets to it."""
        yield Candidate(zero_bubble_v(pp, microbatches, weights=True))
        for extra in (0, 1, 2):
            order = zero_bubble_v(pp, microbatches, extra)
            yield from (Candidate(order, caps, alpha) for alpha in ALPHAS)
