"""Prove that a lowered program obeys NCCL's point-to-point rules, without starting a process.

What NCCL requires (and gloo forgives, which is why a CPU run proves nothing about it):

* Tags are ignored. Between two ranks the k-th send of A to B is matched with the k-th receive
  of B from A, so both must agree on what the k-th message is: its values, shapes and dtypes.
* A rank's batched P2P (`batch_isend_irecv`, the only kind the runtime posts) runs on one stream
  in posting order, and that stream first waits for the compute queued before the post. A group
  holds the stream until its partner group is running on the other rank.

The check, for every pair of ranks: the k-th group of A with B is the exact complement of B's
k-th group with A (A's sends are B's receives, same values, same order, and the reverse). Then it
plays the program under the rules above (two streams per rank: compute, and P2P; the host never
blocks, as on a GPU) and reports a deadlock with where each rank's streams stand. It also checks
that every receive is posted before the compute that reads it and every send after the compute
that produces it, which is what the executor relies on.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from pipelaunch.pipeline.core.ir import COMPUTE_KINDS, Action, Kind, Schedule

SENDS = (Kind.SEND_F, Kind.SEND_B)
RECVS = (Kind.RECV_F, Kind.RECV_B)
#: per communication kind: (the message's direction, whether it sends, whether its stage is the
#: producer end of the edge)
_DIRECTION = {Kind.SEND_F: ("F", True, True), Kind.RECV_F: ("F", False, False),
              Kind.SEND_B: ("B", True, False), Kind.RECV_B: ("B", False, True)}
#: one tensor of a message: (value name, shape, dtype name)
TensorSpec = tuple[str, tuple[int, ...], str]


class P2POrderError(ValueError):
    """A lowered program NCCL would mismatch or deadlock on; the message names ranks and actions."""


@dataclass(slots=True)
class Group:
    """One `batch_isend_irecv` call of one rank: the tensors of one edge, micro-batch, direction."""

    rank: int
    position: int  # index of its action in the rank's program
    action: Action
    peer_rank: int
    send: bool
    #: (direction, producer stage, consumer stage, mb): what both ends call this message
    message: tuple[str, int, int, int]
    tensors: tuple[TensorSpec, ...]

    def describe(self) -> str:
        what = ", ".join(f"{n} {list(shape)} {dtype}" for n, shape, dtype in self.tensors)
        verb = "sends to" if self.send else "receives from"
        return f"{self.action} (action #{self.position}: {verb} rank {self.peer_rank}: {what})"


def edge_messages(stages: Sequence) -> dict[tuple[int, int], tuple[list[TensorSpec], list[TensorSpec]]]:
    """Per cross-stage edge (producer, consumer): the tensors its forward message carries and
    those its gradient message carries back (floating-point values only), sorted by name as both
    ends of the executor order them. `stages` are `StagePlan`s."""
    out: dict[tuple[int, int], tuple[list[TensorSpec], list[TensorSpec]]] = {}
    for st in stages:
        for name, producer in sorted(st.inputs.items()):
            if producer is None:
                continue
            shape, dtype = st.values[name]
            fwd, bwd = out.setdefault((producer, st.index), ([], []))
            spec = (name, tuple(int(d) for d in shape), str(dtype))
            fwd.append(spec)
            if _floating(str(dtype)):
                bwd.append(spec)
    return out


def _floating(dtype: str) -> bool:
    return dtype.removeprefix("torch.") in ("float16", "bfloat16", "float32", "float64")


def groups_of(schedule: Schedule, messages: dict[tuple[int, int], tuple[list[TensorSpec], list[TensorSpec]]]
              ) -> list[list[Group]]:
    """Each rank's P2P groups in posting order (a group with no tensor is not posted)."""
    placement = schedule.placement
    carried = {edge: (tuple(fwd), tuple(bwd)) for edge, (fwd, bwd) in messages.items()}
    out: list[list[Group]] = []
    problems: list[str] = []
    for rank, acts in enumerate(schedule.actions):
        mine: list[Group] = []
        for pos, a in enumerate(acts):
            kind = a.kind
            if kind not in _DIRECTION:
                continue
            if a.peer is None:
                problems.append(f"rank {rank}: {a} (action #{pos}) names no peer stage; lower the schedule with "
                                "pipelaunch.pipeline.planner.passes.lowering.lower")
                continue
            direction, send, outgoing = _DIRECTION[kind]
            edge = (a.stage, a.peer) if outgoing else (a.peer, a.stage)
            if edge not in carried:
                problems.append(f"rank {rank}: {a} (action #{pos}) is on no edge of the stage graph "
                                f"({edge[0]} -> {edge[1]})")
                continue
            if placement[a.peer] == rank:
                problems.append(f"rank {rank}: {a} (action #{pos}) talks to stage {a.peer}, which is on this rank")
                continue
            tensors = carried[edge][direction == "B"]
            if tensors:
                mine.append(Group(rank, pos, a, placement[a.peer], send, (direction, *edge, a.mb), tensors))
        out.append(mine)
    if problems:
        raise P2POrderError(_listing(schedule, "has communication actions NCCL cannot run", problems))
    return out


