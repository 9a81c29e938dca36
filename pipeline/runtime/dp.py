"""Data-parallel gradient sync: one flat all-reduce per stage across the replicas."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


def allreduce_gradients(params: list[nn.Parameter], group: dist.ProcessGroup | None) -> None:
    """Sum the gradients of `params` (each once) over `group` (the loss is already scaled by
    1/(dp x micro-batches)): every parameter at zero=0, the replicated ones above."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    with torch.no_grad():
        for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
            g.copy_(synced)


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
                group = dist.new_group([ctx.global_rank(r, d) for r in ranks])
                if d == ctx.dp_rank and ctx.pp_rank in ranks:
                    self.work.append((group, [local[n] for n in names]))

    def sum_across_stages(self) -> None:
        for group, params in self.work:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            flat = _flatten_dense_tensors(grads)
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
            with torch.no_grad():
                for p, synced in zip(params, _unflatten_dense_tensors(flat, grads), strict=True):
                    p.grad = synced.clone()
