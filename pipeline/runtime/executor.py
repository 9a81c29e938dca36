"""Runs one rank's list of actions for one step: the only place pipeline compute happens.

Stages exchange *named values*: a stage reads some values (from the data, from earlier stages on
this rank, or received from other ranks) and produces values for later stages, which may be
several stages further down (skip connections). Each stage's forward is its own autograd graph:
every value it reads from another stage becomes a fresh leaf with requires_grad, so its backward
yields exactly the gradients to hand back to the producers. The last stage divides each
micro-batch's mean loss by the global batch's scored items over the micro-batch's own (`divisors`:
tokens whose target is not ignored, or samples), so each micro-batch contributes the sum of its
items' losses over the global batch's count: summing over micro-batches and replicas gives the
loss and gradient of one process on the whole batch, whatever the micro-batch count. With equal
counts everywhere the divisor is micro-batches x replicas, as it always was.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from pipelaunch.pipeline.compute.backward import WeightGradStash, backward_input, backward_weight
from pipelaunch.pipeline.core.ir import DP_KINDS, Action, Kind, Schedule, overlapped_pairs
from pipelaunch.pipeline.runtime.comm import P2P
from pipelaunch.pipeline.runtime.heartbeat import Heartbeat
from pipelaunch.pipeline.runtime.overlap import Pair, record_exchanges

if TYPE_CHECKING:
    from pipelaunch.pipeline.runtime.tensor_parallel import TensorParallel


@dataclass
class StageSlot:
    """A stage held by this rank, with everything needed to route its values."""

    index: int
    module: nn.Module  # forward(**inputs) -> dict of outputs
    inputs: dict[str, int | None]  # value -> producing stage (None: model input)
    outputs: dict[str, list[int]]  # value -> consuming stages
    values: dict[str, tuple[tuple[int, ...], torch.dtype]]
    loss_value: str | None
    peer_of: dict[int, int | None]  # neighbouring stage -> its global rank, None when on this rank
    #: values crossing to or from another rank in 1/tp parts, all-gathered by the receiving tp
    #: ranks (Megatron's scatter-gather; StagePlan.scatter), their gradients the same way back
    scatter: frozenset[str] = frozenset()
    #: data.buckets: per micro-batch length, the shape of each of `values` at it (StagePlan.lengths)
    shapes_at: dict[int, dict[str, tuple[int, ...]]] = field(default_factory=dict)

    @property
    def is_last(self) -> bool:
        return self.loss_value is not None

    def grad_flows(self, name: str) -> bool:
        """Gradients travel back along a value only if it is floating point (static, both ends agree)."""
        return self.values[name][1].is_floating_point

    def read_from(self, producer: int) -> list[str]:
        """The values this stage reads from `producer`, in the order both ends put them in a message."""
        return sorted(n for n, p in self.inputs.items() if p == producer)

    def sent_to(self, consumer: int) -> list[str]:
        """The values this stage's `consumer` reads from it, in message order."""
        return sorted(n for n, cs in self.outputs.items() if consumer in cs)


