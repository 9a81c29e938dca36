"""Looped breadth-first: each rank runs every micro-batch through one of its stages before the next.

Why: on the interleaved placement (v stages per rank), depth-first orders (interleaved 1F1B, its zero
bubble form) hand a micro-batch to the next rank after every chunk, so a slow link is paid between
most pairs of actions. Breadth-first (Lamy-Poirier, "Breadth-First Pipeline Parallelism", 2023;
torch.distributed.pipelining's ScheduleLoopedBFS) runs the m forwards of a stage back to back, then
the backwards stage by stage in reverse: a hop is paid once per stage in the fill, and with hops
of 5-10% of a forward it leaves the least idle time of the zoo at many points of
bench/schedules_at_scale.py's grid. The price is memory: a rank holds every micro-batch of every one of its stages (m * v
stage-micro-batches, v times GPipe's).

Here the backward is split: the order of forwards and input gradients is breadth-first's (each
stage's micro-batches in reverse, as torch's, or in order) and `weight_fill` places each W where the
rank would wait, on the measured costs, within that same memory; torch's order (full backwards) is
one candidate, so the step is never longer than torch's LoopedBFS on the same costs. Any
micro-batch count.

Not in scheduler=auto's or plan=auto's default search (`searched_by_default`): on CPU gloo ranks
its steps measured 1.29-1.64 times the simulated ones (bench/RESULTS.md, scheduler=auto on the
default model), against 0.9-1.2 for the other schedules, so a search would pick it for a step it
does not take; the cause (the ranks idle between its runs of forwards far longer than the links'
measured latency explains) is not found yet. Named in `plan.schedulers`, it is searched.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.core.ir import Action, B, F, I
from pipelaunch.pipeline.planner.schedules.base import Candidate, ScheduleCosts
from pipelaunch.pipeline.planner.schedules.interleaved import Interleaved1F1B
from pipelaunch.pipeline.planner.schedules.zero_bubble import ALPHAS


def breadth_first_order(pp: int, v: int, microbatches: int, reverse: bool = True,
                        backward: type = B) -> list[list[Action]]:
    """Per rank: the forwards of its stages in placement order, each over every micro-batch, then
    the backwards (`backward`: B, or I for a split one) of its stages in reverse, each over the
    micro-batches newest first (`reverse`, torch's order) or oldest first."""
    mbs = list(range(microbatches))
    back_mbs = mbs[::-1] if reverse else mbs
    programs = []
    for r in range(pp):
        stages = [chunk * pp + r for chunk in range(v)]
        acts: list[Action] = [F(s, mb) for s in stages for mb in mbs]
        acts += [backward(s, mb) for s in reversed(stages) for mb in back_mbs]
        programs.append(acts)
    return programs


@dataclass(frozen=True)
class LoopedBFS(Interleaved1F1B):
    """Breadth-first over the round-robin placement, backward split, W placed on the measured costs."""

    name: ClassVar[str] = "looped_bfs"
    split_backward: ClassVar[bool] = True
    searched_by_default: ClassVar[bool] = False
    #: place the W on the measured per-stage costs (else F = I = W units)
    cost_aware: bool = True
    #: run an I and its W as one fused B wherever the simulated step does not grow (schedules/fuse.py)
    fuse_backward: bool = True

    def check(self, pp: int, microbatches: int, placement: list[int]) -> None:
        self.check_placement(pp, placement)
        if microbatches < 1:
            raise ConfigError("microbatches", f"scheduler {self.name!r} needs microbatches >= 1, got {microbatches}")

    def compute_actions(self, placement: list[int], microbatches: int, costs: ScheduleCosts | None = None,
                        *, first_order: bool = False) -> list[list[Action]]:
        pp = max(placement) + 1
        v = len(placement) // pp
        return self.best_filled(self._candidates(pp, v, microbatches), placement, microbatches, costs,
                                first_order)

    @staticmethod
    def _candidates(pp: int, v: int, m: int) -> Iterator[Candidate]:
        """Torch's order first (full backwards, newest micro-batch first), then both micro-batch
        orders with the backward split and the W placed by every ALPHAS within m * v held."""
        yield Candidate(breadth_first_order(pp, v, m))
        cap = [m * v] * pp
        for reverse in (True, False):
            order = breadth_first_order(pp, v, m, reverse, backward=I)
            yield from (Candidate(order, cap, alpha) for alpha in ALPHAS)
