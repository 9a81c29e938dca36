"""Tensor parallelism on a rank: Megatron's collectives, the vocabulary-parallel loss, and this
rank's stages at their local shapes.

The tp ranks of one pipeline rank are lockstep copies of it: the same program, the same P2P
(each with its counterpart in the neighbouring stage) and, inside each compute action, the same
tp collectives in the same order (the graph fixes it), so NCCL's rule that every member of a
group issues its collectives in one order holds by construction (docs/tensor_parallel.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn import functional as F  # noqa: N812

from pipelaunch.models.spec import ModelSpec
from pipelaunch.pipeline.compute.vocab_parallel import vocab_parallel_loss as parallel_loss
from pipelaunch.pipeline.core.plan import Plan, dtype_of
from pipelaunch.pipeline.graph.sequence_parallel import (
    REPLICATED,
    SEQUENCE,
    SPLIT,
    SequenceCollectives,
    SequenceRewrite,
    sequence_parallel,
    sequence_setup,
)
from pipelaunch.pipeline.graph.tensor_parallel import Collectives, Rewritten, local_split, parallelize
from pipelaunch.pipeline.runtime.gloo_comm import InPlaceAllGather, InPlaceReduceScatter

#: torch >= 2.12 names it all_gather_single (all_gather_into_tensor deprecated); older ones only the latter
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class TensorParallel:
    """This rank's place in its tp group; `log`, when a list, records every tp collective issued
    (`debug.record_p2p`: the order the tests check)."""

    group: dist.ProcessGroup | None
    size: int
    rank: int
    log: list[str] | None = None

    def all_reduce(self, tensor: torch.Tensor, what: str, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
        if self.log is not None:
            self.log.append(what)
        dist.all_reduce(tensor, op=op, group=self.group)
        return tensor

    def gather_along(self, x: torch.Tensor, dim: int, what: str) -> torch.Tensor:
        """The tp ranks' parts of a value, joined along `dim` (rank order)."""
        if self.log is not None:
            self.log.append(what)
        moved = x.movedim(dim, 0).contiguous()
        whole = torch.empty((moved.shape[0] * self.size, *moved.shape[1:]), dtype=x.dtype, device=x.device)
        if x.device.type == "cpu":  # gloo's all-gather holds two output-sized temporaries (gloo_comm.py)
            whole.chunk(self.size)[self.rank].copy_(moved)
            InPlaceAllGather()(whole, moved, self.group)
        else:
            _all_gather(whole, moved, group=self.group)
        # contiguous: a view would make each projection reading it save its own copy (q, k and v three)
        return whole.movedim(0, dim).contiguous()

    def scatter_along(self, x: torch.Tensor, dim: int, what: str) -> torch.Tensor:
        """This rank's part along `dim` of the tp ranks' values summed (a reduce-scatter)."""
        if self.log is not None:
            self.log.append(what)
        moved = x.movedim(dim, 0).contiguous()
        part = torch.empty((moved.shape[0] // self.size, *moved.shape[1:]), dtype=x.dtype, device=x.device)
        if x.device.type == "cpu":  # gloo's reduce-scatter holds an input-sized copy (gloo_comm.py)
            if moved.data_ptr() == x.data_ptr():
                moved = moved.clone()  # summed in place: never the caller's tensor
            InPlaceReduceScatter()(part, moved, self.group, dist.ReduceOp.SUM)
        else:
            _reduce_scatter(part, moved, group=self.group)
        return part.movedim(0, dim).contiguous()

    def own_part(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return x.chunk(self.size, dim)[self.rank].contiguous()

    def part(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's 1/tp of a value every tp rank holds whole: what it sends of a scattered one."""
        return tensor.detach().reshape(-1).chunk(self.size)[self.rank]

    def gather(self, part: torch.Tensor, shape: tuple[int, ...], what: str) -> torch.Tensor:
        """The whole value from the tp ranks' parts (`part` of each, in tp rank order)."""
        if self.log is not None:
            self.log.append(what)
        whole = torch.empty(part.numel() * self.size, dtype=part.dtype, device=part.device)
        _all_gather(whole, part, group=self.group)
        return whole.view(shape)


class _Copy(torch.autograd.Function):
    """Megatron's f: the value as it is forward; its gradient summed over the tp ranks backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TensorParallel, label: str) -> torch.Tensor:
        ctx.tp, ctx.label = tp, label
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.tp.all_reduce(grad.contiguous().clone(), ctx.label), None, None


class _Reduce(torch.autograd.Function):
    """Megatron's g: the partial sums of the tp ranks summed forward; the gradient as it is backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TensorParallel, label: str) -> torch.Tensor:
        return tp.all_reduce(x.contiguous().clone(), label)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None, None


class _SequenceScatter(torch.autograd.Function):
    """g under sequence parallelism: partial sums in, this rank's positions of the sum out; the
    gradient's positions all-gathered backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TensorParallel, dim: int, label: str) -> torch.Tensor:
        ctx.tp, ctx.dim, ctx.label = tp, dim, label
        return tp.scatter_along(x, dim, f"forward reduce-scatter {label}")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.tp.gather_along(grad, ctx.dim, f"backward all-gather {ctx.label}"), None, None, None


class _SequenceGather(torch.autograd.Function):
    """f under sequence parallelism: the whole sequence for the split projections; their partial
    gradients summed and this rank's positions kept backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TensorParallel, dim: int, label: str) -> torch.Tensor:
        ctx.tp, ctx.dim, ctx.label = tp, dim, label
        return tp.gather_along(x, dim, f"forward all-gather {label}")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.tp.scatter_along(grad, ctx.dim, f"backward reduce-scatter {ctx.label}"), None, None, None


class _ToWhole(torch.autograd.Function):
    """A sequence value whole for an op that mixes positions; backward its gradient (equal on every
    tp rank) cut to this rank's positions."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TensorParallel, dim: int, label: str) -> torch.Tensor:
        ctx.tp, ctx.dim = tp, dim
        return tp.gather_along(x, dim, f"forward all-gather {label}")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.tp.own_part(grad, ctx.dim), None, None, None


class _ToPart(torch.autograd.Function):
    """A replicated value cut to this rank's positions; backward the parts' gradients all-gathered
    (so the replicated value's gradient stays whole and equal)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TensorParallel, dim: int, label: str) -> torch.Tensor:
        ctx.tp, ctx.dim, ctx.label = tp, dim, label
        return tp.own_part(x, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.tp.gather_along(grad, ctx.dim, f"backward all-gather {ctx.label}"), None, None, None


class SequenceCollective(nn.Module):
    """One of the sequence-parallel collectives where the pass placed it, along `dim`."""

    def __init__(self, fn: type[torch.autograd.Function], tp: TensorParallel, dim: int, label: str) -> None:
        super().__init__()
        self.fn, self.tp, self.dim, self.label = fn, tp, dim, label

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn.apply(x, self.tp, self.dim, self.label)


class TensorParallelCollective(nn.Module):
    """`f` (`_Copy`) or `g` (`_Reduce`) where the rewrite placed it; its log label made once."""

    def __init__(self, fn: type[torch.autograd.Function], tp: TensorParallel, label: str) -> None:
        super().__init__()
        self.fn, self.tp, self.label = fn, tp, label

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn.apply(x, self.tp, self.label)


class VocabParallelEmbedding(nn.Module):
    """A lookup in this rank's rows of the vocabulary (ids elsewhere give zeros), summed over the
    tp ranks: every rank ends with the full embedding of every id (Megatron's)."""

    def __init__(self, tp: TensorParallel, what: str, padding_idx: int | None) -> None:
        super().__init__()
        self.tp, self.padding_idx, self.label = tp, padding_idx, f"forward embedding {what}"
        #: False under sequence parallelism: a reduce-scatter after it sums the rows instead
        self.reduce_output = True

    def forward(self, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        rows = weight.shape[0]
        start = self.tp.rank * rows
        outside = (ids < start) | (ids >= start + rows)
        local = torch.where(outside, torch.zeros_like(ids), ids - start)
        padding = self.padding_idx - start if self.padding_idx is not None and 0 <= self.padding_idx - start < rows \
            else None
        out = F.embedding(local, weight, padding) * (~outside).unsqueeze(-1).to(weight.dtype)
        return _Reduce.apply(out, self.tp, self.label) if self.reduce_output else out


def collectives(tp: TensorParallel) -> Collectives:
    return Collectives(copy=lambda what: TensorParallelCollective(_Copy, tp, f"backward copy {what}"),
                       reduce=lambda what: TensorParallelCollective(_Reduce, tp, f"forward reduce {what}"),
                       embedding=lambda what, padding: VocabParallelEmbedding(tp, what, padding))


def sequence_collectives(tp: TensorParallel) -> SequenceCollectives:
    return SequenceCollectives(
        scatter=lambda what, dim: SequenceCollective(_SequenceScatter, tp, dim, what),
        gather=lambda what, dim: SequenceCollective(_SequenceGather, tp, dim, what),
        to_whole=lambda what, dim: SequenceCollective(_ToWhole, tp, dim, f"whole {what}"),
        to_part=lambda what, dim: SequenceCollective(_ToPart, tp, dim, f"part {what}"),
        partial=lambda what: TensorParallelCollective(_Copy, tp, f"backward partial {what}"))


def vocab_parallel_loss(tp: TensorParallel, ignore_index: int = -100):
    """The mean next-token cross-entropy on this rank's vocabulary shard of the logits, its three
    all-reduces over the tp group (`compute/vocab_parallel.py`)."""
    return parallel_loss(tp.rank, tp.all_reduce, ignore_index)


@dataclass
class LocalStages:
    """This rank's stages at their local shapes (tp > 1), what the rewrites did, the split
    parameters' names -> dimension, and per stage the parameters whose gradients are partial per
    tp rank under sequence parallelism (summed over the tp ranks once per step)."""

    stages: dict[int, torch.fx.GraphModule]
    rewrites: dict[int, Rewritten]
    dims: dict[str, int]
    partial: dict[int, list[str]]


def local_stages(spec: ModelSpec, plan: Plan, full: dict[int, torch.fx.GraphModule], tp: TensorParallel,
                 device: torch.device) -> LocalStages:
    """This rank's stages at their local shapes, rewritten with the tp collectives (and, under
    sequence parallelism, `graph/sequence_parallel.py`'s): the model traced again with its planned
    parameters at local shapes (`shard_meta`), cut by the plan's assignment, each tensor this
    rank's slice of the full stage's (`full`, materialised by name)."""
    split, sharded = local_split(spec.build_meta(), lambda m: spec.trace(plan.micro_batch_size, m), plan.assignment,
                                 len(plan.stages), plan.tp_modules, tp.size, device)
    out = LocalStages({}, {}, {n: s.dim for n, s in sharded.items()}, {})
    made: dict[int, torch.Tensor] = {}  # stages of one rank sharing a tensor share its slice too
    for index, whole in full.items():
        gm = split.stages[index]
        _take_tensors(gm, whole, out.dims, tp, made)
        out.rewrites[index] = parallelize(gm, sharded, plan.tp_modules, collectives(tp))
        if plan.sequence_parallel:
            done = apply_sequence_parallel(gm, spec, plan, index, sharded, sequence_collectives(tp), tp.size)
            out.partial[index] = sorted(done.partial)
        out.stages[index] = gm
    return out


def sum_partial_gradients(modules: Sequence[nn.Module], tp: TensorParallel) -> None:
    """Under sequence parallelism, the gradients each tp rank computed from its positions only (a
    norm's weight, a bias added to a sequence value) summed over the tp ranks: one all-reduce of
    them all, once per step (Megatron's for its sequence-parallel parameters)."""
    params = {id(p): p for m in modules for name in getattr(m, "sequence_partial", ())
              if (p := m.gm.get_parameter(name)).grad is not None}
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params.values()]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    tp.all_reduce(flat, "step partial gradients")
    for g, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        g.copy_(part.view_as(g))


def apply_sequence_parallel(gm: torch.fx.GraphModule, spec: ModelSpec, plan: Plan, index: int,
                            sharded: Mapping[str, object], make: SequenceCollectives, tp: int) -> SequenceRewrite:
    """The sequence-parallel pass on stage `index`'s rewritten graph: its inputs' meta values and
    layouts from the plan (a model input whole; a boundary value as the plan says it crosses),
    its boundary values leaving as they were planned, the loss's input whole."""
    stage = plan.stages[index]
    data = dict(zip(spec.data_args, spec.meta_args(plan.micro_batch_size), strict=True))
    inputs = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        name = node.name
        if stage.inputs.get(name, "data") is None or name not in stage.values:
            inputs.append((data[plan.data_of(name)], (REPLICATED, None)))
            continue
        shape, dtype = stage.values[name]
        layout = (SEQUENCE, stage.sequence[name]) if name in stage.sequence else \
            (SPLIT, None) if name in stage.split else (REPLICATED, None)
        inputs.append((torch.empty(shape, dtype=dtype_of(dtype), device="meta"), layout))
    setup = sequence_setup(True, spec, plan.micro_batch_size, tp)
    return sequence_parallel(gm, make, tp, setup.seq_len, sharded, inputs,
                             keep=lambda name: name in stage.sequence)


def _take_tensors(gm: torch.fx.GraphModule, whole: torch.fx.GraphModule, dims: dict[str, int],
                  tp: TensorParallel, made: dict[int, torch.Tensor]) -> None:
    """Every parameter and buffer of the local stage `gm` from the full one by name: this rank's
    slice where split, the tensor itself where not; tied names keep one tensor (`made`: full
    tensor's id -> what replaced it, shared by the rank's stages)."""
    wholes = dict(whole.named_parameters(remove_duplicate=False)) | dict(whole.named_buffers(remove_duplicate=False))
    for name, t in [*gm.named_parameters(remove_duplicate=False), *gm.named_buffers(remove_duplicate=False)]:
        source = wholes.get(name)
        if source is None:
            if t.device.type == "meta":
                raise RuntimeError(f"the tensor-parallel stage has {name}, which the full stage lacks")
            continue
        if id(source) not in made:
            value = source.detach()
            if name in dims:
                size = value.shape[dims[name]] // tp.size
                value = value.narrow(dims[name], tp.rank * size, size).clone()
            made[id(source)] = nn.Parameter(value, source.requires_grad) if isinstance(source, nn.Parameter) else value
        owner, _, attr = name.rpartition(".")
        module = gm.get_submodule(owner) if owner else gm
        if attr in module._parameters:
            module._parameters[attr] = made[id(source)]
        elif attr in module._buffers:
            module._buffers[attr] = made[id(source)]
        else:
            setattr(module, attr, made[id(source)])
