"""Interleaved 1F1B (Megatron-LM style): each rank holds `stages_per_rank` chunks, round-robin.

Why: with v chunks per rank the fill and drain take v times shorter steps, so the bubble drops to
about (p-1)/(v*m + p-1), at the price of v times more point-to-point messages.

Order on rank r: forwards go in groups of p micro-batches per chunk (chunk 0 for micro-batches
0..p-1, chunk 1 for the same, ..., then the next p micro-batches), backwards the same with the
chunks reversed. A warm-up of 2(p-1-r) + (v-1)g forwards precedes strict F/B alternation, g the
first group's size. A count of micro-batches that is no multiple of p is cut into m // p groups as
equal as can be (each of p or more: torch's flexible interleaved 1F1B makes them equal, Megatron-
Core's `microbatch_group_size_per_vp_stage` sets their size), and fewer than p make one group of
all of them: every count from 1 runs, with the bubble of a pipeline that never fills. (Groups of p
with a smaller one last deadlock: its chunks switch before a micro-batch has crossed the ranks.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.core.ir import Action, Kind, action_table
from pipelaunch.pipeline.planner.placement import interleaved
from pipelaunch.pipeline.planner.schedules.base import ScheduleCosts, ScheduleGenerator


class _StagesPerRank(int):
    """An int that can also be called: the base class (and `pipelaunch.pipeline.core.plan`) ask every generator
    `stages_per_rank()`, while the Hydra config sets `stages_per_rank: 2` as a plain field."""

    def __call__(self) -> int:
        return int(self)


@dataclass(frozen=True)
class Interleaved1F1B(ScheduleGenerator):
    """Megatron's interleaved 1F1B over the round-robin placement (stage s on rank s % pp)."""

    name: ClassVar[str] = "interleaved_1f1b"
    default_placement: ClassVar[str] = "interleaved"
    supported_placements: ClassVar[tuple[str, ...]] = ("interleaved",)
    stages_per_rank: int = 2  # type: ignore[assignment]  # a field here, a method on the base

    def __post_init__(self) -> None:
        if not isinstance(self.stages_per_rank, int) or self.stages_per_rank < 1:
            raise ConfigError("scheduler.stages_per_rank", f"must be an integer >= 1, got {self.stages_per_rank!r}")
        object.__setattr__(self, "stages_per_rank", _StagesPerRank(self.stages_per_rank))  # frozen: normalised once

    def check(self, pp: int, microbatches: int, placement: list[int]) -> None:
        self.check_placement(pp, placement)
        if microbatches < 1:
            raise ConfigError("microbatches", f"scheduler {self.name!r} needs at least one micro-batch; got "
                                              f"{microbatches}")

    def check_placement(self, pp: int, placement: list[int]) -> None:
        """The round-robin placement of `stages_per_rank` stages per rank, or a ConfigError naming it."""
        v = int(self.stages_per_rank)
        expected = interleaved(pp, v)
        if list(placement) != expected:
            raise ConfigError(
                "placement",
                f"scheduler {self.name!r} with stages_per_rank={v} needs the round-robin placement "
                f"{expected} (placement=interleaved or auto), got {placement}",
            )

    def compute_actions(self, placement: list[int], microbatches: int, costs: ScheduleCosts | None = None,
                        *, first_order: bool = False) -> list[list[Action]]:
        pp = max(placement) + 1
        return interleaved_order(pp, len(placement) // pp, microbatches)


def interleaved_order(pp: int, v: int, microbatches: int, hop_warmup: int = 2) -> list[list[Action]]:
    """Megatron's interleaved 1F1B order (module docstring); `hop_warmup`: the extra warm-up forwards
    per rank between r and the last rank (2 in Megatron, which with m = p runs every forward first;
    torch's interleaved zero bubble uses 1, and keeps its warm-up at m = p too)."""
    m = microbatches
    total = m * v

    rounds = max(1, m // pp)
    sizes = [m // rounds + (1 if g < m % rounds else 0) for g in range(rounds)]  # equal but for one each

    def slots(backward: bool) -> list[tuple[int, int]]:
        """(chunk, micro-batch) in the order every rank runs them: the groups in turn, each through
        its chunks (reversed for the backward)."""
        out, start = [], 0
        for size in sizes:
            for chunk in (range(v - 1, -1, -1) if backward else range(v)):
                out += [(chunk, mb) for mb in range(start, start + size)]
            start += size
        return out

    # every rank runs its chunks in the same (chunk, micro-batch) sequence
    forward_slots, backward_slots = slots(False), slots(True)
    f_table, b_table = action_table(Kind.F, pp * v, m), action_table(Kind.B, pp * v, m)
    programs: list[list[Action]] = []
    group = sizes[0]
    for r in range(pp):
        all_first = m == pp and v > 1 and hop_warmup == 2
        warmup = total if all_first else min(total, hop_warmup * (pp - 1 - r) + (v - 1) * group)
        acts: list[Action] = []
        forwards = [f_table[(chunk * pp + r) * m + mb] for chunk, mb in forward_slots]
        backwards = [b_table[(chunk * pp + r) * m + mb] for chunk, mb in backward_slots]
        acts += forwards[:warmup]
        for k in range(total - warmup):
            acts += [forwards[warmup + k], backwards[k]]
        acts += backwards[total - warmup:]
        programs.append(acts)
    return programs
