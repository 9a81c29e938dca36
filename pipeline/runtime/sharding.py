"""Data-parallel sharding (`zero=1|2|3`): torch's FSDP2 over each stage's replicas, one unit per block.

Each block of a stage (its units: pipeline/graph/units.py, a transformer layer, a U-Net block) is
wrapped with `fully_shard` on the data-parallel group (a DeviceMesh over the replicas of this
pipeline rank), then the stage module itself, which keeps the parameters of no block (the root
unit). The parameters become DTensors sharded on dim 0, the optimizer (built after) holds a shard's
states, and DCP checkpoints write each shard. When to gather, release and reduce is not left to
FSDP2's module hooks, which an export-traced stage never calls (it reads its weights by
`get_attr`) and which cannot see a backward split into input (I) and weight (W) halves: they are
removed, and a `ShardedStage` (runtime/stage_driver.py) drives each unit's FSDP2 parameter group
from the hooks rewritten into the stage's graph (runtime/unit_hooks.py) and from the program's
UNSHARD, RESHARD and REDUCE_GRAD actions (planner/passes/data_parallel.py):

- zero=1 and 2: the stage's units are gathered at its first compute of the step (UNSHARD) and
  released after its last reduction (RESHARD); zero=2 reduce-scatters each unit's gradients as
  the backward finishes them, in every micro-batch; zero=1 in the stage's last backward only;
- zero=3: each unit is gathered as it begins (the next prefetched) and, with `reshard=use`,
  released as it ends, in the forward and again in the backward; with `reshard=run` it stays
  gathered until the RESHARD that ends the stage's run of consecutive actions.

Under expert parallelism a rank's experts are held by its `dp / ep` expert replicas only: at ep = dp
by no other (they stay out of FSDP2, whole), and for 1 < ep < dp each experts module is wrapped first
on the mesh of those replicas (`expert_dp`), a second group driven with the unit holding it, right
after the unit's own (docs/sharding.md "Experts").

A parameter that several stages hold (tied weights, `Plan.shared_params`) stays whole on every
replica and is all-reduced after the step as at zero=0: FSDP2 manages a parameter within one
module only. The executor's loss is already divided by dp x micro-batches, so FSDP2's own division
of the reduced gradient is turned off.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
from torch.distributed.tensor import DTensor

from pipelaunch.pipeline.core.ir import Action, Kind
from pipelaunch.pipeline.core.plan import Plan
from pipelaunch.pipeline.core.precision import PRECISIONS
from pipelaunch.pipeline.graph.units import StageUnits, Unit
from pipelaunch.pipeline.runtime import unit_hooks
from pipelaunch.pipeline.runtime.dp import require_reductions, tied_params
from pipelaunch.pipeline.runtime.experts import expert_holders
from pipelaunch.pipeline.runtime.gloo_comm import InPlaceAllGather, InPlaceReduceScatter
from pipelaunch.pipeline.runtime.stage import module_units
from pipelaunch.pipeline.runtime.stage_driver import RankStages, StageDriver
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


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: a DTensor's local shard, any other tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def unit_modules(gm: nn.Module, unit: Unit, kept: set[int]) -> list[nn.Module] | None:
    """The submodules whose parameters are exactly the unit's (tied ones, `kept`, aside): each
    parameter's module, lifted to an ancestor while the ancestor holds nothing else. None when no
    such set exists (a module holding the unit's parameter beside another unit's)."""
    mine = set(unit.params)

    def holds_only_mine(path: str) -> bool:
        module = gm.get_submodule(path)
        return all(f"{path}.{n}" in mine or id(p) in kept for n, p in module.named_parameters(remove_duplicate=False))

    chosen: set[str] = set()
    for name in unit.params:
        path = name.rpartition(".")[0]
        if not path or not holds_only_mine(path):
            return None
        while "." in path and holds_only_mine(path.rpartition(".")[0]):
            path = path.rpartition(".")[0]
        chosen.add(path)
    outer = sorted(p for p in chosen if not any(p.startswith(f"{q}.") for q in chosen))
    return [gm.get_submodule(p) for p in outer]


def _cast_inputs(dtype: torch.dtype, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    def cast(t: object) -> object:
        return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
    return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}


def _drop_shards(group: FSDPParamGroup) -> None:
    """Return the memory of the group's shards (its parameters are gathered whole, in the shards'
    dtype: each shard is a slice of them). Nothing reads a shard until `_refill_shards`: the
    optimizer steps after the stage's RESHARD, and gradients reduce into separate tensors."""
    for fp in group.fsdp_params:
        fp._sharded_param_data.untyped_storage().resize_(0)


