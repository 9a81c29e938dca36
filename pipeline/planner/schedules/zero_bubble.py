"""Zero-bubble schedules (Qi et al., "Zero Bubble Pipeline Parallelism"): ZB-H1 and ZB-H2.

The backward is split into I (gradient of the stage input: on the critical path) and W (gradient
of the weights: can wait). Deferring W fills the bubbles 1F1B leaves in its warm-up and cool-down.

Both schedules here come out of `list_schedule`, a greedy list scheduler that plays the pipeline
forward in time with unit costs (F = I = W = 1, B = 2) and lets every free rank pick the next ready
action by a fixed priority, under a per-rank cap on micro-batches in flight:

1. a backward (I or B) whose inputs are there, earliest micro-batch first;
2. otherwise a forward, if the rank holds fewer than `cap[r]` (stage, micro-batch) pairs;
3. otherwise the oldest pending W.

The cap is the memory knob: 2p - 1 gives ZB-H2. ZB-H1 is written out directly (`zb_h1_programs`),
since a greedy rule does not find its tight cool-down. Because the order is taken from a complete (deadlock-free) play-through, every generated
program is deadlock-free under any costs: the dependencies are the same, only the timing differs.
The same scheduler, with other placements and caps, serves ZBV and Hanayo.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from pipeline.core.errors import ConfigError
from pipeline.core.ir import Action, B, F, I, Kind, W
from pipeline.planner.schedules.base import ScheduleGenerator, require_microbatches_at_least


def list_schedule(
    placement: Sequence[int],
    microbatches: int,
    *,
    split_backward: bool,
    cap: Sequence[int],
    cap_unbackwarded: Sequence[int] | None = None,
    max_deferred_w: Sequence[int] | None = None,
    forward_priority: str = "deepest",
    backward_priority: str = "earliest",
    forward_first: bool = False,
    costs: tuple[float | Sequence[float], float | Sequence[float], float | Sequence[float]] = (1, 1, 1),
    reserve_deeper: bool = False,
    eager_w: bool = False,
) -> list[list[Action]]:
    """Per-rank programs from a greedy unit-cost play-through (see the module docstring).

    `forward_priority`: "deepest" runs the forward of the highest ready stage first (finishes a
    micro-batch sooner, so its memory frees sooner); "earliest" runs the lowest micro-batch first.
    `backward_priority`: which ready backward goes first: "earliest" micro-batch, "deepest" or
    "shallowest" stage. `forward_first` tries a forward before any backward (used by ZBV).
    `cap_unbackwarded` bounds forwarded-but-not-I/B pairs separately; `max_deferred_w` forces a W
    before any forward once more W are pending.
    `costs` are the (F, I, W) durations used for the play-through, each one number or one per
    stage (a measured profile: the play-through then orders actions for the real, uneven stages);
    B costs I + W. `reserve_deeper` keeps one in-flight slot free for each deeper stage of the
    rank that still has forwards to run: with uneven real costs a fast shallow stage could
    otherwise fill the cap before the deeper stage's first input arrives.
    `eager_w` runs each W right after its I while the rank still has forwards to issue (its
    activations and gradients are still in cache, and freed sooner); in the cool-down W is
    deferred as usual to fill the bubbles.
    Raises ConfigError("microbatches", ...) if the caps leave the pipeline stuck.
    """
    num_stages = len(placement)
    pp = max(placement) + 1
    m = microbatches
    cf, ci, cw = (list(c) if isinstance(c, Sequence) else [c] * num_stages for c in costs)
    cb = [i + w for i, w in zip(ci, cw, strict=True)]
    stages_of = [[s for s in range(num_stages) if placement[s] == r] for r in range(pp)]
    if forward_priority == "deepest":
        f_order = [sorted(st, reverse=True) for st in stages_of]
    elif forward_priority == "earliest":
        f_order = [list(st) for st in stages_of]
    else:
        raise ValueError(f"forward_priority must be 'deepest' or 'earliest', got {forward_priority!r}")
    bkeys = {
        "earliest": lambda s, mb: (mb, -s),
        "deepest": lambda s, mb: (-s, mb),
        "shallowest": lambda s, mb: (s, mb),
    }
    bkey = bkeys[backward_priority]
    inf = float("inf")
    f_end = [[inf] * m for _ in range(num_stages)]  # finish time of F(s, mb)
    g_end = [[inf] * m for _ in range(num_stages)]  # finish time of B/I(s, mb)
    next_f = [0] * num_stages
    next_b = [0] * num_stages
    pending_w: list[deque[tuple[int, int]]] = [deque() for _ in range(pp)]
    inflight = [0] * pp
    waiting_b = [0] * pp  # forwarded but not yet I/B: what 1F1B's warm-up bounds
    cap_b = list(cap_unbackwarded) if cap_unbackwarded is not None else list(cap)
    max_w = list(max_deferred_w) if max_deferred_w is not None else [num_stages * m] * pp
    programs: list[list[Action]] = [[] for _ in range(pp)]
    just_i: list[tuple[int, int] | None] = [None] * pp  # eager_w: the I whose W runs next
    releases: list[list[tuple[int, int]]] = [[] for _ in range(pp)]  # (time, rank-local frees)
    remaining = num_stages * m * (3 if split_backward else 2)

    def reserved(r: int, s: int) -> int:
        if not reserve_deeper:
            return 0
        return sum(1 for d in stages_of[r] if d > s and next_f[d] < m and next_f[d] <= next_f[s])

    def pick_f(r: int, t: int) -> tuple[Action, int] | None:
        if inflight[r] < cap[r] and waiting_b[r] < cap_b[r]:
            for s in f_order[r]:
                mb = next_f[s]
                if mb < m and (s == 0 or f_end[s - 1][mb] <= t) and inflight[r] + reserved(r, s) < cap[r]:
                    next_f[s] += 1
                    f_end[s][mb] = t + cf[s]
                    inflight[r] += 1
                    waiting_b[r] += 1
                    return F(s, mb), cf[s]
        return None

    def forwards_left(r: int) -> bool:
        return any(next_f[s] < m for s in stages_of[r])

    def pick(r: int, t: int) -> tuple[Action, int] | None:
        if eager_w and just_i[r] is not None:
            s, mb = just_i[r]
            just_i[r] = None
            pending_w[r].remove((s, mb))
            releases[r].append((t + cw[s], 1))
            return W(s, mb), cw[s]
        if forward_first:
            got = pick_f(r, t)
            if got is not None:
                return got
        best: tuple[int, int] | None = None
        for s in stages_of[r]:
            mb = next_b[s]
            if mb < next_f[s] and f_end[s][mb] <= t and (s + 1 == num_stages or g_end[s + 1][mb] <= t):
                if best is None or bkey(s, mb) < bkey(*best):
                    best = (s, mb)
        if best is not None:
            s, mb = best
            next_b[s] += 1
            waiting_b[r] -= 1
            if split_backward:
                g_end[s][mb] = t + ci[s]
                pending_w[r].append((s, mb))
                if eager_w and forwards_left(r):
                    just_i[r] = (s, mb)
                return I(s, mb), ci[s]
            g_end[s][mb] = t + cb[s]
            releases[r].append((t + cb[s], 1))
            return B(s, mb), cb[s]
        if pending_w[r] and len(pending_w[r]) > max_w[r]:
            s, mb = pending_w[r].popleft()
            releases[r].append((t + cw[s], 1))
            return W(s, mb), cw[s]
        got = pick_f(r, t)
        if got is not None:
            return got
        if pending_w[r]:
            s, mb = pending_w[r].popleft()
            releases[r].append((t + cw[s], 1))
            return W(s, mb), cw[s]
        return None

    # Event loop. A rank that found nothing to do stays asleep until something it waits on
    # changes: its own action ends (which also frees its in-flight slots and makes its pending
    # W runnable), the forward of the stage before one of its stages ends, or the backward of
    # the stage after. Polling every idle rank at every event instead made this O(pp) slower
    # (pp=64 ZBV: 1.7M polls for 49k actions).
    busy: list[tuple[float, int, int, bool]] = []  # heap of (free time, rank, stage, was a forward)
    idle = set(range(pp))
    woken = set(range(pp))
    t = 0
    while remaining:
        for r in sorted(idle):
            if r not in woken:
                continue
            rel = releases[r]
            if rel:
                inflight[r] -= sum(n for when, n in rel if when <= t)
                releases[r] = [x for x in rel if x[0] > t]
            got = pick(r, t)
            if got is not None:
                act, dur = got
                programs[r].append(act)
                remaining -= 1
                idle.discard(r)
                heapq.heappush(busy, (t + dur, r, act.stage, act.kind is Kind.F))
                if dur == 0:  # done already: a later rank of this same pass may use it, as it ends now
                    woken.add(_neighbour_rank(placement, act.stage, act.kind is Kind.F))
        if not remaining:
            break
        if not busy:
            stuck = ", ".join(f"rank {r} after {len(programs[r])} actions" for r in sorted(idle))
            raise ConfigError(
                "microbatches",
                f"the in-flight caps {list(cap)} leave the pipeline stuck ({stuck}); "
                f"raise the cap or change microbatches",
            )
        t = busy[0][0]
        woken = set()
        while busy and busy[0][0] == t:
            _, r, s, forward = heapq.heappop(busy)
            idle.add(r)
            woken.add(r)
            woken.add(_neighbour_rank(placement, s, forward))
    return programs


def _neighbour_rank(placement: Sequence[int], stage: int, forward: bool) -> int:
    """The rank that an action of `stage` ending may unblock: the next stage's after a forward
    (its input), the previous stage's after a backward (its output gradient); -1 for none."""
    neighbour = stage + 1 if forward else stage - 1
    return placement[neighbour] if 0 <= neighbour < len(placement) else -1