def check_p2p(schedule: Schedule, messages: dict[tuple[int, int], tuple[list[TensorSpec], list[TensorSpec]]]
              ) -> list[list[Group]]:
    """Raise P2POrderError unless `schedule` (lowered) is NCCL-correct; return its groups."""
    groups = groups_of(schedule, messages)
    _check_placement_in_program(schedule, groups, messages)
    _check_pairs(schedule, groups)
    _check_progress(schedule, groups)
    return groups


def check_plan(plan) -> None:
    """`check_p2p` on a Plan's training and evaluation programs."""
    messages = edge_messages(plan.stages)
    for schedule in (plan.schedule, plan.eval_schedule):
        if schedule is not None:
            check_p2p(schedule, messages)


def _listing(schedule: Schedule, what: str, problems: list[str]) -> str:
    more = f"\n  ... and {len(problems) - 12} more" if len(problems) > 12 else ""
    return f"schedule {schedule.name!r} {what}:\n  " + "\n  ".join(problems[:12]) + more


def _check_placement_in_program(schedule: Schedule, groups: list[list[Group]],
                                messages: dict[tuple[int, int], tuple[list[TensorSpec], list[TensorSpec]]]) -> None:
    """Every message a compute needs is received before it on its rank, every message it makes is
    sent after it, each exactly once."""
    wanted = _compute_messages(schedule, messages)
    problems: list[str] = []
    for rank, acts in enumerate(schedule.actions):
        at: tuple[dict, dict] = ({}, {})  # [send] message -> its group on this rank
        for g in groups[rank]:
            if g.message in at[g.send]:
                problems.append(f"rank {rank}: {g.action} (action #{g.position}) posts a message a second time")
            at[g.send][g.message] = g
        for pos, a in enumerate(acts):
            for d, p, c, send in wanted.get((a.kind, a.stage), ()):
                g = at[send].get((d, p, c, a.mb))
                if g is None:
                    problems.append(f"rank {rank}: {a} (action #{pos}) {'makes' if send else 'reads'} a message "
                                    f"no action {'sends' if send else 'receives'} ({d} of edge {p} -> {c}, mb {a.mb})")
                elif send and g.position < pos:
                    problems.append(f"rank {rank}: {g.action} (action #{g.position}) sends before {a} "
                                    f"(action #{pos}) has made it")
                elif not send and g.position > pos:
                    problems.append(f"rank {rank}: {a} (action #{pos}) runs before {g.action} (action "
                                    f"#{g.position}) receives what it reads")
    if problems:
        raise P2POrderError(_listing(schedule, "posts messages where the executor cannot run them", problems))


