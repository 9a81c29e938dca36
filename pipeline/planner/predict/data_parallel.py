"""What the data-parallel collectives of a program add to a step: priced where the program has them.

The simulator plays the compute; this prices the UNSHARD / RESHARD / REDUCE_GRAD actions that
planner/passes/data_parallel.py placed, on the link model of the data-parallel group (the plan's
latency and bandwidth: replicas of one pipeline rank sit on one node's links as its P2P does),
with ring collectives over d replicas:

- all-reduce (zero=0) of B bytes: 2 (d-1) hops of latency and 2 (d-1)/d B of traffic;
- reduce-scatter and all-gather (zero >= 1): (d-1) hops and (d-1)/d B.

A REDUCE_GRAD is started, not waited for: it runs on the rank's data-parallel channel from the end
of the backward before it (or once the channel is free: reductions queue), while the rank
computes on; the step ends when the channel is idle. A gather (UNSHARD) blocks: the compute after
it waits, and so does everything after on that rank (an upper bound: slack the schedule had may
have absorbed it). RESHARD frees memory and costs nothing. Tied parameters are all-reduced after
the step, at the end of the channel.

`flat=True` prices instead what the runtime did before reductions were actions: every reduction
started after the rank's last compute, back to back (the comparison bench/ reports).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipelaunch.pipeline.core.ir import Action, Kind, Schedule


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

    def all_reduce(self, nbytes: float) -> float:
        return self._ring(nbytes, 2)

    def reduce_scatter(self, nbytes: float) -> float:
        """Into the shards; under hybrid sharding also the shard's all-reduce across the groups."""
        shard = self.shard or self.dp
        return self._ring(nbytes, 1, shard) + self._ring(nbytes / shard, 2, self.dp // shard)

    def all_gather(self, nbytes: float) -> float:
        return self._ring(nbytes, 1, self.shard or self.dp)


@dataclass(frozen=True)
class DataParallelStep:
    """Per pipeline rank: how long after its last compute the rank's collectives end, and how much
    its gathers delay its compute (both seconds)."""

    tail_s: list[float]
    gather_s: list[float]


def data_parallel_step(schedule: Schedule, compute_ends: Sequence[Sequence[float]], zero: int,
                       sharded_bytes: Sequence[float], replicated_bytes: Sequence[float] | None,
                       links: Collectives, flat: bool = False) -> DataParallelStep:
    """Price the collectives of each rank's program. `compute_ends[r][i]`: when rank r's i-th compute
    action ends (`simulate.compute_end_times`); `sharded_bytes[s]`: stage s's parameter bytes the
    collectives move (tied ones excluded), `replicated_bytes[s]` the tied ones."""
    tails, gathers = [], []
    tied = replicated_bytes or [0.0] * schedule.num_stages
    for rank, acts in enumerate(schedule.actions):
        ends = compute_ends[rank]
        last = ends[-1] if ends else 0.0
        tail_end, gathered = _play(acts, ends, zero, sharded_bytes, links, flat, last)
        stages = schedule.stages_of(rank)
        tail_end += links.all_reduce(sum(float(tied[s]) for s in stages))
        tails.append(max(0.0, tail_end - (last + gathered)))
        gathers.append(gathered)
    return DataParallelStep(tails, gathers)


def _play(acts: Sequence[Action], ends: Sequence[float], zero: int, sharded_bytes: Sequence[float],
          links: Collectives, flat: bool, last: float) -> tuple[float, float]:
    """One rank: (when its data-parallel channel goes idle, the gather time its compute waited)."""
    done = 0  # compute actions before the current position
    shift = 0.0  # blocking gathers so far
    channel = 0.0  # when the data-parallel channel is next free
    for a in acts:
        if a.is_compute:
            done += 1
            continue
        nbytes = float(sharded_bytes[a.stage])
        if a.kind is Kind.UNSHARD:
            shift += links.all_gather(nbytes)
        elif a.kind is Kind.REDUCE_GRAD:
            ready = last if flat else (ends[done - 1] if done else 0.0)
            start = max(ready + shift, channel)
            channel = start + (links.all_reduce(nbytes) if zero == 0 else links.reduce_scatter(nbytes))
    return max(channel, last + shift), shift
