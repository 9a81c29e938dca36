"""What the data-parallel collectives of a program add to a step: priced where the runtime issues them.

The simulator plays the compute; this prices the replicas' collectives on the data-parallel
group's link (the plan's latency and bandwidth: replicas of one pipeline rank sit on one node's
links as its P2P does), with ring collectives over d replicas:

- all-reduce (zero=0) of B bytes: 2 (d-1) hops of latency and 2 (d-1)/d B of traffic;
- reduce-scatter and all-gather (zero >= 1): (d-1) hops and (d-1)/d B.

A stage's collectives move its units (pipeline/graph/units.py: a block each), inside its compute
actions, as the runtime issues them (runtime/stage_driver.py). A compute action's time is cut into
its units' parts in proportion to their profiled times (forward order for F and R, backward order
for B, I and W):

- a unit's reduction (an all-reduce at zero=0, a reduce-scatter above) starts at the end of its
  part of the action that completes its gradients (every B or W at zero 2-3; the stage's last at
  zero 0-1), while the rest of the backward computes; the root unit's at the REDUCE_GRAD after;
- at zero=3 a unit's gather is requested at the start of the part before its own (the first one's
  and the root's at the program's UNSHARD before the action, overlapping its receives) and must be
  done when its part starts: what is not yet done delays the compute, and everything after it on
  that rank (an upper bound: the schedule's slack may have absorbed some). With `reshard=run` a
  unit is gathered once per run of the stage's consecutive actions;
- at zero 1-2 the program's UNSHARD gathers the whole stage at its first compute of the step
  (blocking).

The collectives of one rank share one channel, in issue order (one communicator: NCCL runs its
collectives in the order they are issued); the step ends when the channel is idle. Tied
parameters are all-reduced after the step, at the end of the channel. `flat=True` prices instead
one flat reduction of everything after the rank's last compute (what the runtime did before
reductions were placed in the program: the comparison bench/dp_overlap.py reports).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pipelaunch.pipeline.core.ir import Action, Kind, Schedule
from pipelaunch.pipeline.core.plan_records import UnitCost

_BACKWARD_ORDER = (Kind.B, Kind.I, Kind.W)
_TIME = {Kind.F: "forward_s", Kind.R: "forward_s", Kind.B: "backward_s", Kind.I: "backward_input_s",
         Kind.W: "backward_weight_s"}


@dataclass(frozen=True)
class Collectives:
    """Ring collectives over `dp` replicas on one link model (seconds per hop, bytes per second)."""

    dp: int
    latency_s: float
    bandwidth: float
    #: hybrid sharding: the replicas a shard spans (None: all dp); the groups then all-reduce shards
    shard: int | None = None

    def _ring(self, nbytes: float, rounds: int, d: int | None = None) -> float:
        d = self.dp if d is None else d
        if d < 2 or nbytes <= 0:
            return 0.0
        return rounds * ((d - 1) * self.latency_s + (d - 1) / d * nbytes / self.bandwidth)

    def all_reduce(self, nbytes: float, d: int | None = None) -> float:
        """Over all dp replicas, or over `d` of them (an ep rank's expert replicas)."""
        return self._ring(nbytes, 2, d)

    def reduce_scatter(self, nbytes: float) -> float:
        """Into the shards; under hybrid sharding also the shard's all-reduce across the groups."""
        shard = self.shard or self.dp
        return self._ring(nbytes, 1, shard) + self._ring(nbytes / shard, 2, self.dp // shard)

    def all_gather(self, nbytes: float) -> float:
        return self._ring(nbytes, 1, self.shard or self.dp)


@dataclass(frozen=True)
class Sharded:
    """How the runtime moves a plan's stages: its level, zero=3's release point, the gathered
    parameters' bytes per byte of their fp32 shard (0.5 under bf16), and per stage its units in
    forward order (the root unit, gathered for whole actions, named `root`)."""

    zero: int
    units: Sequence[Sequence[UnitCost]]
    reshard: str = "use"
    compute_bytes: float = 1.0


@dataclass
class DataParallelStep:
    """Per pipeline rank: how long after its last compute the rank's collectives end, and how much
    its gathers delay its compute (both seconds); and every collective as a timeline event (the
    simulator's event format, on the `dp` lane of its rank)."""

    tail_s: list[float]
    gather_s: list[float]
    events: list[dict] = field(default_factory=list)
    #: per rank, each compute action's (start, end) once the gathers' delays are in
    spans: list[list[tuple[float, float]]] = field(default_factory=list)


def whole_stages(stage_bytes: Sequence[float]) -> list[list[UnitCost]]:
    """Each stage as one unit of its bytes (a plan without units, or a model priced per stage)."""
    return [[UnitCost("stage", float(b), 1.0, 1.0, 1.0, 1.0)] for b in stage_bytes]


def data_parallel_step(schedule: Schedule, spans: Sequence[Sequence[tuple[float, float]]], sharded: Sharded,
                       replicated_bytes: Sequence[float] | None, links: Collectives,
                       flat: bool = False, expert_bytes: Sequence[float] | None = None,
                       expert_replicas: int = 1) -> DataParallelStep:
    """Price the collectives of each rank's program. `spans[r][i]`: when rank r's i-th compute
    action starts and ends (`SimResult.compute_spans`); `replicated_bytes[s]`: stage s's tied
    parameter bytes (all-reduced after the step); `expert_bytes[s]`: under ep > 1 its share of
    the routed experts, all-reduced over the `expert_replicas` ranks holding the same ones (dp /
    ep; none at ep = dp) after the step (the runtime reduces them in the buckets they fall in, on
    their own group: priced as the step's tail, a slight over-estimate)."""
    tails, gathers, events, moved = [], [], [], []
    tied = replicated_bytes or [0.0] * schedule.num_stages
    for rank, acts in enumerate(schedule.actions):
        play = _RankPlay(rank, acts, spans[rank], sharded, links, flat)
        play.run()
        stages = schedule.stages_of(rank)
        tied_bytes = sum(float(tied[s]) for s in stages)
        if tied_bytes > 0:
            play.queue(play.last + play.shift, links.all_reduce(tied_bytes), Action(stages[0], Kind.REDUCE_GRAD, 0),
                       "tied")
        experts = sum(float(expert_bytes[s]) for s in stages) if expert_bytes is not None else 0.0
        if experts > 0 and expert_replicas > 1:
            play.queue(play.last + play.shift, links.all_reduce(experts, expert_replicas),
                       Action(stages[0], Kind.REDUCE_GRAD, 0), "experts")
        tails.append(max(0.0, play.channel - (play.last + play.shift)))
        gathers.append(play.shift)
        events += play.events
        moved.append(play.moved)
    return DataParallelStep(tails, gathers, events, moved)


class _RankPlay:
    """One rank's program against its compute spans: the channel, the delay its gathers add."""

    def __init__(self, rank: int, acts: Sequence[Action], spans: Sequence[tuple[float, float]], sharded: Sharded,
                 links: Collectives, flat: bool) -> None:
        self.rank, self.acts, self.spans, self.sharded, self.links, self.flat = rank, acts, spans, sharded, links, flat
        self.last = spans[-1][1] if spans else 0.0
        self.channel = 0.0  # when the data-parallel channel is next free
        self.shift = 0.0  # what gathers have delayed this rank's compute so far
        self.events: list[dict] = []
        self.moved: list[tuple[float, float]] = []  # each compute action's span, gathers' delays in
        split = {(a.stage, a.mb) for a in acts if a.kind is Kind.W}
        completes = [pos for pos, a in enumerate(acts)
                     if a.kind is Kind.W or (a.kind is Kind.B and (a.stage, a.mb) not in split)]
        self.completes = set(completes)
        self.last_completes = {acts[pos].stage: pos for pos in completes}
        self.gathered: set[tuple[int, str]] = set()  # reshard=run: (stage, unit) gathered in this run
        self.prefetch_at: dict[int, float] = {}  # stage -> when its UNSHARD asked for its next action's first unit
        self.parts: dict[tuple, tuple[list[UnitCost], list[float]]] = {}  # (stage, kind): its units, their shares

    def queue(self, ready: float, seconds: float, action: Action, unit: str) -> float:
        """A collective of `seconds` issued at `ready`: it runs once the channel is free; returns its end."""
        start = max(ready, self.channel)
        self.channel = start + seconds
        if seconds > 0:
            self.events.append({"rank": self.rank, "action": f"{action}:{unit}", "kind": action.kind.value,
                                "stage": action.stage, "mb": action.mb, "start_s": start, "end_s": self.channel,
                                "lane": "dp"})
        return self.channel

    def run(self) -> None:
        done = 0  # compute actions before the current position
        prev_end = 0.0
        zero = self.sharded.zero
        for pos, a in enumerate(self.acts):
            if a.is_compute:
                start, end = self.spans[done]
                done += 1
                shifted = start + self.shift
                prev_end = self._compute(pos, a, shifted, end + self.shift)
                self.moved.append((shifted, prev_end))
                continue
            units = self.sharded.units[a.stage]
            if a.kind is Kind.UNSHARD:
                if zero == 3:
                    self.prefetch_at[a.stage] = prev_end
                else:  # zero 1-2: the whole stage for the step, blocking
                    nbytes = sum(u.param_bytes for u in units) * self.sharded.compute_bytes
                    end = self.queue(prev_end, self.links.all_gather(nbytes), a, "stage")
                    self.shift += max(0.0, end - prev_end)
                    prev_end = max(prev_end, end)
            elif a.kind is Kind.RESHARD:
                self.gathered = {g for g in self.gathered if g[0] != a.stage}
            elif a.kind is Kind.REDUCE_GRAD:
                for u in units:
                    if u.name == "root":
                        self._reduce(a, u, self.last + self.shift if self.flat else prev_end)

    def _reduce(self, action: Action, unit: UnitCost, ready: float) -> None:
        seconds = self.links.all_reduce(unit.param_bytes) if self.sharded.zero == 0 else \
            self.links.reduce_scatter(unit.param_bytes)
        self.queue(ready, seconds, Action(action.stage, Kind.REDUCE_GRAD, action.mb), unit.name)

    def _compute(self, pos: int, a: Action, start: float, end: float) -> float:
        """One compute action from `start` to `end` (shifted): its units' gathers and reductions; returns its end."""
        sharded, zero = self.sharded, self.sharded.zero
        due = pos in self.completes and (zero >= 2 or self.last_completes.get(a.stage) == pos)
        if zero != 3 and not due:  # nothing of the replicas' starts inside this action
            return end
        if (a.stage, a.kind) not in self.parts:
            units = [u for u in sharded.units[a.stage] if u.name != "root"]
            if a.kind in _BACKWARD_ORDER:
                units = units[::-1]
            self.parts[(a.stage, a.kind)] = (units, _shares(units, a.kind))
        units, shares = self.parts[(a.stage, a.kind)]
        bounds = [start]  # where each unit's part of the action starts, and (last) where it ends
        for share in shares:
            bounds.append(bounds[-1] + share * (end - start))
        if not shares:  # a stage of root parameters alone: the action still spans its time
            bounds.append(end)
        if zero == 3:
            asked = self.prefetch_at.pop(a.stage, start)
            root = [u for u in sharded.units[a.stage] if u.name == "root"]
            for k, u in [(0, r) for r in root] + list(enumerate(units)):
                key = (a.stage, u.name)
                if sharded.reshard == "run" and key in self.gathered:
                    continue
                self.gathered.add(key)
                ready = asked if k == 0 else bounds[k - 1]  # asked for as the part before it starts
                seconds = self.links.all_gather(u.param_bytes * sharded.compute_bytes)
                late = self.queue(ready, seconds, Action(a.stage, Kind.UNSHARD, a.mb), u.name) - bounds[k]
                if late > 0:  # the compute waits for it: this part and everything after shift
                    self.shift += late
                    bounds = [b + late if j >= k else b for j, b in enumerate(bounds)]
        if due:
            for k, u in enumerate(units):
                self._reduce(a, u, self.last + self.shift if self.flat else bounds[k + 1])
        return bounds[-1]


def _shares(units: Sequence[UnitCost], kind: Kind) -> list[float]:
    """Each unit's share of an action of `kind` on its stage: its profiled time over theirs (the
    backward's when the split halves were not profiled; its parameter bytes without a profile)."""
    times = [float(getattr(u, _TIME[kind])) for u in units]
    if sum(times) <= 0 and kind in (Kind.I, Kind.W):
        times = [float(u.backward_s) for u in units]
    if sum(times) <= 0:
        times = [float(u.param_bytes) for u in units]
    total = sum(times)
    return [t / total for t in times] if total > 0 else [1.0 / len(units)] * len(units) if units else []