def _as_planned(outs: dict[str, torch.Tensor], values: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> dict[str, torch.Tensor]:
    """A stage's outputs in the dtypes the plan records (what receivers allocate): those autocast
    gives with fp32 parameters; sharding's bf16 parameters (runtime/sharding.py) can turn an fp32
    value bf16, which is cast back here (autograd casts its gradient)."""
    return {n: t.to(values[n][1]) if n in values and t.is_floating_point() else t for n, t in outs.items()}


@dataclass
class MicroBatchState:
    """What a (stage, micro-batch) keeps between its forward and its backward."""

    inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    outputs: dict[str, torch.Tensor] | None = None  # with graph (None under remat until R runs)
    loss: torch.Tensor | None = None
    stash: WeightGradStash | None = None
    #: the random-number state the forward started from, replayed by its recompute (R)
    rng: tuple[torch.Tensor, torch.Tensor | None] | None = None


class ReplicaCollectives(Protocol):
    """Runs the data-parallel actions of a program (UNSHARD, RESHARD, REDUCE_GRAD: placed by
    planner/passes/data_parallel.py) and the per-block ones inside its compute actions:
    replicated gradients (runtime/dp.py) or sharded stages (runtime/sharding.py)."""

    def begin_step(self) -> None: ...

    def run(self, action: Action, pos: int) -> None: ...

    def compute(self, action: Action, pos: int) -> AbstractContextManager:
        """Around a compute action: which of its stage's blocks to gather, release and reduce."""

    def weight_jobs(self, stage: int) -> Callable[[list[list[nn.Parameter]]], Iterator[None]] | None:
        """What drives a W's restarts block by block (`compute.backward.backward_weight`)."""

    def graph_params(self, stage: int) -> list[nn.Parameter] | None:
        """The parameters the stage's graph computes with (FSDP2's unsharded ones), None: its own."""


def message_label(direction: str, producer: int, consumer: int, mb: int) -> str:
    """What both ends of a message call it (posting-order logs, errors)."""
    return f"{direction} {producer}>{consumer} mb{mb}"


class Executor:
    def __init__(
        self,
        schedule: Schedule,
        pp_rank: int,
        slots: dict[int, StageSlot],
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        device: torch.device,
        loss_scale: float,
        record_timings: bool = True,
        autocast: torch.dtype | None = None,
        heartbeat: Heartbeat | None = None,
        record_p2p: bool = False,
        model_inputs: Mapping[str, str] | None = None,
        collectives: ReplicaCollectives | None = None,
        tp: TensorParallel | None = None,
        overlap: bool = False,
    ) -> None:
        self.actions = schedule.actions[pp_rank]
        # moe.overlap under ep > 1: a forward followed by another stage's backward run as a pair
        self._pairs = overlapped_pairs(self.actions) if overlap else set()
        # model input -> what the data gives it: `input`, `target` (a model taking its targets) or
        # an extra per-token field of the batch (`position_ids`: packed documents)
        self.model_inputs = dict(model_inputs or {})
        self.training = schedule.training
        self.m = schedule.num_microbatches
        self.slots = slots
        self.loss_fn = loss_fn
        self.device = device
        self.loss_scale = loss_scale
        # stages this rank rematerialises (remat=full: all; remat=auto: those the planner chose)
        self.remat_stages = set(schedule.remat_stages())
        self.record_timings = record_timings
        self.pp_rank = pp_rank
        # precision=bf16: stage forwards (and the loss) run under autocast; what they produce is
        # what goes over P2P, so the plan's values carry the dtypes autocast gives
        self.autocast = autocast
        # entered per forward: a no-op context when there is no autocast, not a disabled autocast
        self._autocast = partial(torch.autocast, device.type, dtype=autocast) if autocast is not None else nullcontext
        # where this rank is, readable from outside (pipeline/runtime/heartbeat.py); None: untracked
        self.heartbeat = heartbeat
        # with record_p2p, the first step's posting order is logged per peer (debug.record_p2p)
        self.p2p = P2P(device, record=record_p2p)
        self.collectives = collectives
        # the tp group a scattered boundary value is all-gathered over (StageSlot.scatter)
        self.tp = tp
        # remote neighbours per stage: the messages its forward and backward wait for
        self._remote_in = {s: [p for p in sorted(set(slot.inputs.values()) - {None}) if slot.peer_of[p] is not None]
                           for s, slot in slots.items()}
        self._remote_out = {s: [c for c in sorted({c for cs in slot.outputs.values() for c in cs})
                                if slot.peer_of[c] is not None] for s, slot in slots.items()}
        # per (stage, remote neighbour): the values of its messages, in the order both ends use
        self._reads = {(s, p): slot.read_from(p) for s, slot in slots.items() for p in self._remote_in[s]}
        self._grads_back = {(s, c): [n for n in slot.sent_to(c) if slot.grad_flows(n)]
                            for s, slot in slots.items() for c in self._remote_out[s]}

    # ---- one step -------------------------------------------------------------------------
    def run_step(
        self, inputs: list[torch.Tensor] | None, targets: list[torch.Tensor] | None,
        divisors: list[float] | None = None, fields: Mapping[str, list[torch.Tensor]] | None = None,
        lengths: list[int] | None = None,
    ) -> tuple[torch.Tensor, list[dict], dict[int, torch.Tensor]]:
        """Run this rank's program once. Returns (sum of scaled micro-batch losses held by this
        rank, timing events, model outputs per micro-batch when not training). `inputs` and
        `targets`: this replica's micro-batches of the data, where a stage of this rank reads them
        (a model input, or the targets a loss outside the model scores). `divisors`: per
        micro-batch, the global batch's scored items over its own (`loss_scale` for each if None).
        `fields`: this replica's micro-batches of the batch's extra per-token fields (packed
        documents' `position_ids`), where a stage reads them as a model input. `lengths`: under
        data.buckets, each micro-batch's length, which sets the shape of every message it sends and
        receives (every rank computed the same from the data: no shape travels).

        Event times are `time.perf_counter()` values: CLOCK_MONOTONIC is shared by all processes
        of a machine, so ranks' events line up once the earliest start is subtracted. On a GPU
        they come from CUDA events, read once after the step: nothing in the step waits for the
        device."""
        self._inputs, self._targets = inputs, targets
        # what a stage's model inputs read from the data, by name: built once a step, read per action
        self._data = {**(fields or {}), "input": inputs, "target": targets}
        self._divisors = divisors
        self._lengths = lengths
        self._state: dict[tuple[int, int], MicroBatchState] = {}
        self._fwd_box: dict[tuple[int, int, str], torch.Tensor] = {}  # (consumer, mb, value)
        self._bwd_box: dict[tuple[int, int, str, int], torch.Tensor] = {}  # (producer, mb, value, consumer)
        self._outbox: dict[tuple[Kind, int, int, int], list[torch.Tensor]] = {}  # what a SEND action sends
        self._outputs: dict[int, torch.Tensor] = {}
        # per stage: did any forward output hold a NaN or inf this step (device flags, no sync)
        self.nonfinite = {s: torch.zeros((), dtype=torch.bool, device=self.device) for s in self.slots}
        loss_sum = torch.zeros((), device=self.device)
        clock = StepClock(self.device) if self.record_timings else None
        marks: list[tuple[Action, object, object]] = []
        beat = self.heartbeat.action if self.heartbeat is not None else None
        if self.collectives is not None and self.training:
            self.collectives.begin_step()
        exchanges: list | None = [] if clock is not None and not clock.cuda else None
        record_exchanges(exchanges)
        paired = self._pairs  # none in a forward-only program: a pair's second action is a backward
        self._idle: dict[tuple[str, int, int], float] = {}
        for pos, action in enumerate(self.actions):
            if beat is not None:
                beat(pos)
            if pos - 1 in paired:  # run beside the forward before it
                continue
            if pos in paired:
                loss = self._run_pair(pos, clock, marks)
                if loss is not None:
                    loss_sum += loss
                self.p2p.release_completed()
                continue
            if action.kind in DP_KINDS:
                start = clock.mark() if clock is not None else None
                self.collectives.run(action, pos)
                if clock is not None:
                    marks.append((action, start, clock.mark()))
                continue
            if not action.is_compute:
                self._communicate(action, pos)
                continue
            self._receive_inputs(action)
            if beat is not None:
                beat(pos)
            start = clock.mark() if clock is not None else None
            with self._collectives(action, pos):
                loss = self._dispatch(action)
            if loss is not None:
                loss_sum += loss
            if clock is not None:
                marks.append((action, start, clock.mark()))
            self.p2p.release_completed()
        self.p2p.wait_sends()
        if self.p2p.log is not None:  # one step's order is every step's: log the first only
            self.posting_log, self.p2p.log = self.p2p.log, None
        self._state.clear()
        record_exchanges(None)
        return loss_sum, self._events(clock, marks, exchanges), self._outputs

    def _events(self, clock: StepClock | None, marks: list, exchanges: list | None) -> list[dict]:
        """The step's events: each compute action (a paired one with `busy_s`, its own work: its
        span less the time its partner ran) and each expert all-to-all, on the collectives' lane."""
        events = clock.events(self.pp_rank, marks) if clock is not None else []
        for e in events:
            idle = self._idle.pop((e["kind"], e["stage"], e["mb"]), None)
            if idle is not None:
                e["busy_s"] = max(0.0, e["end_s"] - e["start_s"] - idle)
        return events + [{"rank": self.pp_rank, "action": label, "kind": "A2A", "lane": "dp", "stage": None,
                          "mb": None, "start_s": start, "end_s": end} for label, start, end in exchanges or []]

    def _run_pair(self, pos: int, clock: StepClock | None, marks: list) -> torch.Tensor | None:
        """DualPipe's overlapped pair: the forward at `pos` and the backward after it, each side's
        expert all-to-alls in flight while the other computes (runtime/overlap.py)."""
        actions = (self.actions[pos], self.actions[pos + 1])
        for action in actions:
            self._receive_inputs(action)
        losses: list[torch.Tensor | None] = [None, None]

        def side(i: int) -> Callable[[], None]:
            def run() -> None:
                start = clock.mark() if clock is not None else None
                with self._collectives(actions[i], pos + i):
                    losses[i] = self._dispatch(actions[i])
                if clock is not None:
                    marks.append((actions[i], start, clock.mark()))
            return run

        pair = Pair()
        pair.run(side(0), side(1), self.device)
        for action, side_name in zip(actions, "FB", strict=True):
            self._idle[(action.kind.value, action.stage, action.mb)] = pair.idle_s[side_name]
        return losses[0]  # the forward's loss on a last stage (a backward returns none)

    # ---- communication --------------------------------------------------------------------
    def _communicate(self, action: Action, pos: int) -> None:
        """Post the group of one SEND or RECV action: the values of one edge, in name order."""
        kind, s, mb, other = action.kind, action.stage, action.mb, action.peer
        slot = self.slots[s]
        if kind is Kind.RECV_F:
            names = self._reads[(s, other)]
            self.p2p.post_recv((Kind.F, s, mb, other), message_label("F", other, s, mb), slot.peer_of[other],
                               [self._wire(slot, n, mb) for n in names], pos)
        elif kind is Kind.RECV_B:
            names = self._grads_back[(s, other)]
            self.p2p.post_recv((Kind.B, s, mb, other), message_label("B", s, other, mb), slot.peer_of[other],
                               [self._wire(slot, n, mb) for n in names], pos)
        elif kind is Kind.SEND_F:
            self.p2p.send(message_label("F", s, other, mb), slot.peer_of[other],
                          self._outbox.pop((Kind.F, s, mb, other)))
        elif kind is Kind.SEND_B:
            self.p2p.send(message_label("B", other, s, mb), slot.peer_of[other],
                          self._outbox.pop((Kind.B, s, mb, other), []))
        else:
            raise ValueError(f"{action} is not a communication action")

    def _wire(self, slot: StageSlot, name: str, mb: int) -> tuple[tuple[int, ...], torch.dtype]:
        """The shape and dtype a message of micro-batch `mb` carries of `name`: a scattered value's
        1/tp, flat; its shape at the micro-batch's length under data.buckets."""
        shape, dtype = slot.values[name]
        if self._lengths is not None:
            shape = slot.shapes_at[self._lengths[mb]][name]
        if name not in slot.scatter:
            return shape, dtype
        return (math.prod(shape) // self.tp.size,), dtype

    def _sent(self, slot: StageSlot, name: str, t: torch.Tensor) -> torch.Tensor:
        """What this rank sends of `name` (or of its gradient): its part when it is scattered."""
        return self.tp.part(t) if name in slot.scatter else t

    def _received(self, slot: StageSlot, name: str, t: torch.Tensor, label: str) -> torch.Tensor:
        """A received value whole: a scattered one all-gathered over the tp group (each tp rank
        received its part from its counterpart)."""
        if name not in slot.scatter:
            return t
        return self.tp.gather(t, slot.values[name][0], f"gather {label} {name}")

    def _wait(self, key: tuple[Kind, int, int, int]) -> list[torch.Tensor]:
        if self.heartbeat is not None:  # a stuck rank is reported at the receive it waits on
            position = self.p2p.pending_position(key)
            if position is not None:
                self.heartbeat.action(position)
        return self.p2p.wait_recv(key)

    def _receive_inputs(self, action: Action) -> None:
        """Wait for what a compute action reads from other ranks: a forward its inputs, a backward
        the gradients of its outputs."""
        kind, s, mb = action.kind, action.stage, action.mb
        slot = self.slots[s]
        if kind is Kind.F:
            for p in self._remote_in[s]:
                for name, t in zip(self._reads[(s, p)], self._wait((Kind.F, s, mb, p)), strict=True):
                    self._fwd_box[(s, mb, name)] = self._received(slot, name, t, message_label("F", p, s, mb))
        elif kind in (Kind.B, Kind.I):
            for c in self._remote_out[s]:
                names = self._grads_back[(s, c)]
                if names:
                    for name, t in zip(names, self._wait((Kind.B, s, mb, c)), strict=True):
                        self._bwd_box[(s, mb, name, c)] = self._received(slot, name, t,
                                                                         message_label("B", s, c, mb))

    def _collectives(self, action: Action, pos: int) -> AbstractContextManager:
        """The per-block collectives of a training compute action (nothing without replicas)."""
        if self.collectives is None or not self.training:
            return nullcontext()
        return self.collectives.compute(action, pos)

    def _dispatch(self, action: Action) -> torch.Tensor | None:
        kind, s, mb = action.kind, action.stage, action.mb
        if kind is Kind.F:
            return self._forward(action)
        if kind is Kind.B:
            self._backward(action, full=True)
        elif kind is Kind.I:
            self._backward(action, full=False)
        elif kind is Kind.W:
            around = self.collectives.weight_jobs(s) if self.collectives is not None else None
            backward_weight(self._state.pop((s, mb)).stash, around)
        elif kind is Kind.R:
            self._recompute(action)
        return None

    # ---- compute actions ------------------------------------------------------------------
    def _gather_inputs(self, slot: StageSlot, mb: int) -> dict[str, torch.Tensor]:
        kw = {}
        for name, prod in slot.inputs.items():
            if prod is None:  # a model input: the data's inputs, its targets or an extra field
                what = self.model_inputs.get(name, "input")
                data = self._data.get(what)
                assert data is not None, f"stage {slot.index} reads the data's {what}"
                kw[name] = data[mb]
                continue
            x = self._fwd_box.pop((slot.index, mb, name))
            if self.training and x.is_floating_point():
                x = x.detach().requires_grad_(True)
            kw[name] = x
        return kw

    def _run(self, slot: StageSlot, kw: dict[str, torch.Tensor], mb: int, state: MicroBatchState) -> torch.Tensor | None:
        with self._autocast():
            outs = slot.module(**kw)
            if self.autocast is not None:  # only a compute dtype other than fp32 can change a value's dtype
                outs = _as_planned(outs, slot.values)
            loss = None
            if slot.loss_value is not None and self._targets is not None:
                divisor = self._divisors[mb] if self._divisors is not None else self.loss_scale
                loss = self.loss_fn(outs[slot.loss_value], self._targets[mb]) / divisor
                if divisor == math.inf and not self.training:  # a held-out micro-batch scoring nothing: 0/0
                    loss = loss.nan_to_num(0.0) * 0.0  # (training refuses it before spawn; a NaN is reported)
        state.outputs, state.loss = outs, loss
        return loss

    def _forward(self, action: Action) -> torch.Tensor | None:
        s, mb = action.stage, action.mb
        slot = self.slots[s]
        kw = self._gather_inputs(slot, mb)
        state = MicroBatchState(inputs=kw)
        keep_graph = self.training and s not in self.remat_stages
        if self.training and not keep_graph:  # R replays this forward: same dropout masks
            state.rng = save_rng(self.device)
        with torch.set_grad_enabled(keep_graph):
            loss = self._run(slot, kw, mb, state)
        outs = state.outputs
        flag = self.nonfinite[s]  # checked once per forward, not again when R recomputes it
        for name, t in outs.items():
            if name == slot.loss_value and loss is not None:
                # the scalar loss stands for the logits it scores: a NaN or inf in them reaches it,
                # and reading the logits again cost ~5% of the last rank's step (vocab-wide tensors)
                flag |= ~torch.isfinite(loss.detach())
            elif t.is_floating_point():
                flag |= ~torch.isfinite(t.detach()).all()
        if slot.loss_value is not None and not self.training:
            self._outputs[mb] = outs[slot.loss_value].detach()
        for name, consumers in slot.outputs.items():
            for c in consumers:
                if slot.peer_of[c] is None:  # consumer on this rank: hand over in memory
                    self._fwd_box[(c, mb, name)] = outs[name].detach()
        for c in self._remote_out[s]:
            self._outbox[(Kind.F, s, mb, c)] = [self._sent(slot, n, outs[n]) for n in slot.sent_to(c)]
        if not keep_graph:
            state.outputs = state.loss = None
        if self.training:
            self._state[(s, mb)] = state
        return None if loss is None else loss.detach()

    def _recompute(self, action: Action) -> None:
        slot = self.slots[action.stage]
        state = self._state[(action.stage, action.mb)]
        with torch.enable_grad(), replay_rng(self.device, state.rng):
            self._run(slot, state.inputs, action.mb, state)

    def _backward(self, action: Action, full: bool) -> None:
        s, mb = action.stage, action.mb
        slot = self.slots[s]
        state = self._state[(s, mb)]
        roots, grads = [], []
        if state.loss is not None:
            roots.append(state.loss)
            grads.append(None)
        for name, consumers in slot.outputs.items():
            if not slot.grad_flows(name):
                continue
            total = None
            for c in consumers:
                g = self._bwd_box.pop((s, mb, name, c))
                total = g if total is None else total + g
            out = state.outputs[name]
            if total is not None and out.requires_grad:
                roots.append(out)
                grads.append(total)
        leaves = {n: x for n, x in state.inputs.items() if slot.inputs[n] is not None and x.requires_grad}
        if full:
            if roots:
                torch.autograd.backward(roots, grads)
            input_grads = {n: x.grad for n, x in leaves.items()}
            del self._state[(s, mb)]
        else:
            # the parameters the graph computed with: under sharding the gathered ones, which a
            # block released since holds even when the module holds its shard again
            params = self.collectives.graph_params(s) if self.collectives is not None else None
            if params is None:
                params = [p for p in slot.module.parameters() if p.requires_grad]
            input_grads, state.stash = backward_input(roots, grads, leaves, params)
            state.outputs = state.loss = None
        # an input the graph did not reach gets a zero gradient: its producer still waits for one
        grads = {n: g if (g := input_grads.get(n)) is not None else torch.zeros_like(x) for n, x in leaves.items()}
        for name, g in grads.items():
            prod = slot.inputs[name]
            if slot.peer_of[prod] is None:
                self._bwd_box[(prod, mb, name, s)] = g
        for p in self._remote_in[s]:
            names = [n for n in self._reads[(s, p)] if n in grads]
            if names:
                self._outbox[(Kind.B, s, mb, p)] = [self._sent(slot, n, grads[n]) for n in names]


def save_rng(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The CPU generator's state, and this rank's GPU's when it runs on one."""
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


@contextmanager
def replay_rng(device: torch.device, state: tuple[torch.Tensor, torch.Tensor | None] | None) -> Iterator[None]:
    """Run a recomputation from the random state its forward started from, then put the
    generators back where they were: the forward's dropout masks again, and no effect on the
    random numbers of everything after."""
    if state is None:
        yield
        return
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type=device.type):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], device)
        yield


class StepClock:
    """When each compute action of a step started and ended, on the host's clock.

    On a CPU the actions run on the host: `time.perf_counter()`. On a GPU they run later, on the
    device: a CUDA event is recorded at each mark and all of them are read once the step is over
    (`events`), placed on the host clock by the step's first event. No mark waits for the GPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            self._origin = torch.cuda.Event(enable_timing=True)
            self._origin.record()
            self._origin_host = time.perf_counter()

    def mark(self) -> object:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, mark: object) -> float:
        if not self.cuda:
            return float(mark)
        return self._origin_host + self._origin.elapsed_time(mark) / 1000.0

    def events(self, rank: int, marks: list[tuple[Action, object, object]]) -> list[dict]:
        if self.cuda and marks:
            marks[-1][2].synchronize()  # the step is over: read every event once
        return [{"rank": rank, "action": str(a), "kind": a.kind.value, "stage": a.stage, "mb": a.mb,
                 "start_s": self.seconds(start), "end_s": self.seconds(end)} for a, start, end in marks]
