"""What every schedule generator is: a pure function of (placement, micro-batches, costs) plus its rules.

A generator is a small frozen dataclass so that the launcher can build it from
`conf/scheduler/<name>.yaml` (its class's import path and its fields) and it holds nothing else: the measured costs (`ScheduleCosts`) are an
argument of `compute_actions`. It declares which placement `placement=auto` should give it, checks
its own requirements, and returns compute actions per rank; sends and receives come from
`pipelaunch.pipeline.planner.passes.lowering`, never from the generator.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.core.ir import Action
from pipelaunch.pipeline.planner.predict.simulate import makespan, simulate_programs
from pipelaunch.pipeline.planner.schedules.fuse import fuse_slack_backwards
from pipelaunch.pipeline.planner.schedules.weight_fill import (
    Filled,
    StageCosts,
    StageMemory,
    fill_weight_grads,
)

#: actions the candidates of one schedule may place in all: past it (and once one candidate
#: succeeded) the rest are skipped, so that large plans stay within seconds; candidates come most
#: promising first
CANDIDATE_WORK = 600_000


class Candidate(NamedTuple):
    """One way to order a schedule, for `ScheduleGenerator.best_filled`: a critical order (per rank
    F, I and B, no W) whose W are placed under `cap` micro-batches per rank (with `memory`, bytes as
    it prices a micro-batch of each stage), or, with `cap` None, finished programs taken as they are."""

    orders: Sequence[Sequence[Action]]
    cap: Sequence[float] | None = None
    alpha: float = math.inf
    glued: frozenset[Action] = frozenset()
    backlog: Sequence[int] | None = None
    memory: StageMemory | None = None

    def fill(self, placement: list[int], microbatches: int, costs: StageCosts, timed: bool = True) -> Filled:
        """The programs and the step they take; finished programs untimed (an infinite step) unless
        `timed` (a caller keeping the first candidate needs no step)."""
        if self.cap is None:
            programs = [list(acts) for acts in self.orders]
            if not timed:
                return Filled(programs, math.inf)
            triple = (list(costs.forward), list(costs.input_grad), list(costs.weight_grad))
            fused = list(costs.backward) if costs.backward is not None else None
            sim = simulate_programs(programs, placement, microbatches, triple, fused, costs.hop)
            return Filled(programs, sim.makespan_s, sim.longest_span_s)
        return fill_weight_grads(self.orders, placement, microbatches, costs, self.cap, alpha=self.alpha,
                                 glued=self.glued, backlog=self.backlog, memory=self.memory)


def step_floor(placement: Sequence[int], microbatches: int, costs: StageCosts) -> float:
    """A step no order can beat: the busiest rank's work (each backward at its cheaper form, split
    or fused) after the earliest its first stage's input can arrive (forwards and hops before it)."""
    arrive, start = 0.0, {}
    for s, rank in enumerate(placement):
        start.setdefault(rank, arrive)
        arrive += costs.forward[s] + (costs.hop[s] if s < len(costs.hop) else 0.0)
    work: dict[int, float] = {}
    for s, rank in enumerate(placement):
        backward = min(costs.input_grad[s] + costs.weight_grad[s], costs.fused(s))
        work[rank] = work.get(rank, 0.0) + microbatches * (costs.forward[s] + backward)
    return max(start[r] + work[r] for r in work)


@dataclass(frozen=True)
class ScheduleCosts:
    """A measured per-stage profile, handed to `compute_actions` by the planner: generators that order
    actions by a simulated play-through (`cost_aware` ones) choose on it; others ignore it. None in its
    place means unit costs (F = I = W = 1, free hops). A value, not generator state, so that one
    generator serves every candidate of a search and a plan is a function of its arguments.

    `backward`: the fused backward, when profiled apart (it costs less than I + W), so that fusing a
    pair is credited its saving. `hop[s]`: the time a value takes from stage s to stage s + 1 (0 on
    one rank). `memory`: the bytes a micro-batch holds on each stage, for generators whose memory
    promise is in bytes."""

    forward: tuple[float, ...]
    input_grad: tuple[float, ...]
    weight_grad: tuple[float, ...]
    backward: tuple[float, ...] | None = None
    hop: tuple[float, ...] | None = None
    memory: StageMemory | None = None

    @classmethod
    def of(cls, forward: Sequence[float], input_grad: Sequence[float], weight_grad: Sequence[float],
           backward: Sequence[float] | None = None, hop: Sequence[float] | None = None,
           memory: StageMemory | None = None) -> ScheduleCosts:
        """From per-stage sequences (lists are copied into tuples, so the value stays frozen)."""
        return cls(tuple(forward), tuple(input_grad), tuple(weight_grad),
                   tuple(backward) if backward is not None else None, tuple(hop) if hop is not None else None, memory)


