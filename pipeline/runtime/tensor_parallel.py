"""Tensor parallelism on a rank: Megatron's collectives, the vocabulary-parallel loss, and this
rank's stages at their local shapes.

The tp ranks of one pipeline rank are lockstep copies of it: the same program, the same P2P
(each with its counterpart in the neighbouring stage) and, inside each compute action, the same
tp collectives in the same order (the graph fixes it), so NCCL's rule that every member of a
group issues its collectives in one order holds by construction (docs/tensor_parallel.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F  # noqa: N812

from pipelaunch.models.spec import ModelSpec
from pipelaunch.pipeline.compute.vocab_parallel import vocab_parallel_loss as parallel_loss
from pipelaunch.pipeline.core.plan import Plan
from pipelaunch.pipeline.graph.tensor_parallel import Collectives, Rewritten, local_split, parallelize

#: torch >= 2.12 names it all_gather_single (all_gather_into_tensor deprecated); older ones only the latter
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


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

    def forward(self, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        rows = weight.shape[0]
        start = self.tp.rank * rows
        outside = (ids < start) | (ids >= start + rows)
        local = torch.where(outside, torch.zeros_like(ids), ids - start)
        padding = self.padding_idx - start if self.padding_idx is not None and 0 <= self.padding_idx - start < rows \
            else None
        out = F.embedding(local, weight, padding) * (~outside).unsqueeze(-1).to(weight.dtype)
        return _Reduce.apply(out, self.tp, self.label)


def collectives(tp: TensorParallel) -> Collectives:
    return Collectives(copy=lambda what: TensorParallelCollective(_Copy, tp, f"backward copy {what}"),
                       reduce=lambda what: TensorParallelCollective(_Reduce, tp, f"forward reduce {what}"),
                       embedding=lambda what, padding: VocabParallelEmbedding(tp, what, padding))


def vocab_parallel_loss(tp: TensorParallel, ignore_index: int = -100):
    """The mean next-token cross-entropy on this rank's vocabulary shard of the logits, its three
    all-reduces over the tp group (`compute/vocab_parallel.py`)."""
    return parallel_loss(tp.rank, tp.all_reduce, ignore_index)


def local_stages(spec: ModelSpec, plan: Plan, full: dict[int, torch.fx.GraphModule], tp: TensorParallel,
                 device: torch.device) -> tuple[dict[int, torch.fx.GraphModule], dict[int, Rewritten], dict[str, int]]:
    """This rank's stages at their local shapes, rewritten with the tp collectives: the model
    traced again with its planned parameters at local shapes (`shard_meta`), cut by the plan's
    assignment, each tensor this rank's slice of the full stage's (`full`, materialised by name).
    Returns the stages, what each rewrite did, and the split parameters' names -> dimension."""
    split, sharded = local_split(spec.build_meta(), lambda m: spec.trace(plan.micro_batch_size, m), plan.assignment,
                                 len(plan.stages), plan.tp_modules, tp.size, device)
    dims = {n: s.dim for n, s in sharded.items()}
    stages, rewrites = {}, {}
    made: dict[int, torch.Tensor] = {}  # stages of one rank sharing a tensor share its slice too
    for index, whole in full.items():
        gm = split.stages[index]
        _take_tensors(gm, whole, dims, tp, made)
        rewrites[index] = parallelize(gm, sharded, plan.tp_modules, collectives(tp))
        stages[index] = gm
    return stages, rewrites, dims


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
