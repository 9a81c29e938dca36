"""Fuse an I and its W back into one B wherever the split buys nothing.

Why: splitting a backward into I and W costs extra work (autograd runs twice over the stage and
the weight-gradient nodes are restarted one by one: about 5-10% of the backward on gpt_bench
blocks). The split pays off only where the input gradient is on the critical path: in the
warm-up and cool-down of a zero-bubble schedule. In the steady state of ZBV a rank's I is
usually followed right away by its own W (the eager-W order) and the rank downstream has other
work until it needs that gradient, so running both as one fused B loses nothing.

The pass walks each rank's program in order and replaces an adjacent `I(s, mb) W(s, mb)` by
`B(s, mb)` when the simulator finds the step shorter, or as long with no rank's span (first start to
last end) longer. B is priced as profiled when the profile
timed both (`planner/measure/profile.py`: the split costs 4-7% more on gpt_bench stages), else at I + W
(no credit for the saving); either way the real run is then faster by what the fused backward saves.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipelaunch.pipeline.core.ir import Action, Kind
from pipelaunch.pipeline.planner.predict.simulate import simulate_programs

#: above this many (pair x action) simulations the pass is skipped: it stays well under a second
#: for the schedules people train with, and plan mode must answer for pp=64 in seconds
MAX_WORK = 400_000


def _is_pair(acts: list[Action], i: int) -> bool:
    """acts[i] is an I immediately followed by its own W."""
    a = acts[i]
    return a.kind is Kind.I and i + 1 < len(acts) and acts[i + 1] == Action(a.stage, Kind.W, a.mb)


def _count_pairs(programs: list[list[Action]], enough: int) -> int:
    """The I/W pairs of the programs, counted up to `enough` (past it the pass is skipped anyway:
    at pp=64 with 256 micro-batches counting them all took 0.05 s)."""
    pairs = 0
    for acts in programs:
        for i in range(len(acts)):
            if _is_pair(acts, i):
                pairs += 1
                if pairs >= enough:
                    return pairs
    return pairs


def fuse_slack_backwards(
    programs: list[list[Action]], placement: Sequence[int], microbatches: int, costs: tuple,
    backward: list[float] | None = None, hop: Sequence[float] | None = None,
) -> list[list[Action]]:
    """Programs with I/W pairs fused into B wherever the simulated step does not grow (B costing
    `backward` per stage when given, else I + W; `hop[s]`: the transfer over the cut after stage s,
    as the orders were chosen on: a fusion that is free on free links can lengthen the step on slow ones)."""
    total = sum(len(acts) for acts in programs)
    pairs = _count_pairs(programs, MAX_WORK // max(total, 1) + 1)
    if not pairs or pairs * total > MAX_WORK:
        return programs
    programs = [list(acts) for acts in programs]
    best = _step(programs, placement, microbatches, costs, backward, hop)
    for r, acts in enumerate(programs):
        i = 0
        while i < len(acts):  # the list shrinks as pairs fuse
            if _is_pair(acts, i):
                a = acts[i]
                trial = acts[:i] + [Action(a.stage, Kind.B, a.mb)] + acts[i + 2 :]
                got = _step(programs[:r] + [trial] + programs[r + 1 :], placement, microbatches, costs, backward, hop)
                shorter = got[0] < best[0] * (1 - 1e-9)
                if shorter or (got[0] <= best[0] * (1 + 1e-9) and got[1] <= best[1] * (1 + 1e-12)):
                    programs[r] = acts = trial
                    best = (min(best[0], got[0]), got[1])
            i += 1
    return programs


def _step(programs, placement, microbatches, costs, backward, hop) -> tuple[float, float]:
    """The simulated step and the longest span of a rank (what overlapping steps cost): a fusion must
    shorten the step, or keep it and not lengthen that span."""
    sim = simulate_programs(programs, placement, microbatches, costs, backward, hop)
    return sim.makespan_s, sim.longest_span_s
