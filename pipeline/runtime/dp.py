"""Data-parallel gradients at zero=0 (every replica holds everything): each block's gradients
all-reduced as one bucket as soon as the stage's last backward of the step has finished them,
in flight while the rest of that backward and the rank's other stages still compute; the update
waits for them. A bucket is a unit of the stage (pipeline/graph/units.py: a transformer layer, a
U-Net block; the small ones joined to a neighbour), as DDP's buckets fill in the backward's order:
with one bucket per stage, a rank holding one stage had nothing left to hide its all-reduce behind.
Tied parameters (several stages hold them) are summed across stages and then all-reduced after
the step, at every level."""

from __future__ import annotations

from collections.abc import Hashable

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from pipelaunch.pipeline.core.ir import Action, Kind
from pipelaunch.pipeline.runtime import unit_hooks
from pipelaunch.pipeline.runtime.stage import module_units
from pipelaunch.pipeline.runtime.stage_driver import RankStages, StageDriver


def allreduce_gradients(params: list[nn.Parameter], group: dist.ProcessGroup | None) -> None:
    """Sum the gradients of `params` (each once) over `group` (the loss is already scaled by
    1/(dp x micro-batches)): the replicated (tied) parameters after the step."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    with torch.no_grad():
        for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
            g.copy_(synced)


class BucketStage(StageDriver):
    """One stage at zero=0: its units are buckets, all-reduced as their gradients are final."""

    def __init__(self, plan, stage: int, module: nn.Module, actions: list[Action], group: dist.ProcessGroup,
                 in_flight: list, expert_group: dist.ProcessGroup | None = None) -> None:
        units = module_units(module, plan)
        super().__init__(stage, units, actions, 0, "use")
        named = dict(module.gm.named_parameters(remove_duplicate=False))
        self.buckets = [list({id(named[n]): named[n] for n in u.params}.values()) for u in units.units]
        self.buckets.append(list({id(named[n]): named[n] for n in units.root}.values()))
        self.names = [u.name for u in units.units] + ["root"]
        self._index = {id(p): u for u, ps in enumerate(self.buckets[:-1]) for p in ps}
        self.group = group
        self.in_flight = in_flight
        #: under ep > 1: this rank's share of the experts, whose gradients sum over the expert
        #: replicas (`expert_group`; None: ep == dp, no other rank holds them)
        self.experts = {id(p) for n, p in module.named_model_parameters() if n in module.expert_params}
        self.expert_group = expert_group
        unit_hooks.install(module.gm, units, self)

    def units_of(self, params: list[nn.Parameter]) -> list[int]:
        return sorted({self._index[id(p)] for p in params if id(p) in self._index})

    def reduce(self, unit: int) -> None:
        params = [p for p in self.buckets[unit] if p.requires_grad]
        if not params:
            return
        for p in params:  # unused on this replica's data (an MoE expert): the replicas still agree on sizes
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        shared = [p for p in params if id(p) not in self.experts]
        experts = [p for p in params if id(p) in self.experts]
        for part, group, what in ((shared, self.group, "all_reduce"), (experts, self.expert_group, "experts")):
            if not part or (part is experts and group is None):
                continue
            grads = [p.grad for p in part]
            flat = _flatten_dense_tensors(grads)
            if self.issued is not None:
                self.issued.append(f"{self.stage}:{self.names[unit]} {what} {flat.numel()}")
            work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=True)
            self.in_flight.append((work, flat, grads))


class ReplicatedGrads(RankStages):
    """zero=0: per stage a `BucketStage`, whose buckets the backward's hooks and the program's
    REDUCE_GRAD actions all-reduce asynchronously; `finish` waits for them and writes the sums back."""

    def __init__(self, plan, modules: dict[int, nn.Module], actions: list, group: dist.ProcessGroup,
                 expert_group: dist.ProcessGroup | None = None) -> None:
        tied = set(plan.shared_params)
        #: the tied parameters, all-reduced after the step (each once)
        self.replicated = tied_params(plan, modules)
        self.in_flight: list[tuple[dist.Work, torch.Tensor, list[torch.Tensor]]] = []
        super().__init__({s: BucketStage(plan, s, m, actions, group, self.in_flight, expert_group)
                          for s, m in modules.items()
                          if any(n not in tied for n, _ in m.named_model_parameters())})
        require_reductions(actions, list(self.stages))
        self.shard_group = None  # nothing is sharded

    def begin_step(self) -> None:
        self.in_flight.clear()

    def run(self, action, pos: int) -> None:
        driver = self.stages.get(action.stage)
        if driver is not None and action.kind is Kind.REDUCE_GRAD:
            driver.reduce_leftovers(final=False)

    def finish(self) -> None:
        for work, flat, grads in self.in_flight:
            work.wait()
            with torch.no_grad():
                for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
                    g.copy_(synced)
        self.in_flight.clear()

    def release(self) -> None:
        """Nothing is gathered at zero=0."""


def tied_params(plan, modules: dict[int, nn.Module]) -> list[nn.Parameter]:
    """This rank's parameters that several stages hold (`Plan.shared_params`), each once: kept whole
    on every replica at every level, summed across stages, then all-reduced after the step."""
    tied = set(plan.shared_params)
    return list({id(p): p for m in modules.values() for n, p in m.named_model_parameters() if n in tied}.values())


def verify_collective_order(logs: list[tuple[Hashable, list[str] | None]], kind: str = "data-parallel",
                            members: str = "replicas of pipeline rank") -> None:
    """`logs[rank]`: (its communicator, the collectives of `kind` it issued in one step): the
    replicas of one pipeline rank, or (tensor-parallel) the tp ranks of one pipeline rank of one
    replica. NCCL matches a communicator's collectives by order: raise RuntimeError at the first
    one where two members differ."""
    first: dict[Hashable, tuple[int, list[str]]] = {}
    for rank, (group, log) in enumerate(logs):
        log = log or []
        if group not in first:
            first[group] = (rank, log)
            continue
        other, theirs = first[group]
        for k in range(max(len(log), len(theirs))):
            x = log[k] if k < len(log) else None
            y = theirs[k] if k < len(theirs) else None
            if x != y:
                raise RuntimeError(f"ranks {other} and {rank}, {members} {group}, issued different {kind} "
                                   f"collectives #{k}: {y or 'nothing'} and {x or 'nothing'}; NCCL matches a "
                                   "communicator's collectives by order, so it would hang or mix them")


def require_reductions(actions: list, stages: list[int]) -> None:
    """A stage with parameters to reduce has a REDUCE_GRAD in the program, or its replicas would
    silently drift apart (a schedule built without planner/passes/data_parallel.py)."""
    reduced = {a.stage for a in actions if a.kind is Kind.REDUCE_GRAD}
    missing = [s for s in stages if s not in reduced]
    if missing:
        raise RuntimeError(f"the program reduces no gradients of stage(s) {missing} over the dp replicas: its "
                           "schedule was built without planner.passes.data_parallel.place_data_parallel")


class SharedGrads:
    """Tied parameters held by several pipeline ranks: sum their partial gradients.

    Each rank holding a copy sees only the gradient of its own uses; after the all-reduce within
    the ranks of one replica that hold it, every copy has the full gradient, so identical
    optimizer steps keep the copies identical (as one tensor would be in a single process).
    Groups are created by every rank in the same order, as torch.distributed requires.
    """

    def __init__(self, plan, ctx, slots) -> None:
        self.work: list[tuple[dist.ProcessGroup, list[torch.Tensor]]] = []
        by_ranks: dict[tuple[int, ...], list[str]] = {}
        for name, ranks in sorted(plan.shared_param_ranks().items()):
            by_ranks.setdefault(tuple(ranks), []).append(name)
        local = {}
        for slot in slots.values():
            for name, p in slot.module.named_model_parameters():
                local.setdefault(name, p)
        for ranks, names in by_ranks.items():
            for d in range(ctx.dp):
                for c in range(ctx.cp):  # each cp rank's copies hold its positions' share
                    for t in range(ctx.tp):  # under tp, the copies at one tp rank hold the same slice
                        group = dist.new_group([ctx.global_rank(r, d, t, c) for r in ranks])
                        if d == ctx.dp_rank and c == ctx.cp_rank and t == ctx.tp_rank and ctx.pp_rank in ranks:
                            self.work.append((group, [local[n] for n in names]))

    def sum_across_stages(self) -> None:
        for group, params in self.work:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            flat = _flatten_dense_tensors(grads)
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
            with torch.no_grad():
                for p, synced in zip(params, _unflatten_dense_tensors(flat, grads), strict=True):
                    p.grad = synced.clone()