def _refill_shards(group: FSDPParamGroup) -> None:
    """The shards back, from this replica's slice of the gathered parameters (FSDP2 lays a gathered
    parameter out shard after padded shard, in the order of the shard group's ranks)."""
    with torch.no_grad():
        for fp in group.fsdp_params:
            data = fp._sharded_param_data
            n = data.numel()
            data.untyped_storage().resize_(n * data.element_size())
            if n:
                data.copy_(fp.all_gather_outputs[0].narrow(0, fp.mesh_info.shard_mesh_rank * n, n))


def _next_compute_kinds(actions: list[Action]) -> dict[int, Kind]:
    """Per UNSHARD position, the kind of its stage's next compute action (one pass from the end)."""
    ahead: dict[int, Kind] = {}
    out: dict[int, Kind] = {}
    for pos in range(len(actions) - 1, -1, -1):
        a = actions[pos]
        if a.is_compute:
            ahead[a.stage] = a.kind
        elif a.kind is Kind.UNSHARD and a.stage in ahead:
            out[pos] = ahead[a.stage]
    return out


def _group(module: nn.Module) -> FSDPParamGroup | None:
    groups = fully_shard.state(module)._fsdp_param_groups
    return groups[0] if groups else None


def _unit_of_holder(units: StageUnits, path: str, holder: nn.Module) -> int:
    """The unit (forward order; len(units.units): the root) whose parameters hold an experts module's."""
    first = f"{path}.{next(iter(holder.named_parameters()))[0]}"
    return next((i for i, u in enumerate(units.units) if first in u.params), len(units.units))


#: per unit, its FSDP2 groups with their names in the collective log
UnitGroups = list[list[tuple[str, FSDPParamGroup]]]


