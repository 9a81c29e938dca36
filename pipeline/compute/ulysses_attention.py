"""All-to-all attention over a context-parallel group (DeepSpeed-Ulysses, `cp_method=alltoall`):
each rank holds 1/cp of a sequence's positions with every head; one all-to-all gives it every
position of 1/cp of the heads, where attention runs whole (torch's own kernel), and one all-to-all
gives the positions back.

Against the ring (pipeline/compute/ring_attention.py): two all-to-alls of q, k, v and the output
(each rank sends (cp − 1)/cp of them) instead of cp − 1 rotations of k and v, and the attention
kernel is torch's fused one on a whole sequence; but the heads (the key/value heads too: the
caller repeats grouped ones first) must divide by cp. The positions a rank holds may be any
(`pos`, e.g. the head-tail balance): they are gathered with the tokens, and the sequence is put in
position order before the kernel, so a causal mask is torch's `is_causal` and packed documents a
mask by document.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from pipelaunch.pipeline.compute.ring_attention import record


class _Exchange(torch.autograd.Function):
    """`to_positions`: [B, H, T/cp, D] (every head, this rank's positions) -> [B, H/cp, T, D] (this
    rank's heads, every rank's positions in rank order); else the inverse. The backward is the
    inverse exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, to_positions: bool) -> torch.Tensor:  # noqa: ANN001
        ctx.group, ctx.to_positions = group, to_positions
        return (_to_positions if to_positions else _to_heads)(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        return (_to_heads if ctx.to_positions else _to_positions)(grad, ctx.group), None, None


def _to_positions(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    record("alltoall to positions")
    cp = dist.get_world_size(group)
    b, h, t, d = x.shape
    send = x.reshape(b, cp, h // cp, t, d).transpose(0, 1).contiguous()  # [cp, B, H/cp, T/cp, D] by head group
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[r]: rank r's positions of my heads
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * t, d)


def _to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    record("alltoall to heads")
    cp = dist.get_world_size(group)
    b, hl, t, d = x.shape
    send = x.reshape(b, hl, cp, t // cp, d).permute(2, 0, 1, 3, 4).contiguous()  # [cp, B, H/cp, T/cp, D] by rank
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[r]: my positions of rank r's heads
    return recv.transpose(0, 1).reshape(b, cp * hl, t // cp, d)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, group: dist.ProcessGroup,
                      causal: bool = True, doc: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """softmax(q kᵀ · scale, masked) v over the cp group's whole sequence for this rank's
    positions: q, k, v [B, H, T/cp, D] at global positions `pos` [T/cp]; `doc` [B, T/cp] each
    position's document (None: one sequence). H must divide by the group's size, and so must k's
    and v's heads (grouped-query attention: fewer, each read by H / Hkv query heads)."""
    cp = dist.get_world_size(group)
    if q.shape[1] % cp or k.shape[1] % cp:
        raise ValueError(f"all-to-all attention splits the heads over cp={cp}: {q.shape[1]} query and {k.shape[1]} "
                         "key/value heads do not divide")
    where = pos[None] if doc is None else torch.cat([pos[None], doc])
    record("allgather positions")
    gathered = torch.empty((cp * where.shape[0], where.shape[1]), dtype=where.dtype, device=where.device)
    dist.all_gather_into_tensor(gathered, where.contiguous(), group=group)
    # in rank order, as the exchange concatenates the positions
    every = gathered.view(cp, *where.shape).permute(1, 0, 2).reshape(where.shape[0], -1)
    order = torch.argsort(every[0])
    qs, ks, vs = (_Exchange.apply(t, group, True)[:, :, order] for t in (q, k, v))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if doc is None:
        out = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, scale=scale,
                                                               enable_gqa=ks.shape[1] != qs.shape[1])
    else:
        docs = every[1:, order]
        mask = docs[:, :, None] == docs[:, None, :]
        if causal:
            mask = mask & torch.ones(mask.shape[-1], mask.shape[-1], dtype=torch.bool, device=mask.device).tril()
        out = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask[:, None], scale=scale,
                                                               enable_gqa=ks.shape[1] != qs.shape[1])
    back = torch.empty_like(order)
    back[order] = torch.arange(order.numel(), device=order.device)
    return _Exchange.apply(out[:, :, back].contiguous(), group, False)
