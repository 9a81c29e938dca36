"""Data-parallel gradient sync: one flat all-reduce per stage across the replicas."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


def allreduce_gradients(modules: list[nn.Module], group: dist.ProcessGroup | None) -> None:
    """Sum gradients over `group` (the loss is already scaled by 1/(dp x micro-batches))."""
    grads = [p.grad for m in modules for p in m.parameters() if p.grad is not None]
    if not grads:
        return
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    with torch.no_grad():
        for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
            g.copy_(synced)