def _linear_check(gen: ScheduleGenerator, pp: int, microbatches: int, placement: list[int]) -> None:
    ScheduleGenerator.check(gen, pp, microbatches, placement)
    if list(placement) != list(range(pp)):
        raise ConfigError(
            "placement",
            f"scheduler {gen.name!r} needs one stage per rank in order (placement=linear or auto), "
            f"got {placement}",
        )


def zb_h1_programs(pp: int, microbatches: int) -> list[list[Action]]:
    """ZB-H1 order: 1F1B with B split into I and W, rank r running W(j) only after I(j + r).

    Deferring r weight gradients on rank r is exactly what lets the input-gradient chain of the
    last micro-batches run back to back in the cool-down; with F = I = W the step takes
    3m + p - 1 units (1F1B: 3m + 3(p - 1)), so the idle time per rank is a third of 1F1B's.
    Rank r holds at most p - r micro-batches awaiting I (1F1B's bound) plus r awaiting W.
    """
    m = microbatches
    programs: list[list[Action]] = []
    for r in range(pp):
        warmup = min(pp - 1 - r, m)
        acts: list[Action] = [F(r, j) for j in range(warmup)]

        def backward(j: int, r: int = r, acts: list[Action] = acts) -> None:
            acts.append(I(r, j))
            if j - r >= 0:
                acts.append(W(r, j - r))

        for k in range(m - warmup):
            acts.append(F(r, warmup + k))
            backward(k)
        for k in range(m - warmup, m):
            backward(k)
        acts.extend(W(r, j) for j in range(max(0, m - r), m))
        programs.append(acts)
    return programs


