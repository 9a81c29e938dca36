"""Ring attention over a context-parallel group (`cp > 1`): each rank holds 1/cp of a sequence's
positions, and its queries meet every rank's keys and values as these travel round the ring.

The positions a rank holds (`balanced_positions`): the sequence cut into 2·cp chunks, rank r
holding chunks r and 2·cp − 1 − r (the head-tail balance torchtitan's and Megatron's context
parallelism use), so that under a causal mask every rank computes the same share of the score
matrix. Which query sees which key is decided by global positions alone: causal where
`q_pos >= k_pos`, and with packed documents only within a document (`q_doc == k_doc`), so the
one rule covers every block of the ring, whatever chunks meet in it (a document crossing a chunk
boundary is attended across ranks as in one process).

Why our own kernel and not torch's `context_parallel`: on CPU its dispatch fails (NOTES: no
sharding strategy for `_scaled_dot_product_flash_attention_for_cpu`). Each block is computed
exactly (scores, their log-sum-exp) and merged online as flash attention merges tiles; the
backward recomputes each block's probabilities from the saved log-sum-exp (nothing per block is
kept), the keys' and values' gradients travelling round the ring with their block and arriving
home after cp steps.

The exchanges: per step one `batch_isend_irecv` of the keys and values (and their positions) to
the next rank and from the previous one, posted before the block's compute so it runs while they
travel; in the backward the same, and after each block its key/value gradients onward. Every rank
posts the same operations in the same order, each pair's sends matched by its receives in posting
order (NCCL's rule; tags unused).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

#: where the cp group's exchanges are recorded while set (debug.record_p2p: the runtime's first
#: step), one line each: what it moves and which way
EXCHANGES: list[list[str] | None] = [None]


def record(what: str) -> None:
    if EXCHANGES[0] is not None:
        EXCHANGES[0].append(what)


def balanced_positions(seq: int, cp: int, rank: int, device: torch.device | None = None) -> torch.Tensor:
    """The global positions rank `rank` of `cp` holds of a sequence of `seq`: chunks r and
    2·cp − 1 − r of 2·cp (the causal head-tail balance). `seq` must divide by 2·cp."""
    if seq % (2 * cp):
        raise ValueError(f"a sequence of {seq} does not split into 2 x cp = {2 * cp} equal chunks")
    c = seq // (2 * cp)
    head = torch.arange(rank * c, (rank + 1) * c, device=device)
    tail = torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)
    return torch.cat([head, tail])


def _allowed(q_pos: torch.Tensor, k_pos: torch.Tensor, q_doc: torch.Tensor | None, k_doc: torch.Tensor | None,
             causal: bool) -> torch.Tensor | None:
    """Which (query, key) pairs a block scores: [1 or B, 1, Tq, Tk] bool, None for all of them."""
    mask = (q_pos[:, None] >= k_pos[None, :])[None, None] if causal else None
    if q_doc is not None:
        same = (q_doc[:, :, None] == k_doc[:, None, :])[:, None]
        mask = same if mask is None else mask & same
    return mask


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, mask: torch.Tensor | None) -> torch.Tensor:
    """q kᵀ · scale, a masked pair -inf: one [.., Tq, Tk] tensor, scaled and masked in place (the
    block's scores are the ring's largest transient)."""
    s = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
    return s if mask is None else s.masked_fill_(~mask, float("-inf"))


class _Ring:
    """The ring's neighbours in `group` and one rotation of a list of tensors: to the next rank,
    from the previous one, posted at once; `wait` gives the received ones."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group, self.size, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def rotate(self, tensors: list[torch.Tensor], what: str) -> tuple[list, list[torch.Tensor]]:
        record(f"ring {what} to {self.next} from {self.prev}")
        recv = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t.contiguous(), self.next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, r, self.prev, self.group) for r in recv]
        return dist.batch_isend_irecv(ops), recv

    @staticmethod
    def wait(works: list, recv: list[torch.Tensor]) -> list[torch.Tensor]:
        for w in works:
            w.wait()
        return recv


def _heads(x: torch.Tensor, rep: int) -> torch.Tensor:
    """Grouped-query keys or values [.., Hkv, T, D] at the queries' heads (each `rep` times): made
    per block, so the ring carries the Hkv heads only."""
    return x if rep == 1 else x.repeat_interleave(rep, dim=-3)