class ShardedStage(StageDriver):
    """One stage under FSDP2, one parameter group per unit (and the root's), driven explicitly. With
    the experts sharded over their expert replicas (zero >= 1, 1 < ep < dp: `expert_mesh`), each
    experts module is a group of its own on that mesh, gathered, released and reduced with the unit
    whose parameters hold it, right after that unit's own group."""

    def __init__(self, plan: Plan, stage: int, module: nn.Module, actions: list[Action], mesh: DeviceMesh,
                 expert_mesh: DeviceMesh | None = None) -> None:
        experts = getattr(module, "expert_params", ())
        # tied parameters, and under ep == dp (no `expert_mesh`) this rank's experts (no other
        # replica holds them), stay out of FSDP2: whole, reduced elsewhere or not at all
        kept_params = [p for n, p in module.named_model_parameters()
                       if n in plan.shared_params or (expert_mesh is None and n in experts)]
        kept = {id(p) for p in kept_params}
        units = module_units(module, plan)
        covered = [(u, unit_modules(module.gm, u, kept)) for u in units.units]
        # a unit no clean set of modules holds joins the root (its parameters gathered per action)
        units = StageUnits(tuple(u for u, mods in covered if mods is not None),
                           units.root + tuple(p for u, mods in covered if mods is None for p in u.params))
        super().__init__(stage, units, actions, plan.meta.zero, plan.meta.reshard)
        policy = mixed_precision(plan.meta.precision)
        holders = expert_holders(module.gm) if expert_mesh is not None and experts else []
        #: per unit (index n: the root), its groups: its own on the replicas' mesh, then its experts'
        self.groups: UnitGroups = self._shard(module, [mods for _, mods in covered if mods is not None], holders,
                                              (mesh, expert_mesh), set(kept_params), policy)
        root = fully_shard.state(module)
        root._lazy_init()
        for state in root._state_ctx.all_states:  # driven from the program, not from module calls
            state._pre_forward_hook_handle.remove()
            state._post_forward_hook_handle.remove()
        self.comm_ctx = root._comm_ctx
        for group in self._groups():
            # the loss is already divided by dp x micro-batches: a plain sum (no PREMUL_SUM, which
            # gloo lacks; NCCL's zero-copy path needs SUM too); a parameter one replica's data left
            # unused (an MoE expert no token chose) still takes part, so the replicas agree
            group.gradient_divide_factor = 1.0
            group.force_sum_reduction_for_comms = True
            group.reduce_scatter_unused_params = True
            if group.device.type == "cpu":  # gloo: in place, without its full-size temporaries
                group._all_gather_comm, group._reduce_scatter_comm = InPlaceAllGather(), InPlaceReduceScatter()
        if policy.param_dtype is not None:
            # the stage's floating inputs in the policy's dtype, as FSDP2's root pre-forward casts
            # them (its hooks are gone): a LayerNorm with bf16 weights refuses an fp32 input on CPU
            module.register_forward_pre_hook(partial(_cast_inputs, policy.param_dtype), with_kwargs=True)
        if kept and policy.param_dtype is not None:
            # the tied parameters FSDP2 leaves alone are read in the policy's dtype too, or an
            # fp32 one meets bf16 ones in an op autocast does not cast (runtime/tied_cast.py)
            CastOnUse(module.gm, kept_params, policy.param_dtype)
        self.kept = kept_params
        #: zero 1-2 in fp32: while a unit is gathered for the step its whole parameters hold its
        #: shard's values, so the shard's memory is returned and refilled from them at its release
        self.drops_shards = plan.meta.zero in (1, 2) and policy.param_dtype is None
        self.dropped: set[int] = set()
        #: unsharded parameter (what autograd saw) -> its unit; FSDP2 makes them at a unit's first gather
        self._index: dict[int, int] = {}
        self._params = sum(len(g.fsdp_params) for g in self._groups())
        #: under a bf16 policy a micro-batch's bf16 gradients join fp32 ones (FSDP2's post-backward);
        #: in fp32 autograd accumulates straight into them, and nothing is left to do
        self.mixed = policy.param_dtype is not None
        unit_hooks.install(module.gm, self.units, self)

    def _shard(self, module: nn.Module, unit_mods: list[list[nn.Module]], holders: list[tuple[str, nn.Module]],
               meshes: tuple[DeviceMesh, DeviceMesh | None], ignored: set[nn.Parameter],
               policy: MixedPrecisionPolicy) -> UnitGroups:
        """fully_shard the experts modules on the expert replicas' mesh first (a unit's fully_shard
        then leaves their parameters to them), then each unit's modules and the stage itself on the
        replicas'; returns each unit's groups (n: the root's) named for the log: the unit's own, then
        its experts' (`layer1/layer1.mlp.experts`)."""
        mesh, expert_mesh = meshes
        for _, holder in holders:
            fully_shard(holder, mesh=expert_mesh, reshard_after_forward=False, ignored_params=ignored, mp_policy=policy)
        for mods in unit_mods:
            fully_shard(mods if len(mods) > 1 else mods[0], mesh=mesh, reshard_after_forward=False,
                        ignored_params=ignored, mp_policy=policy)
        fully_shard(module, mesh=mesh, reshard_after_forward=False, ignored_params=ignored, mp_policy=policy)
        names = [u.name for u in self.units.units] + ["root"]
        out: UnitGroups = [[(names[u], g)] if (g := _group(m)) is not None else []
                           for u, m in enumerate([*(mods[0] for mods in unit_mods), module])]
        for path, holder in holders:
            u = _unit_of_holder(self.units, path, holder)
            if (g := _group(holder)) is not None:
                out[u].append((f"{names[u]}/{path}", g))
        return out

    def _groups(self) -> Iterator[FSDPParamGroup]:
        return (g for groups in self.groups for _, g in groups)

    def _log(self, what: str, label: str, group: FSDPParamGroup) -> None:
        if self.issued is not None:
            numel = sum(fp._orig_size.numel() for fp in group.fsdp_params)
            self.issued.append(f"{self.stage}:{label} {what} {numel} elements")

    # ---- the parameters the stage computes with ------------------------------------------------
    def graph_params(self) -> list[nn.Parameter]:
        """The unsharded parameters (what autograd accumulates into) and the tied ones."""
        out = [fp._unsharded_param for g in self._groups() for fp in g.fsdp_params
               if hasattr(fp, "_unsharded_param") and fp._unsharded_param.requires_grad]
        return out + [p for p in self.kept if p.requires_grad]

    def units_of(self, params: list[nn.Parameter]) -> list[int]:
        if len(self._index) < self._params:
            self._index = {id(fp._unsharded_param): u for u, groups in enumerate(self.groups) for _, g in groups
                           for fp in g.fsdp_params if hasattr(fp, "_unsharded_param")}
        return sorted({self._index[id(p)] for p in params if id(p) in self._index and self._index[id(p)] < self.n})

    # ---- gather, release, reduce (each of the unit's groups, in one order) ---------------------
    def gather(self, unit: int, wait: bool) -> None:
        for label, group in self.groups[unit]:
            if not group.is_unsharded and group._all_gather_result is None:
                self._log("all_gather", label, group)
                group.unshard(async_op=True)
        if wait:
            for _, group in self.groups[unit]:
                group.wait_for_unshard()

    def release(self, unit: int) -> None:
        for _, group in self.groups[unit]:
            if group._all_gather_result is not None:  # a prefetch nothing used: finish it first
                group.wait_for_unshard()
            if unit in self.dropped:
                _refill_shards(group)
            group.reshard()
        self.dropped.discard(unit)

    def reduce(self, unit: int) -> None:
        for label, group in self.groups[unit]:
            self._log("reduce_scatter", label, group)
            group.reduce_grads = True
            try:
                group.post_backward()
            finally:
                group.reduce_grads = False
                group._training_state = TrainingState.IDLE
        if any(g.device.type == "cpu" for _, g in self.groups[unit]):
            # gloo's reduce-scatter has returned: its input buffer, which FSDP2 keeps until the next
            # one so that a GPU's allocator does not reuse it while the reduce stream reads it, is
            # free now (on a GPU it stays, and the memory model prices one unit's)
            self.comm_ctx.reduce_scatter_states.clear()

    def accumulate(self, unit: int) -> None:
        if not self.mixed:
            return
        for _, group in self.groups[unit]:
            group.post_backward()  # reduce_grads off: a bf16 micro-batch joins the fp32 whole gradients
            group._training_state = TrainingState.IDLE

    def begin_action(self) -> None:
        if self.zero == 3:
            self.gather(self.n, wait=True)

    def end_action(self) -> None:
        if self.after_use:
            self.release(self.n)

    def finish_backward(self) -> None:
        for group in self._groups():
            group.finalize_backward()
            group._training_state = TrainingState.IDLE
        ctx = self.comm_ctx
        for state in ctx.reduce_scatter_states:  # the compute stream reuses their memory after them
            if state.event is not None:
                ctx.device_handle.current_stream().wait_event(state.event)
        ctx.reduce_scatter_states.clear()

    def gather_all(self) -> None:
        """UNSHARD at zero 1-2: the whole stage for the step (started together, then waited for);
        in fp32 each unit's shard memory is returned while its whole parameters hold it."""
        for u in range(self.n + 1):
            self.gather(u, wait=False)
        for u in range(self.n + 1):
            self.gather(u, wait=True)
            if self.drops_shards and self.groups[u] and u not in self.dropped:
                for _, group in self.groups[u]:
                    _drop_shards(group)
                self.dropped.add(u)

    def prefetch(self, kind: Kind) -> None:
        """UNSHARD at zero=3: start gathering what the next action needs first (the root, and the
        first unit of a forward or the last of a backward), overlapped with its receives."""
        self.gather(self.n, wait=False)
        if self.n:
            self.gather(0 if kind in (Kind.F, Kind.R) else self.n - 1, wait=False)

    def release_all(self) -> None:
        for u in range(self.n + 1):
            self.release(u)

    def begin_step(self) -> None:
        for group in self._groups():
            group.reduce_grads = False
            group.reshard_after_backward = False
            group._training_state = TrainingState.IDLE


