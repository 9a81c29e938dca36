"""Data-parallel sharding (`zero=1|2|3`): torch's FSDP2 over each stage's replicas, driven by the schedule.

Each stage module of this rank is wrapped with `fully_shard` on the data-parallel group (a 1-D
DeviceMesh over the replicas of this pipeline rank): its parameters become DTensors sharded on
dim 0, the optimizer (built after) holds a shard's states, and DCP checkpoints write each shard.
FSDP2's own hooks gather a stage's parameters for its forward; everything else is decided here,
per compute action of the schedule, because the schedule splits backwards into input (I) and
weight (W) halves and interleaves micro-batches, which FSDP2's autograd hooks cannot see (as
torch.distributed.pipelining does with its explicit unshard / reshard / reduce-grad calls):

- zero=1: a stage's parameters stay gathered from its first forward to its last backward of the
  step; gradients accumulate whole and are reduce-scattered once, when the stage's last backward
  action of the step has run; each replica's optimizer steps its shard.
- zero=2: as 1, but the gradients are reduce-scattered after every micro-batch's backward (its B,
  or its W when split), so only one micro-batch's whole gradients exist at a time.
- zero=3: as 2, and the parameters are gathered around every compute action (FSDP2 reshards after
  each forward; B, I, W and R gather explicitly and release after) instead of for the whole step.

At every level the gathered parameters are released when the stage's last backward is done, so
between steps a replica holds its shards only. A parameter that several stages hold (tied
weights, `Plan.shared_params`) stays whole on every replica and is all-reduced as at zero=0: FSDP2
manages a parameter within one module only. The executor's loss is already divided by
dp x micro-batches, so FSDP2's own division of the reduced gradient is turned off.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from pipelaunch.pipeline.core.ir import Action, Kind
from pipelaunch.pipeline.core.plan import Plan
from pipelaunch.pipeline.core.precision import PRECISIONS

#: compute actions that run a stage's backward graph (R runs its forward again, through FSDP2's hooks)
_BACKWARD = (Kind.B, Kind.I, Kind.W)


def mixed_precision(precision: str) -> MixedPrecisionPolicy:
    """FSDP2's policy for `precision`: under bf16 the all-gather and the compute use bf16 copies
    of the parameters, while the shards (the optimizer's master weights), their states and the
    reduce-scatter stay fp32 (docs/sharding.md "Mixed precision"). A stage's floating inputs are
    cast to bf16 (a CPU LayerNorm with bf16 weights refuses fp32 ones); autocast stays on, and the
    executor casts its outputs to the dtypes the plan records for them."""
    compute = PRECISIONS[precision]
    if compute is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: a DTensor's local shard, any other tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


class ShardedStages:
    """This rank's stages under FSDP2 at one zero level, told by the executor around each compute
    action (`before` / `after`) when to gather, release and reduce."""

    def __init__(self, level: int, plan: Plan, modules: dict[int, nn.Module], actions: list[Action],
                 dp_group: dist.ProcessGroup, device: torch.device) -> None:
        self.level = level
        mesh = DeviceMesh.from_group(dp_group, device.type)
        replicated_names = set(plan.shared_params)
        self.units: dict[int, FSDPModule] = {}
        self.replicated: list[nn.Parameter] = []
        for s, module in modules.items():
            named = dict(module.named_model_parameters())
            kept = {p for n, p in named.items() if n in replicated_names}
            self.replicated += [p for p in kept if all(p is not q for q in self.replicated)]
            if len(kept) == len({id(p) for p in named.values()}):
                continue  # nothing of this stage to shard
            fully_shard(module, mesh=mesh, reshard_after_forward=level == 3, ignored_params=kept,
                        mp_policy=mixed_precision(plan.meta.precision))
            # the loss is already divided by dp x micro-batches: a plain sum (no PREMUL_SUM, which
            # gloo lacks; NCCL's zero-copy path needs SUM too)
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
            self.units[s] = module
        self.completes, self.last = _gradient_points(actions)

    def begin_step(self) -> None:
        """Gradients accumulate locally and parameters stay gathered until this class says otherwise."""
        for unit in self.units.values():
            unit.set_requires_gradient_sync(False)
            unit.set_reshard_after_backward(False)
            unit.set_is_last_backward(False)

    def before(self, action: Action) -> None:
        unit = self.units.get(action.stage)
        if unit is not None and self.level == 3 and action.kind in _BACKWARD:
            unit.unshard()

    def after(self, action: Action, pos: int) -> None:
        unit = self.units.get(action.stage)
        if unit is None or action.kind not in _BACKWARD:
            return
        key = (action.stage, action.mb)
        if self.last.get(action.stage) == pos:
            self._reduce(unit, final=True)
        elif self.completes.get(key) == pos and self.level >= 2:
            self._reduce(unit, final=False)
        if self.level == 3 and self.last.get(action.stage) != pos:
            unit.reshard()

    @staticmethod
    def _reduce(unit: FSDPModule, final: bool) -> None:
        """Reduce-scatter the stage's whole gradients into its shard (accumulating there); `final`:
        its last of the step, which also waits for the reductions and releases the parameters."""
        unit.set_requires_gradient_sync(True)
        unit.set_reshard_after_backward(final)
        unit.set_is_last_backward(final)
        state = fully_shard.state(unit)
        for each in state._state_ctx.all_states:
            for group in each._fsdp_param_groups:
                group.post_backward()
        if final:
            state._root_post_backward_final_callback()
        else:
            unit.set_requires_gradient_sync(False)
            unit.set_reshard_after_backward(False)


def _gradient_points(actions: list[Action]) -> tuple[dict[tuple[int, int], int], dict[int, int]]:
    """Per (stage, micro-batch), the position of the action after which its weight gradients are
    complete (its W when the backward is split, else its B); per stage the last of those."""
    completes: dict[tuple[int, int], int] = {}
    has_w = {(a.stage, a.mb) for a in actions if a.kind is Kind.W}
    for pos, a in enumerate(actions):
        if a.kind is Kind.W or (a.kind is Kind.B and (a.stage, a.mb) not in has_w):
            completes[(a.stage, a.mb)] = pos
    last: dict[int, int] = {}
    for (stage, _), pos in completes.items():
        last[stage] = max(pos, last.get(stage, -1))
    return completes, last
