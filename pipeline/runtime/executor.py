"""Runs one rank's list of actions for one step: the only place pipeline compute happens.

Each stage's forward is its own autograd graph: inputs that come from another stage (remote or
on this rank) are fresh leaves with requires_grad, so a backward action produces exactly the
gradient to hand to the previous stage. The loss of the last stage is divided by
(micro-batches x data-parallel replicas), so summing gradients over micro-batches and replicas
gives the gradient of the global-batch mean loss, as single-process accumulation does.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from pipeline.ir import Action, Kind, Schedule
from pipeline.runtime.backward import WeightGradStash, backward_input, backward_weight
from pipeline.runtime.comm import P2P


@dataclass
class StageSlot:
    """A stage held by this rank and who its neighbours are (global ranks, None if none/local)."""

    index: int
    module: nn.Module
    is_first: bool
    is_last: bool
    input_shape: tuple[int, ...] | None  # shape of what the previous stage sends
    input_dtype: torch.dtype | None
    output_shape: tuple[int, ...]
    output_dtype: torch.dtype
    prev_peer: int | None  # global rank holding stage index-1, if on another rank
    next_peer: int | None  # global rank holding stage index+1, if on another rank


@dataclass
class MicroBatchState:
    """What a (stage, micro-batch) keeps between its forward and its backward."""

    inputs: torch.Tensor | None = None
    output: torch.Tensor | None = None  # with graph (None under remat until R runs)
    loss: torch.Tensor | None = None
    stash: WeightGradStash | None = None


@dataclass
class StepRecord:
    """Per-action timings of one step, relative to the step's start."""

    events: list[dict] = field(default_factory=list)


