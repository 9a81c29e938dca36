"""Runs one rank's list of actions for one step: the only place pipeline compute happens.

Stages exchange *named values*: a stage reads some values (from the data, from earlier stages on
this rank, or received from other ranks) and produces values for later stages, which may be
several stages further down (skip connections). Each stage's forward is its own autograd graph:
every value it reads from another stage becomes a fresh leaf with requires_grad, so its backward
yields exactly the gradients to hand back to the producers. The last stage divides the loss by
(micro-batches x data-parallel replicas), so summing gradients over micro-batches and replicas
gives the gradient of the global-batch mean loss, as single-process accumulation does.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn

from pipeline.ir import Action, Kind, Schedule
from pipeline.runtime.backward import WeightGradStash, backward_input, backward_weight
from pipeline.runtime.comm import BACKWARD, FORWARD, P2P, RecvSpec, message_tag
from pipeline.runtime.heartbeat import Heartbeat


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
    edge_id: dict[tuple[int, int, str], int] = field(default_factory=dict)

    @property
    def is_last(self) -> bool:
        return self.loss_value is not None

    def grad_flows(self, name: str) -> bool:
        """Gradients travel back along a value only if it is floating point (static, both ends agree)."""
        return self.values[name][1].is_floating_point


@dataclass
class MicroBatchState:
    """What a (stage, micro-batch) keeps between its forward and its backward."""

    inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    outputs: dict[str, torch.Tensor] | None = None  # with graph (None under remat until R runs)
    loss: torch.Tensor | None = None
    stash: WeightGradStash | None = None


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
        lookahead: int = 4,
        autocast: torch.dtype | None = None,
        heartbeat: Heartbeat | None = None,
    ) -> None:
        self.actions = schedule.actions[pp_rank]
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
        self.p2p = P2P(device)
        self.lookahead = lookahead
        self._recv_positions = [i for i, a in enumerate(self.actions) if a.kind in (Kind.RECV_F, Kind.RECV_B)]
        self._params = {s: [p for p in slot.module.parameters() if p.requires_grad] for s, slot in slots.items()}

    # ---- one step -------------------------------------------------------------------------
    def run_step(
        self, inputs: list[torch.Tensor] | None, targets: list[torch.Tensor] | None
    ) -> tuple[torch.Tensor, list[dict], dict[int, torch.Tensor]]:
        """Run this rank's program once. Returns (sum of scaled micro-batch losses held by this
        rank, timing events, model outputs per micro-batch when not training).

        Event times are raw `time.perf_counter()` values: CLOCK_MONOTONIC is shared by all
        processes of a machine, so ranks' events line up once the earliest start is subtracted."""
        self._inputs, self._targets = inputs, targets
        self._state: dict[tuple[int, int], MicroBatchState] = {}
        self._fwd_box: dict[tuple[int, int, str], torch.Tensor] = {}  # (consumer, mb, value)
        self._bwd_box: dict[tuple[int, int, str, int], torch.Tensor] = {}  # (producer, mb, value, consumer)
        self._grads_out: dict[tuple[int, int], dict[str, torch.Tensor]] = {}  # input grads awaiting SEND_B
        self._outputs: dict[int, torch.Tensor] = {}
        # per stage: did any forward output hold a NaN or inf this step (device flags, no sync)
        self.nonfinite = {s: torch.zeros((), dtype=torch.bool, device=self.device) for s in self.slots}
        loss_sum = torch.zeros((), device=self.device)
        events: list[dict] = []
        next_recv, n_recv = 0, len(self._recv_positions)
        timed = self.record_timings
        beat = self.heartbeat.action if self.heartbeat is not None else None
        for pos, action in enumerate(self.actions):
            if beat is not None:
                beat(pos)
            while next_recv < n_recv and self._recv_positions[next_recv] <= pos + self.lookahead:
                self._post(self.actions[self._recv_positions[next_recv]])
                next_recv += 1
            start = time.perf_counter() if timed else 0.0
            loss = self._dispatch(action)
            if loss is not None:
                loss_sum += loss
            if timed and action.kind not in (Kind.SEND_F, Kind.SEND_B, Kind.RECV_F, Kind.RECV_B):
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                events.append({"rank": self.pp_rank, "action": str(action), "kind": action.kind.value,
                               "stage": action.stage, "mb": action.mb, "start_s": start,
                               "end_s": time.perf_counter()})
        self.p2p.wait_sends()
        self._state.clear()
        return loss_sum, events, self._outputs

    # ---- communication --------------------------------------------------------------------
    def _tag(self, slot: StageSlot, producer: int, consumer: int, name: str, mb: int, direction: int) -> int:
        return message_tag(slot.edge_id[(producer, consumer, name)], mb, direction, self.m)

    def _post(self, action: Action) -> None:
        slot = self.slots[action.stage]
        s, mb = action.stage, action.mb
        specs = []
        if action.kind is Kind.RECV_F:
            for name, prod in slot.inputs.items():
                if prod is not None and slot.peer_of[prod] is not None:
                    shape, dtype = slot.values[name]
                    specs.append(RecvSpec(name, slot.peer_of[prod], shape, dtype, self._tag(slot, prod, s, name, mb, FORWARD)))
        else:
            for name, consumers in slot.outputs.items():
                if not slot.grad_flows(name):
                    continue
                for c in consumers:
                    if slot.peer_of[c] is not None:
                        shape, dtype = slot.values[name]
                        specs.append(RecvSpec((name, c), slot.peer_of[c], shape, dtype,
                                              self._tag(slot, s, c, name, mb, BACKWARD)))
        self.p2p.post(action, specs)

    def _dispatch(self, action: Action) -> torch.Tensor | None:
        kind, s, mb = action.kind, action.stage, action.mb
        if kind is Kind.F:
            return self._forward(action)
        if kind is Kind.B:
            self._backward(action, full=True)
        elif kind is Kind.I:
            self._backward(action, full=False)
        elif kind is Kind.W:
            backward_weight(self._state.pop((s, mb)).stash)
        elif kind is Kind.R:
            self._recompute(action)
        elif kind is Kind.RECV_F:
            for name, t in self.p2p.take(action).items():
                self._fwd_box[(s, mb, name)] = t
        elif kind is Kind.RECV_B:
            for (name, c), t in self.p2p.take(action).items():
                self._bwd_box[(s, mb, name, c)] = t
        elif kind is Kind.SEND_F:
            self._send_forward(action)
        elif kind is Kind.SEND_B:
            slot = self.slots[s]
            # nothing to send when every cross-rank input is non-differentiable (an integer or bool
            # mask, say): lowering adds SEND_B per remote producer edge, whatever its dtype
            for name, grad in self._grads_out.pop((s, mb), {}).items():
                prod = slot.inputs[name]
                self.p2p.send(grad, slot.peer_of[prod], self._tag(slot, prod, s, name, mb, BACKWARD))
        return None

    def _send_forward(self, action: Action) -> None:
        s, mb = action.stage, action.mb
        slot = self.slots[s]
        state = self._state[(s, mb)]
        for name, consumers in slot.outputs.items():
            for c in consumers:
                if slot.peer_of[c] is not None:
                    self.p2p.send(state.outputs[name], slot.peer_of[c], self._tag(slot, s, c, name, mb, FORWARD))
        if not self.training:
            del self._state[(s, mb)]
        elif s in self.remat_stages:
            state.outputs = None

    # ---- compute actions ------------------------------------------------------------------
    def _gather_inputs(self, slot: StageSlot, mb: int) -> dict[str, torch.Tensor]:
        kw = {}
        for name, prod in slot.inputs.items():
            if prod is None:
                assert self._inputs is not None, f"stage {slot.index} reads the model input"
                kw[name] = self._inputs[mb]
                continue
            x = self._fwd_box.pop((slot.index, mb, name))
            if self.training and x.is_floating_point():
                x = x.detach().requires_grad_(True)
            kw[name] = x
        return kw

    def _run(self, slot: StageSlot, kw: dict[str, torch.Tensor], mb: int, state: MicroBatchState) -> torch.Tensor | None:
        with self._autocast():
            outs = slot.module(**kw)
            loss = None
            if slot.loss_value is not None and self._targets is not None:
                loss = self.loss_fn(outs[slot.loss_value], self._targets[mb]) / self.loss_scale
        state.outputs, state.loss = outs, loss
        return loss

    def _forward(self, action: Action) -> torch.Tensor | None:
        s, mb = action.stage, action.mb
        slot = self.slots[s]
        kw = self._gather_inputs(slot, mb)
        state = MicroBatchState(inputs=kw)
        keep_graph = self.training and s not in self.remat_stages
        with torch.set_grad_enabled(keep_graph):
            loss = self._run(slot, kw, mb, state)
        outs = state.outputs
        flag = self.nonfinite[s]  # checked once per forward, not again when R recomputes it
        for t in outs.values():
            if t.is_floating_point():
                flag |= ~torch.isfinite(t.detach()).all()
        if slot.loss_value is not None and not self.training:
            self._outputs[mb] = outs[slot.loss_value].detach()
        has_remote = False
        for name, consumers in slot.outputs.items():
            for c in consumers:
                if slot.peer_of[c] is None:  # consumer on this rank: hand over in memory
                    self._fwd_box[(c, mb, name)] = outs[name].detach()
                else:
                    has_remote = True
        if not keep_graph and not has_remote:
            state.outputs = state.loss = None
        if self.training or has_remote:
            self._state[(s, mb)] = state
        return None if loss is None else loss.detach()

    def _recompute(self, action: Action) -> None:
        slot = self.slots[action.stage]
        state = self._state[(action.stage, action.mb)]
        with torch.enable_grad():
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
            input_grads, state.stash = backward_input(roots, grads, leaves, self._params[s])
            state.outputs = state.loss = None
        remote: dict[str, torch.Tensor] = {}
        for name, x in leaves.items():
            g = input_grads.get(name)
            if g is None:
                g = torch.zeros_like(x)
            prod = slot.inputs[name]
            if slot.peer_of[prod] is None:
                self._bwd_box[(prod, mb, name, s)] = g
            else:
                remote[name] = g
        if remote:
            self._grads_out[(s, mb)] = remote
