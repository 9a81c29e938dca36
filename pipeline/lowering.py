"""Derive sends and receives from compute actions and the placement: the one place P2P is decided.

Rule: a stage's inputs come from the stage before it, its output gradients from the stage after
it. When that neighbour lives on another rank, a RECV goes right before the consuming compute
action and a SEND right after the producing one. Neighbours on the same rank exchange tensors in
memory, with no action.

Non-sequential stage graphs (skip connections) are handled by `edges`: the producer->consumer
stage pairs. By default each stage feeds the next one.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from pipeline.ir import Action, Kind, Schedule

FORWARD_CONSUMERS = (Kind.F, Kind.R)
BACKWARD_KINDS = (Kind.B, Kind.I)


def sequential_edges(num_stages: int) -> list[tuple[int, int]]:
    return [(s, s + 1) for s in range(num_stages - 1)]


def lower(schedule: Schedule, edges: Iterable[tuple[int, int]] | None = None) -> Schedule:
    """Return a copy of `schedule` with SEND/RECV actions inserted for cross-rank edges.

    A RECV_F(s, mb) / RECV_B(s, mb) action receives *all* cross-rank inputs of stage s (resp. all
    gradients of its cross-rank outputs) for that micro-batch; SEND_F / SEND_B send all of them.
    The recompute action R never receives: it reuses the stage inputs kept by F.
    """
    if schedule.lowered:
        return schedule
    edge_list = list(edges) if edges is not None else sequential_edges(schedule.num_stages)
    placement: Sequence[int] = schedule.placement
    producers: dict[int, list[int]] = {s: [] for s in range(schedule.num_stages)}
    consumers: dict[int, list[int]] = {s: [] for s in range(schedule.num_stages)}
    for src, dst in edge_list:
        producers[dst].append(src)
        consumers[src].append(dst)

    # Precomputed once per stage: lowering big schedules (pp=64, hundreds of micro-batches) stays fast.
    has_remote_in = [any(placement[p] != placement[s] for p in producers[s]) for s in range(schedule.num_stages)]
    has_remote_out = [any(placement[c] != placement[s] for c in consumers[s]) for s in range(schedule.num_stages)]

    def remote_in(stage: int) -> bool:
        return has_remote_in[stage]

    def remote_out(stage: int) -> bool:
        return has_remote_out[stage]

    lowered: list[list[Action]] = []
    for acts in schedule.actions:
        out: list[Action] = []
        for act in acts:
            if act.kind is Kind.F:
                if remote_in(act.stage):
                    out.append(Action(act.stage, Kind.RECV_F, act.mb))
                out.append(act)
                if remote_out(act.stage):
                    out.append(Action(act.stage, Kind.SEND_F, act.mb))
            elif act.kind in BACKWARD_KINDS and schedule.training:
                if remote_out(act.stage):
                    out.append(Action(act.stage, Kind.RECV_B, act.mb))
                out.append(act)
                if remote_in(act.stage):
                    out.append(Action(act.stage, Kind.SEND_B, act.mb))
            else:
                out.append(act)
        lowered.append(out)
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
