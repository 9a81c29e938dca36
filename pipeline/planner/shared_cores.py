"""The step of a schedule whose ranks take turns on too few cores (processor sharing).

Why: on a CPU machine with fewer cores than local ranks x threads, an action runs slower while
more ranks are busy, and at full speed while the others wait in their bubbles. `simulate` gives
each rank a core of its own, and the bound "all ranks' work over the cores" ignores the bubbles
and the order. Here every busy rank progresses at `min(1, slots / busy)` of its own speed (the
kernel shares cores fairly among runnable processes; a rank waiting for a transfer is not
runnable), with the dependencies and transfers of `simulate`. Data-parallel replicas run the same
program at the same time, so each busy pipeline rank counts `replicas` times.

All busy ranks progress at one rate, so time is kept as work done per busy rank (`virtual`): an
action that starts at virtual work v and costs c seconds ends when the virtual clock reaches
v + c. Each start and end is then one heap operation, and a pp=64 step of 128 micro-batches
takes about as long to play as `simulate` does.
"""

from __future__ import annotations

import heapq
import math

from pipeline.core.ir import Schedule
from pipeline.planner.simulate import _CODE, _F, _G, _R, _W, CostModel, ScheduleError, transfer_delays

#: what the end of an action (by its code in `_CODE`: F, B, I, W, R) completes
_CLASS = (_F, _G, _G, _W, _R)


def shared_makespan(schedule: Schedule, cost: CostModel, slots: float, replicas: int = 1) -> float:
    """Seconds one step of `schedule` takes when `replicas` copies of its ranks share `slots`
    ranks' worth of cores (raises ScheduleError on a deadlock; `simulate` names the actions)."""
    m, pp, stages = schedule.num_microbatches, schedule.pp, schedule.num_stages
    programs = [[(_CODE[a.kind], a.stage, a.mb) for a in acts if a.kind in _CODE] for acts in schedule.actions]
    remat = {(s, mb) for prog in programs for code, s, mb in prog if code == 4}
    hop = transfer_delays(schedule, cost)
    work = (cost.forward_s, cost.backward_s, cost.backward_input_s, cost.backward_weight_s, cost.recompute_s)
    done: list[list[float | None]] = [[None] * (stages * m) for _ in range(4)]
    waiters: dict[tuple[int, int], list[int]] = {}
    pos = [0] * pp
    running: list[tuple[float, int]] = []  # (virtual work at which its action ends, rank)
    pending: list[tuple[float, int]] = []  # (time its next action may start, rank)
    now = virtual = 0.0
    left = sum(len(p) for p in programs)

    def needs(rank: int) -> list[tuple[int, int, float]]:
        """(class, index, delay) of what the rank's next action waits for."""
        code, s, mb = programs[rank][pos[rank]]
        idx = s * m + mb
        if code == 0:
            return [(_F, idx - m, hop[s - 1])] if s > 0 else []
        if code in (1, 2):
            deps = [(_F, idx, 0.0)] + ([(_R, idx, 0.0)] if (s, mb) in remat else [])
            return deps + ([(_G, idx + m, hop[s])] if s + 1 < stages else [])
        return [(_G, idx, 0.0)] if code == 3 else [(_F, idx, 0.0)]

    def try_start(rank: int) -> None:
        if pos[rank] >= len(programs[rank]):
            return
        ready = now
        for cls, idx, delay in needs(rank):
            t = done[cls][idx]
            if t is None:
                waiters.setdefault((cls, idx), []).append(rank)
                return
            ready = max(ready, t + delay)
        if ready > now:
            heapq.heappush(pending, (ready, rank))
        else:
            code, s, _ = programs[rank][pos[rank]]
            heapq.heappush(running, (virtual + work[code][s], rank))

    for rank in range(pp):
        try_start(rank)
    while left:
        if not running and not pending:
            raise ScheduleError(f"schedule {schedule.name!r} deadlocks")
        rate = min(1.0, slots / (len(running) * replicas)) if running else 0.0
        t_end = now + (running[0][0] - virtual) / rate if running else math.inf
        t_start = pending[0][0] if pending else math.inf
        t = min(t_end, t_start)
        virtual += rate * (t - now)
        now = t
        woken: list[int] = []
        while running and running[0][0] <= virtual + 1e-12 * max(1.0, virtual):
            _, rank = heapq.heappop(running)
            code, s, mb = programs[rank][pos[rank]]
            key = (_CLASS[code], s * m + mb)
            done[key[0]][key[1]] = now
            pos[rank] += 1
            left -= 1
            woken.append(rank)
            woken.extend(waiters.pop(key, ()))
        while pending and pending[0][0] <= now:
            woken.append(heapq.heappop(pending)[1])
        for rank in woken:
            try_start(rank)
    return now
