"""Selective recomputation (`remat=selective`): which operators a recomputed block keeps.

Why this policy: a transformer block's saved activations are dominated, at long sequences, by the
attention core (the [b, heads, t, t] scores, their softmax and dropout mask), which costs little
to recompute next to the projections and the MLP. Korthikanti et al. (2022, "Reducing activation
recomputation in large transformer models") recompute exactly that core; torchtitan's operator
policy saves the matmuls' outputs and recomputes the rest. Both are one rule on operators: keep
the outputs of the dense matrix products (the projections, the MLP, a fused attention kernel's
output and log-sum-exp) and recompute everything else (norms, activations, rotary, elementwise,
and the batched products `bmm` of a materialised attention: its scores and their product with v).

The runtime runs a recomputed block under non-reentrant `torch.utils.checkpoint` with this policy
(`selective_context`, `pipeline/graph/recompute.py`); the planner prices the same rule on every
operator it measures or prices (`KeptByPolicy`), so a block's bytes kept and its recompute time
come from the operators the policy names.

Why not torch's `create_selective_checkpoint_contexts`: it hands each kept output to one backward
and refuses a second ("Trying to backward an extra time"), and the split backward reruns a block
twice, once for its input gradients (I) and once for its weight gradients (W). The pair below keeps
the outputs until the block's graph is released, for every rerun, and refuses a kept output that
was written in place since (what torch's `_VersionWrapper` checks).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten


def _packets(*names: str) -> frozenset:
    """The overload packets of those aten operators this torch has."""
    return frozenset(getattr(aten, n) for n in names if hasattr(aten, n))


#: operators whose outputs a selectively recomputed block keeps: dense matrix products and fused
#: attention kernels (their outputs, and the log-sum-exp their backward reads)
KEPT = _packets("mm", "addmm", "_grouped_mm", "_scaled_mm", "linear", "_scaled_dot_product_flash_attention",
                "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
                "_scaled_dot_product_cudnn_attention", "_flash_attention_forward", "_efficient_attention_forward",
                "scaled_dot_product_attention")


def kept(op: Any) -> bool:
    """Whether the policy keeps this operator's outputs (an OpOverload or its packet)."""
    return getattr(op, "overloadpacket", op) in KEPT


def _detached(value: Any) -> Any:
    return value.detach() if isinstance(value, torch.Tensor) else value


class _Keep(TorchDispatchMode):
    """The forward of a selectively recomputed block: each kept operator's outputs stored, in order."""

    def __init__(self, store: list) -> None:
        super().__init__()
        self.store = store

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if kept(func):
            value = torch.utils._pytree.tree_map(_detached, out)
            versions = [t._version for t in torch.utils._pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]
            self.store.append((func, value, versions))
        return out


class _Replay(TorchDispatchMode):
    """A rerun of the block (each backward graph task's): a kept operator returns its stored
    outputs instead of running; every other operator runs."""

    def __init__(self, store: list) -> None:
        super().__init__()
        self.store, self.next = store, 0

    def __enter__(self) -> _Replay:
        self.next = 0
        return super().__enter__()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if not kept(func):
            return func(*args, **(kwargs or {}))
        stored, value, versions = self.store[self.next]
        self.next += 1
        now = [t._version for t in torch.utils._pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]
        if stored is not func or now != versions:
            raise RuntimeError(f"remat=selective: the kept output of {stored} was written in place after the "
                               f"forward (or the rerun reached {func} instead); recompute this block full "
                               "(remat=full)")
        return value


def selective_context() -> tuple[TorchDispatchMode, TorchDispatchMode]:
    """The context pair `torch.utils.checkpoint(..., context_fn=...)` takes for the policy: a
    fresh store per checkpointed call."""
    store: list = []
    return _Keep(store), _Replay(store)


def _tensor_bytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in torch.utils._pytree.tree_leaves(value)
               if isinstance(t, torch.Tensor))


class KeptByPolicy(TorchDispatchMode):
    """While active, what the policy would keep of the operators that run (`kept_bytes`: their
    outputs) and the time of those it would recompute (`recompute_s` of `total_s`, measured on
    each operator's own call; `timed=False` on meta tensors, where only bytes mean anything)."""

    def __init__(self, timed: bool = True) -> None:
        super().__init__()
        self.timed = timed
        self.kept_bytes = 0
        self.recompute_s = 0.0
        self.total_s = 0.0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        t0 = time.perf_counter() if self.timed else 0.0
        out = func(*args, **kwargs)
        seconds = time.perf_counter() - t0 if self.timed else 0.0
        self.total_s += seconds
        if kept(func):
            self.kept_bytes += _tensor_bytes(out)
        else:
            self.recompute_s += seconds
        return out


def recompute_share(run: Callable[[], Any]) -> tuple[int, float]:
    """(bytes the policy keeps, share of the forward's operator time it recomputes) of one call."""
    mode = KeptByPolicy()
    with mode:
        run()
    return mode.kept_bytes, (mode.recompute_s / mode.total_s if mode.total_s > 0 else 1.0)

