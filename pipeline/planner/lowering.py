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
timing. `pipeline.planner.p2p_check` proves both properties for a finished Plan.

Neighbours on the same rank exchange tensors in memory, with no action. Non-sequential stage
graphs (skip connections) are handled by `edges`: the producer->consumer stage pairs; by default
each stage feeds the next one. `grad_edges` lists the edges along which a gradient flows back
(those carrying a floating-point value); by default all of them.
"""

from __future__ import annotations

from collections.abc import Iterable

from pipeline.core.ir import Action, Kind, Schedule

BACKWARD_KINDS = (Kind.B, Kind.I)


def sequential_edges(num_stages: int) -> list[tuple[int, int]]:
    return [(s, s + 1) for s in range(num_stages - 1)]


def causal_order(schedule: Schedule) -> dict[tuple[int, int], int]:
    """(rank, index in its compute program) -> position in one order of all compute actions in
    which every action comes after the ones it depends on (and after its rank's earlier ones).

    Played with unit costs: every action lasts 1, so a consumer ends strictly after its producer;
    ties between ranks are broken by rank."""
    from pipeline.planner.simulate import CostModel, simulate

    compute = Schedule(schedule.name, schedule.num_stages, schedule.num_microbatches, list(schedule.placement),
                       schedule.compute_only(), schedule.training)
    events = simulate(compute, CostModel.uniform(schedule.num_stages), check=False).events
    position: dict[tuple[int, int], int] = {}
    index = [0] * schedule.pp
    for e in sorted(events, key=lambda e: (e["end_s"], e["rank"], e["start_s"])):
        rank = e["rank"]
        position[(rank, index[rank])] = len(position)
        index[rank] += 1
    return position


def lower(schedule: Schedule, edges: Iterable[tuple[int, int]] | None = None,
          grad_edges: Iterable[tuple[int, int]] | None = None) -> Schedule:
    """Return a copy of `schedule` with SEND/RECV actions for cross-rank edges, in the global
    order described above. SEND_F(s, mb)>c sends stage s's values read by stage c; RECV_F(c, mb)<s
    receives them; SEND_B(c, mb)>s and RECV_B(s, mb)<c carry their gradients back. The recompute
    action R never receives: it reuses the stage inputs kept by F."""
    if schedule.lowered:
        return schedule
    placement = schedule.placement
    edge_set = sorted(set(edges if edges is not None else sequential_edges(schedule.num_stages)))
    remote = [(p, c) for p, c in edge_set if placement[p] != placement[c]]
    with_grad = set(remote) if grad_edges is None else set(grad_edges) & set(remote)
    consumers: dict[int, list[int]] = {}
    producers: dict[int, list[int]] = {}
    for p, c in remote:
        consumers.setdefault(p, []).append(c)
        producers.setdefault(c, []).append(p)

    programs = schedule.compute_only()
    order = causal_order(schedule)
    # who produces each (direction, producer-side stage, mb): the global rank of its compute action
    made_at: dict[tuple[str, int, int], int] = {}
    for rank, acts in enumerate(programs):
        for i, a in enumerate(acts):
            if a.kind is Kind.F:
                made_at[("F", a.stage, a.mb)] = order[(rank, i)]
            elif a.kind in BACKWARD_KINDS:
                made_at[("B", a.stage, a.mb)] = order[(rank, i)]

    # every rank's messages, keyed by (global rank of the producing compute, peer stage): the order
    # both ends of each message post it in
    messages: list[list[tuple[tuple[int, int], Action]]] = [[] for _ in range(schedule.pp)]
    for rank, acts in enumerate(programs):
        for a in acts:
            s, mb = a.stage, a.mb
            if a.kind is Kind.F:
                for c in consumers.get(s, ()):
                    messages[rank].append(((made_at[("F", s, mb)], c), Action(s, Kind.SEND_F, mb, c)))
                for p in producers.get(s, ()):
                    messages[rank].append(((made_at[("F", p, mb)], s), Action(s, Kind.RECV_F, mb, p)))
            elif a.kind in BACKWARD_KINDS and schedule.training:
                for p in producers.get(s, ()):
                    if (p, s) in with_grad:
                        messages[rank].append(((made_at[("B", s, mb)], p), Action(s, Kind.SEND_B, mb, p)))
                for c in consumers.get(s, ()):
                    if (s, c) in with_grad:
                        messages[rank].append(((made_at[("B", c, mb)], s), Action(s, Kind.RECV_B, mb, c)))

    lowered = [_interleave(acts, sorted(msgs, key=lambda m: m[0])) for acts, msgs in zip(programs, messages, strict=True)]
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


def _interleave(compute: list[Action], messages: list[tuple[tuple[int, int], Action]]) -> list[Action]:
    """One rank's program: its compute actions in order, its messages in the global order, each
    receive posted as soon as the messages before it are, each send right after its producer."""
    out: list[Action] = []
    produced: set[tuple[Kind, int, int]] = set()
    next_msg = 0

    def post_ready() -> None:
        nonlocal next_msg
        while next_msg < len(messages):
            act = messages[next_msg][1]
            if act.kind in (Kind.SEND_F, Kind.SEND_B):
                made_by = Kind.F if act.kind is Kind.SEND_F else Kind.B
                if (made_by, act.stage, act.mb) not in produced:
                    return
            out.append(act)
            next_msg += 1

    post_ready()
    for act in compute:
        out.append(act)
        if act.kind is Kind.F:
            produced.add((Kind.F, act.stage, act.mb))
        elif act.kind in BACKWARD_KINDS:
            produced.add((Kind.B, act.stage, act.mb))
        post_ready()
    if next_msg != len(messages):  # a send whose producer never runs on this rank: not a valid schedule
        raise ValueError(f"{messages[next_msg][1]} has no producing compute action on its rank")
    return out
