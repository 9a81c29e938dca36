"""The step of a schedule whose ranks take turns on too few cores (processor sharing).

Why: on a CPU machine with fewer cores than local ranks x threads, an action runs slower while
more ranks are busy, and at full speed while the others wait in their bubbles. `simulate` gives
each rank a core of its own, and the bound "all ranks' work over the cores" ignores the bubbles
and the order. Here every busy rank progresses at `min(1, slots / busy)` of its own speed (the
kernel shares cores fairly among runnable processes; a rank waiting for a transfer is not
runnable), with the dependency rules of `pipelaunch.pipeline.planner.passes.dependencies` and the transfers of
`simulate`. Data-parallel replicas run the same program at the same time, so each busy pipeline
rank counts `replicas` times.

All busy ranks progress at one rate, so time is kept as work done per busy rank (`virtual`): an
action that starts at virtual work v and costs c seconds ends when the virtual clock reaches
v + c. Each start and end is then one heap operation, and a pp=64 step of 128 micro-batches
takes about as long to play as `simulate` does.
"""

from __future__ import annotations

import heapq
import math

from pipelaunch.pipeline.core.ir import Action, Kind, Schedule, overlapped_pairs
from pipelaunch.pipeline.planner.passes.dependencies import COMPLETES, Progress, remat_pairs, wait_table
from pipelaunch.pipeline.planner.predict.simulate import CostModel, ScheduleError, pair_s, transfer_delays


def shared_makespan(schedule: Schedule, cost: CostModel, slots: float, replicas: int = 1) -> float:
    """Seconds one step of `schedule` takes when `replicas` copies of its ranks share `slots`
    ranks' worth of cores (raises ScheduleError on a deadlock; `simulate` names the actions)."""
    return _SharedPlay(schedule, cost, slots, replicas).run()


class _SharedPlay:
    """The play-through: ranks start actions as `pipelaunch.pipeline.planner.passes.dependencies` allows; the busy
    ones advance one virtual clock together."""

    def __init__(self, schedule: Schedule, cost: CostModel, slots: float, replicas: int) -> None:
        self.name, self.slots, self.replicas = schedule.name, slots, replicas
        self.programs: list[list[Action]] = [[a for a in acts if a.kind in COMPLETES] for acts in schedule.actions]
        remat = remat_pairs(self.programs)
        waits = wait_table(schedule.num_stages, transfer_delays(schedule, cost))
        work = {Kind.F: cost.forward_s, Kind.B: cost.backward_s, Kind.I: cost.backward_input_s,
                Kind.W: cost.backward_weight_s, Kind.R: cost.recompute_s}
        #: per rank, its program as (waits, mb, seconds of work, step it completes, stage)
        self.jobs = [[(waits[(a.kind, (a.stage, a.mb) in remat)][a.stage], a.mb, work[a.kind][a.stage],  # type: ignore[index]
                       COMPLETES[a.kind], a.stage, None) for a in acts] for acts in self.programs]
        if cost.overlap_exchange_s is not None and schedule.training:
            self.jobs = [_paired(jobs, acts, prog, cost.overlap_exchange_s)
                         for jobs, acts, prog in zip(self.jobs, schedule.actions, self.programs, strict=True)]
        self.progress = Progress(schedule.num_stages, schedule.num_microbatches)
        self.pos = [0] * schedule.pp
        self.running: list[tuple[float, int]] = []  # (virtual work at which its action ends, rank)
        self.pending: list[tuple[float, int]] = []  # (time its next action may start, rank)
        self.left = sum(len(p) for p in self.jobs)

    def run(self) -> float:
        """Play until every action has ended; returns when the last one ends. One loop with its
        helpers inlined: it turns once per start or end of an action (200k at pp=64)."""
        jobs, pos, running, pending = self.jobs, self.pos, self.running, self.pending
        earliest_start, ended, woken_by, m = (self.progress.earliest_start, self.progress.end, self.progress.woken,
                                              self.progress.m)
        now = virtual = 0.0
        left = self.left
        woken = list(range(len(jobs)))
        while True:
            for rank in woken:  # start its next action now, queue it until its inputs arrive, or let it wait
                i = pos[rank]
                if i >= len(jobs[rank]):
                    continue
                waits, mb, work, _, _, partner = jobs[rank][i]
                ready = earliest_start(waits, mb, now, rank)
                if ready is not None and partner is not None:  # an overlapped pair: once both may
                    other = earliest_start(partner[0], partner[1], now, rank)
                    ready = None if other is None else max(ready, other)
                if ready is not None and ready > now:
                    heapq.heappush(pending, (ready, rank))
                elif ready is not None:
                    heapq.heappush(running, (virtual + work, rank))
            if not left:
                return now
            if not running and not pending:
                raise ScheduleError(f"schedule {self.name!r} deadlocks")
            # the clock moves to the next end of a running action or start of a pending one
            rate = min(1.0, self.slots / (len(running) * self.replicas)) if running else 0.0
            t_end = now + (running[0][0] - virtual) / rate if running else math.inf
            t = min(t_end, pending[0][0] if pending else math.inf)
            virtual += rate * (t - now)
            now = t
            woken = []
            while running and running[0][0] <= virtual + 1e-12 * max(1.0, virtual):  # work done: it ends
                rank = heapq.heappop(running)[1]
                _, mb, _, step, stage, partner = jobs[rank][pos[rank]]
                pos[rank] += 1
                left -= 1
                woken.append(rank)
                ended[step][stage * m + mb] = now  # `Progress.finish`
                woken.extend(woken_by(step, stage * m + mb))
                if partner is not None:
                    _, mb2, step2, stage2 = partner
                    ended[step2][stage2 * m + mb2] = now
                    woken.extend(woken_by(step2, stage2 * m + mb2))
            while pending and pending[0][0] <= now:
                woken.append(heapq.heappop(pending)[1])


def _paired(jobs: list[tuple], actions: list[Action], program: list[Action], exchange_s: list[float]) -> list[tuple]:
    """A rank's jobs with each overlapped pair (`overlapped_pairs`) one job: started once both
    actions may, costing `simulate.pair_s`, ending both."""
    index = {id(a): i for i, a in enumerate(program)}
    firsts = {index[id(actions[p])] for p in overlapped_pairs(actions)}
    out, i = [], 0
    while i < len(jobs):
        if i in firsts:
            (waits, mb, f_s, step, stage, _), (waits2, mb2, b_s, step2, stage2, _) = jobs[i], jobs[i + 1]
            out.append((waits, mb, pair_s(exchange_s, stage, f_s, stage2, b_s), step, stage, (waits2, mb2, step2, stage2)))
            i += 2
        else:
            out.append(jobs[i])
            i += 1
    return out
