"""The optimizer step's companions: the learning-rate schedule and global gradient clipping.

An LR schedule is a callable `factor(step) -> float` (the LR of optimizer step `step` is the
optimizer's own `lr` times it), named in `conf/lr_scheduler/*.yaml` (built by the launcher, with
its options bound) and wrapped in `torch.optim.lr_scheduler.LambdaLR`; a new one is one function
plus one YAML.
The single-process reference builds the very same objects, so a pipeline and one process
follow the same curve.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from pipelaunch.pipeline.core.plugins import OptimizerSpec, Plugin
from pipelaunch.pipeline.runtime.sharding import local


def _warm(step: int, warmup_steps: int) -> float | None:
    """Linear warm-up: step 0 gets 1/warmup of the LR, step warmup-1 the full LR."""
    return (step + 1) / warmup_steps if step < warmup_steps else None


def _progress(step: int, warmup_steps: int, total_steps: int) -> float:
    return min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))


def constant(step: int, warmup_steps: int = 0, min_lr_ratio: float = 1.0, total_steps: int = 1) -> float:
    """Warm-up, then the optimizer's LR throughout."""
    warm = _warm(step, warmup_steps)
    return 1.0 if warm is None else warm


def cosine(step: int, warmup_steps: int = 0, min_lr_ratio: float = 0.0, total_steps: int = 1) -> float:
    """Warm-up, then a half cosine from the LR down to min_lr_ratio x LR at total_steps."""
    warm = _warm(step, warmup_steps)
    if warm is not None:
        return warm
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * _progress(step, warmup_steps, total_steps)))


def linear(step: int, warmup_steps: int = 0, min_lr_ratio: float = 0.0, total_steps: int = 1) -> float:
    """Warm-up, then a straight line from the LR down to min_lr_ratio x LR at total_steps."""
    warm = _warm(step, warmup_steps)
    if warm is not None:
        return warm
    return 1.0 - (1 - min_lr_ratio) * _progress(step, warmup_steps, total_steps)


def build_optimizer(optimizer_spec: OptimizerSpec, lr_scheduler: Plugin | None,
                    params: list[torch.nn.Parameter]) -> tuple[torch.optim.Optimizer, LambdaLR]:
    """The configured optimizer over `params` and its LR schedule (positioned at step 0); no
    `lr_scheduler`: the optimizer's LR throughout."""
    optimizer = optimizer_spec(params)
    factor: Callable[[int], float] = lr_scheduler if lr_scheduler is not None else constant
    return optimizer, LambdaLR(optimizer, factor)


def square_norm(grads: Iterable[torch.Tensor]) -> torch.Tensor:
    """Sum of squares of `grads`, in float32 (a 0-d tensor on their device); of a DTensor, its
    local shard's."""
    grads = list(grads)
    if not grads:
        return torch.zeros(())
    norms = torch._foreach_norm([local(g).float() for g in grads], 2.0)
    return torch.stack(norms).square().sum()


def clip_gradients(params: list[torch.nn.Parameter], counted: list[torch.nn.Parameter], max_norm: float,
                   group: dist.ProcessGroup | None, device: torch.device,
                   shard_group: dist.ProcessGroup | None = None, tp_group: dist.ProcessGroup | None = None,
                   experts: tuple[list[torch.nn.Parameter], dist.ProcessGroup | None] | None = None) -> float:
    """Scale every gradient of `params` so that the global norm is at most `max_norm`, as one
    process's `torch.nn.utils.clip_grad_norm_` would. `counted` are the parameters this rank adds to
    the norm (a tied parameter held by several ranks counts on one of them only); the squares are
    summed over `group` (the pipeline ranks of one replica: the replicas' gradients are equal
    after the data-parallel all-reduce). Sharded gradients (DTensors, zero >= 1) add their shards'
    squares over `shard_group` first; `experts`, this rank's share of the experts (ep > 1) and its ep
    group, whose ranks hold the others: their squares sum over it. Returns the norm before clipping."""
    grads = [p.grad for p in counted if p.grad is not None]
    total = square_norm(g for g in grads if not isinstance(g, DTensor)).to(device)
    sharded = [g for g in grads if isinstance(g, DTensor)]
    if sharded:
        shards = square_norm(sharded).to(device)
        dist.all_reduce(shards, group=shard_group)
        total = total + shards
    if tp_group is not None:  # `counted` holds this tp rank's slices and, on tp rank 0, the whole ones
        dist.all_reduce(total, group=tp_group)
    if experts is not None:
        held = [p.grad for p in experts[0] if p.grad is not None]
        mine = square_norm(g for g in held if not isinstance(g, DTensor)).to(device)
        shards = [g for g in held if isinstance(g, DTensor)]
        if shards:  # sharded over their expert replicas (zero >= 1, 1 < ep < dp): summed there first
            part = square_norm(shards).to(device)
            dist.all_reduce(part, group=shards[0].device_mesh.get_group())
            mine = mine + part
        dist.all_reduce(mine, group=experts[1])
        total = total + mine
    if group is not None:
        dist.all_reduce(total, group=group)
    norm = total.sqrt()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    grads = [local(p.grad) for p in params if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].device))
    return float(norm)