def _compute_messages(schedule: Schedule, messages: dict[tuple[int, int], tuple[list[TensorSpec], list[TensorSpec]]]
                      ) -> dict[tuple[Kind, int], list[tuple[str, int, int, bool]]]:
    """(compute kind, stage) -> the messages each of its actions reads (send False), then those it
    makes (send True), as (direction, producer, consumer, send): a forward reads its remote inputs
    and makes its remote outputs, a backward (B or I) reads its outputs' gradients and makes its
    inputs'. Edges whose message carries no tensor are left out (nothing is posted for them)."""
    placement = schedule.placement
    into: dict[int, list[tuple[int, int]]] = {}  # stage -> remote edges it reads
    out_of: dict[int, list[tuple[int, int]]] = {}  # stage -> remote edges it feeds
    for (p, c) in messages:
        if placement[p] != placement[c]:
            into.setdefault(c, []).append((p, c))
            out_of.setdefault(p, []).append((p, c))
    wanted: dict[tuple[Kind, int], list[tuple[str, int, int, bool]]] = {}
    for stage in range(schedule.num_stages):
        ins, outs = into.get(stage, []), out_of.get(stage, [])
        wanted[(Kind.F, stage)] = ([("F", p, c, False) for p, c in ins if messages[(p, c)][0]]
                                   + [("F", p, c, True) for p, c in outs if messages[(p, c)][0]])
        if schedule.training:
            backward = ([("B", p, c, False) for p, c in outs if messages[(p, c)][1]]
                        + [("B", p, c, True) for p, c in ins if messages[(p, c)][1]])
            wanted[(Kind.B, stage)] = wanted[(Kind.I, stage)] = backward
    return wanted


def _check_pairs(schedule: Schedule, groups: list[list[Group]]) -> None:
    """The k-th group of A with B is the complement of B's k-th group with A."""
    with_peer: list[dict[int, list[Group]]] = []
    for mine in groups:
        by_peer: dict[int, list[Group]] = {}
        for g in mine:
            by_peer.setdefault(g.peer_rank, []).append(g)
        with_peer.append(by_peer)
    for a, by_peer in enumerate(with_peer):
        for b, ours in sorted(by_peer.items()):
            if b < a:
                continue
            theirs = with_peer[b].get(a, [])
            for k in range(max(len(ours), len(theirs))):
                g = ours[k] if k < len(ours) else None
                h = theirs[k] if k < len(theirs) else None
                if g is not None and h is not None and g.message == h.message and g.send != h.send \
                        and g.tensors == h.tensors:
                    continue
                raise P2POrderError(
                    f"schedule {schedule.name!r} would make ranks {a} and {b} disagree on their P2P group #{k} "
                    f"with each other: rank {a} posts {g.describe() if g else 'nothing more'}, rank {b} posts "
                    f"{h.describe() if h else 'nothing more'}. NCCL ignores tags and matches a pair's "
                    "messages in posting order, so it would "
                    + ("hang waiting for the missing partner" if g is None or h is None else
                       "hand one message's tensors to another (or hang on a size mismatch)")
                    + "; both ends must post the same messages in the same order (pipelaunch.pipeline.planner.passes.lowering.lower "
                    "does so)")