@dataclass
class ZBH1(ScheduleGenerator):
    """ZB-H1: 1F1B's peak memory, a third of its bubble when F = I = W; any microbatches >= 1."""

    name: ClassVar[str] = "zb_h1"
    split_backward: ClassVar[bool] = True

    def check(self, pp: int, microbatches: int, placement: list[int]) -> None:
        _linear_check(self, pp, microbatches, placement)
        require_microbatches_at_least(self.name, microbatches, 1, "it needs at least one micro-batch")

    def compute_actions(self, placement: list[int], microbatches: int) -> list[list[Action]]:
        return zb_h1_programs(len(placement), microbatches)


@dataclass
class ZBH2(ScheduleGenerator):
    """ZB-H2: at most 2p-1 micro-batches per rank; with F = I = W the makespan is the lower bound
    3m + p - 1 from m >= p, and from m >= 2p - 1 each rank is busy without a gap from r to 3m + r
    (the parallelogram whose ends ZB's post-validation overlaps with the optimizer step)."""

    name: ClassVar[str] = "zb_h2"
    split_backward: ClassVar[bool] = True
    #: order actions by a play-through on the measured per-stage costs (else F = I = W units)
    cost_aware: bool = True
    #: run an I and its W as one fused B wherever the simulated step does not grow (schedules/fuse.py)
    fuse_backward: bool = True

    def check(self, pp: int, microbatches: int, placement: list[int]) -> None:
        _linear_check(self, pp, microbatches, placement)
        require_microbatches_at_least(self.name, microbatches, 1, "it needs at least one micro-batch")

    def compute_actions(self, placement: list[int], microbatches: int) -> list[list[Action]]:
        pp = len(placement)
        return self.play_through(list_schedule, placement, microbatches, split_backward=True,
                                 cap=[2 * pp - 1] * pp)
