"""Place the weight-gradient passes (W) of a zero-bubble schedule around a fixed critical order.

Why two parts: in a zero-bubble schedule the forwards and the input-gradient passes (F, I, or a
fused B) form the critical path, while each W can run any time after its I on the same rank. So a
schedule is chosen as a *critical order* per rank (a template such as 1F1B's or ZB-V's, or a greedy
play-through: `pipelaunch.pipeline.planner.schedules.orders`), and the W are then placed by this pass on the
measured costs: a rank runs pending W in the gaps where it would otherwise wait for its next critical
action's input, as long as they end before that input arrives, so they delay nothing; a W also runs
when the rank is at its memory cap and the next forward needs a slot (a W frees its micro-batch);
`alpha` lets a W start in a gap shorter than itself when the gap is at least `alpha` W long (it then
delays the critical action by the rest). Whatever is left runs at the end. Greedy per-rank filling of a
fixed order is how the Zero Bubble paper's heuristic fills its bubbles too; here the critical order is
an input, so the same pass serves every placement (linear, V, interleaved) and memory budget.

The placement is a play-through with exact end times: a rank's action starts when its rank is free
and its inputs have arrived (the previous stage's F, or the next stage's B/I, plus the hop between
their ranks), the rules of `pipelaunch.pipeline.planner.passes.dependencies`. Ranks advance in dependency order, each as
far as its inputs allow, so the gap before every critical action is known when its W are placed.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.core.ir import Action, Kind, W, action_table
from pipelaunch.pipeline.planner.passes.dependencies import note_waiting


@dataclass(frozen=True)
class StageMemory:
    """Per stage, the bytes one micro-batch holds there, as the simulator counts them: from its F to
    its I (or B) the stage's activations, from its I to its W what the I left (the activations W
    still reads and the gradients it restarts from: with a split backward often more than before)."""

    forward: tuple[float, ...]
    after_input_grad: tuple[float, ...]

    @classmethod
    def units(cls, n: int) -> StageMemory:
        """Every micro-batch counts one, from its F to its W or B."""
        return cls((1.0,) * n, (1.0,) * n)


@dataclass(frozen=True)
class StageCosts:
    """Per stage: forward, input-gradient and weight-gradient times, the fused backward (defaults to
    I + W), and per cut between stages s and s + 1 the time a value takes to cross it (0 within a
    rank)."""

    forward: tuple[float, ...]
    input_grad: tuple[float, ...]
    weight_grad: tuple[float, ...]
    hop: tuple[float, ...]
    backward: tuple[float, ...] | None = None

    @classmethod
    def of(cls, n: int, costs: tuple, hop: Sequence[float] | float = 0.0,
           backward: Sequence[float] | None = None) -> StageCosts:
        """From (F, I, W), each one number or one per stage, and one hop or one per cut."""
        f, i, w = (tuple(float(v) for v in c) if isinstance(c, Sequence) else (float(c),) * n for c in costs)
        hops = tuple(float(h) for h in hop) if isinstance(hop, Sequence) else (float(hop),) * max(0, n - 1)
        fused = tuple(float(b) for b in backward) if backward is not None else None
        return cls(f, i, w, hops, fused)

    def fused(self, s: int) -> float:
        return self.backward[s] if self.backward is not None else self.input_grad[s] + self.weight_grad[s]

    def duration(self, kind: Kind, s: int) -> float:
        if kind is Kind.F:
            return self.forward[s]
        if kind is Kind.I:
            return self.input_grad[s]
        if kind is Kind.W:
            return self.weight_grad[s]
        return self.fused(s)


@dataclass(frozen=True)
class Filled:
    """Per-rank programs with their W placed, the step they take (the play-through's makespan) and
    the longest span of a rank (its first start to its last end): what consecutive steps cost where
    nothing joins the ranks between steps, the cost behind the Zero Bubble paper's bubble rate."""

    programs: list[list[Action]]
    makespan: float
    longest_span: float = math.inf

    def better_than(self, other: Filled | None) -> bool:
        """A shorter step; of equal steps (to rounding), the one with the shorter longest span."""
        if other is None or self.makespan < other.makespan * (1 - 1e-9):
            return True
        return self.makespan <= other.makespan * (1 + 1e-9) and self.longest_span < other.longest_span * (1 - 1e-12)


def fill_weight_grads(
    orders: Sequence[Sequence[Action]], placement: Sequence[int], microbatches: int, costs: StageCosts,
    cap: Sequence[int], *, alpha: float = math.inf, glued: frozenset[Action] = frozenset(),
    backlog: Sequence[int] | None = None, memory: StageMemory | None = None,
) -> Filled:
    """Place the W of every I in `orders` (per rank: F, I and B actions, no W) as the module docstring
    says. `cap[r]`: the most micro-batches rank r may hold, counted from a stage's F to its W or B;
    in bytes where `memory` gives what each holds (an I may then add bytes, and W are run before it
    as before a forward).
    `glued`: actions that must run right after the one before them (DualPipeV's overlapped pairs), so
    no W goes before them. `backlog[r]`: the most W rank r may leave pending before a critical
    action (the others run first, even if that delays it): a rank keeps as many as will fill its
    idle time at the end of the step and no more. Raises ConfigError("microbatches") if the order needs more than the cap or
    waits on itself."""
    backlog = backlog if backlog is not None else [len(placement) * microbatches] * len(orders)
    return _Fill(orders, placement, microbatches, costs, cap, alpha, glued, backlog, memory).run()


class _Fill:
    """One placement: the state of `fill_weight_grads` (see there)."""

    def __init__(self, orders, placement, microbatches, costs, cap, alpha, glued, backlog, memory) -> None:
        self.orders, self.m, self.costs, self.cap, self.alpha, self.glued = orders, microbatches, costs, cap, alpha, glued
        self.backlog = backlog
        self.n, self.pp = len(placement), len(orders)
        self.f_end: list[float | None] = [None] * (self.n * microbatches)
        self.g_end: list[float | None] = [None] * (self.n * microbatches)
        self.free = [0.0] * self.pp
        self.pos = [0] * self.pp
        self.held = [0.0] * self.pp
        #: a cap in micro-batches (exact) or in bytes (compared with rounding room)
        self.in_units = memory is None
        memory = memory or StageMemory.units(self.n)
        #: what a micro-batch adds to its rank's held amount at its F, at its I; what its W or B frees
        self.on_forward = memory.forward
        self.on_input_grad = tuple(a - f for a, f in zip(memory.after_input_grad, memory.forward, strict=True))
        self.on_weight_grad = memory.after_input_grad
        self.pending: list[deque[Action]] = [deque() for _ in range(self.pp)]
        self.weight_actions = action_table(Kind.W, self.n, microbatches)
        self.programs: list[list[Action]] = [[] for _ in range(self.pp)]
        self.first: list[float | None] = [None] * self.pp
        #: per (stage, mb) whose F (resp. I or B) is not placed yet: the ranks waiting for it
        self.f_waiting: list[list[int] | None] = [None] * (self.n * microbatches)
        self.g_waiting: list[list[int] | None] = [None] * (self.n * microbatches)

    def run(self) -> Filled:
        ready = list(range(self.pp))
        while ready:
            r = ready.pop()
            ready.extend(self._advance(r))
        stuck = [r for r in range(self.pp) if self.pos[r] < len(self.orders[r])]
        if stuck:
            raise ConfigError("microbatches", "the schedule's order waits on itself: " + ", ".join(
                f"rank {r} at {self.orders[r][self.pos[r]]}" for r in stuck))
        for r in range(self.pp):
            while self.pending[r]:
                self._put_w(r)
        span = max((self.free[r] - (self.first[r] or 0.0) for r in range(self.pp)), default=0.0)
        return Filled(self.programs, max(self.free, default=0.0), span)

    def _advance(self, r: int) -> list[int]:
        """Place rank r's critical actions until one waits for an input not placed yet; the ranks
        that were waiting on what it placed. One loop with the state in locals: it runs once per
        critical action, 65k times per candidate at pp=64 with 256 micro-batches (the W that go
        before an action are `_weights_before`'s, called only when some are pending)."""
        order, woken = self.orders[r], []
        m, n, glued, f_waiting, g_waiting = self.m, self.n, self.glued, self.f_waiting, self.g_waiting
        f_end, g_end, hop = self.f_end, self.g_end, self.costs.hop
        forward, input_grad, weight_grad = self.costs.forward, self.costs.input_grad, self.costs.weight_grad
        cap = self.cap[r]
        on_forward, on_input_grad, on_weight_grad = self.on_forward, self.on_input_grad, self.on_weight_grad
        unit = self.in_units
        limit = cap + 0.5 if unit else cap * (1 + 1e-9)
        pending, program, weight_of = self.pending[r], self.programs[r], self.weight_actions
        free, pos, held, first = self.free[r], self.pos[r], self.held[r], self.first[r]
        kind_f, kind_i, kind_w = Kind.F, Kind.I, Kind.W
        length = len(order)
        while pos < length:
            act = order[pos]
            s, kind, mb = act[0], act[1], act[2]
            # when its inputs are all there; else wait for the first one missing
            if kind is kind_f:
                if s == 0:
                    ready = 0.0
                else:
                    end = f_end[(s - 1) * m + mb]
                    if end is None:
                        note_waiting(f_waiting, (s - 1) * m + mb, r)
                        break
                    ready = end + hop[s - 1]
            else:
                ready = f_end[s * m + mb]
                if ready is None:
                    note_waiting(f_waiting, s * m + mb, r)
                    break
                if s + 1 != n:
                    grad = g_end[(s + 1) * m + mb]
                    if grad is None:
                        note_waiting(g_waiting, (s + 1) * m + mb, r)
                        break
                    grad += hop[s]
                    if grad > ready:
                        ready = grad
            adds = on_forward[s] if kind is kind_f else on_input_grad[s] if kind is kind_i else 0.0
            if not glued or act not in glued:
                if pending:
                    free, held = self._weights_before(r, free, held, ready, adds, limit)
                if adds > 0 and held + adds > limit:
                    raise ConfigError("microbatches", f"the schedule's order holds more than {cap:g} "
                                                      f"{'micro-batches' if unit else 'bytes'} on rank {r} at {act}")
            # place it
            start = free if free > ready else ready
            if first is None:
                first = start
            idx = s * m + mb
            program.append(act)
            held += adds
            if kind is kind_f:
                free = f_end[idx] = start + forward[s]
                waiters = f_waiting[idx]
                if waiters is not None:
                    woken.extend(waiters)
                    f_waiting[idx] = None
            else:
                if kind is kind_i:
                    free = start + input_grad[s]
                    pending.append(weight_of[idx])
                else:
                    free = start + (weight_grad[s] if kind is kind_w else self.costs.fused(s))
                    held -= on_weight_grad[s] if kind is kind_w else on_forward[s]
                g_end[idx] = free
                waiters = g_waiting[idx]
                if waiters is not None:
                    woken.extend(waiters)
                    g_waiting[idx] = None
            pos += 1
        self.free[r], self.pos[r], self.held[r], self.first[r] = free, pos, held, first
        return woken

    def _weights_before(self, r: int, free: float, held: float, ready: float, adds: float, limit: float
                        ) -> tuple[float, float]:
        """Run rank r's pending W before a critical action whose input arrives at `ready` and that
        adds `adds` to what the rank holds (`limit` at most): those the cap forces out before an
        action that adds (a forward; an I holding more than its F did), those past the backlog and
        those that end before its input arrives; then one more if the gap left is at least alpha of
        it. The rank's free time and held amount after them."""
        pending, program, weight_grad, on_weight_grad = self.pending[r], self.programs[r], self.costs.weight_grad, \
            self.on_weight_grad
        backlog, alpha = self.backlog[r], self.alpha
        slack = ready + 1e-9 * (ready if ready > 1.0 else 1.0)  # a W that fits exactly fits (times are >= 0)
        stretched = False
        while pending:
            stage = pending[0][0]
            w = weight_grad[stage]
            if not ((adds > 0 and held + adds > limit) or len(pending) > backlog or free + w <= slack):
                if not (ready > free and ready - free >= alpha * w):
                    break
                stretched = True
            program.append(pending.popleft())
            free += w
            held -= on_weight_grad[stage]
            if stretched:
                break
        return free, held

    def _put_w(self, r: int) -> None:
        w = self.pending[r].popleft()
        self.programs[r].append(w)
        self.free[r] += self.costs.weight_grad[w.stage]
        self.held[r] -= self.on_weight_grad[w.stage]


def deferred_by(orders: Sequence[Sequence[Action]], backlog: Sequence[int]) -> list[list[Action]]:
    """Programs whose W come in a fixed pattern rather than by the costs: after each critical action,
    the oldest pending W while rank r has more than `backlog[r]` pending, the rest at the end (ZB-H1's
    and torch's interleaved zero bubble's rule: rank r defers r). A reference order, and the memory
    bound its placement keeps."""
    programs = []
    for r, acts in enumerate(orders):
        pending: deque[Action] = deque()
        prog: list[Action] = []
        for act in acts:
            prog.append(act)
            if act.kind is Kind.I:
                pending.append(W(act.stage, act.mb))
            while len(pending) > backlog[r]:
                prog.append(pending.popleft())
        programs.append(prog + list(pending))
    return programs
