"""Derive sends and receives from compute actions and the placement: the one place P2P is decided.

Why a global order: on GPUs, P2P runs on NCCL, which ignores tags. Between two ranks the k-th
send of one is matched with the k-th receive of the other, and all of a rank's batched P2P runs
on one stream in posting order, where an operation holds the stream until its partner is posted.
So both ends of every pair must post complementary groups in the same order, and the order over
all pairs must let every group meet its partner.

How: one message group per stage-graph edge and micro-batch and direction (`Action.peer` names
the stage at the other end), so a SEND and the RECV that matches it carry the same tensors. The
compute program is played once (`simulate`, unit costs) to give every compute action a causal
rank: an action is ranked after everything it depends on. A message takes the rank of the
compute that produces it, and every rank posts its messages in that one global order: a send
right after the compute that produces it, a receive as early as that order allows (so transfers
overlap compute). Then the earliest message not yet delivered is always at the head of both its
ranks' streams and its producer has run: no pair mismatches and nothing deadlocks, whatever the
timing. `pipelaunch.pipeline.planner.passes.p2p_check` proves both properties for a finished Plan.

Neighbours on the same rank exchange tensors in memory, with no action. Non-sequential stage
graphs (skip connections) are handled by `edges`: the producer->consumer stage pairs; by default
each stage feeds the next one. `grad_edges` lists the edges along which a gradient flows back
(those carrying a floating-point value); by default all of them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from operator import itemgetter
from typing import NamedTuple

from pipelaunch.pipeline.core.ir import Action, Kind, Schedule

BACKWARD_KINDS = (Kind.B, Kind.I)


def sequential_edges(num_stages: int) -> list[tuple[int, int]]:
    return [(s, s + 1) for s in range(num_stages - 1)]


def causal_order(schedule: Schedule) -> list[list[int]]:
    """[rank][index in its compute program] -> position in one order of all compute actions in
    which every action comes after the ones it depends on (and after its rank's earlier ones).

    Played with unit costs: every action lasts 1, so a consumer ends strictly after its producer;
    ties between ranks are broken by rank (a rank's ends all differ, and come in program order)."""
    from pipelaunch.pipeline.planner.predict.simulate import CostModel, compute_end_times

    compute = Schedule(schedule.name, schedule.num_stages, schedule.num_microbatches, list(schedule.placement),
                       schedule.compute_only(), schedule.training)
    ends = compute_end_times(compute, CostModel.uniform(schedule.num_stages))
    keyed = sorted((end, rank, i) for rank, times in enumerate(ends) for i, end in enumerate(times))
    positions = [[0] * len(times) for times in ends]
    for position, (_, rank, i) in enumerate(keyed):
        positions[rank][i] = position
    return positions


def lower(schedule: Schedule, edges: Iterable[tuple[int, int]] | None = None,
          grad_edges: Iterable[tuple[int, int]] | None = None) -> Schedule:
    """Return a copy of `schedule` with SEND/RECV actions for cross-rank edges, in the global
    order described above. SEND_F(s, mb)>c sends stage s's values read by stage c; RECV_F(c, mb)<s
    receives them; SEND_B(c, mb)>s and RECV_B(s, mb)<c carry their gradients back. The recompute
    action R never receives: it reuses the stage inputs kept by F."""
    if schedule.lowered:
        return schedule
    placement, n, m = schedule.placement, schedule.num_stages, schedule.num_microbatches
    edge_set = sorted(set(edges if edges is not None else sequential_edges(n)))
    remote = [(p, c) for p, c in edge_set if placement[p] != placement[c]]
    with_grad = set(remote) if grad_edges is None else set(grad_edges) & set(remote)
    links = _Links({}, {})
    for p, c in remote:
        links.consumers.setdefault(p, []).append((c, (p, c) in with_grad and schedule.training))
        links.producers.setdefault(c, []).append((p, (p, c) in with_grad and schedule.training))

    programs = schedule.compute_only()
    made = _made_at(programs, causal_order(schedule), n, m)
    lowered = [_interleave(acts, _messages(acts, made, links, n)) for acts in programs]
    return Schedule(
        name=schedule.name,
        num_stages=schedule.num_stages,
        num_microbatches=schedule.num_microbatches,
        placement=list(schedule.placement),
        actions=lowered,
        training=schedule.training,
        lowered=True,
        meta=dict(schedule.meta),
    )


class _Links(NamedTuple):
    """The cross-rank edges of the stage graph, from each end: stage -> [(the other stage, whether
    a gradient flows back along the edge)]."""

    consumers: dict[int, list[tuple[int, bool]]]
    producers: dict[int, list[tuple[int, bool]]]


#: _Made[direction][stage][mb]: the causal position of the compute that makes a message's values
_Made = tuple[list[list[int | None]], list[list[int | None]]]


def _made_at(programs: list[list[Action]], order: list[list[int]], num_stages: int, microbatches: int) -> _Made:
    """Who produces each (direction, producer-side stage, mb): the causal position of its compute
    action (the forward's outputs, or the backward's input gradients); the last one if repeated."""
    forward: list[list[int | None]] = [[None] * microbatches for _ in range(num_stages)]
    backward: list[list[int | None]] = [[None] * microbatches for _ in range(num_stages)]
    for acts, positions in zip(programs, order, strict=True):
        for a, position in zip(acts, positions, strict=True):
            if a.kind is Kind.F:
                forward[a.stage][a.mb] = position
            elif a.kind in BACKWARD_KINDS:
                backward[a.stage][a.mb] = position
    return forward, backward


def _messages(acts: list[Action], made: _Made, links: _Links, num_stages: int) -> list[tuple[int, Action]]:
    """One rank's messages, each keyed by (causal position of the compute producing it, peer
    stage) as one integer: the order both ends of each message post it in."""
    forward, backward = made
    consumers, producers = links
    out: list[tuple[int, Action]] = []
    post = out.append
    for a in acts:
        s, mb, kind = a.stage, a.mb, a.kind
        if kind is Kind.F:
            for c, _ in consumers.get(s, ()):
                post((forward[s][mb] * num_stages + c, Action(s, Kind.SEND_F, mb, c)))  # type: ignore[operator]
            for p, _ in producers.get(s, ()):
                post((forward[p][mb] * num_stages + s, Action(s, Kind.RECV_F, mb, p)))  # type: ignore[operator]
        elif kind in BACKWARD_KINDS:
            for p, grad in producers.get(s, ()):
                if grad:
                    post((backward[s][mb] * num_stages + p, Action(s, Kind.SEND_B, mb, p)))  # type: ignore[operator]
            for c, grad in consumers.get(s, ()):
                if grad:
                    post((backward[c][mb] * num_stages + s, Action(s, Kind.RECV_B, mb, c)))  # type: ignore[operator]
    out.sort(key=itemgetter(0))  # stable: equal keys keep program order
    return out


def _interleave(compute: list[Action], messages: list[tuple[int, Action]]) -> list[Action]:
    """One rank's program: its compute actions in order, its messages in the global order, each
    receive posted as soon as the messages before it are, each send right after its producer."""
    made_by: dict[tuple[Kind, int, int], int] = {}  # (F or B, stage, mb) -> index of its first producer
    for i, act in enumerate(compute):
        if act.kind is Kind.F:
            made_by.setdefault((Kind.F, act.stage, act.mb), i)
        elif act.kind in BACKWARD_KINDS:
            made_by.setdefault((Kind.B, act.stage, act.mb), i)
    # the compute after which each message is posted: its producer's, and never before the one ahead
    after: list[float] = []
    latest: float = -1
    for _, act in messages:
        if act.kind is Kind.SEND_F or act.kind is Kind.SEND_B:
            need = made_by.get((Kind.F if act.kind is Kind.SEND_F else Kind.B, act.stage, act.mb), math.inf)
            latest = max(latest, need)
        after.append(latest)
    out: list[Action] = []
    k, total = 0, len(messages)
    while k < total and after[k] < 0:  # receives posted before any compute
        out.append(messages[k][1])
        k += 1
    for i, act in enumerate(compute):
        out.append(act)
        while k < total and after[k] <= i:
            out.append(messages[k][1])
            k += 1
    if k != total:  # a send whose producer never runs on this rank: not a valid schedule
        raise ValueError(f"{messages[k][1]} has no producing compute action on its rank")
    return out
