"""Place the data-parallel collectives in each rank's program: where a stage's parameters are
gathered and released, and where its gradients are reduced over the replicas.

Why as actions: the schedule knows when a stage's gradients are final (its last backward of the
step) and when its parameters are next needed, so a reduction can start right there and overlap
the backward work still to come on the rank, instead of one flat all-reduce after the step; the
simulator prices the collectives where they stand, the executor runs them in program order, and
the timeline shows them. Every replica of a pipeline rank runs the same program, so the replicas
issue the same collectives in the same order (what NCCL needs of a communicator), and a
collective never waits for a P2P that waits for it: the replicas reach it after the same sends
and receives, which the P2P check proves complete (passes/p2p_check.py).

Per level (`zero`, docs/sharding.md), for each stage s of the rank:

- 0: `REDUCE_GRAD s` (an all-reduce of the stage's gradients) after its last backward.
- 1: `UNSHARD s` before its first compute action; `REDUCE_GRAD s` (a reduce-scatter) after its
  last backward, then `RESHARD s`.
- 2: as 1, with a `REDUCE_GRAD s mb` after every micro-batch's backward (its B, or its W).
- 3: as 2, and `UNSHARD` before / `RESHARD` after every run of consecutive compute actions of s
  (consecutive ones share one gather).

A reduction goes after the sends that follow the backward (the P2P on the critical path is posted
first). Parameters several stages hold (tied weights) are left out of every collective here and
summed after the step (runtime/dp.py).
"""

from __future__ import annotations

from dataclasses import replace

from pipelaunch.pipeline.core.ir import Action, Kind, Schedule

_BACKWARD = (Kind.B, Kind.W)
_SENDS = (Kind.SEND_F, Kind.SEND_B)


def place_data_parallel(schedule: Schedule, zero: int, dp: int) -> Schedule:
    """The schedule with its data-parallel collectives placed (unchanged when dp == 1 or it does
    not train)."""
    if dp < 2 or not schedule.training:
        return schedule
    actions = [_program(acts, zero) for acts in schedule.actions]
    return replace(schedule, actions=actions, meta={**schedule.meta, "zero": zero})


def gradient_points(acts: list[Action]) -> tuple[dict[tuple[int, int], int], dict[int, int]]:
    """Per (stage, micro-batch), the position of the action after which its weight gradients are
    complete (its W when the backward is split, else its B); per stage the last of those."""
    split = {(a.stage, a.mb) for a in acts if a.kind is Kind.W}
    completes = {(a.stage, a.mb): pos for pos, a in enumerate(acts)
                 if a.kind is Kind.W or (a.kind is Kind.B and (a.stage, a.mb) not in split)}
    last: dict[int, int] = {}
    for (stage, _), pos in completes.items():
        last[stage] = max(pos, last.get(stage, -1))
    return completes, last


def _program(acts: list[Action], zero: int) -> list[Action]:
    completes, last = gradient_points(acts)
    reduce_at = set(last.values()) if zero < 2 else set(completes.values())
    computes = [pos for pos, a in enumerate(acts) if a.is_compute]
    next_compute = {p: (acts[q].stage if q is not None else None)
                    for p, q in zip(computes, [*computes[1:], None], strict=True)}
    first = {}
    for pos in computes:
        first.setdefault(acts[pos].stage, pos)
    out: list[Action] = []
    held: int | None = None  # zero=3: the stage whose parameters are gathered now
    pending: list[Action] = []  # collectives waiting for the sends after a compute action
    for pos, a in enumerate(acts):
        if pending and a.kind not in _SENDS:
            out += pending
            pending = []
        if a.is_compute:
            s = a.stage
            if (zero == 3 and held != s) or (zero in (1, 2) and first[s] == pos):
                out.append(Action(s, Kind.UNSHARD, a.mb))
                held = s
            out.append(a)
            if pos in reduce_at and a.kind in _BACKWARD:
                pending.append(Action(s, Kind.REDUCE_GRAD, a.mb))
            if zero and ((zero == 3 and next_compute[pos] != s) or (zero < 3 and last.get(s) == pos)):
                pending.append(Action(s, Kind.RESHARD, a.mb))
                held = None if held == s else held
            continue
        out.append(a)
    return out + pending