class ShardedStages(RankStages):
    """This rank's stages under FSDP2, carrying out the program's data-parallel actions."""

    def __init__(self, plan: Plan, modules: dict[int, nn.Module], actions: list[Action], mesh: DeviceMesh,
                 expert_mesh: DeviceMesh | None = None) -> None:
        """`expert_mesh`: under 1 < ep < dp, the replicas holding this rank's experts (`expert_dp`),
        over which they are sharded; None: they are sharded as every parameter (ep = 1) or held
        whole (ep = dp)."""
        #: the replicas a shard spans: a clipping norm sums the shards' squares over them
        self.shard_group = (mesh if mesh.ndim == 1 else mesh["dp_shard"]).get_group()
        #: tied parameters, which FSDP2 leaves alone (runtime/dp.py all-reduces them after the step)
        self.replicated = tied_params(plan, modules)
        # per UNSHARD at zero=3: the kind of its stage's next compute action (which block to prefetch)
        self.next_kind = _next_compute_kinds(actions)
        # a stage holding only tied parameters has nothing to shard
        super().__init__({s: ShardedStage(plan, s, module, actions, mesh, expert_mesh) for s, module in modules.items()
                          if not all(n in plan.shared_params for n, _ in module.named_model_parameters())})
        require_reductions(actions, list(self.stages))
        #: per stage, the position of its last reduction of the step
        self.last = {a.stage: pos for pos, a in enumerate(actions) if a.kind is Kind.REDUCE_GRAD}

    def begin_step(self) -> None:
        for driver in self.stages.values():
            driver.begin_step()

    def run(self, action: Action, pos: int) -> None:
        driver = self.stages.get(action.stage)
        if driver is None:
            return
        if action.kind is Kind.UNSHARD:
            if driver.zero == 3:
                driver.prefetch(self.next_kind.get(pos, Kind.F))
            else:
                driver.gather_all()
        elif action.kind is Kind.RESHARD:
            driver.release_all()
        elif action.kind is Kind.REDUCE_GRAD:
            driver.reduce_leftovers(final=self.last.get(action.stage) == pos)

    def finish(self) -> None:
        """Nothing left in flight: a stage's last reduction waited for its own."""

    def release(self) -> None:
        """Back to the shards (after an evaluation, whose forwards gathered the parameters)."""
        for driver in self.stages.values():
            driver.release_all()