def _check_progress(schedule: Schedule, groups: list[list[Group]]) -> None:
    """Play the program on two streams per rank and raise if some group never meets its partner.

    A rank's groups complete in posting order (a group completes only at the head of its stream),
    so "the groups a compute reads have completed" is "the stream's head is past the last of them"."""
    pp = schedule.pp
    computes = [[(pos, a) for pos, a in enumerate(acts) if a.kind in COMPUTE_KINDS] for acts in schedule.actions]
    # per rank: how many computes a group waits for (all those queued before it), and per compute
    # the last of the groups it reads (-1: none)
    facts = [_stream_facts(schedule.actions[r], groups[r]) for r in range(pp)]
    after, last_read = [f[0] for f in facts], [f[1] for f in facts]
    partner = _partners(groups)
    done = [0] * pp  # computes finished, per rank
    head = [0] * pp  # next group on each rank's P2P stream
    todo = deque(range(pp))
    queued = [True] * pp
    while todo:
        rank = todo.popleft()
        queued[rank] = False
        reads, waits, pairs, n_compute, n_groups = last_read[rank], after[rank], partner[rank], \
            len(computes[rank]), len(groups[rank])
        while True:
            # the compute stream runs while what each compute reads has arrived
            while done[rank] < n_compute and reads[done[rank]] < head[rank]:
                done[rank] += 1
            # a group starts once the compute queued before it has run; it ends with its partner
            gi = head[rank]
            if gi >= n_groups or done[rank] < waits[gi] or pairs[gi] is None:
                break
            orank, ogi = pairs[gi]
            if head[orank] != ogi or done[orank] < after[orank][ogi]:
                break  # the partner's rank looks again when its own stream moves
            head[rank] += 1
            head[orank] += 1
            if not queued[orank]:
                todo.append(orank)
                queued[orank] = True
    if any(head[r] != len(groups[r]) or done[r] != len(computes[r]) for r in range(pp)):
        raise P2POrderError(_deadlock(schedule, groups, computes, partner, head, done))


def _stream_facts(acts: Sequence[Action], mine: list[Group]) -> tuple[list[int], list[int]]:
    """For one rank: per group, the computes posted before it; per compute, the index of the last
    group it reads (-1 when it reads none). One pass over the program."""
    reader: dict[tuple[str, int, int], int] = {}  # ("F"/"B", stage, mb) -> index of the compute reading it
    count = 0
    compute_before: dict[int, int] = {}  # position of a communication action -> computes before it
    for pos, a in enumerate(acts):
        if a.kind in COMPUTE_KINDS:
            if a.kind is Kind.F:
                reader[("F", a.stage, a.mb)] = count
            elif a.kind is Kind.B or a.kind is Kind.I:
                reader[("B", a.stage, a.mb)] = count
            count += 1
        else:
            compute_before[pos] = count
    last = [-1] * count
    for gi, g in enumerate(mine):
        if not g.send:
            direction, producer, consumer, mb = g.message
            ci = reader.get((direction, producer if direction == "B" else consumer, mb))
            if ci is not None:
                last[ci] = max(last[ci], gi)
    return [compute_before[g.position] for g in mine], last


def _partners(groups: list[list[Group]]) -> list[list[tuple[int, int] | None]]:
    """Per group, (rank, index) of the group posting the same message the other way, if any."""
    posted: tuple[dict, dict] = ({}, {})  # [send] message -> (rank, index); the last if posted twice
    for rank, mine in enumerate(groups):
        for gi, g in enumerate(mine):
            posted[g.send][g.message] = (rank, gi)
    return [[posted[not g.send].get(g.message) for g in mine] for mine in groups]


def _deadlock(schedule: Schedule, groups: list[list[Group]], computes: list[list[tuple[int, Action]]],
              partner: list[list[tuple[int, int] | None]], head: list[int], done: list[int]) -> str:
    """Where each rank's streams stand when no group can meet its partner."""
    lines = []
    for rank in range(schedule.pp):
        if head[rank] == len(groups[rank]) and done[rank] == len(computes[rank]):
            lines.append(f"rank {rank}: finished")
            continue
        parts = []
        if done[rank] < len(computes[rank]):
            pos, act = computes[rank][done[rank]]
            parts.append(f"compute stream at {act} (action #{pos})")
        if head[rank] < len(groups[rank]):
            g = groups[rank][head[rank]]
            other = partner[rank][head[rank]]
            if other is None:
                where = "which no rank posts"
            else:
                og = groups[other[0]][other[1]]
                where = f"which rank {og.rank} posts as its {og.action} (action #{og.position})"
            parts.append(f"P2P stream at {g.describe()}, {where}")
        lines.append(f"rank {rank}: " + "; ".join(parts))
    return (f"schedule {schedule.name!r} would deadlock under NCCL (each rank's batched P2P runs in "
            "posting order on one stream, after the compute queued before it):\n  " + "\n  ".join(lines))