class Executor:
    def __init__(
        self,
        schedule: Schedule,
        pp_rank: int,
        slots: dict[int, StageSlot],
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        device: torch.device,
        loss_scale: float,
        remat: bool = False,
        record_timings: bool = True,
    ) -> None:
        self.actions = schedule.actions[pp_rank]
        self.training = schedule.training
        self.slots = slots
        self.loss_fn = loss_fn
        self.device = device
        self.loss_scale = loss_scale
        self.remat = remat
        self.record_timings = record_timings
        self.p2p = P2P(schedule.num_microbatches)
        self.pp_rank = pp_rank
        self._recv_positions = [i for i, a in enumerate(self.actions) if a.kind in (Kind.RECV_F, Kind.RECV_B)]

    # ---- one step -------------------------------------------------------------------------
    def run_step(
        self, inputs: list[torch.Tensor] | None, targets: list[torch.Tensor] | None
    ) -> tuple[torch.Tensor, list[dict], dict[int, torch.Tensor]]:
        """Run this rank's program once. Returns (sum of scaled micro-batch losses held by this
        rank, timing events, outputs of the last stage per micro-batch when not training).

        Event times are raw `time.perf_counter()` values: CLOCK_MONOTONIC is shared by all
        processes of a machine, so ranks' events line up once the earliest start is subtracted."""
        self._inputs, self._targets = inputs, targets
        self._state: dict[tuple[int, int], MicroBatchState] = {}
        self._local_fwd: dict[tuple[int, int], torch.Tensor] = {}
        self._local_bwd: dict[tuple[int, int], torch.Tensor] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        loss_sum = torch.zeros((), device=self.device)
        events: list[dict] = []
        next_recv = 0
        for pos, action in enumerate(self.actions):
            # keep `lookahead` receives posted ahead of where the program is
            while next_recv < len(self._recv_positions) and self._recv_positions[next_recv] <= pos + self._window():
                self._post(self.actions[self._recv_positions[next_recv]])
                next_recv += 1
            start = time.perf_counter() if self.record_timings else 0.0
            loss = self._dispatch(action)
            if loss is not None:
                loss_sum = loss_sum + loss
            if self.record_timings and action.is_compute:
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                end = time.perf_counter()
                events.append({"rank": self.pp_rank, "action": str(action), "kind": action.kind.value,
                               "stage": action.stage, "mb": action.mb, "start_s": start, "end_s": end})
        self.p2p.wait_sends()
        self._state.clear()
        return loss_sum, events, self._outputs

    def _window(self) -> int:
        return 2 * self.p2p.lookahead + 1

    def _post(self, action: Action) -> None:
        slot = self.slots[action.stage]
        if action.kind is Kind.RECV_F:
            self.p2p.post_recv(action, slot.prev_peer, slot.input_shape, slot.input_dtype, self.device)
        else:
            self.p2p.post_recv(action, slot.next_peer, slot.output_shape, slot.output_dtype, self.device)

    def _dispatch(self, action: Action) -> torch.Tensor | None:
        kind = action.kind
        if kind is Kind.F:
            return self._forward(action)
        if kind is Kind.B:
            self._backward(action, full=True)
        elif kind is Kind.I:
            self._backward(action, full=False)
        elif kind is Kind.W:
            self._weight(action)
        elif kind is Kind.R:
            self._recompute(action)
        elif kind is Kind.RECV_F:
            self._local_fwd[(action.stage, action.mb)] = self.p2p.take_recv(action)
        elif kind is Kind.RECV_B:
            self._local_bwd[(action.stage, action.mb)] = self.p2p.take_recv(action)
        elif kind is Kind.SEND_F:
            state = self._state[(action.stage, action.mb)]
            self.p2p.send(action, self.slots[action.stage].next_peer, state.output)
            if not self.training:
                del self._state[(action.stage, action.mb)]
            elif self.remat:
                state.output = None
        elif kind is Kind.SEND_B:
            grad = self._local_bwd.pop(("in", action.stage, action.mb))
            self.p2p.send(action, self.slots[action.stage].prev_peer, grad)
        return None

    # ---- compute actions ------------------------------------------------------------------
    def _stage_input(self, slot: StageSlot, mb: int) -> torch.Tensor:
        if slot.is_first:
            assert self._inputs is not None, "first stage needs input micro-batches"
            return self._inputs[mb]
        x = self._local_fwd.pop((slot.index, mb))
        if self.training and x.is_floating_point():
            x = x.detach().requires_grad_(True)
        return x

    def _forward(self, action: Action) -> torch.Tensor | None:
        slot = self.slots[action.stage]
        x = self._stage_input(slot, action.mb)
        keep_graph = self.training and not self.remat
        with torch.set_grad_enabled(keep_graph):
            out = slot.module(x)
        state = MicroBatchState(inputs=x if self.training else None, output=out)
        self._state[(action.stage, action.mb)] = state
        loss = None
        if slot.is_last:
            if self._targets is not None:
                with torch.set_grad_enabled(keep_graph):
                    scaled = self.loss_fn(out, self._targets[action.mb]) / self.loss_scale
                state.loss = scaled if keep_graph else None
                loss = scaled.detach()
            if not self.training:
                self._outputs[action.mb] = out.detach()
            state.output = None if not keep_graph else out
        elif slot.next_peer is None:  # next stage lives on this rank: hand over in memory
            self._local_fwd[(action.stage + 1, action.mb)] = out.detach()
            if not keep_graph:
                state.output = None
        if not self.training and (slot.is_last or slot.next_peer is None):
            del self._state[(action.stage, action.mb)]
        return loss

    def _recompute(self, action: Action) -> None:
        slot = self.slots[action.stage]
        state = self._state[(action.stage, action.mb)]
        with torch.enable_grad():
            state.output = slot.module(state.inputs)
            if slot.is_last and self._targets is not None:
                state.loss = self.loss_fn(state.output, self._targets[action.mb]) / self.loss_scale

    def _roots(self, slot: StageSlot, action: Action, state: MicroBatchState) -> tuple[torch.Tensor, torch.Tensor | None]:
        if slot.is_last:
            return state.loss, None
        return state.output, self._local_bwd.pop((action.stage, action.mb))

    def _backward(self, action: Action, full: bool) -> None:
        slot = self.slots[action.stage]
        key = (action.stage, action.mb)
        state = self._state[key]
        root, grad = self._roots(slot, action, state)
        x = state.inputs
        needs_input_grad = isinstance(x, torch.Tensor) and x.requires_grad
        if full:
            torch.autograd.backward(root, grad)
            input_grad = x.grad if needs_input_grad else None
            del self._state[key]
        else:
            input_grad, state.stash = backward_input(root, grad, x if needs_input_grad else None, slot.module)
            state.output = state.loss = None
        if input_grad is not None:
            self._hand_back(slot, action.mb, input_grad)

    def _hand_back(self, slot: StageSlot, mb: int, input_grad: torch.Tensor) -> None:
        if slot.prev_peer is None:  # previous stage on this rank
            self._local_bwd[(slot.index - 1, mb)] = input_grad
        else:
            self._local_bwd[("in", slot.index, mb)] = input_grad

    def _weight(self, action: Action) -> None:
        state = self._state.pop((action.stage, action.mb))
        backward_weight(state.stash)
