"""DualPipeV: DeepSeek's bidirectional-in-a-V schedule, with overlapped forward/backward pairs.

Why: DualPipe (DeepSeek-V3) feeds micro-batches from both ends of the pipeline so that in the steady
state every rank runs a forward of one chunk together with the backward of its other chunk; on a GPU
the two can overlap (one's communication under the other's compute). DualPipeV is its cut-in-half
form on the V placement (p ranks, 2p stages), the one torch.distributed.pipelining ships as
ScheduleDualPipeV; it needs m >= 2p.

Here: the order is DualPipeV's (`orders.dualpipe_v`); each overlapped (forward, backward) pair runs
back to back as one action (`overlapped`: the runtime runs the two one after the other, as torch's
runtime does, and the simulator prices each part as profiled); the W of its split backwards are
either where DualPipeV puts them or placed by `weight_fill` on the measured costs within the memory
DualPipeV's own placement holds, whichever the simulator finds faster.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.core.ir import Action, Kind
from pipelaunch.pipeline.planner.placement import v_shape
from pipelaunch.pipeline.planner.schedules.base import (
    Candidate,
    ScheduleCosts,
    ScheduleGenerator,
    require_microbatches_at_least,
)
from pipelaunch.pipeline.planner.schedules.interleaved_zb import peak_held
from pipelaunch.pipeline.planner.schedules.orders import dualpipe_v
from pipelaunch.pipeline.planner.schedules.zero_bubble import ALPHAS


@dataclass(frozen=True)
class DualPipeV(ScheduleGenerator):
    """DualPipeV on the V placement; microbatches >= 2 * pp."""

    name: ClassVar[str] = "dualpipev"
    default_placement: ClassVar[str] = "v"
    supported_placements: ClassVar[tuple[str, ...]] = ("v",)
    split_backward: ClassVar[bool] = True
    #: place the W on the measured per-stage costs (else F = I = W units)
    cost_aware: bool = True

    def stages_per_rank(self) -> int:
        return 2

    def check(self, pp: int, microbatches: int, placement: list[int]) -> None:
        if list(placement) != v_shape(pp):
            raise ConfigError("placement", f"scheduler 'dualpipev' needs the V placement {v_shape(pp)} "
                                           f"(placement=v or auto), got {placement}")
        require_microbatches_at_least(self.name, microbatches, 2 * pp,
                                      f"its steady state pairs the two chunks of {2 * pp} stages")

    def overlapped(self, placement: list[int], microbatches: int) -> list[tuple[Action, Action]]:
        """DualPipeV's overlapped (forward, backward) pairs: every candidate keeps them glued."""
        return list(dualpipe_v(max(placement) + 1, microbatches).overlapped)

    def compute_actions(self, placement: list[int], microbatches: int, costs: ScheduleCosts | None = None,
                        *, first_order: bool = False) -> list[list[Action]]:
        pp = max(placement) + 1
        reference = dualpipe_v(pp, microbatches)
        critical = [[a for a in acts if a.kind is not Kind.W] for acts in reference.orders]
        glued = frozenset(b for _, b in reference.overlapped)
        caps = peak_held(reference.orders)
        candidates = [Candidate(reference.orders), *(Candidate(critical, caps, alpha, glued) for alpha in ALPHAS)]
        return self.best_filled(candidates, placement, microbatches, costs, first_order)
