"""What a model's attention and positions read under context parallelism (`cp > 1`): the rank's
cp group, its method (`ring` or `alltoall`) and the global positions of the tokens it holds.

Why a setting of the rank and not a value in the graph: the positions a rank holds are the same
for every micro-batch of a run (the head-tail balance of the sequence, `balanced_positions`), so a
recomputed forward (remat, inside the backward of a micro-batch) reads what the first forward
read. Packed documents need no more: a token's document is where it starts, its global position
minus its position within the document (`position_ids`), so the same document is the same start
on whichever rank its tokens are.

Models call `attention` and `positions` (kept whole in a trace: the model's module wraps them,
`torch.fx.wrap`); outside cp they are torch's causal attention and `arange` (the same as one
process computes), and the planner's passes on meta tensors never see a group.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.distributed as dist

from pipelaunch.pipeline.compute.ring_attention import balanced_positions, ring_attention
from pipelaunch.pipeline.compute.ulysses_attention import ulysses_attention

METHODS = ("ring", "alltoall")


@dataclass(frozen=True)
class ContextParallel:
    """This rank's share of every sequence: `group` (the cp ranks), `method`, and the global
    positions of its tokens (`positions`, for a local length)."""

    group: dist.ProcessGroup
    method: str = "ring"

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)

    def positions(self, local: int, device: torch.device) -> torch.Tensor:
        """The same for every micro-batch and attention of a run: made once per (length, device)."""
        return _positions(local * self.size, self.size, dist.get_rank(self.group), device)


@lru_cache(maxsize=64)
def _positions(seq: int, cp: int, rank: int, device: torch.device) -> torch.Tensor:
    return balanced_positions(seq, cp, rank, device)


_ACTIVE: list[ContextParallel | None] = [None]


def activate(cp: ContextParallel | None) -> None:
    """Set (or, None, clear) the rank's context parallelism, before its stages run."""
    _ACTIVE[0] = cp


def active() -> ContextParallel | None:
    return _ACTIVE[0]


def positions(tokens: torch.Tensor) -> torch.Tensor:
    """The global positions of `tokens`' [b, t] columns: 0..t-1, or this cp rank's share."""
    cp = _ACTIVE[0]
    if cp is None or tokens.is_meta:
        return torch.arange(tokens.shape[1], device=tokens.device)
    return cp.positions(tokens.shape[1], tokens.device)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, position_ids: torch.Tensor | None,
              dropout_p: float, scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
    """Causal attention of q [b, heads, t, d] over the whole sequence (within each document
    where `position_ids` [b, t] are given): over the cp group when it is active, else on the
    tokens at hand as one process computes it (a pass on meta tensors: its shapes and costs)."""
    cp = _ACTIVE[0]
    if cp is None or q.is_meta:
        if position_ids is None or q.is_meta:
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p,
                                                                    scale=scale, enable_gqa=enable_gqa)
        start = torch.arange(q.shape[-2], device=q.device)[None] - position_ids  # each token's document
        t = q.shape[-2]
        mask = (start[:, :, None] == start[:, None, :]) & torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], dropout_p=dropout_p,
                                                                scale=scale, enable_gqa=enable_gqa)
    if dropout_p:
        raise ValueError("attention dropout under context parallelism is not supported; set model.dropout=0")
    pos = cp.positions(q.shape[-2], q.device)
    doc = None if position_ids is None else pos[None] - position_ids
    fn = ring_attention if cp.method == "ring" else ulysses_attention
    return fn(q, *_for_kernel(cp, q, k, v), pos, cp.group, causal=True, doc=doc, scale=scale)


def _for_kernel(cp: ContextParallel, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped-query keys and values as the cp kernel takes them: as they are for the ring (it
    moves the key heads and repeats them per block), and for the all-to-all where their heads
    divide by cp; else repeated to the query's heads (what `enable_gqa` means)."""
    heads, kv_heads = query.shape[-3], key.shape[-3]
    if kv_heads == heads or cp.method == "ring" or kv_heads % cp.size == 0:
        return key, value
    return key.repeat_interleave(heads // kv_heads, dim=-3), value.repeat_interleave(heads // kv_heads, dim=-3)


def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
         dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
         enable_gqa: bool = False, position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """`scaled_dot_product_attention` as a model calls it, over the cp group when it is active:
    what a traced model's own attention calls become under cp (pipeline/graph/context_parallel.py).
    Outside cp (and on meta tensors) torch's own, so one process and the planner compute as the
    model does. `position_ids` (packed documents: the data's, each token's position in its
    document) stands for the model's document mask: causal attention within each document
    (`attention`). Grouped-query keys and values (`enable_gqa`) travel at their own heads
    (`_for_kernel`)."""
    if position_ids is not None:
        return attention(query, key, value, position_ids, dropout_p, scale, enable_gqa)
    cp = _ACTIVE[0]
    if cp is None or query.is_meta:
        return torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
            enable_gqa=enable_gqa)
    if attn_mask is not None or dropout_p:
        raise ValueError("attention with a mask or dropout cannot be split over a cp group (graph rewrite refuses it)")
    key, value = _for_kernel(cp, query, key, value)
    fn = ring_attention if cp.method == "ring" else ulysses_attention
    return fn(query, key, value, cp.positions(query.shape[-2], query.device), cp.group, causal=is_causal, scale=scale)


def arange(*args, **kwargs) -> torch.Tensor:  # noqa: ANN002, ANN003 - torch.arange's own
    """`torch.arange` where a traced model makes the positions of its tokens (0..t-1 at the rank's
    length t): this rank's global positions under cp, so rotary tables and position embeddings
    are those of the tokens it holds."""
    out = torch.arange(*args, **kwargs)
    cp = _ACTIVE[0]
    if cp is None or out.is_meta:
        return out
    return cp.positions(out.shape[0], out.device).to(out.dtype)