@dataclass(frozen=True)
class ScheduleGenerator:
    """Base class: subclasses set the class variables and implement `compute_actions`. A frozen
    value holding only its configured options (what `conf/scheduler/<name>.yaml` passes): the costs
    and the first-order mode are arguments of each call, so one generator serves every plan."""

    name: ClassVar[str] = "base"
    #: placement kind `placement=auto` resolves to ("linear", "interleaved" or "v").
    default_placement: ClassVar[str] = "linear"
    #: placement kinds the generator can run on ("explicit" = any list).
    supported_placements: ClassVar[tuple[str, ...]] = ("linear",)
    #: whether the backward is split into I and W actions.
    split_backward: ClassVar[bool] = False
    #: False for forward-only schedules.
    training: ClassVar[bool] = True
    #: whether scheduler=auto and plan=auto try it unless `plan.schedulers` names the schedules
    searched_by_default: ClassVar[bool] = True

    def stages_per_rank(self) -> int:
        return 1

    def measured(self, costs: ScheduleCosts | None) -> ScheduleCosts | None:
        """The profile orders are chosen on: `costs` for a cost-aware generator, else None (units)."""
        return costs if getattr(self, "cost_aware", False) else None

    def stage_costs(self, num_stages: int, costs: ScheduleCosts | None) -> StageCosts:
        """The costs orders are chosen on: the measured ones when cost-aware and given (with the
        hops), else F = I = W = 1 and free hops."""
        measured = self.measured(costs)
        if measured is None:
            return StageCosts.of(num_stages, (1, 1, 1))
        return StageCosts.of(num_stages, self.play_costs(measured), measured.hop or 0.0, measured.backward)

    def stage_memory(self, costs: ScheduleCosts | None) -> StageMemory | None:
        """The bytes a micro-batch holds per stage, when cost-aware and given with the measured costs."""
        measured = self.measured(costs)
        return measured.memory if measured is not None else None

    def best_filled(self, candidates: Iterable[Candidate], placement: list[int], microbatches: int,
                    costs: ScheduleCosts | None, first_order: bool = False) -> list[list[Action]]:
        """The candidate whose programs take the shortest step on `stage_costs` (of equal steps, the
        one idling least inside the ranks' spans; then the first): a critical order whose W
        `weight_fill` places, or finished programs; at most CANDIDATE_WORK actions in all. With `fuse_backward`,
        the I/W pairs whose split buys nothing then run as one B (schedules/fuse.py).

        `first_order`: keep the first feasible candidate (the most promising), neither timed nor
        with its backwards fused: for a caller that needs the order's shape, not its best step (the
        partitioner's in-flight counts without a memory budget, before the measured costs choose the
        order that runs; they only break ties between splits there)."""
        unit = self.measured(costs) is None
        costs = self.stage_costs(len(placement), costs)
        # on unit costs (the order the split is priced on, before the measured one; and the order of
        # cost_aware=false) an order at the lower bound cannot take a shorter step, so the rest are
        # not tried (of equal steps the first is kept, not the one with the shortest rank span)
        floor = step_floor(placement, microbatches, costs) if unit else 0.0
        best: Filled | None = None
        error: ConfigError | None = None
        spent = 0
        for cand in candidates:
            if best is not None and (best.makespan <= floor * (1 + 1e-9) or first_order):
                break
            spent += sum(len(acts) for acts in cand.orders)
            if best is not None and spent > CANDIDATE_WORK:
                break
            try:
                got = cand.fill(placement, microbatches, costs, timed=not first_order)
            except ConfigError as err:
                error = error or err
                continue
            if got.better_than(best):
                best = got
        if best is None:
            raise error or ConfigError("microbatches", f"scheduler {self.name!r} has no order for these settings")
        programs = best.programs
        if getattr(self, "fuse_backward", False) and not first_order:
            triple = (list(costs.forward), list(costs.input_grad), list(costs.weight_grad))
            fused = list(costs.backward) if costs.backward is not None else None
            programs = fuse_slack_backwards(programs, placement, microbatches, triple, fused, costs.hop)
        return programs

    def play_through(self, play, placement: list[int], microbatches: int, costs: ScheduleCosts | None,
                     **kwargs) -> list[list[Action]]:
        """Run a list-scheduling play-through on the measured costs when cost-aware; if real costs
        would leave the greedy stuck under the memory cap, keep the unit-cost order (always valid).

        With a split backward, the order that runs each W right after its I (`eager_w`) is kept
        when the simulator, on the same costs, finds it no slower: the W then reuses what its I
        just touched while it is still in cache, and frees the micro-batch's memory sooner. With
        `fuse_backward`, I/W pairs whose split buys nothing then run as one B (schedules/fuse.py)."""
        measured = self.measured(costs)
        triple = self.play_costs(measured)
        if not kwargs.get("split_backward"):
            return self._play_once(play, placement, microbatches, triple, **kwargs)
        eager = self._play_once(play, placement, microbatches, triple, eager_w=True, **kwargs)
        deferred = self._play_once(play, placement, microbatches, triple, **kwargs)
        hop = list(measured.hop) if measured is not None and measured.hop is not None else None
        slower = makespan(eager, placement, microbatches, triple, hop=hop) > (
            makespan(deferred, placement, microbatches, triple, hop=hop) * (1 + 1e-9))
        programs = deferred if slower else eager
        if getattr(self, "fuse_backward", False):
            fused = list(measured.backward) if measured is not None and measured.backward is not None else None
            programs = fuse_slack_backwards(programs, placement, microbatches, triple, fused, hop)
        return programs

    @staticmethod
    def _play_once(play, placement, microbatches, costs, **kwargs) -> list[list[Action]]:
        if costs != (1, 1, 1):
            try:
                return play(placement, microbatches, costs=costs, reserve_deeper=True, **kwargs)
            except ConfigError:
                pass
        return play(placement, microbatches, **kwargs)

    def play_costs(self, costs: ScheduleCosts | None) -> tuple:
        """(F, I, W) for the play-through: the measured per-stage costs when cost-aware, else units."""
        measured = self.measured(costs)
        if measured is None:
            return (1, 1, 1)
        return (list(measured.forward), list(measured.input_grad), list(measured.weight_grad))

    def overlapped(self, placement: list[int], microbatches: int) -> list[tuple[Action, Action]]:
        """The (forward, backward) pairs of `compute_actions`' programs that run back to back as one
        overlapped action (DualPipeV's); none for most schedules."""
        return []

    def check(self, pp: int, microbatches: int, placement: list[int]) -> None:
        """Raise ConfigError if this schedule cannot run with these settings."""
        from pipelaunch.pipeline.planner.placement import classify

        kind = classify(placement) if pp > 1 else "linear"
        if kind not in self.supported_placements and "explicit" not in self.supported_placements:
            raise ConfigError(
                "placement",
                f"scheduler {self.name!r} cannot run on a {kind} placement {placement}; "
                f"it supports: {', '.join(self.supported_placements)} (placement=auto picks "
                f"{self.default_placement!r})",
            )
        if len(placement) != pp * self.stages_per_rank() and "explicit" not in self.supported_placements:
            raise ConfigError(
                "placement",
                f"scheduler {self.name!r} needs {self.stages_per_rank()} stage(s) per rank, "
                f"i.e. {pp * self.stages_per_rank()} stages for pp={pp}, but the placement has {len(placement)}",
            )

    def compute_actions(self, placement: list[int], microbatches: int, costs: ScheduleCosts | None = None,
                        *, first_order: bool = False) -> list[list[Action]]:
        """Per rank, the compute actions (F, B or I and W) in the order it runs them: a function of
        the arguments and the generator's options. `costs`: the measured profile (None: unit
        costs); `first_order`: the first feasible candidate order will do (`best_filled`)."""
        raise NotImplementedError


def require_microbatches_at_least(name: str, microbatches: int, minimum: int, why: str) -> None:
    if microbatches < minimum:
        raise ConfigError(
            "microbatches",
            f"scheduler {name!r} needs microbatches >= {minimum} ({why}); got {microbatches}",
        )


__all__ = ["Candidate", "ScheduleCosts", "ScheduleGenerator", "makespan", "require_microbatches_at_least"]
