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
import itertools
import math
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import ClassVar

from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.core.ir import Action, F, I, Kind, W, action_table
from pipelaunch.pipeline.planner.passes.dependencies import Step, Wait, released_stage, wait_table
from pipelaunch.pipeline.planner.schedules.base import (
    Candidate,
    ScheduleCosts,
    ScheduleGenerator,
    require_microbatches_at_least,
)
from pipelaunch.pipeline.planner.schedules.orders import one_f_one_b
from pipelaunch.pipeline.planner.schedules.weight_fill import StageCosts


def list_schedule(
    placement: Sequence[int],
    microbatches: int,
    *,
    split_backward: bool,
    cap: Sequence[int],
    cap_unbackwarded: Sequence[int] | None = None,
    stage_cap: Sequence[int] | None = None,
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
    `cap_unbackwarded` bounds forwarded-but-not-I/B pairs separately, `stage_cap` the same per stage;
    `max_deferred_w` forces a W
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
    if forward_priority not in ("deepest", "earliest"):
        raise ValueError(f"forward_priority must be 'deepest' or 'earliest', got {forward_priority!r}")
    return _ListScheduler(
        placement, microbatches, costs, split_backward=split_backward, cap=cap, cap_unbackwarded=cap_unbackwarded, stage_cap=stage_cap,
        max_deferred_w=max_deferred_w, deepest_forward_first=forward_priority == "deepest",
        backward_key=_BACKWARD_KEYS[backward_priority], forward_first=forward_first, reserve_deeper=reserve_deeper,
        eager_w=eager_w,
    ).run()


#: the order among ready backwards of (stage, mb), by `backward_priority`
_BACKWARD_KEYS: dict[str, Callable[[int, int], tuple[int, int]]] = {
    "earliest": lambda s, mb: (mb, -s),
    "deepest": lambda s, mb: (-s, mb),
    "shallowest": lambda s, mb: (s, mb),
}


class _ListScheduler:
    """One play-through. Time advances from one action end to the next; at each, the ranks that
    may have something new to do pick by the priorities of the module docstring (`_pick`), and
    what they pick is appended to their programs. Readiness follows
    `pipelaunch.pipeline.planner.passes.dependencies` without transfers; `ends` holds when each picked F and B/I
    ends. The options are `list_schedule`'s."""

    def __init__(
        self, placement: Sequence[int], microbatches: int, costs: tuple, *, split_backward: bool,
        cap: Sequence[int], cap_unbackwarded: Sequence[int] | None, stage_cap: Sequence[int] | None,
        max_deferred_w: Sequence[int] | None,
        deepest_forward_first: bool, backward_key: Callable[[int, int], tuple[int, int]], forward_first: bool,
        reserve_deeper: bool, eager_w: bool,
    ) -> None:
        self.placement, self.m = placement, microbatches
        self.num_stages = n = len(placement)
        self.pp = pp = max(placement) + 1
        self.split_backward, self.forward_first, self.reserve_deeper, self.eager_w = (
            split_backward, forward_first, reserve_deeper, eager_w)
        self.cap = list(cap)
        self.cap_unbackwarded = list(cap_unbackwarded) if cap_unbackwarded is not None else list(cap)
        self.stage_cap = list(stage_cap) if stage_cap is not None else [microbatches] * n
        self.max_deferred_w = list(max_deferred_w) if max_deferred_w is not None else [n * microbatches] * pp
        self.backward_key = backward_key
        self.cf, self.ci, self.cw = (list(c) if isinstance(c, Sequence) else [c] * n for c in costs)
        self.cb = [i + w for i, w in zip(self.ci, self.cw, strict=True)]
        self.stages_of = [[s for s in range(n) if placement[s] == r] for r in range(pp)]
        self.f_order = [sorted(st, reverse=True) if deepest_forward_first else list(st) for st in self.stages_of]
        #: ends[step][stage * m + mb]: when the picked action completing that step ends (inf: not picked)
        self.ends = [[math.inf] * (n * microbatches) for _ in Step]
        self.f_ends, self.g_ends = self.ends[Step.FORWARD], self.ends[Step.INPUT_GRAD]
        waits = wait_table(n)  # the play-through has no transfers
        self.f_checks = [self._checks(w) for w in waits[(Kind.F, False)]]
        self.b_checks = [self._checks(w) for w in waits[(Kind.I, False)]]
        #: released_rank[kind][stage]: the rank of the other stage whose action an end may let start, -1 for none
        self.released_rank = {kind: [placement[x] if x is not None else -1
                                     for x in (released_stage(kind, s, n) for s in range(n))]
                              for kind in (Kind.F, Kind.B, Kind.I, Kind.W)}
        self.next_f = [0] * n
        self.next_b = [0] * n
        self.pending_w: list[deque[tuple[int, int]]] = [deque() for _ in range(pp)]
        self.inflight = [0] * pp
        self.waiting_b = [0] * pp  # forwarded but not yet I/B: what 1F1B's warm-up bounds
        self.just_i: list[tuple[int, int] | None] = [None] * pp  # eager_w: the I whose W runs next
        self.releases: list[list[tuple[float, int]]] = [[] for _ in range(pp)]  # (time, in-flight slots freed)
        self.programs: list[list[Action]] = [[] for _ in range(pp)]
        self.remaining = n * microbatches * (3 if split_backward else 2)
        #: the actions it picks from, at stage * m + mb
        self.acts = {kind: action_table(kind, n, microbatches) for kind in (Kind.F, Kind.B, Kind.I, Kind.W)}

    def _checks(self, waits: tuple[Wait, ...]) -> tuple[tuple[list[float], int], ...]:
        """A stage's waits as (the ends of their step, the offset of their stage): an action of
        micro-batch mb may start at t when ends[offset + mb] <= t for each."""
        assert all(w.delay == 0 for w in waits)
        return tuple((self.ends[w.step], w.stage * self.m) for w in waits)

    # Event loop. A rank that found nothing to do stays asleep until something it waits on
    # changes: its own action ends (which also frees its in-flight slots and makes its pending
    # W runnable), or an action ends that `released_stage` says may let one of its stages start.
    # Polling every idle rank at every event instead made this O(pp) slower (pp=64 ZBV: 1.7M
    # polls for 49k actions).

    def run(self) -> list[list[Action]]:
        self.busy: list[tuple[float, int, int]] = []  # heap of (free time, rank, the rank its action may release)
        self.idle = set(range(self.pp))
        woken = set(range(self.pp))
        t: float = 0
        while True:
            self._start_woken(t, woken)
            if not self.remaining:
                return self.programs
            if not self.busy:
                raise self._stuck()
            t, woken = self._next_ends()

    def _start_woken(self, t: float, woken: set[int]) -> None:
        """Let each woken idle rank, lowest first, pick and start its next action at `t`."""
        turn = sorted(woken & self.idle)  # a sorted list is a heap
        while turn:
            r = heapq.heappop(turn)
            if self.releases[r]:
                self._release_slots(r, t)
            got = self._pick(r, t)
            if got is None:
                continue
            act, dur = got
            self.programs[r].append(act)
            self.remaining -= 1
            self.idle.discard(r)
            released = self.released_rank[act.kind][act.stage]
            heapq.heappush(self.busy, (t + dur, r, released))
            if dur == 0 and released > r and released in self.idle and released not in woken:
                woken.add(released)  # done already: a later rank of this same pass may use it, as it ends now
                heapq.heappush(turn, released)

    def _next_ends(self) -> tuple[float, set[int]]:
        """Advance to the next action end; the ranks it frees and those it may let start."""
        t = self.busy[0][0]
        woken = set()
        while self.busy and self.busy[0][0] == t:
            _, r, released = heapq.heappop(self.busy)
            self.idle.add(r)
            woken.add(r)
            woken.add(released)
        return t, woken

    def _release_slots(self, r: int, t: float) -> None:
        """Give back the in-flight slots of the rank's B and W that have ended by `t`."""
        rel = self.releases[r]
        self.inflight[r] -= sum(n for when, n in rel if when <= t)
        self.releases[r] = [x for x in rel if x[0] > t]

    def _stuck(self) -> ConfigError:
        stuck = ", ".join(f"rank {r} after {len(self.programs[r])} actions" for r in sorted(self.idle))
        return ConfigError(
            "microbatches",
            f"the in-flight caps {self.cap} leave the pipeline stuck ({stuck}); "
            f"raise the cap or change microbatches",
        )

    # Picking: what a free rank runs next, by the priorities of the module docstring.

    def _pick(self, r: int, t: float) -> tuple[Action, float] | None:
        if self.eager_w and self.just_i[r] is not None:
            return self._eager_w(r, t)
        if self.forward_first:
            got = self._pick_forward(r, t)
            if got is not None:
                return got
        best = self._ready_backward(r, t)
        if best is not None:
            return self._start_backward(r, t, *best)
        if self.pending_w[r] and len(self.pending_w[r]) > self.max_deferred_w[r]:
            return self._deferred_w(r, t)
        got = self._pick_forward(r, t)
        if got is not None:
            return got
        if self.pending_w[r]:
            return self._deferred_w(r, t)
        return None

    def _pick_forward(self, r: int, t: float) -> tuple[Action, float] | None:
        inflight, cap = self.inflight[r], self.cap[r]
        if inflight >= cap or self.waiting_b[r] >= self.cap_unbackwarded[r]:
            return None
        next_f, f_checks, m = self.next_f, self.f_checks, self.m
        for s in self.f_order[r]:
            mb = next_f[s]
            if mb >= m or mb - self.next_b[s] >= self.stage_cap[s]:
                continue
            for ends, offset in f_checks[s]:
                if ends[offset + mb] > t:  # its input is not there yet
                    break
            else:  # ready: all it waits for ended by t
                if self.reserve_deeper and inflight + self._reserved(r, s) >= cap:
                    continue
                next_f[s] += 1
                self.f_ends[s * m + mb] = t + self.cf[s]
                self.inflight[r] += 1
                self.waiting_b[r] += 1
                return self.acts[Kind.F][s * m + mb], self.cf[s]
        return None

    def _reserved(self, r: int, s: int) -> int:
        """In-flight slots kept for the rank's deeper stages that still have forwards to run."""
        next_f = self.next_f
        return sum(1 for d in self.stages_of[r] if d > s and next_f[d] < self.m and next_f[d] <= next_f[s])

    def _ready_backward(self, r: int, t: float) -> tuple[int, int] | None:
        """The (stage, mb) of the rank's ready backward that goes first, if any."""
        key, next_b, next_f, b_checks = self.backward_key, self.next_b, self.next_f, self.b_checks
        best: tuple[int, int] | None = None
        for s in self.stages_of[r]:
            mb = next_b[s]
            if mb >= next_f[s]:
                continue
            for ends, offset in b_checks[s]:
                if ends[offset + mb] > t:  # its F or the next stage's gradient is not there yet
                    break
            else:  # ready: all it waits for ended by t
                if best is None or key(s, mb) < key(*best):
                    best = (s, mb)
        return best

    def _start_backward(self, r: int, t: float, s: int, mb: int) -> tuple[Action, float]:
        self.next_b[s] += 1
        self.waiting_b[r] -= 1
        if self.split_backward:
            self.g_ends[s * self.m + mb] = t + self.ci[s]
            self.pending_w[r].append((s, mb))
            if self.eager_w and any(self.next_f[d] < self.m for d in self.stages_of[r]):
                self.just_i[r] = (s, mb)
            return self.acts[Kind.I][s * self.m + mb], self.ci[s]
        self.g_ends[s * self.m + mb] = t + self.cb[s]
        self.releases[r].append((t + self.cb[s], 1))
        return self.acts[Kind.B][s * self.m + mb], self.cb[s]

    def _eager_w(self, r: int, t: float) -> tuple[Action, float]:
        """The W of the I the rank just ran."""
        s, mb = self.just_i[r]  # type: ignore[misc]
        self.just_i[r] = None
        self.pending_w[r].remove((s, mb))
        return self._start_w(r, t, s, mb)

    def _deferred_w(self, r: int, t: float) -> tuple[Action, float]:
        """The rank's oldest pending W."""
        s, mb = self.pending_w[r].popleft()
        return self._start_w(r, t, s, mb)

    def _start_w(self, r: int, t: float, s: int, mb: int) -> tuple[Action, float]:
        self.releases[r].append((t + self.cw[s], 1))
        return self.acts[Kind.W][s * self.m + mb], self.cw[s]


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


#: how far past a gap a weight-gradient pass may run (`weight_fill`'s alpha): inf fills only gaps it
#: fits, smaller values also start W in shorter gaps; each is a candidate (most promising first),
#: the fastest is kept
ALPHAS = (0.5, math.inf, 0.0, 1.0)

#: stage-micro-batches above which the greedy play-through is not tried as one more candidate (it
#: is the slow one, and at that size the templates win): plans for p = 64 stay within seconds
GREEDY_LIMIT = 8192


def greedy_candidate(gen: ScheduleGenerator, placement: list[int], microbatches: int, costs: ScheduleCosts | None,
                     **play) -> list[Candidate]:
    """The list scheduler's play-through (module docstring) as one finished candidate, where the
    schedule is small enough; none above GREEDY_LIMIT."""
    if len(placement) * microbatches > GREEDY_LIMIT:
        return []
    programs = gen.play_through(list_schedule, placement, microbatches, costs, split_backward=True, **play)
    return [Candidate(programs)]


def fill_warmup(costs: StageCosts, pp: int) -> list[int]:
    """Per rank of a linear pipeline, how many forwards it can run before micro-batch 0's input
    gradient reaches it (micro-batch 0 forwarded down and its gradient passed back up, hops
    included): the warm-up that leaves no gap before its first backward."""
    f, i, hop = costs.forward, costs.input_grad, costs.hop
    arrive = [0.0] * pp
    for r in range(1, pp):
        arrive[r] = arrive[r - 1] + f[r - 1] + hop[r - 1]
    grad = [0.0] * pp
    grad[pp - 1] = arrive[pp - 1] + f[pp - 1]
    for r in range(pp - 2, -1, -1):
        grad[r] = grad[r + 1] + i[r + 1] + hop[r]
    return [max(1, int((grad[r] - arrive[r]) / f[r] + 1e-9)) if f[r] > 0 else pp for r in range(pp)]


#: how far each rank's warm-up goes from 1F1B's (0) to the one that fills the time to its first
#: input gradient (1), most promising first
WARMUP_MIX = (1.0, 0.5, 0.75, 0.25, 0.0)
#: the same from the tight warm-up (one forward fewer), tried first (`linear_candidates`)
TIGHT_MIX = (1.0, 0.9)


def _mixed(top: Sequence[int], x: float, cap: int) -> tuple[int, ...]:
    """Per rank of a linear pipeline, a warm-up x of the way from 1F1B's (p - 1 - r) to `top[r]`,
    leaving a slot under `cap` for the forward one_f_one_b runs after it."""
    pp = len(top)
    return tuple(max(0, min(cap - 1, round(x * top[r] + (1 - x) * (pp - 1 - r)))) for r in range(pp))


def linear_candidates(costs: StageCosts, pp: int, microbatches: int, caps: Sequence[int]) -> Iterator[Candidate]:
    """ZB-H1/ZB-H2 orders on `costs` (the generator's `stage_costs`), most promising first: under
    each of `caps` micro-batches per rank, the tight warm-up and its taper (TIGHT_MIX), then warm-ups
    from 1F1B's to the one that fills the time to the first input gradient (WARMUP_MIX), each with the
    W placed by every ALPHAS, then with each rank's W backlog bounded by what fills its drain (rank r
    waits about r input-gradient hops for the last gradient: ZB-H1's r deferred W at unit costs).

    The tight warm-up ends each rank's forwards before its first input gradient arrives (one forward
    fewer than the filling one, whose last forward runs past that arrival): a rank then idles a
    little, but never delays the gradient the ranks before it wait for. On the Zero Bubble paper's
    profiles those delays added up along the pipeline (0.2 to 1.5 points over the published ZB-H2
    rates) until this order was tried. Where the cap clips the first ranks' warm-ups (p=32, m=256,
    slow hops), every rank at its cap makes each step wait for the gradient chain (1.5x the step);
    tapering the others' warm-ups a little toward 1F1B's avoids it."""
    backlog = [math.ceil(r * (costs.input_grad[r] + (costs.hop[r] if r < pp - 1 else 0.0))
                         / max(costs.weight_grad[r], 1e-12)) for r in range(pp)]
    fill = fill_warmup(costs, pp)
    tight = [f - 1 for f in fill]  # one_f_one_b runs warm-up + 1 forwards before the first backward
    for limit in (None, backlog):
        for cap in caps:
            warmups = dict.fromkeys([*(_mixed(tight, x, cap) for x in TIGHT_MIX),
                                     *(_mixed(fill, x, cap) for x in WARMUP_MIX)])
            for w in warmups:
                order = one_f_one_b(pp, microbatches, list(w))
                yield from (Candidate(order, [cap] * pp, alpha, backlog=limit) for alpha in ALPHAS)


@dataclass(frozen=True)
class ZBH1(ScheduleGenerator):
    """ZB-H1: 1F1B's peak memory, a third of its bubble when F = I = W; any microbatches >= 1."""

    name: ClassVar[str] = "zb_h1"
    split_backward: ClassVar[bool] = True

    def check(self, pp: int, microbatches: int, placement: list[int]) -> None:
        _linear_check(self, pp, microbatches, placement)
        require_microbatches_at_least(self.name, microbatches, 1, "it needs at least one micro-batch")

    #: order and place the W on the measured per-stage costs (else F = I = W units)
    cost_aware: bool = True

    def compute_actions(self, placement: list[int], microbatches: int, costs: ScheduleCosts | None = None,
                        *, first_order: bool = False) -> list[list[Action]]:
        pp = len(placement)
        fixed = Candidate(zb_h1_programs(pp, microbatches))
        candidates = linear_candidates(self.stage_costs(pp, costs), pp, microbatches, [pp])
        return self.best_filled(itertools.chain([fixed], candidates), placement, microbatches, costs, first_order)


@dataclass(frozen=True)
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
    #: micro-batches a rank may hold (F to W); None: ZB-H2's 2p - 1. The Zero Bubble paper's
    #: automatic ZB-2p is given 2p: where more forwards than 2p - 1 fit before rank 0's first input
    #: gradient returns (many stages, slow hops), one more slot shortens its wait
    in_flight: int | None = None

    def check(self, pp: int, microbatches: int, placement: list[int]) -> None:
        _linear_check(self, pp, microbatches, placement)
        require_microbatches_at_least(self.name, microbatches, 1, "it needs at least one micro-batch")
        if self.in_flight is not None and (isinstance(self.in_flight, bool) or not isinstance(self.in_flight, int)
                                           or self.in_flight < pp):
            raise ConfigError("scheduler.in_flight", f"got {self.in_flight!r}; valid: null (2p - 1 = {2 * pp - 1}, "
                                                     f"ZB-H2's) or an integer >= pp = {pp} (2p = {2 * pp}: the "
                                                     "memory of the Zero Bubble paper's ZB-2p)")

    def compute_actions(self, placement: list[int], microbatches: int, costs: ScheduleCosts | None = None,
                        *, first_order: bool = False) -> list[list[Action]]:
        pp = len(placement)
        cap = 2 * pp - 1 if self.in_flight is None else self.in_flight
        greedy = greedy_candidate(self, placement, microbatches, costs, cap=[cap] * pp)
        candidates = linear_candidates(self.stage_costs(pp, costs), pp, microbatches, [cap, pp])
        return self.best_filled(itertools.chain(greedy, candidates), placement, microbatches, costs, first_order)
