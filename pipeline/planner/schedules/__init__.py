"""Schedule generators (one module per family) and `build_schedule`, which applies one."""

from __future__ import annotations

from collections.abc import Collection

from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.core.ir import Action, Kind, R, Schedule
from pipelaunch.pipeline.planner.schedules.base import ScheduleCosts, ScheduleGenerator

REMAT_CHOICES = ("none", "selective", "full", "stage", "auto")


def insert_recompute(actions: list[list[Action]], stages: Collection[int] | None = None) -> list[list[Action]]:
    """Rematerialisation: put R(s, mb) right before the first backward action of (s, mb), for every
    stage or only for `stages`."""
    out: list[list[Action]] = []
    for acts in actions:
        seen: set[tuple[int, int]] = set()
        prog: list[Action] = []
        for act in acts:
            if (act.kind in (Kind.B, Kind.I) and (act.stage, act.mb) not in seen
                    and (stages is None or act.stage in stages)):
                seen.add((act.stage, act.mb))
                prog.append(R(act.stage, act.mb))
            prog.append(act)
        out.append(prog)
    return out


def build_schedule(
    generator: ScheduleGenerator, placement: list[int], microbatches: int, remat: str = "none",
    remat_stages: Collection[int] = (), costs: ScheduleCosts | None = None, *, first_order: bool = False,
) -> Schedule:
    """Check the generator's rules, generate compute actions on `costs` (None: unit costs; with
    `first_order`, the generator's first feasible candidate order), and add recomputation if asked:
    `remat=full` on every stage, `remat=auto` on `remat_stages` (what the planner chose to fit
    the memory budget)."""
    if remat not in REMAT_CHOICES:
        raise ConfigError("remat", f"got {remat!r}; valid: {', '.join(REMAT_CHOICES)}")
    pp = max(placement) + 1
    generator.check(pp, microbatches, list(placement))
    actions = generator.compute_actions(list(placement), microbatches, costs, first_order=first_order)
    if remat == "stage":
        if not generator.training:
            raise ConfigError("remat", f"scheduler {generator.name!r} runs no backward; use remat=none")
        actions = insert_recompute(actions)
    elif remat == "auto" and remat_stages and generator.training:
        actions = insert_recompute(actions, set(remat_stages))
    meta = {"remat": remat, "split_backward": generator.split_backward}
    pairs = generator.overlapped(list(placement), microbatches)
    if pairs:  # run back to back as one overlapped action (DualPipeV): "0F4+1B2"
        meta["overlapped"] = [f"{f}+{b}" for f, b in pairs]
    return Schedule(
        name=generator.name,
        num_stages=len(placement),
        num_microbatches=microbatches,
        placement=list(placement),
        actions=actions,
        training=generator.training,
        meta=meta,
    )
