"""The cross-entropy of logits split by vocabulary over tensor-parallel ranks (Megatron's), shared
by the rank that trains with it and the planner that measures its local work."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

#: sums (or maxima) a tensor over the tp ranks in place and returns it; `what` names it for a log
AllReduce = Callable[[torch.Tensor, str, dist.ReduceOp], torch.Tensor]


def no_reduce(tensor: torch.Tensor, what: str, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
    """One rank's local work alone (what the planner times; the all-reduces are priced apart)."""
    return tensor


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy summed over scored positions, on logits split by vocabulary: three
    all-reduces of one value per position (the max, the sum of exponentials, the target's logit),
    never the logits themselves. The backward is local: softmax minus the one-hot on the rank's
    rows."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, rank: int, reduce: AllReduce,
                ignore_index: int) -> torch.Tensor:
        logits = logits.float()
        rows = logits.shape[-1]
        start = rank * rows
        peak = reduce(logits.max(dim=-1).values, "loss max", dist.ReduceOp.MAX)
        shifted = logits - peak.unsqueeze(-1)
        exp = shifted.exp()
        total = reduce(exp.sum(dim=-1), "loss sum", dist.ReduceOp.SUM)
        outside = (targets < start) | (targets >= start + rows)
        local = torch.where(outside, torch.zeros_like(targets), targets - start)
        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        picked = reduce(picked, "loss target", dist.ReduceOp.SUM)
        scored = targets != ignore_index
        losses = (total.log() - picked).masked_fill(~scored, 0.0)
        ctx.save_for_backward(exp.div_(total.unsqueeze(-1)), local, outside, scored)
        return losses.sum()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        softmax, local, outside, scored = ctx.saved_tensors
        onehot = torch.zeros_like(softmax).scatter_(-1, local.unsqueeze(-1), (~outside).unsqueeze(-1).to(softmax.dtype))
        return (softmax - onehot) * (scored.unsqueeze(-1) * grad).to(softmax.dtype), None, None, None, None


def vocab_parallel_loss(rank: int, reduce: AllReduce = no_reduce, ignore_index: int = -100):
    """The mean next-token cross-entropy (`models.spec.causal_lm_loss`) of a micro-batch whose
    logits this rank holds the `rank`-th 1/tp of the vocabulary of: equal to it on the gathered
    logits, `ignore_index` labels unscored."""

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        flat, labels = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
        summed = _VocabParallelCrossEntropy.apply(flat, labels, rank, reduce, ignore_index)
        return (summed / (labels != ignore_index).sum().clamp(min=1)).to(logits.dtype)

    return loss
