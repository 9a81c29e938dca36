"""The dependency rules of the schedule IR, stated once: what an action waits for.

Three players run a pipeline forward in time and must agree on them: the simulator
(`pipelaunch.pipeline.planner.predict.simulate`), the step with ranks sharing too few cores
(`pipelaunch.pipeline.planner.predict.shared_cores`) and the list scheduler that orders the zero-bubble schedules
(`pipelaunch.pipeline.planner.schedules.zero_bubble`). The executor follows the same contract.

* F(s, mb) waits for F(s-1, mb): its input, across the cut between stages s-1 and s.
* B(s, mb) and I(s, mb) wait for F(s, mb), for R(s, mb) when (s, mb) is rematerialised, and for
  B/I(s+1, mb): the gradient of its output, across the cut between stages s and s+1.
* W(s, mb) waits for I(s, mb).
* R(s, mb) waits for F(s, mb) (it reuses the stage inputs F kept).

What an action's end makes available is its `Step` (`COMPLETES`): B and I both give the input
gradient, so B/I(s-1, mb) waits on whichever of them stage s runs. A wait that crosses a cut
between stages on different ranks is delayed by the transfer over that cut (`Need.cut`); within
a rank it is free. Sends and receives of a lowered program add no dependency of their own: a
receive is implied by the compute that reads it (`READS`), a send is asynchronous.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from enum import IntEnum
from typing import NamedTuple

from pipelaunch.pipeline.core.ir import Action, Kind


class Step(IntEnum):
    """What the end of an action makes available to the actions waiting for it."""

    FORWARD = 0  # F: the stage's outputs (and the inputs a backward or a recompute reads)
    INPUT_GRAD = 1  # B or I: the gradient of the stage's inputs
    WEIGHT_GRAD = 2  # W: the weight gradients (nothing waits on them inside a step)
    RECOMPUTE = 3  # R: the recomputed activations


#: the step each compute kind completes
COMPLETES: dict[Kind, Step] = {
    Kind.F: Step.FORWARD,
    Kind.B: Step.INPUT_GRAD,
    Kind.I: Step.INPUT_GRAD,
    Kind.W: Step.WEIGHT_GRAD,
    Kind.R: Step.RECOMPUTE,
}

#: a receive of a lowered program is read by the compute of its (stage, micro-batch) that
#: completes this step: RECV_F by the F, RECV_B by the B or I
READS: dict[Kind, Step] = {Kind.RECV_F: Step.FORWARD, Kind.RECV_B: Step.INPUT_GRAD}


class Need(NamedTuple):
    """One thing an action of micro-batch mb waits for: `step` of (`stage`, mb)."""

    step: Step
    stage: int
    #: the cut (between stages `cut` and `cut + 1`) the result crosses; None within a stage
    cut: int | None
    #: how a message names the awaited action ("F", "B/I", "I", "R")
    label: str


def needs(kind: Kind, stage: int, num_stages: int, remat: bool = False) -> tuple[Need, ...]:
    """What an action of `kind` on `stage` waits for (the same for every micro-batch), in the
    order the players check it; `remat`: the (stage, micro-batch) is rematerialised. Sends and
    receives wait for nothing here (see the module docstring)."""
    if kind is Kind.F:
        return (Need(Step.FORWARD, stage - 1, stage - 1, "F"),) if stage > 0 else ()
    if kind is Kind.B or kind is Kind.I:
        out = [Need(Step.FORWARD, stage, None, "F")]
        if remat:
            out.append(Need(Step.RECOMPUTE, stage, None, "R"))
        if stage + 1 < num_stages:
            out.append(Need(Step.INPUT_GRAD, stage + 1, stage, "B/I"))
        return tuple(out)
    if kind is Kind.W:
        return (Need(Step.INPUT_GRAD, stage, None, "I"),)
    if kind is Kind.R:
        return (Need(Step.FORWARD, stage, None, "F"),)
    return ()


def released_stage(kind: Kind, stage: int, num_stages: int) -> int | None:
    """The other stage whose action the end of this one may let start (the converse of `needs`
    across a cut): the next stage's F after an F, the previous stage's B/I after a B or I; None
    for the ends of the pipeline and for W and R, which only their own stage waits on."""
    if kind is Kind.F:
        return stage + 1 if stage + 1 < num_stages else None
    if kind is Kind.B or kind is Kind.I:
        return stage - 1 if stage > 0 else None
    return None


def remat_pairs(programs: Iterable[Iterable[Action]]) -> set[tuple[int, int]]:
    """The (stage, micro-batch) pairs that are rematerialised: those with an R action."""
    return {(a.stage, a.mb) for acts in programs for a in acts if a.kind is Kind.R}


class Wait(NamedTuple):
    """A `Need` as a player checks it: `step` of (`stage`, mb), usable `delay` seconds after it ends."""

    step: int
    stage: int
    delay: float


def wait_table(num_stages: int, hop: Sequence[float] | None = None) -> dict[tuple[Kind, bool], list[tuple[Wait, ...]]]:
    """`needs` for every compute kind, remat flag and stage, with the transfer over each cut
    (`hop[cut]`, none when `hop` is None) filled in: table[(kind, remat)][stage]."""
    table: dict[tuple[Kind, bool], list[tuple[Wait, ...]]] = {}
    for kind in COMPLETES:
        for remat in (False, True):
            table[(kind, remat)] = [
                tuple(Wait(int(n.step), n.stage, 0.0 if n.cut is None or hop is None else hop[n.cut])
                      for n in needs(kind, s, num_stages, remat))
                for s in range(num_stages)
            ]
    return table


def note_waiting(waiting: list[list[int] | None], idx: int, rank: int) -> None:
    """Note that `rank` waits for action `idx` of a per-action table of waiting ranks (None: none):
    lists rather than a dict of tuples, since a play notes and wakes once per action."""
    if waiting[idx] is None:
        waiting[idx] = [rank]
    else:
        waiting[idx].append(rank)  # type: ignore[union-attr]


class Progress:
    """When each step of each (stage, micro-batch) finished during a play-through, and which ranks
    wait on the ones that have not: the bookkeeping of the simulator and the core-sharing model
    (the list scheduler, which picks rather than waits, keeps end times of its own)."""

    __slots__ = ("end", "m", "waiting")

    def __init__(self, num_stages: int, microbatches: int) -> None:
        self.m = microbatches
        #: end[step][stage * m + mb]: finish time, None until it finished
        self.end: list[list[float | None]] = [[None] * (num_stages * microbatches) for _ in Step]
        #: waiting[step][stage * m + mb]: the ranks waiting for it to finish (`note_waiting`)
        self.waiting: list[list[list[int] | None]] = [[None] * (num_stages * microbatches) for _ in Step]

    def earliest_start(self, waits: tuple[Wait, ...], mb: int, start: float, rank: int) -> float | None:
        """The earliest time, not before `start`, at which an action waiting for `waits` of `mb`
        may start; None, with `rank` noted as waiting, if one of them has not finished."""
        m, end = self.m, self.end
        for step, stage, delay in waits:
            t = end[step][stage * m + mb]
            if t is None:
                note_waiting(self.waiting[step], stage * m + mb, rank)
                return None
            t += delay
            if t > start:
                start = t
        return start

    def finish(self, step: int, stage: int, mb: int, t: float) -> Sequence[int]:
        """Record `step` of (stage, mb) as finished at `t`; the ranks that were waiting on it."""
        idx = stage * self.m + mb
        self.end[step][idx] = t
        return self.woken(step, idx)

    def woken(self, step: int, idx: int) -> Sequence[int]:
        """The ranks waiting for `step` of stage * m + mb = `idx`, now that it finished (forgotten)."""
        waiters = self.waiting[step]
        ranks = waiters[idx]
        if ranks is None:
            return ()
        waiters[idx] = None
        return ranks

    def finished(self, step: int, stage: int, mb: int) -> bool:
        return self.end[step][stage * self.m + mb] is not None


__all__ = ["COMPLETES", "READS", "Need", "Progress", "Step", "Wait", "needs", "note_waiting", "released_stage",
           "remat_pairs", "wait_table"]
