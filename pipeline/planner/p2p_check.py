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

from bisect import bisect_left
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from pipeline.core.ir import Action, Kind, Schedule

SENDS = (Kind.SEND_F, Kind.SEND_B)
RECVS = (Kind.RECV_F, Kind.RECV_B)
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
    out: list[list[Group]] = []
    problems: list[str] = []
    for rank, acts in enumerate(schedule.actions):
        mine: list[Group] = []
        for pos, a in enumerate(acts):
            if a.kind not in SENDS and a.kind not in RECVS:
                continue
            if a.peer is None:
                problems.append(f"rank {rank}: {a} (action #{pos}) names no peer stage; lower the schedule with "
                                "pipeline.planner.lowering.lower")
                continue
            forward = a.kind in (Kind.SEND_F, Kind.RECV_F)
            producer, consumer = ((a.stage, a.peer) if a.kind in (Kind.SEND_F, Kind.RECV_B) else (a.peer, a.stage))
            if (producer, consumer) not in messages:
                problems.append(f"rank {rank}: {a} (action #{pos}) is on no edge of the stage graph "
                                f"({producer} -> {consumer})")
                continue
            if placement[a.peer] == rank:
                problems.append(f"rank {rank}: {a} (action #{pos}) talks to stage {a.peer}, which is on this rank")
                continue
            fwd, bwd = messages[(producer, consumer)]
            tensors = tuple(fwd if forward else bwd)
            if not tensors:
                continue
            mine.append(Group(rank, pos, a, placement[a.peer], a.kind in SENDS,
                              ("F" if forward else "B", producer, consumer, a.mb), tensors))
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
    placement = schedule.placement
    into: dict[int, list[tuple[int, int]]] = {}  # stage -> remote edges it reads
    out_of: dict[int, list[tuple[int, int]]] = {}  # stage -> remote edges it feeds
    for (p, c) in messages:
        if placement[p] != placement[c]:
            into.setdefault(c, []).append((p, c))
            out_of.setdefault(p, []).append((p, c))
    problems: list[str] = []
    for rank, acts in enumerate(schedule.actions):
        at: dict[tuple, Group] = {}
        for g in groups[rank]:
            key = g.message + (g.send,)
            if key in at:
                problems.append(f"rank {rank}: {g.action} (action #{g.position}) posts a message a second time")
            at[key] = g
        for pos, a in enumerate(acts):
            if a.kind is Kind.F:
                needs = [("F", p, c, a.mb, False) for p, c in into.get(a.stage, ()) if messages[(p, c)][0]]
                makes = [("F", p, c, a.mb, True) for p, c in out_of.get(a.stage, ()) if messages[(p, c)][0]]
            elif a.kind in (Kind.B, Kind.I) and schedule.training:
                needs = [("B", p, c, a.mb, False) for p, c in out_of.get(a.stage, ()) if messages[(p, c)][1]]
                makes = [("B", p, c, a.mb, True) for p, c in into.get(a.stage, ()) if messages[(p, c)][1]]
            else:
                continue
            for key in needs:
                g = at.get(key)
                if g is None:
                    problems.append(f"rank {rank}: {a} (action #{pos}) reads a message no action receives "
                                    f"({key[0]} of edge {key[1]} -> {key[2]}, mb {key[3]})")
                elif g.position > pos:
                    problems.append(f"rank {rank}: {a} (action #{pos}) runs before {g.action} (action "
                                    f"#{g.position}) receives what it reads")
            for key in makes:
                g = at.get(key)
                if g is None:
                    problems.append(f"rank {rank}: {a} (action #{pos}) makes a message no action sends "
                                    f"({key[0]} of edge {key[1]} -> {key[2]}, mb {key[3]})")
                elif g.position < pos:
                    problems.append(f"rank {rank}: {g.action} (action #{g.position}) sends before {a} "
                                    f"(action #{pos}) has made it")
    if problems:
        raise P2POrderError(_listing(schedule, "posts messages where the executor cannot run them", problems))


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
                    + "; both ends must post the same messages in the same order (pipeline.planner.lowering.lower "
                    "does so)")


