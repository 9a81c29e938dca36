"""When a job fails or hangs: what every rank was executing or waiting on, from its heartbeat.

A stuck rank cannot say where it is, and its peers only know that their own wait timed out. The
heartbeat files (`pipeline/runtime/heartbeat.py`) outlive the ranks, so the launcher can print,
per rank, its step, the action (with the peer it waits on) and for how long, then the schedule
program of each rank around that action:

    rank 0 (pp 0, dp 0): step 2, RECV_F stage 1 mb 0 from rank 1, for 10.2 s
    rank 1 (pp 1, dp 0): step 2, hung on purpose (debug.hang_rank), for 10.3 s

On NCCL the host does not wait for a receive (the GPU does), so a heartbeat says how far the host
got, not what the GPU was stuck in; torch's flight recorder dump (pipeline/runtime/flight_recorder.py)
says that, and is folded in under each rank:

    rank 0 (pp 0, dp 0): step 2, SEND_F stage 0 mb 3 to rank 1, for 121.0 s
      on NCCL: recv from rank 1, [4, 8, 32] BFloat16 (P2P #5), started, not completed; 3 more queued behind it
"""

from __future__ import annotations

from pathlib import Path

from pipelaunch.pipeline.core.ir import Action, Kind
from pipelaunch.pipeline.core.layout import Coordinates
from pipelaunch.pipeline.core.plan import Plan
from pipelaunch.pipeline.runtime import flight_recorder, heartbeat

WINDOW = 3  # actions shown on each side of the current one


def _peers(plan: Plan, action: Action, at: Coordinates) -> str:
    """` from rank 3` / ` to rank 3`: the global rank at the other end of a message action (the
    pipeline rank holding the peer stage, at this rank's dp, cp and tp coordinates)."""
    if action.kind not in (Kind.RECV_F, Kind.SEND_B, Kind.RECV_B, Kind.SEND_F) or action.peer is None:
        return ""
    word = "from" if action.kind in (Kind.RECV_F, Kind.RECV_B) else "to"
    return f" {word} rank {plan.layout.rank(at.dp, plan.stages[action.peer].rank, at.cp, at.tp)}"


def short(action: Action) -> str:
    """`0F1` for compute actions (the schedule grid's notation), `RECV_B(0,1<1)` for messages: stage,
    micro-batch and the stage at the other end."""
    if action.kind in (Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B):
        arrow = "" if action.peer is None else ("<" if action.kind in (Kind.RECV_F, Kind.RECV_B) else ">")
        return f"{action.kind.name}({action.stage},{action.mb}{arrow}{'' if action.peer is None else action.peer})"
    return str(action)


def describe(plan: Plan, schedule_actions: list[Action], index: int, at: Coordinates) -> str:
    action = schedule_actions[index]
    return f"{action.kind.name} stage {action.stage} mb {action.mb}{_peers(plan, action, at)}"


def where_ranks_were(directory: Path, plan: Plan, flight: str | Path | None = None,
                     since: float | None = None) -> str:
    """The per-rank report, or '' when no rank left a heartbeat or a flight recorder dump.
    `flight`: the dump prefix of a run on NCCL (`flight_recorder.dump_prefix`); dumps older than
    `since` (a time.time(), the job's start) belong to an earlier run and are ignored."""
    world = plan.world_size
    beats = {r: heartbeat.read(directory, r) for r in range(world)}
    nccl = flight_recorder.where_ranks(flight, since) if flight is not None else {}
    if not any(beats.values()) and not nccl:
        return ""
    lines, around = ["where each rank was:"], []
    for rank, beat in beats.items():
        at = plan.layout.coordinates(rank)
        more = "".join(f", {axis} {getattr(at, axis)}" for axis in ("cp", "tp") if getattr(plan, axis) > 1)
        head = f"rank {rank} (pp {at.pp}, dp {at.dp}{more})"
        on_nccl = [f"    on NCCL: {nccl[rank]}"] if rank in nccl else []
        if beat is None:
            lines += [f"  {head}: no heartbeat (it never started)" if not on_nccl else f"  {head}: no heartbeat",
                      *on_nccl]
            continue
        acts = plan.schedule.actions[at.pp]
        if beat["action"] is not None and 0 <= beat["action"] < len(acts):
            what = describe(plan, acts, beat["action"], at)
            lo, hi = max(0, beat["action"] - WINDOW), min(len(acts), beat["action"] + WINDOW + 1)
            shown = [f"[{short(a)}]" if i == beat["action"] else short(a) for i, a in enumerate(acts[lo:hi], start=lo)]
            around.append(f"  rank {rank}: {'... ' if lo else ''}{' '.join(shown)}{' ...' if hi < len(acts) else ''}")
        else:
            what = beat["phase"]
        lines += [f"  {head}: step {beat['step']}, {what}, for {beat['for_s']:.1f} s", *on_nccl]
    if around:
        lines += ["each rank's program around that action ([..] = the one it was on):", *around]
    return "\n".join(lines)
