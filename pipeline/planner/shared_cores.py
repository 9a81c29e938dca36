"""The step of a schedule whose ranks take turns on too few cores (processor sharing).

Why: on a CPU machine with fewer cores than local ranks x threads, an action runs slower while
more ranks are busy, and at full speed while the others wait in their bubbles. `simulate` gives
each rank a core of its own, and the bound "all ranks' work over the cores" ignores the bubbles
and the order. Here every busy rank progresses at `min(1, slots / busy)` of its own speed (the
kernel shares cores fairly among runnable processes; a rank waiting for a transfer is not
runnable), with the dependency rules of `pipeline.planner.dependencies` and the transfers of
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

from pipeline.core.ir import Action, Kind, Schedule
from pipeline.planner.dependencies import COMPLETES, Progress, remat_pairs, wait_table
from pipeline.planner.simulate import CostModel, ScheduleError, transfer_delays


def shared_makespan(schedule: Schedule, cost: CostModel, slots: float, replicas: int = 1) -> float:
    """Seconds one step of `schedule` takes when `replicas` copies of its ranks share `slots`
    ranks' worth of cores (raises ScheduleError on a deadlock; `simulate` names the actions)."""
    return _SharedPlay(schedule, cost, slots, replicas).run()


class _SharedPlay:
    """The play-through: ranks start actions as `pipeline.planner.dependencies` allows; the busy
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
                       COMPLETES[a.kind], a.stage) for a in acts] for acts in self.programs]
        self.progress = Progress(schedule.num_stages, schedule.num_microbatches)
        self.pos = [0] * schedule.pp
        self.running: list[tuple[float, int]] = []  # (virtual work at which its action ends, rank)
        self.pending: list[tuple[float, int]] = []  # (time its next action may start, rank)
        self.now = self.virtual = 0.0
        self.left = sum(len(p) for p in self.jobs)

    def run(self) -> float:
        for rank in range(len(self.programs)):
            self._try_start(rank)
        while self.left:
            if not self.running and not self.pending:
                raise ScheduleError(f"schedule {self.name!r} deadlocks")
            self._advance_clock()
            for rank in self._finish_due() + self._pending_due():
                self._try_start(rank)
        return self.now

    def _try_start(self, rank: int) -> None:
        """Start `rank`'s next action now, or queue it for when its inputs arrive, or leave it
        waiting (in `progress`) for an action that has not finished."""
        i, jobs = self.pos[rank], self.jobs[rank]
        if i >= len(jobs):
            return
        waits, mb, work, _, _ = jobs[i]
        ready = self.progress.earliest_start(waits, mb, self.now, rank)
        if ready is None:
            return
        if ready > self.now:
            heapq.heappush(self.pending, (ready, rank))
        else:
            heapq.heappush(self.running, (self.virtual + work, rank))

    def _advance_clock(self) -> None:
        """Move time to the next end of a running action or start of a pending one."""
        running, pending = self.running, self.pending
        rate = min(1.0, self.slots / (len(running) * self.replicas)) if running else 0.0
        t_end = self.now + (running[0][0] - self.virtual) / rate if running else math.inf
        t_start = pending[0][0] if pending else math.inf
        t = min(t_end, t_start)
        self.virtual += rate * (t - self.now)
        self.now = t

    def _finish_due(self) -> list[int]:
        """End the running actions whose work is done; their ranks and those that waited on them."""
        woken: list[int] = []
        running, virtual, pos, finish = self.running, self.virtual, self.pos, self.progress.finish
        while running and running[0][0] <= virtual + 1e-12 * max(1.0, virtual):
            _, rank = heapq.heappop(running)
            _, mb, _, step, stage = self.jobs[rank][pos[rank]]
            pos[rank] += 1
            self.left -= 1
            woken.append(rank)
            woken.extend(finish(step, stage, mb, self.now))
        return woken

    def _pending_due(self) -> list[int]:
        """The queued ranks whose next action may start now."""
        due = []
        while self.pending and self.pending[0][0] <= self.now:
            due.append(heapq.heappop(self.pending)[1])
        return due