def _check_progress(schedule: Schedule, groups: list[list[Group]]) -> None:
    """Play the program on two streams per rank and raise if some group never meets its partner."""
    pp = schedule.pp
    computes = [[(pos, a) for pos, a in enumerate(acts) if a.is_compute] for acts in schedule.actions]
    # per rank: how many computes a group waits for before it starts (all those queued before it),
    # and per compute the receive groups it reads
    after: list[list[int]] = []
    waits: list[list[list[int]]] = []
    for rank, mine in enumerate(groups):
        positions = [pos for pos, _ in computes[rank]]
        after.append([bisect_left(positions, g.position) for g in mine])
        reader = _readers(schedule, rank)
        ci_of = {pos: ci for ci, pos in enumerate(positions)}
        reads: list[list[int]] = [[] for _ in positions]
        for gi, g in enumerate(mine):
            if not g.send:
                pos = reader.get((g.message[0], g.message[1] if g.message[0] == "B" else g.message[2], g.message[3]))
                if pos is not None:
                    reads[ci_of[pos]].append(gi)
        waits.append(reads)
    index: dict[tuple, tuple[int, int]] = {}
    for rank, mine in enumerate(groups):
        for gi, g in enumerate(mine):
            index[(*g.message, g.send)] = (rank, gi)
    partner: list[list[tuple[int, int] | None]] = [
        [index.get((*g.message, not g.send)) for g in mine] for mine in groups]

    done_compute = [0] * pp  # computes finished, per rank
    head = [0] * pp  # next group on each rank's P2P stream
    complete = [[False] * len(g) for g in groups]
    todo = deque(range(pp))
    queued = [True] * pp
    while todo:
        rank = todo.popleft()
        queued[rank] = False
        mine, reads, done, n_compute = complete[rank], waits[rank], done_compute, len(computes[rank])
        while True:
            # the compute stream runs while what each compute reads has arrived
            while done[rank] < n_compute and all(mine[gi] for gi in reads[done[rank]]):
                done[rank] += 1
            # a group starts once the compute queued before it has run; it ends with its partner
            gi = head[rank]
            if gi >= len(mine) or done[rank] < after[rank][gi]:
                break
            other = partner[rank][gi]
            if other is None:
                break
            orank, ogi = other
            if head[orank] != ogi or done[orank] < after[orank][ogi]:
                break  # the partner's rank looks again when its own stream moves
            mine[gi] = complete[orank][ogi] = True
            head[rank] += 1
            head[orank] += 1
            if not queued[orank]:
                todo.append(orank)
                queued[orank] = True
    if all(head[r] == len(groups[r]) and done_compute[r] == len(computes[r]) for r in range(pp)):
        return
    lines = []
    for rank in range(pp):
        if head[rank] == len(groups[rank]) and done_compute[rank] == len(computes[rank]):
            lines.append(f"rank {rank}: finished")
            continue
        parts = []
        if done_compute[rank] < len(computes[rank]):
            pos, act = computes[rank][done_compute[rank]]
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
    raise P2POrderError(f"schedule {schedule.name!r} would deadlock under NCCL (each rank's batched P2P runs in "
                        "posting order on one stream, after the compute queued before it):\n  " + "\n  ".join(lines))


def _readers(schedule: Schedule, rank: int) -> dict[tuple[str, int, int], int]:
    """("F", stage, mb) -> position of the forward reading stage's inputs; ("B", stage, mb) ->
    position of the backward (B or I) reading its output gradients."""
    out = {}
    for pos, a in enumerate(schedule.actions[rank]):
        if a.kind is Kind.F:
            out[("F", a.stage, a.mb)] = pos
        elif a.kind in (Kind.B, Kind.I):
            out[("B", a.stage, a.mb)] = pos
    return out
