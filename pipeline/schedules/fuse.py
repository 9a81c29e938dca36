"""Fuse an I and its W back into one B wherever the split buys nothing.

Why: splitting a backward into I and W costs extra work (autograd runs twice over the stage and
the weight-gradient nodes are restarted one by one: about 5-10% of the backward on gpt_bench
blocks). The split pays off only where the input gradient is on the critical path: in the
warm-up and cool-down of a zero-bubble schedule. In the steady state of ZBV a rank's I is
usually followed right away by its own W (the eager-W order) and the rank downstream has other
work until it needs that gradient, so running both as one fused B loses nothing.

The pass walks each rank's program in order and replaces an adjacent `I(s, mb) W(s, mb)` by
`B(s, mb)` when the simulator, pricing B at I + W (no credit for the saving), finds the step no
longer. The real run is then faster by whatever the fused backward saves.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipeline.ir import Action, Kind, Schedule

#: above this many (pair x action) simulations the pass is skipped: it stays well under a second
#: for the schedules people train with, and plan mode must answer for pp=64 in seconds
MAX_WORK = 400_000


def fuse_slack_backwards(
    programs: list[list[Action]], placement: Sequence[int], microbatches: int, costs: tuple
) -> list[list[Action]]:
    """Programs with I/W pairs fused into B wherever the simulated step does not grow."""
    from pipeline.schedules.base import makespan

    pairs = [(r, i) for r, acts in enumerate(programs) for i, a in enumerate(acts[:-1])
             if a.kind is Kind.I and acts[i + 1] == Action(a.stage, Kind.W, a.mb)]
    actions = sum(len(acts) for acts in programs)
    if not pairs or len(pairs) * actions > MAX_WORK:
        return programs
    programs = [list(acts) for acts in programs]
    best = makespan(programs, placement, microbatches, costs)
    for r in range(len(programs)):
        i = 0
        while i < len(programs[r]) - 1:
            a = programs[r][i]
            if a.kind is Kind.I and programs[r][i + 1] == Action(a.stage, Kind.W, a.mb):
                trial = list(programs[r])
                trial[i : i + 2] = [Action(a.stage, Kind.B, a.mb)]
                candidate = programs[:r] + [trial] + programs[r + 1 :]
                span = makespan(candidate, placement, microbatches, costs)
                if span <= best * (1 + 1e-9):
                    programs[r], best = trial, min(best, span)
            i += 1
    return programs


def count_fused(schedule: Schedule) -> int:
    """How many backwards of a split-backward schedule run fused (as B)."""
    return sum(1 for acts in schedule.actions for a in acts if a.kind is Kind.B)