def _fold(x: torch.Tensor, rep: int) -> torch.Tensor:
    """Gradients at the queries' heads [.., H, T, D] summed back onto their key/value heads."""
    return x if rep == 1 else x.unflatten(-3, (x.shape[-3] // rep, rep)).sum(-3)


class RingAttention(torch.autograd.Function):
    """softmax(q kᵀ · scale, masked) v over the cp group's whole sequence, for this rank's
    queries: q [B, H, T/cp, D], k and v [B, Hkv, T/cp, D] (grouped-query attention when Hkv < H:
    query head i reads key head i // (H / Hkv), as torch's `enable_gqa`), at `pos` [T/cp] (global
    positions), `doc` [B, T/cp] the document of each position (None: one sequence)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,  # noqa: ANN001
                doc: torch.Tensor | None, group: dist.ProcessGroup, causal: bool, scale: float) -> torch.Tensor:
        ring, rep = _Ring(group), q.shape[-3] // k.shape[-3]
        out = torch.zeros_like(q, dtype=torch.float32)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        kv, where = torch.stack([k, v]), pos[None] if doc is None else torch.cat([pos[None], doc])
        for step in range(ring.size):
            pending = ring.rotate([kv, where], "kv") if step < ring.size - 1 else None
            k_doc = None if doc is None else where[1:]
            s = _scores(q.float(), _heads(kv[0].float(), rep), scale, _allowed(pos, where[0], doc, k_doc, causal))
            block = torch.logsumexp(s, dim=-1)
            merged = torch.logaddexp(lse, block)
            seen = torch.isfinite(merged)
            keep = torch.where(seen, torch.exp(lse - merged), 0.0)
            # the block's probabilities in place of its scores (a row nothing has scored yet is all
            # -inf: exp gives 0)
            take = s.sub_(torch.where(seen, merged, 0.0)[..., None]).exp_()
            out = out * keep[..., None] + torch.matmul(take, _heads(kv[1].float(), rep))
            del s, take
            lse = merged
            if pending is not None:
                kv, where = ring.wait(*pending)
        ctx.save_for_backward(q, k, v, pos, doc if doc is not None else pos.new_empty(0), out, lse)
        ctx.group, ctx.causal, ctx.scale, ctx.has_doc = group, causal, scale, doc is not None
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        q, k, v, pos, doc, out, lse = ctx.saved_tensors
        doc = doc if ctx.has_doc else None
        ring, scale, rep = _Ring(ctx.group), ctx.scale, q.shape[-3] // k.shape[-3]
        g = grad.float()
        delta = (g * out).sum(dim=-1, keepdim=True)
        finite = torch.where(torch.isfinite(lse), lse, 0.0)[..., None]
        dq = torch.zeros_like(q, dtype=torch.float32)
        kv, where = torch.stack([k, v]), pos[None] if doc is None else torch.cat([pos[None], doc])
        dkv = torch.zeros_like(kv, dtype=torch.float32)  # the gradients of the block held now, so far
        moving = None
        for step in range(ring.size):
            pending = ring.rotate([kv, where], "kv backward") if step < ring.size - 1 else None
            k_doc = None if doc is None else where[1:]
            keys, values = _heads(kv[0].float(), rep), _heads(kv[1].float(), rep)
            s = _scores(q.float(), keys, scale, _allowed(pos, where[0], doc, k_doc, ctx.causal))
            p = s.sub_(finite).exp_()  # in place of the scores; a masked score is -inf: 0
            ds = torch.matmul(g, values.transpose(-1, -2)).sub_(delta).mul_(p)  # dp, then ds, in place
            dq = dq + torch.matmul(ds, keys) * scale
            here = _fold(torch.stack([torch.matmul(ds.transpose(-1, -2), q.float()) * scale,
                                      torch.matmul(p.transpose(-1, -2), g)]), rep)
            del keys, values
            del s, p, ds
            if moving is not None:  # what the ranks before added to this block
                dkv = ring.wait(*moving)[0]
            moving = ring.rotate([dkv + here], "dkv backward")
            if pending is not None:
                kv, where = ring.wait(*pending)
        dkv = ring.wait(*moving)[0]  # this rank's own block, home after cp steps
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, group: dist.ProcessGroup,
                   causal: bool = True, doc: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """`RingAttention` (see there); `scale` None: 1 / sqrt(D), as scaled_dot_product_attention.
    Values of another head size than the keys' (DeepSeek-V3's attention: 192 against 128) travel
    zero-padded to the larger, which changes no score and no output: the keys and values move as
    one tensor, and the output is cut back to the values' size."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    width, dv = max(q.shape[-1], v.shape[-1]), v.shape[-1]
    if q.shape[-1] != dv:
        q, k, v = (torch.nn.functional.pad(t, (0, width - t.shape[-1])) for t in (q, k, v))
    return RingAttention.apply(q, k, v, pos, doc, group, causal, scale)[..., :dv]
