"""One stage's units through a step: when each is gathered, released and has its gradients reduced.

The program's compute actions run a stage's forward or backward as a whole; inside them the unit
hooks (runtime/unit_hooks.py) say where each unit begins and ends. A `StageDriver` turns those
moments into the level's collectives (what a gather or a reduction is belongs to its subclass:
FSDP2 groups in runtime/sharding.py, all-reduce buckets in runtime/dp.py):

- forward (F, R; evaluation too): a unit is gathered as it begins (the next one prefetched at
  zero=3) and, with `reshard=use`, released as it ends;
- backward (B, I, and a W that runs a plain backward): gathered as its first gradient arrives (the
  one before prefetched), released when its backward is done;
- the action that completes a micro-batch's gradients (B, or W when the backward is split) hands
  each unit's gradients on as soon as they are final: reduced now (zero 2-3 at every micro-batch,
  zero 0-1 in the stage's last completing action of the step), else accumulated (FSDP2 adds a
  bf16 micro-batch into its fp32 whole gradients);
- a W that restarts autograd per branch (compute/backward.py) runs its restarts unit by unit
  (`weight_jobs`): gathered before a restart that needs them, finished after their last one.

What no hook reached (a unit whose inputs need no gradient, the root unit) is finished by the
program's REDUCE_GRAD action after the sends (`reduce_leftovers`), or accumulated at the end of
an action that does not reduce. Every replica runs the same program on the same graph, so the
hooks fire, and the collectives are issued, in the same order on every replica.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from torch import nn

from pipelaunch.pipeline.core.ir import Action, Kind
from pipelaunch.pipeline.graph.units import StageUnits

_FORWARD = (Kind.F, Kind.R)
_COMPLETES = (Kind.B, Kind.W)


def last_completing(actions: Sequence[Action], stage: int) -> int | None:
    """The position of the stage's last action that completes a micro-batch's weight gradients:
    its last W when its backward is split, else its last B."""
    split = {a.mb for a in actions if a.stage == stage and a.kind is Kind.W}
    positions = [pos for pos, a in enumerate(actions) if a.stage == stage
                 and (a.kind is Kind.W or (a.kind is Kind.B and a.mb not in split))]
    return positions[-1] if positions else None


class StageDriver:
    """The unit lifecycle of one stage (units 0..n-1 in forward order, and the root unit n)."""

    def __init__(self, stage: int, units: StageUnits, actions: Sequence[Action], zero: int, reshard: str) -> None:
        self.stage = stage
        self.units = units
        self.n = len(units.units)
        self.zero = zero
        #: zero=3 with reshard=use: a unit's gathered parameters go as soon as it has run
        self.after_use = zero == 3 and reshard == "use"
        self.last = last_completing(actions, stage)
        self.phase: str | None = None  # forward | backward | weight; None outside actions (evaluation)
        self.completing = False
        self.reduce_now = False
        #: units (n: the root) whose gradients the current completing action has finished
        self.done: set[int] = set()
        #: what this stage issued, in order (debug.record_p2p), shared with the rank's log
        self.issued: list[str] | None = None

    # ---- around a compute action --------------------------------------------------------------
    @contextmanager
    def action(self, action: Action, pos: int) -> Iterator[None]:
        kind = action.kind
        self.phase = "forward" if kind in _FORWARD else "backward"
        self.completing = kind in _COMPLETES
        if self.completing:
            self.reduce_now = self.zero >= 2 or pos == self.last
            self.done = set()
        self.begin_action()
        try:
            yield
        finally:
            self.phase = None
            self.end_action()
        if self.completing and not self.reduce_now:
            for u in range(self.n + 1):
                self._complete(u)

    # ---- hooks (runtime/unit_hooks.py) ---------------------------------------------------------
    def forward_begin(self, unit: int) -> None:
        if self.phase in (None, "forward"):
            self.gather(unit, wait=True)
            if self.zero == 3 and unit + 1 < self.n:
                self.gather(unit + 1, wait=False)

    def forward_end(self, unit: int) -> None:
        if self.phase in (None, "forward") and self.after_use:
            self.release(unit)

    def backward_begin(self, unit: int) -> None:
        if self.phase == "backward":
            self.gather(unit, wait=True)
            if self.zero == 3 and unit > 0:
                self.gather(unit - 1, wait=False)

    def backward_end(self, unit: int) -> None:
        if self.phase != "backward":
            return
        if self.after_use:
            self.release(unit)
        if self.completing:
            self._complete(unit)

    # ---- a W restarting autograd per branch ----------------------------------------------------
    def weight_jobs(self, jobs: list[list[nn.Parameter]]) -> Iterator[None]:
        """Yields before each restart of a W (`compute.backward.backward_weight`): the units its
        parameters belong to are gathered then, and finished after their last restart."""
        self.phase = "weight"
        needs = [self.units_of(params) for params in jobs]
        last_job = {u: i for i, us in enumerate(needs) for u in us}
        for i, us in enumerate(needs):
            if i:
                self._after_job(i - 1, needs, last_job)
            for u in us:
                self.gather(u, wait=True)
            if self.zero == 3 and i + 1 < len(needs):
                for u in needs[i + 1]:
                    self.gather(u, wait=False)
            yield
        if needs:
            self._after_job(len(needs) - 1, needs, last_job)
        self.phase = "backward"

    def _after_job(self, i: int, needs: list[list[int]], last_job: dict[int, int]) -> None:
        for u in needs[i]:
            if last_job[u] == i:
                if self.after_use:
                    self.release(u)
                if self.completing:
                    self._complete(u)

    # ---- the program's data-parallel actions ---------------------------------------------------
    def reduce_leftovers(self, final: bool) -> None:
        """REDUCE_GRAD: the units the completing action before it did not finish, last first; the
        stage's last of the step also waits for every reduction."""
        for u in range(self.n, -1, -1):
            self._complete(u)
        if final:
            self.finish_backward()

    def _complete(self, unit: int) -> None:
        if unit in self.done:
            return
        self.done.add(unit)
        if self.reduce_now:
            self.reduce(unit)
        else:
            self.accumulate(unit)

    # ---- what a level does (subclasses) --------------------------------------------------------
    def units_of(self, params: list[nn.Parameter]) -> list[int]:
        """The units (forward order) holding any of `params` (the parameters the graph computed with)."""
        return []

    def begin_action(self) -> None:
        """Before a compute action of the stage (zero=3: gather the root unit)."""

    def end_action(self) -> None:
        """After it (zero=3 with reshard=use: release the root unit)."""

    def gather(self, unit: int, wait: bool) -> None:
        """Make the unit's parameters whole: start it, and with `wait` finish it."""

    def release(self, unit: int) -> None:
        """Back to the unit's shard."""

    def reduce(self, unit: int) -> None:
        """Start the reduction of the unit's gradients over the replicas."""

    def accumulate(self, unit: int) -> None:
        """Keep a micro-batch's gradients for a later reduction."""

    def finish_backward(self) -> None:
        """The stage's reductions of the step are all issued: wait for them."""

    def graph_params(self) -> list[nn.Parameter] | None:
        """The parameters the graph computes with when its module holds others (None: its own)."""
        return None


class RankStages:
    """A rank's stage drivers, as the executor sees them (its `ReplicaCollectives`): the compute
    actions' per-block collectives and the order log, one driver per stage; the program's
    data-parallel actions are the level's (`run`, in the subclasses)."""

    def __init__(self, stages: dict[int, StageDriver]) -> None:
        self.stages = stages
        self._issued: list[str] | None = None

    @property
    def issued(self) -> list[str] | None:
        """What this rank issued, in order (debug.record_p2p: replicas must agree)."""
        return self._issued

    @issued.setter
    def issued(self, log: list[str] | None) -> None:
        self._issued = log
        for driver in self.stages.values():
            driver.issued = log

    @contextmanager
    def compute(self, action: Action, pos: int) -> Iterator[None]:
        driver = self.stages.get(action.stage)
        if driver is None:
            yield
            return
        with driver.action(action, pos):
            yield

    def weight_jobs(self, stage: int):
        driver = self.stages.get(stage)
        return driver.weight_jobs if driver is not None else None

    def graph_params(self, stage: int) -> list[nn.Parameter] | None:
        """The parameters the stage's graph computes with, where its module holds others."""
        driver = self.stages.get(stage)
        return driver.graph_params() if driver is not None else None
