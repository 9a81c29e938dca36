"""Discrete-event simulation of a schedule against a cost model: makespan, bubbles, peak memory.

Why a simulator: it is how a schedule is validated (every (stage, micro-batch) forwarded and
backwarded exactly once, on the right rank, without deadlock) and how `scheduler=auto` and the
post-run report predict a run without starting processes.

Semantics (the same contract the executor follows):

* A rank runs its actions strictly in program order; one action at a time.
* An action starts once what it waits for has finished, by the rules of
  `pipelaunch.pipeline.planner.passes.dependencies` (F after the previous stage's F, B/I after its own F, R and the
  next stage's B/I, W after its I, R after its F), plus a transfer where the wait crosses ranks.
* Sends are asynchronous: a transfer of `output_bytes[s]` takes `latency_s + bytes / bandwidth`
  and never blocks the sender. Links have no contention (each transfer is independent).
  A lowered schedule's RECV actions are therefore implied by the compute dependencies.

Memory accounting per rank (activation memory only, weights excluded):

* F(s, mb) holds `activation_bytes[s]` from its start, or only `input_bytes[s]` when (s, mb) is
  rematerialised (it has an R action); R(s, mb) then adds `activation_bytes[s]` again.
* B frees everything held by (s, mb). I frees `input_grad_freed_bytes[s]` of the stage's
  activations (by default all but the share `held_after_input_grad` that stands for what the
  weight gradient still needs) and adds `weight_stash_bytes[s]`, the gradients captured where W
  restarts; W frees the rest and the stash, together with any inputs.
* A lowered program also holds its P2P buffers: a receive from its post to the compute that
  reads it, a send from its producer's end until its transfer is over (`_in_flight`).
* `peak_activation_microbatches` counts (stage, micro-batch) pairs holding activations (F done
  without remat, or R done) that are not yet fully freed; pairs holding only their remat inputs
  do not count.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property, partial
from operator import itemgetter
from typing import NamedTuple

from pipelaunch.pipeline.core.ir import Action, Kind, Schedule, overlapped_pairs
from pipelaunch.pipeline.planner.passes.dependencies import (
    COMPLETES,
    READS,
    Progress,
    Step,
    Wait,
    needs,
    remat_pairs,
    wait_table,
)

COMPUTE = (Kind.F, Kind.B, Kind.I, Kind.W, Kind.R)


class ScheduleError(ValueError):
    """A schedule is incomplete, misplaced or deadlocks; the message names the actions."""


@dataclass
class CostModel:
    """Per-stage costs (seconds, bytes) and a link model. A fused backward B costs `backward_s`
    when it was measured (running I and W as one pass is cheaper than the two apart), else I + W."""

    forward_s: list[float]
    backward_input_s: list[float]
    backward_weight_s: list[float]
    recompute_s: list[float] | None = None
    activation_bytes: list[float] | None = None
    input_bytes: list[float] | None = None
    output_bytes: list[float] | None = None
    latency_s: float = 0.0
    bandwidth_bytes_per_s: float = math.inf
    backward_s: list[float] | None = None
    #: share of a stage's activations still held between its I and its W
    held_after_input_grad: float = 0.5
    #: bytes a stage's I adds per micro-batch for its W (the gradients W restarts from)
    weight_stash_bytes: list[float] | None = None
    #: bytes of its activations a stage's I frees per micro-batch (default: all but
    #: `held_after_input_grad` of them)
    input_grad_freed_bytes: list[float] | None = None
    #: per micro-batch, the factor on every compute action's time (data.buckets: its length over
    #: model.seq_len); None: every micro-batch alike. Memory stays priced at the full length.
    microbatch_scale: list[float] | None = None
    #: per cross-rank edge (producer stage, consumer stage): the bytes of its forward message and of
    #: the gradient message back (only floating-point values carry one); None: each message of a
    #: stage priced at its stage's whole `output_bytes` / `input_bytes`
    edge_bytes: dict[tuple[int, int], tuple[float, float]] | None = None
    #: under ep > 1 with moe.overlap: per stage, the seconds of its expert all-to-alls in one
    #: micro-batch's forward (the same again in its backward), inside its compute times; with it,
    #: each forward the program follows with another stage's backward (`overlapped_pairs`) runs
    #: beside it, each side's exchanges hidden behind the other's compute. None: one at a time.
    overlap_exchange_s: list[float] | None = None

    def __post_init__(self) -> None:
        n = len(self.forward_s)
        if self.backward_s is None:
            self.backward_s = [i + w for i, w in zip(self.backward_input_s, self.backward_weight_s, strict=False)]
        if self.recompute_s is None:
            self.recompute_s = list(self.forward_s)
        if self.activation_bytes is None:
            self.activation_bytes = [1.0] * n
        if self.input_bytes is None:
            self.input_bytes = [0.0] * n
        if self.output_bytes is None:
            self.output_bytes = [0.0] * n
        if self.weight_stash_bytes is None:
            self.weight_stash_bytes = [0.0] * n
        if self.input_grad_freed_bytes is None:
            self.input_grad_freed_bytes = [a * (1.0 - self.held_after_input_grad) for a in self.activation_bytes]
        for label in ("backward_input_s", "backward_weight_s", "backward_s", "recompute_s", "activation_bytes",
                      "input_bytes", "output_bytes", "weight_stash_bytes", "input_grad_freed_bytes"):
            if len(getattr(self, label)) != n:
                raise ValueError(f"CostModel.{label} has {len(getattr(self, label))} entries, expected {n}")

    @property
    def num_stages(self) -> int:
        return len(self.forward_s)

    @classmethod
    def uniform(
        cls,
        num_stages: int,
        f: float = 1.0,
        i: float = 1.0,
        w: float = 1.0,
        r: float | None = None,
        activation_bytes: float = 1.0,
        input_bytes: float = 0.0,
        output_bytes: float = 0.0,
        latency_s: float = 0.0,
        bandwidth_bytes_per_s: float = math.inf,
    ) -> CostModel:
        """Every stage alike: the textbook setting in which bubble formulas are stated."""
        n = num_stages
        return cls(
            forward_s=[f] * n,
            backward_input_s=[i] * n,
            backward_weight_s=[w] * n,
            recompute_s=[f if r is None else r] * n,
            activation_bytes=[activation_bytes] * n,
            input_bytes=[input_bytes] * n,
            output_bytes=[output_bytes] * n,
            latency_s=latency_s,
            bandwidth_bytes_per_s=bandwidth_bytes_per_s,
        )

    def resplit(self, num_stages: int) -> CostModel:
        """The same model cut into `num_stages` equal parts (cost assumed uniform inside a stage).

        Lets one profile compare schedules that need different stage counts (1F1B vs ZBV).
        """
        if num_stages == self.num_stages:
            return self
        n = self.num_stages

        def spread(values: Sequence[float]) -> list[float]:
            # Stage j of the new split covers [j*n/S, (j+1)*n/S) of the old stages, pro rata.
            out = []
            for j in range(num_stages):
                lo, hi = j * n / num_stages, (j + 1) * n / num_stages
                total = 0.0
                for k in range(int(lo), min(n, math.ceil(hi))):
                    total += values[k] * max(0.0, min(hi, k + 1) - max(lo, k))
                out.append(total)
            return out

        def boundary(values: Sequence[float]) -> list[float]:
            # What crosses the cut after new stage j: the output of the old stage holding the cut.
            return [values[min(n - 1, max(0, math.ceil((j + 1) * n / num_stages) - 1))]
                    for j in range(num_stages)]

        return CostModel(
            forward_s=spread(self.forward_s),
            backward_input_s=spread(self.backward_input_s),
            backward_weight_s=spread(self.backward_weight_s),
            backward_s=spread(self.backward_s or []),
            recompute_s=spread(self.recompute_s or self.forward_s),
            activation_bytes=spread(self.activation_bytes or []),
            input_bytes=boundary(self.input_bytes or []),
            output_bytes=boundary(self.output_bytes or []),
            latency_s=self.latency_s,
            bandwidth_bytes_per_s=self.bandwidth_bytes_per_s,
            held_after_input_grad=self.held_after_input_grad,
            weight_stash_bytes=spread(self.weight_stash_bytes or []),
            input_grad_freed_bytes=spread(self.input_grad_freed_bytes or []),
        )

    def transfer_s(self, nbytes: float) -> float:
        if math.isinf(self.bandwidth_bytes_per_s):
            return self.latency_s
        return self.latency_s + nbytes / self.bandwidth_bytes_per_s


@dataclass
class SimResult:
    """What a simulated step looks like; per-rank lists are indexed by pipeline rank."""

    makespan_s: float
    busy_s: list[float]
    #: idle share of the makespan per rank (includes the unavoidable ramp at either end).
    bubble: list[float]
    #: idle share between the rank's first start and last end (the part a schedule controls).
    internal_bubble: list[float]
    #: a makespan no schedule can beat on this cost model (fill time of the first micro-batch + work).
    lower_bound_s: float
    peak_activation_bytes: list[float]
    peak_activation_microbatches: list[int]
    #: per rank, when its activation bytes first reach their peak (the events of that instant up to
    #: the one that reaches it: frees before allocations)
    peak_time_s: list[float] = field(default_factory=list)
    #: builds `events` the first time they are read: generators comparing candidates never read
    #: them (200k dicts at pp=64), a dry run draws them
    event_source: Callable[[], list[dict]] | None = field(default=None, repr=False, compare=False)
    #: builds `compute_spans` the first time they are read (the data-parallel pricing does)
    ends_source: Callable[[], list[list[float]]] | None = field(default=None, repr=False, compare=False)

    @cached_property
    def compute_spans(self) -> list[list[tuple[float, float]]]:
        """Per rank, when each action of its compute program starts and ends, in program order."""
        source, self.ends_source = self.ends_source, None
        return source() if source is not None else []

    @cached_property
    def events(self) -> list[dict]:
        """Each compute action that ran: {rank, action, kind, stage, mb, start_s, end_s}, by rank
        then start."""
        source, self.event_source = self.event_source, None
        return source() if source is not None else []

    @property
    def mean_bubble(self) -> float:
        return sum(self.bubble) / len(self.bubble) if self.bubble else 0.0

    @property
    def excess_bubble(self) -> float:
        """Share of the makespan above `lower_bound_s`: 0 means only the unavoidable pipeline fill."""
        return 1.0 - self.lower_bound_s / self.makespan_s if self.makespan_s > 0 else 0.0

    @property
    def idle_s(self) -> list[float]:
        return [self.makespan_s - b for b in self.busy_s]

    @property
    def longest_span_s(self) -> float:
        """The longest time from a rank's first start to its last end: what a step costs when
        consecutive steps overlap (nothing joins the ranks between them)."""
        return max((b / (1.0 - i) for b, i in zip(self.busy_s, self.internal_bubble, strict=True) if i < 1.0),
                   default=0.0)

    def summary(self) -> dict:
        return {
            "makespan_s": self.makespan_s,
            "bubble": self.mean_bubble,
            "excess_bubble": self.excess_bubble,
            "max_bubble": max(self.bubble, default=0.0),
            "peak_activation_bytes": max(self.peak_activation_bytes, default=0.0),
            "peak_activation_microbatches": max(self.peak_activation_microbatches, default=0),
        }


def pair_s(exchange_s: Sequence[float], f_stage: int, f_s: float, b_stage: int, b_s: float) -> float:
    """An overlapped pair's time (`CostModel.overlap_exchange_s`): both computes, plus what of
    each side's exchanges the other side's compute does not cover; never less than either alone."""
    a_f, a_b = min(exchange_s[f_stage], f_s), min(exchange_s[b_stage], b_s)
    f_c, b_c = f_s - a_f, b_s - a_b
    return max(f_c + b_c + max(0.0, a_f - b_c) + max(0.0, a_b - f_c), f_s, b_s)


def validate(schedule: Schedule) -> None:
    """Check completeness and placement: one F and one backward (B, or I and W) per (stage, mb).

    Raises ScheduleError naming the offending actions. Ordering problems show up as deadlocks in
    `simulate`.
    """
    placement = schedule.placement
    num_stages, m = schedule.num_stages, schedule.num_microbatches
    problems: list[str] = []
    if len(schedule.actions) != max(placement) + 1:
        problems.append(f"{len(schedule.actions)} rank programs for a placement over {max(placement) + 1} ranks")
    # counts[kind][stage * m + mb]
    counts = {k: [0] * (num_stages * m) for k in COMPUTE}
    for rank, acts in enumerate(schedule.actions):
        for act in acts:
            kind = act.kind
            if kind not in counts:
                continue
            s, mb = act.stage, act.mb
            if not (0 <= s < num_stages and 0 <= mb < m):
                problems.append(f"{act} on rank {rank} is out of range ({num_stages} stages, {m} micro-batches)")
                continue
            if placement[s] != rank:
                problems.append(f"{act} runs on rank {rank} but stage {s} lives on rank {placement[s]}")
            counts[kind][s * m + mb] += 1
    cf, cb, ci, cw, cr = (counts[k] for k in (Kind.F, Kind.B, Kind.I, Kind.W, Kind.R))
    for idx in range(num_stages * m):
        s, mb = divmod(idx, m)
        if cf[idx] != 1:
            problems.append(f"{s}F{mb} appears {cf[idx]} times (expected once)")
        nb, ni, nw, nr = cb[idx], ci[idx], cw[idx], cr[idx]
        if not schedule.training:
            if nb or ni or nw or nr:
                problems.append(f"forward-only schedule has backward/recompute actions for stage {s} mb {mb}")
            continue
        if not ((nb == 1 and ni == 0 and nw == 0) or (nb == 0 and ni == 1 and nw == 1)):
            problems.append(f"stage {s} mb {mb} has B x{nb}, I x{ni}, W x{nw} "
                            f"(expected one {s}B{mb}, or one {s}I{mb} and one {s}W{mb})")
        if nr > 1:
            problems.append(f"{s}R{mb} appears {nr} times (expected at most once)")
    if problems:
        shown = problems[:20]
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise ScheduleError(f"schedule {schedule.name!r} is invalid:\n  " + "\n  ".join(shown) + more)


def transfer_delays(schedule: Schedule, cost: CostModel) -> list[float]:
    """Per stage s: the delay from s finishing to its neighbour s+1 (forward) or s (backward)
    being able to use the result; zero where both live on one rank."""
    placement, n = schedule.placement, schedule.num_stages
    out_b = cost.output_bytes or [0.0] * n
    return [cost.transfer_s(out_b[s]) if s + 1 < n and placement[s] != placement[s + 1] else 0.0 for s in range(n)]


def simulate(schedule: Schedule, cost: CostModel, check: bool = True, memory: bool = True) -> SimResult:
    """Run `schedule` on `cost`; raises ScheduleError if it is invalid or deadlocks. Without
    `memory` the activations are not tracked (the peaks come out 0): for callers comparing steps."""
    # Lowering would only add SEND/RECV actions whose effect the dependencies already model, so an
    # unlowered schedule is simulated as is (this keeps pp=64 x hundreds of micro-batches fast);
    # a lowered one has its communication actions skipped.
    if check:
        validate(schedule)
    if cost.num_stages != schedule.num_stages:
        raise ValueError(f"cost model has {cost.num_stages} stages, schedule {schedule.num_stages}")
    play = _Play(schedule, cost, memory)
    play.run()
    if schedule.lowered and memory:
        _in_flight(schedule, cost, play.raw_events, play.mem_events)
    return play.result()


def compute_end_times(schedule: Schedule, cost: CostModel) -> list[list[float]]:
    """Per rank, when each action of its compute program ends (program order), unchecked: the
    play of `simulate` without the result (events, peaks), for callers that need only the times
    (`pipelaunch.pipeline.planner.passes.lowering.causal_order`). Raises ScheduleError on a deadlock."""
    return [[end for _, end in spans] for spans in compute_spans(schedule, cost)]


def compute_spans(schedule: Schedule, cost: CostModel) -> list[list[tuple[float, float]]]:
    """Per rank, when each action of its compute program starts and ends (program order), unchecked."""
    play = _Play(schedule, cost)
    play.run()
    return _compute_spans(play.raw_events, play.programs)


def _compute_spans(raw_events: list[tuple[int, int, float, float]],
                   programs: list[list[Action]]) -> list[list[tuple[float, float]]]:
    spans = [[(0.0, 0.0)] * len(program) for program in programs]
    for rank, i, start, end in raw_events:
        spans[rank][i] = (start, end)
    return spans


#: memory events: (time, order, bytes, micro-batches); at one instant frees (order 0) come first
_FREE, _ALLOC = 0, 1


class _Effect(NamedTuple):
    """What an action of one kind on one stage does in the simulation, whatever its micro-batch."""

    waits: tuple[Wait, ...]
    completes: int  # the `Step` its end fills in
    duration: float
    #: its memory event: (at its end rather than its start, order, bytes, micro-batches); None if
    #: the schedule is forward-only
    memory: tuple[bool, int, float, int] | None


class _Play:
    """One simulated step: every rank runs its compute program in order, each action starting once
    the rules of `pipelaunch.pipeline.planner.passes.dependencies` allow it; the loop follows ranks as they unblock."""

    def __init__(self, schedule: Schedule, cost: CostModel, memory: bool = True) -> None:
        self.schedule, self.cost, self.memory = schedule, cost, memory
        pp = schedule.pp
        # Programs are compute-only: RECVs are implied by dependencies, SENDs are asynchronous.
        self.programs = [[a for a in acts if a.kind in COMPLETES] for acts in schedule.actions]
        self.remat = remat = remat_pairs(self.programs)
        self.effects: list[_Effect] = []
        starts: dict[tuple[Kind, bool], int] = {}  # where each (kind, remat)'s effects (one per stage) begin
        for key, per_stage in self._effects().items():
            starts[key] = len(self.effects)
            self.effects.extend(per_stage)
        offset = {kind: (starts[(kind, False)], starts[(kind, True)]) for kind in COMPLETES}
        #: per rank, its program as (stage, mb, index in `effects`): plain ints, so that the garbage
        #: collector untracks them (tuples holding objects made full collections run mid-play)
        self.jobs = [[(a.stage, a.mb, offset[a.kind][bool(remat) and (a.stage, a.mb) in remat] + a.stage)
                      for a in acts] for acts in self.programs]
        self.progress = Progress(schedule.num_stages, schedule.num_microbatches)
        self.pos = [0] * pp
        self.free_at = [0.0] * pp
        self.busy = [0.0] * pp
        self.first = [math.inf] * pp
        self.last = [0.0] * pp
        self.mem_events: list[list[tuple[float, int, float, int]]] = [[] for _ in range(pp)]
        self.raw_events: list[tuple[int, int, float, float]] = []  # (rank, index in program, start, end)
        self.remaining = sum(len(p) for p in self.programs)
        #: per rank, the program positions of forwards run as a pair with the action after them
        self.pairs = [set() for _ in range(pp)]
        if cost.overlap_exchange_s is not None and schedule.training:
            for rank, acts in enumerate(schedule.actions):
                index = {id(a): i for i, a in enumerate(self.programs[rank])}
                self.pairs[rank] = {index[id(acts[p])] for p in overlapped_pairs(acts)}

    def _pair_s(self, f_stage: int, f_s: float, b_stage: int, b_s: float) -> float:
        assert self.cost.overlap_exchange_s is not None
        return pair_s(self.cost.overlap_exchange_s, f_stage, f_s, b_stage, b_s)

    def _start(self, waits, mb: int, free_at: float) -> float | None:
        """When an action may start on a rank free at `free_at`; None while a wait is unmet."""
        ended, m = self.progress.end, self.progress.m
        start = free_at
        for w_step, w_stage, delay in waits:
            t = ended[w_step][w_stage * m + mb]
            if t is None:
                return None
            start = max(start, t + delay)
        return start

    def _effects(self) -> dict[tuple[Kind, bool], list[_Effect]]:
        """effects[(kind, rematerialised)][stage]: waits from the dependency rules, costs and memory."""
        schedule, cost = self.schedule, self.cost
        waits = wait_table(schedule.num_stages, transfer_delays(schedule, cost))
        durations = {Kind.F: cost.forward_s, Kind.B: cost.backward_s, Kind.I: cost.backward_input_s,
                     Kind.W: cost.backward_weight_s, Kind.R: cost.recompute_s}
        table: dict[tuple[Kind, bool], list[_Effect]] = {}
        for (kind, remat), per_stage in waits.items():
            if not schedule.training:  # forward-only: every action costs and completes a forward (no memory)
                table[(kind, remat)] = [_Effect(per_stage[s], Step.FORWARD, cost.forward_s[s], None)
                                        for s in range(schedule.num_stages)]
            else:
                table[(kind, remat)] = [_Effect(per_stage[s], COMPLETES[kind], durations[kind][s],  # type: ignore[index]
                                                self._memory(kind, s, remat) if self.memory else None)
                                        for s in range(schedule.num_stages)]
        return table

    def _memory(self, kind: Kind, s: int, remat: bool) -> tuple[bool, int, float, int]:
        """The memory event of a training action (see the module docstring's accounting)."""
        cost = self.cost
        act_b, in_b = cost.activation_bytes, cost.input_bytes
        stash_b, freed_b = cost.weight_stash_bytes, cost.input_grad_freed_bytes
        assert act_b is not None and in_b is not None and stash_b is not None and freed_b is not None
        if kind is Kind.F:
            return (False, _ALLOC, in_b[s] if remat else act_b[s], 0 if remat else 1)
        if kind is Kind.B:
            return (True, _FREE, -(act_b[s] + (in_b[s] if remat else 0.0)), -1)
        if kind is Kind.I:
            return (True, _FREE, stash_b[s] - freed_b[s], 0)
        if kind is Kind.W:
            return (True, _FREE, -(act_b[s] - freed_b[s] + stash_b[s] + (in_b[s] if remat else 0.0)), -1)
        return (False, _ALLOC, act_b[s], 1)  # R

    def run(self) -> None:
        """Play every rank as far as it goes; raise ScheduleError if some never finish."""
        ready = list(range(self.schedule.pp))
        while ready:
            ready.extend(self._advance(ready.pop()))
        if self.remaining:
            raise ScheduleError(self._deadlock_message())

    def _advance(self, rank: int) -> list[int]:
        """Run `rank`'s next actions until one must wait; the ranks whose waits its actions ended."""
        prog, pos, mem, events = self.jobs[rank], self.pos[rank], self.mem_events[rank], self.raw_events
        effects = self.effects
        # `Progress.earliest_start` and `finish` inlined (this loop runs once per action of every play)
        ended, waiting, m = self.progress.end, self.progress.waiting, self.progress.m
        scale = self.cost.microbatch_scale
        start0, free_at, busy = pos, self.free_at[rank], self.busy[rank]
        woken: list[int] = []
        pairs = self.pairs[rank]
        while pos < len(prog):
            s, mb, e = prog[pos]
            waits, step, duration, memory = effects[e]
            if pos in pairs:  # DualPipe's overlapped pair: both start once both may, end together
                s2, mb2, e2 = prog[pos + 1]
                waits2, step2, duration2, memory2 = effects[e2]
                if scale is not None:
                    duration, duration2 = duration * scale[mb], duration2 * scale[mb2]
                start, start2 = self._start(waits, mb, free_at), self._start(waits2, mb2, free_at)
                if start is None or start2 is None:
                    blocked = (waits, mb) if start is None else (waits2, mb2)
                    self.progress.earliest_start(blocked[0], blocked[1], free_at, rank)
                    break
                start = max(start, start2)
                free_at = end = start + self._pair_s(s, duration, s2, duration2)
                for (st, m_, w, stp, mem_ev) in ((s, mb, 0, step, memory), (s2, mb2, 1, step2, memory2)):
                    if mem_ev is not None:
                        at_end, order, nbytes, count = mem_ev
                        mem.append((end if at_end else start, order, nbytes, count))
                    events.append((rank, pos + w, start, end))
                    idx = st * m + m_
                    ended[stp][idx] = end
                    if waiting[stp][idx] is not None:
                        woken.extend(waiting[stp][idx])
                        waiting[stp][idx] = None
                busy += end - start
                if pos == 0:
                    self.first[rank] = start
                pos += 2
                continue
            if scale is not None:
                duration *= scale[mb]
            start = free_at
            for w_step, w_stage, delay in waits:
                t = ended[w_step][w_stage * m + mb]
                if t is None:
                    start = None
                    break
                if t + delay > start:
                    start = t + delay
            if start is None:
                self.progress.earliest_start(waits, mb, free_at, rank)  # notes the rank as waiting
                break
            free_at = end = start + duration
            if memory is not None:
                at_end, order, nbytes, count = memory
                mem.append((end if at_end else start, order, nbytes, count))
            busy += duration
            if pos == 0:  # a rank's starts never decrease: its first is its earliest
                self.first[rank] = start
            events.append((rank, pos, start, end))
            pos += 1
            idx = s * m + mb
            ended[step][idx] = end
            waiters = waiting[step]
            if waiters[idx] is not None:  # `Progress.woken` inlined
                woken.extend(waiters[idx])
                waiters[idx] = None
        if pos > start0:
            self.pos[rank], self.free_at[rank], self.last[rank], self.busy[rank] = pos, free_at, free_at, busy
            self.remaining -= pos - start0
        return woken

    def result(self) -> SimResult:
        pp, busy, first, last = self.schedule.pp, self.busy, self.first, self.last
        makespan = max(last, default=0.0)
        bubble = [(makespan - b) / makespan if makespan > 0 else 0.0 for b in busy]
        internal = []
        for r in range(pp):
            span = last[r] - first[r] if busy[r] > 0 else 0.0
            internal.append(max(0.0, (span - busy[r]) / span) if span > 0 else 0.0)
        peaks = [_peak(events) for events in self.mem_events]
        return SimResult(
            makespan_s=makespan,
            busy_s=busy,
            bubble=bubble,
            internal_bubble=internal,
            lower_bound_s=_lower_bound(self.schedule, self.cost, busy),
            peak_activation_bytes=[b for b, _, _ in peaks],
            peak_activation_microbatches=[n for _, n, _ in peaks],
            peak_time_s=[t for _, _, t in peaks],
            event_source=partial(_event_dicts, self.raw_events, self.programs),
            ends_source=partial(_compute_spans, self.raw_events, self.programs),
        )

    def _deadlock_message(self) -> str:
        placement, num_stages = self.schedule.placement, self.schedule.num_stages
        lines = [f"schedule {self.schedule.name!r} deadlocks: no rank can progress"]
        for rank, prog in enumerate(self.programs):
            if self.pos[rank] >= len(prog):
                lines.append(f"  rank {rank}: finished")
                continue
            act = prog[self.pos[rank]]
            s, mb = act.stage, act.mb
            missing = [f"{n.stage}{n.label}{mb} (rank {placement[n.stage]})"
                       for n in needs(act.kind, s, num_stages, (s, mb) in self.remat)
                       if not self.progress.finished(n.step, n.stage, mb)]
            lines.append(f"  rank {rank}: stuck at {act} (action #{self.pos[rank]}), waiting for {', '.join(missing)}")
        return "\n".join(lines)


def _event_dicts(raw_events: list[tuple[int, int, float, float]], programs: list[list[Action]]) -> list[dict]:
    """The played actions as the report's event dicts (`SimResult.events`)."""
    raw_events.sort(key=lambda e: (e[0], e[2]))
    kind_str = {k: k.value for k in Kind}  # a dict lookup is cheaper than the enum's property
    events = []
    for rank, i, start, end in raw_events:
        act = programs[rank][i]
        kind = kind_str[act.kind]
        events.append({"rank": rank, "action": f"{act.stage}{kind}{act.mb}", "kind": kind, "stage": act.stage,
                       "mb": act.mb, "start_s": start, "end_s": end})
    return events


def _peak(events: list[tuple[float, int, float, int]]) -> tuple[float, int, float]:
    """The most bytes and activation-holding micro-batches a rank's memory events reach at once,
    and when the bytes first reach theirs."""
    cur_b = cur_n = 0.0
    best_b = best_n = best_t = 0.0
    for t, _order, db, dn in sorted(events, key=itemgetter(0, 1)):  # stable: ties keep their order
        cur_b += db
        cur_n += dn
        if cur_b > best_b:
            best_b, best_t = cur_b, t
        if cur_n > best_n:
            best_n = cur_n
    return best_b, int(best_n), best_t


def _in_flight(schedule: Schedule, cost: CostModel, raw_events: list[tuple[int, int, float, float]],
               mem_events: list[list[tuple[float, int, float, int]]]) -> None:
    """Add the P2P buffers of a lowered program to each rank's memory: a receive buffer from the
    moment its group is posted (when the compute before it in the program ends) until the
    compute that reads it starts, and a sent tensor from the end of the compute that made it
    until its transfer is over (the runtime releases it then)."""
    starts: list[dict[int, float]] = [{} for _ in schedule.actions]  # [rank][index in compute program]
    ends: list[dict[int, float]] = [{} for _ in schedule.actions]
    for rank, i, start, end in raw_events:
        starts[rank][i] = start
        ends[rank][i] = end
    message_bytes = _message_bytes(schedule, cost)
    sizes: dict[tuple[Kind, int, int | None], tuple[float, float]] = {}  # per (kind, stage, peer): bytes, transfer
    for rank, acts in enumerate(schedule.actions):
        started, ended = starts[rank], ends[rank]
        # receives are posted after the rest: at one instant the events of one order share a sign,
        # so the peak does not depend on their order
        post = mem_events[rank].append
        reader: dict[tuple[Step, int, int], int] = {}  # (what a compute action completes) -> its index
        receives = []  # (posted at, bytes, what reads it): matched to their reader once every one is known
        done = 0  # compute actions before the current position
        for a in acts:
            kind = a.kind
            completes = COMPLETES.get(kind)
            if completes is not None:
                reader[(completes, a.stage, a.mb)] = done  # the last one, where a key repeats
                done += 1
                continue
            if kind not in _MESSAGES:  # a data-parallel collective: priced by predict/data_parallel.py
                continue
            key = (kind, a.stage, a.peer)
            entry = sizes.get(key)
            if entry is None:
                nbytes = message_bytes(*key)
                entry = sizes[key] = (nbytes, cost.transfer_s(nbytes))
            nbytes, transfer = entry
            if not nbytes:
                continue
            made_end = ended[done - 1] if done else 0.0
            if kind in READS:
                receives.append((made_end, nbytes, (READS[kind], a.stage, a.mb)))
            else:
                post((made_end, _ALLOC, nbytes, 0))
                post((made_end + transfer, _FREE, -nbytes, 0))
        for made_end, nbytes, key in receives:
            read = reader.get(key)
            if read is not None:
                post((made_end, _ALLOC, nbytes, 0))
                post((started[read], _FREE, -nbytes, 0))


_MESSAGES = (Kind.RECV_F, Kind.RECV_B, Kind.SEND_F, Kind.SEND_B)


def _message_bytes(schedule: Schedule, cost: CostModel) -> Callable[[Kind, int, int | None], float]:
    """The bytes one P2P action holds: its own edge's message where the cost model has them per
    edge (a stage sending to three later stages holds three messages of their own sizes, not
    three of its whole output), else its stage's whole input or output."""
    n = schedule.num_stages
    in_b, out_b = cost.input_bytes or [0.0] * n, cost.output_bytes or [0.0] * n
    edges = cost.edge_bytes
    if edges is None:
        held = {Kind.RECV_F: in_b, Kind.RECV_B: out_b, Kind.SEND_F: out_b, Kind.SEND_B: in_b}
        return lambda kind, stage, peer: held[kind][stage]

    def per_edge(kind: Kind, stage: int, peer: int | None) -> float:
        if peer is None:
            return 0.0
        forward = kind in (Kind.SEND_F, Kind.RECV_F)
        edge = (stage, peer) if kind in (Kind.SEND_F, Kind.RECV_B) else (peer, stage)
        fwd, grad = edges.get(edge, (0.0, 0.0))
        return fwd if forward else grad

    return per_edge


def _lower_bound(schedule: Schedule, cost: CostModel, busy: list[float]) -> float:
    """No schedule beats this: a rank cannot start before micro-batch 0 reaches its first stage
    (forwards back to back, transfers included), and then still has all its work to do."""
    arrive = [0.0] * schedule.num_stages
    t = 0.0
    for s in range(schedule.num_stages):
        arrive[s] = t
        t += cost.forward_s[s]
        if s + 1 < schedule.num_stages and schedule.placement[s] != schedule.placement[s + 1]:
            t += cost.transfer_s((cost.output_bytes or [0.0] * schedule.num_stages)[s])
    bound = 0.0
    for rank in range(schedule.pp):
        stages = schedule.stages_of(rank)
        if stages:
            bound = max(bound, min(arrive[s] for s in stages) + busy[rank])
    return bound


def simulate_programs(programs: list[list[Action]], placement: list[int], microbatches: int, costs: tuple,
                      backward: list[float] | None = None, hop: Sequence[float] | None = None) -> SimResult:
    """Simulate compute-only programs under (F, I, W) costs (numbers or per stage); a fused B costs
    `backward` per stage when given, else I + W; `hop[s]`: the transfer over the cut after stage s
    where it joins two ranks (none by default). What schedule generators compare candidates by: the
    step and the spans (no memory is tracked: the peaks come out 0)."""
    n = len(placement)
    f, i, w = ([float(x)] * n if not isinstance(x, (list, tuple)) else [float(v) for v in x] for x in costs)
    schedule = Schedule("play-through", n, microbatches, list(placement), programs)
    links = {} if hop is None else {"output_bytes": [*map(float, hop), 0.0][:n], "bandwidth_bytes_per_s": 1.0}
    return simulate(schedule, CostModel(f, i, w, backward_s=backward, **links), check=False, memory=False)


def makespan(programs: list[list[Action]], placement: list[int], microbatches: int, costs: tuple,
             backward: list[float] | None = None, hop: Sequence[float] | None = None) -> float:
    """The simulated step of compute-only programs (`simulate_programs`)."""
    return simulate_programs(programs, placement, microbatches, costs, backward, hop).makespan_s


__all__ = ["CostModel", "ScheduleError", "SimResult", "compute_end_times", "compute_spans", "makespan", "simulate", "simulate_programs",
           "transfer_delays", "validate"]
