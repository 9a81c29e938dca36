"""Data-parallel sharding (`zero=1|2|3`): torch's FSDP2 over each stage's replicas, driven by the program.

Each stage module of this rank is wrapped with `fully_shard` on the data-parallel group (a 1-D
DeviceMesh over the replicas of this pipeline rank): its parameters become DTensors sharded on
dim 0, the optimizer (built after) holds a shard's states, and DCP checkpoints write each shard.
When to gather, release and reduce is not left to FSDP2's autograd hooks, which cannot see a
backward split into input (I) and weight (W) halves or micro-batches interleaved across stages:
the planner places UNSHARD, RESHARD and REDUCE_GRAD actions in the rank's program
(planner/passes/data_parallel.py says where, per level) and `run` carries each out, as
torch.distributed.pipelining does with its explicit unshard / reshard / reduce-grad calls.
FSDP2 never reshards on its own (reshard_after_forward and reshard_after_backward are off), so a
stage's parameters are gathered exactly between its UNSHARD and its RESHARD.

A stage's last REDUCE_GRAD of the step also waits for its reductions and finishes FSDP2's backward
state. A parameter that several stages hold (tied weights, `Plan.shared_params`) stays whole on
every replica and is all-reduced after the step as at zero=0: FSDP2 manages a parameter within one
module only. The executor's loss is already divided by dp x micro-batches, so FSDP2's own division
of the reduced gradient is turned off.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from pipelaunch.pipeline.core.ir import Action, Kind
from pipelaunch.pipeline.core.plan import Plan
from pipelaunch.pipeline.core.precision import PRECISIONS
from pipelaunch.pipeline.runtime.dp import require_reductions, tied_params
from pipelaunch.pipeline.runtime.tied_cast import CastOnUse


def mixed_precision(precision: str) -> MixedPrecisionPolicy:
    """FSDP2's policy for `precision`: under bf16 the all-gather and the compute use bf16 copies
    of the parameters, while the shards (the optimizer's master weights), their states and the
    reduce-scatter stay fp32 (docs/sharding.md "Mixed precision"). A stage's floating inputs are
    cast to bf16 (a CPU LayerNorm with bf16 weights refuses fp32 ones), and so are its tied
    parameters where it reads them (`CastOnUse`); autocast stays on, and the executor casts its
    outputs to the dtypes the plan records for them."""
    compute = PRECISIONS[precision]
    if compute is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)


def replica_mesh(dp_group: dist.ProcessGroup, device: torch.device, dp: int, pp: int,
                 dp_shard: int | None) -> DeviceMesh:
    """The mesh FSDP2 shards this rank's stages over: its replicas (1-D), or under hybrid sharding
    (`dp_shard` < dp) replicas x shards (2-D: FSDP2 reduce-scatters within a group of `dp_shard`
    and all-reduces the shards across the groups). Ranks are laid out dp-major (RankContext), so a
    group of consecutive replicas is a node's when pp x dp_shard ranks fill a node. Collective: every
    rank calls it."""
    if dp_shard is None or dp_shard == dp:
        return DeviceMesh.from_group(dp_group, device.type)
    world = init_device_mesh(device.type, (dp // dp_shard, dp_shard, pp), mesh_dim_names=("replicate", "shard", "pp"))
    return world["replicate", "shard"]


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: a DTensor's local shard, any other tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


class ShardedStages:
    """This rank's stages under FSDP2, carrying out the program's data-parallel actions."""

    def __init__(self, plan: Plan, modules: dict[int, nn.Module], actions: list[Action], mesh: DeviceMesh) -> None:
        #: the replicas a shard spans: a clipping norm sums the shards' squares over them
        self.shard_group = (mesh if mesh.ndim == 1 else mesh["shard"]).get_group()
        #: tied parameters, which FSDP2 leaves alone (runtime/dp.py all-reduces them after the step)
        self.replicated = tied_params(plan, modules)
        self.units: dict[int, FSDPModule] = {}
        for s, module in modules.items():
            named = dict(module.named_model_parameters())
            kept = {p for n, p in named.items() if n in plan.shared_params}
            if len(kept) == len({id(p) for p in named.values()}):
                continue  # nothing of this stage to shard
            policy = mixed_precision(plan.meta.precision)
            fully_shard(module, mesh=mesh, reshard_after_forward=False, ignored_params=kept, mp_policy=policy)
            if kept and policy.param_dtype is not None:
                # the tied parameters FSDP2 leaves alone are read in the policy's dtype too, or an
                # fp32 one meets bf16 ones in an op autocast does not cast (runtime/tied_cast.py)
                CastOnUse(module.gm, list(kept), policy.param_dtype)
            # the loss is already divided by dp x micro-batches: a plain sum (no PREMUL_SUM, which
            # gloo lacks; NCCL's zero-copy path needs SUM too)
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
            # a parameter one replica's data left unused (an MoE expert no token chose) still takes
            # part: every replica reduce-scatters the same tensors, or the collective mismatches
            module.set_reduce_scatter_unused_params(True)
            self.units[s] = module
        #: per sharded stage, the parameters' elements its collectives move (what the order check logs)
        self.numel = {s: sum(p.numel() for p in unit.parameters()) for s, unit in self.units.items()}
        require_reductions(actions, list(self.units))
        reductions = [pos for pos, a in enumerate(actions) if a.kind is Kind.REDUCE_GRAD]
        #: per stage, the position of its last reduction of the step
        self.last = {actions[pos].stage: pos for pos in reductions}
        #: what this rank issued, in order (debug.record_p2p: replicas must agree)
        self.issued: list[str] | None = None

    def begin_step(self) -> None:
        """Gradients accumulate whole and parameters stay as they are until an action says otherwise."""
        for unit in self.units.values():
            unit.set_requires_gradient_sync(False)
            unit.set_reshard_after_backward(False)
            unit.set_is_last_backward(False)

    def run(self, action: Action, pos: int) -> None:
        unit = self.units.get(action.stage)
        if unit is None:
            return
        if self.issued is not None:
            self.issued.append(f"{action} {self.numel[action.stage]} elements")
        if action.kind is Kind.UNSHARD:
            unit.unshard()
        elif action.kind is Kind.RESHARD:
            unit.reshard()
        elif action.kind is Kind.REDUCE_GRAD:
            self._reduce(unit, final=self.last.get(action.stage) == pos)

    def finish(self) -> None:
        """Nothing left in flight: a stage's last reduction waited for its own."""

    def release(self) -> None:
        """Back to the shards (after an evaluation, whose forwards gathered the parameters)."""
        for unit in self.units.values():
            unit.reshard()

    @staticmethod
    def _reduce(unit: FSDPModule, final: bool) -> None:
        """Reduce-scatter the stage's whole gradients into its shard (accumulating there); `final`:
        its last of the step, which also waits for the reductions."""
        unit.set_requires_gradient_sync(True)
        unit.set_is_last_backward(final)
        state = fully_shard.state(unit)
        for each in state._state_ctx.all_states:
            for group in each._fsdp_param_groups:
                group.post_backward()
        if final:
            state._root_post_backward_final_callback()
        unit.set_requires_gradient_sync(False)
