"""Mixture-of-experts layers for `model=gpt` (`model.experts > 0`): a router, routed experts held
as 3-D tensors (transformers' layout: `gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]), shared
experts, and the auxiliary load-balancing loss.

Routing as the models people train route:

- `softmax` (Mixtral, Qwen-MoE): top-k of the softmax over the experts, the k weights renormalised
  to sum to one;
- `sigmoid` (DeepSeek-V3): each expert's sigmoid score; the top-k picked on the score plus a
  per-expert correction bias (a persistent buffer, `expert_bias`, starting at 0), within the
  `topk_groups` best of `groups` groups of experts (a group ranked by its two best scores); the
  weights are the picked scores, renormalised, times `route_scale`.

DeepSeek-V3's auxiliary-loss-free balancing (its report, arXiv 2412.19437, section 2.1.2) moves the
correction bias between steps, outside back-propagation: after each optimizer step every expert's
bias goes down by `bias_update_rate` if the expert got more than the mean tokens per expert over the
step's whole global batch, up by it if fewer (`update_bias`; DeepSeek-V3 trains with 0.001). The
bias only picks the experts, never weighs them. One process calls `update_bias` with the layer's
own `counts` after its optimizer step; the runtime with the counts summed over the replicas
(`runtime/router_stats.py`), the same update on every rank holding the layer.

The auxiliary loss is Switch's (Fedus et al. 2021): E x sum_i f_i P_i over the layer's tokens, f_i
the share of routed slots expert i gets and P_i its mean routing probability, times
`aux_loss_coef`. It reaches the gradients as Megatron attaches it (`AuxLoss`: the layer's output
passes through unchanged, and the backward adds the aux loss's own gradient, weighted by
`aux_loss_scale`), so it needs no output of its own to cross the pipeline's stages; the trainer
sets the scale to 1 / (replicas x micro-batches), the weight of each micro-batch in the step.

Token dropping (`capacity_factor`, GShard's and Switch's): each expert computes at most
ceil(capacity_factor x tokens x top_k / experts) of a layer call's routed slots, every token's
first choice before any second one, earlier tokens first (`within_capacity`); a dropped slot adds
nothing (the token's other slots and the residual carry it). Decided per layer call on its own
tokens, before any dispatch: the same under every layout as in one process on that micro-batch.
The router's statistics and the aux loss count the routed slots, dropped or not, as Switch's do.

Expert parallelism (`ep > 1`): the rank's layers hold `experts / ep` consecutive experts each
(`Experts.first`, `Experts.local`); `dispatch` (set by the rank: `runtime/experts.py`) carries each
token to the ranks holding its experts and back. Without it the layer computes every expert
itself, as one process does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from pipelaunch.pipeline.compute import context_parallel
from pipelaunch.pipeline.compute.ring_attention import record

#: what each micro-batch's auxiliary loss weighs in the step (the trainer sets it; one process: 1)
_AUX_SCALE = [1.0]
ROUTERS = ("softmax", "sigmoid")


def shapes_only(x: torch.Tensor) -> bool:
    """A pass that reads shapes alone (meta tensors, or fake ones under export or autocast's dtype
    pass): no value to route by."""
    from torch._subclasses.fake_tensor import is_fake

    return x.is_meta or is_fake(x)


def over_context(share: torch.Tensor, shapes: bool) -> tuple[torch.Tensor, int]:
    """The routed share per expert of the whole micro-batch, and the cp ranks holding its tokens:
    under cp each rank routes 1/cp of them, so the aux loss's f_i is the mean over the cp ranks
    (one all-reduce, no gradient) and each rank's term is divided by cp, whose gradients summed
    over the cp ranks are the one-process aux loss's (its P_i is the mean of theirs)."""
    cp = context_parallel.active()
    if cp is None or shapes:
        return share, 1
    share = share.clone()
    dist.all_reduce(share, group=cp.group)
    record("allreduce expert shares")
    return share / cp.size, cp.size


def set_aux_loss_scale(scale: float) -> None:
    """The weight of the auxiliary loss of every micro-batch that follows (1 / (dp x m) in a step
    of m micro-batches per replica, as the training loss's own mean)."""
    _AUX_SCALE[0] = float(scale)


class AuxLoss(torch.autograd.Function):
    """Identity on `x`; its backward adds the gradient of `aux` (weighted by the current scale) to
    what flows back, so the auxiliary loss trains the router wherever the layer runs."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        ctx.save_for_backward(aux)
        ctx.scale = _AUX_SCALE[0]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.scale)


class Router(nn.Module):
    """Scores each token's experts and picks its `top_k` (module docstring)."""

    def __init__(self, dim: int, experts: int, top_k: int, kind: str = "softmax", groups: int = 1,
                 topk_groups: int = 1, route_scale: float = 1.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, dim))
        nn.init.normal_(self.weight, std=0.02)
        self.register_buffer("expert_bias", torch.zeros(experts))
        self.experts, self.top_k, self.kind = experts, top_k, kind
        self.groups, self.topk_groups, self.route_scale = groups, topk_groups, route_scale

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(weights [T, k], expert indices [T, k], routing probabilities [T, E]) for tokens x [T, H]."""
        logits = nn.functional.linear(x, self.weight).float()
        if self.kind == "softmax":
            probs = logits.softmax(dim=-1)
            weights, index = probs.topk(self.top_k, dim=-1)
            return (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype), index, probs
        scores = logits.sigmoid()
        biased = scores + self.expert_bias
        if self.groups > 1:
            grouped = biased.view(-1, self.groups, self.experts // self.groups)
            best = grouped.topk(2, dim=-1).values.sum(dim=-1)
            keep = torch.zeros_like(best).scatter_(1, best.topk(self.topk_groups, dim=-1).indices, 1.0)
            biased = biased.masked_fill(~keep.bool().repeat_interleave(self.experts // self.groups, dim=1), 0.0)
        index = biased.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, index)
        weights = weights / weights.sum(dim=-1, keepdim=True) * self.route_scale
        return weights.to(x.dtype), index, scores / scores.sum(dim=-1, keepdim=True)


def update_bias(router: Router, counts: torch.Tensor, rate: float) -> None:
    """DeepSeek-V3's bias update (module docstring), in place: each expert's `expert_bias` moves by
    `rate` toward an even load, -rate for an expert whose tokens in `counts` [E] (a step's, over its
    whole global batch) are above their mean, +rate below it, unchanged at it."""
    move_bias(router.expert_bias, counts, rate)


@torch.no_grad()
def move_bias(bias: torch.Tensor, counts: torch.Tensor, rate: float) -> None:
    """`update_bias` on a correction bias [E] held anywhere (transformers' DeepSeek-V3 keeps its
    own as `gate.e_score_correction_bias`: models/hf_moe.py)."""
    counts = counts.to(torch.float64)
    bias.add_(torch.sign(counts.mean() - counts).to(device=bias.device, dtype=bias.dtype), alpha=rate)


class Experts(nn.Module):
    """The routed experts: SwiGLU MLPs held as 3-D tensors, `local` of the `total` (all of them
    without expert parallelism; a rank's consecutive share from `first` with it)."""

    def __init__(self, dim: int, hidden: int, experts: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * hidden, dim))
        self.down_proj = nn.Parameter(torch.empty(experts, dim, hidden))
        for p in (self.gate_up_proj, self.down_proj):
            nn.init.normal_(p, std=0.02)
        self.total, self.first, self.local = experts, 0, experts
        #: under expert parallelism, how tokens reach the ranks holding their experts (runtime)
        self.dispatch: Callable | None = None

    def expert_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """The routed experts' parameters (relative names), each stacked along the experts."""
        return self.named_parameters(recurse=False)

    def keep(self, first: int, local: int) -> None:
        """Hold only experts `first` .. `first + local - 1` (a rank's share), every parameter cut."""
        for name, whole in list(self.named_parameters(recurse=False)):
            setattr(self, name, nn.Parameter(whole.data[first:first + local].clone(), requires_grad=whole.requires_grad))
        self.first, self.local = first, local

    def whole_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        """Each parameter's shape in the whole model (every expert), by full-model name."""
        return {f"{prefix}.{n}": (self.total, *p.shape[1:]) for n, p in self.named_parameters(recurse=False)}

    def compute(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Each row of x [N, H] through this rank's expert `index` [N] (local ids): [N, H]."""
        out = x.new_zeros(x.shape)
        # unbound once: the backward stacks the experts' gradients into one tensor of the weight's
        # size, where indexing `w[e]` would build a zero-filled tensor of its size per expert
        gate_ups, downs = self.gate_up_proj.unbind(0), self.down_proj.unbind(0)
        for e in range(self.local):
            rows = (index == e).nonzero(as_tuple=True)[0]
            if rows.numel() == 0:
                continue
            gate, up = nn.functional.linear(x[rows], gate_ups[e]).chunk(2, dim=-1)
            out = out.index_copy(0, rows, nn.functional.linear(nn.functional.silu(gate) * up, downs[e]))
        return out

    def balanced(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, H] spread evenly over the local experts, as one batched product each way: the
        computation a shape-only pass runs (meta or fake tensors, where which expert a token picks
        is unknown), its FLOPs and bytes those of a balanced routing."""
        n, h = x.shape
        per = -(-n // self.local)
        padded = torch.cat([x, x.new_zeros(per * self.local - n, h)]).view(self.local, per, h)
        gate, up = torch.bmm(padded, self.gate_up_proj.transpose(1, 2)).chunk(2, dim=-1)
        return torch.bmm(nn.functional.silu(gate) * up, self.down_proj.transpose(1, 2)).reshape(-1, h)[:n]

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
                keep: torch.Tensor | None = None, slots: int | None = None) -> torch.Tensor:
        """Tokens x [T, H], each sent to its `top_k` experts `index` [T, k] and their outputs
        summed with `weights` [T, k], over every expert (`dispatch` brings the other ranks' here).
        `keep` [T, k]: the slots within their expert's capacity (None: all); a dropped slot adds
        nothing, its token's other slots and the residual stream carry it. `slots`: in a shape-only
        pass, how many slots a balanced load keeps (None: all)."""
        t, k = index.shape
        rows = torch.arange(t, device=x.device).repeat_interleave(k)
        flat = index.reshape(-1)
        kept = None
        if keep is not None and not shapes_only(x):
            kept = keep.reshape(-1).nonzero(as_tuple=True)[0]
            rows, flat = rows[kept], flat[kept]
        if shapes_only(x):
            out = self.balanced(x[rows[:slots]] if slots is not None else x[rows])
            if slots is not None and slots < t * k:  # a balanced load past every expert's capacity
                out = torch.cat([out, out.new_zeros((t * k - slots, out.shape[-1]))])
        elif self.dispatch is not None:
            out = self.dispatch(self, x[rows], flat)
        else:
            out = self.compute(x[rows], flat - self.first)
        if kept is not None:
            out = out.new_zeros((t * k, out.shape[-1])).index_copy(0, kept, out)
        return (out.view(t, k, -1) * weights.unsqueeze(-1)).sum(dim=1)


class SwiGLU(nn.Module):
    """A shared expert: every token through one SwiGLU MLP."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_up = nn.Linear(dim, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(nn.functional.silu(gate) * up)


def within_capacity(index: torch.Tensor, experts: int, capacity: int) -> torch.Tensor:
    """Which routed slots `index` [T, k] each expert takes when it takes at most `capacity`: every
    token's first choice before any second one (GShard's priority), earlier tokens first (Switch).
    Returns a bool mask [T, k]."""
    t, k = index.shape
    by_priority = index.t().reshape(-1)  # choice-major: all first choices, then all second ones
    seen = torch.nn.functional.one_hot(by_priority, experts).cumsum(dim=0)
    position = seen.gather(1, by_priority.unsqueeze(1)).squeeze(1) - 1  # the slot's place in its expert's queue
    return (position < capacity).view(k, t).t()


class MoE(nn.Module):
    """A mixture-of-experts MLP in place of a block's dense one: x [b, t, H] -> [b, t, H]."""

    def __init__(self, dim: int, hidden: int, experts: int, top_k: int, shared: int = 0, router: str = "softmax",
                 groups: int = 1, topk_groups: int = 1, route_scale: float = 1.0, aux_loss_coef: float = 0.0,
                 capacity_factor: float | None = None, bias_update_rate: float | None = None) -> None:
        super().__init__()
        #: token dropping (None: dropless): see `capacity`
        self.capacity_factor = capacity_factor
        #: the sigmoid router's bias update after each optimizer step (`update_bias`; None: none)
        self.bias_update_rate = bias_update_rate or None
        self.router = Router(dim, experts, top_k, router, groups, topk_groups, route_scale)
        self.experts = Experts(dim, hidden, experts)
        self.shared = SwiGLU(dim, shared * hidden) if shared else None
        self.aux_loss_coef = aux_loss_coef
        #: tokens each expert got in the forwards since the trainer last read them (router statistics)
        self.counts: torch.Tensor | None = None

    def capacity(self, tokens: int) -> int:
        """Slots each expert takes of a layer call's `tokens` (x top_k routed slots)."""
        assert self.capacity_factor is not None
        return math.ceil(self.capacity_factor * tokens * self.router.top_k / self.router.experts)

    def within_capacity(self, index: torch.Tensor) -> torch.Tensor:
        return within_capacity(index, self.router.experts, self.capacity(index.shape[0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        weights, index, probs = self.router(tokens)
        if shapes_only(x):  # which expert a token picks is unknown: a balanced load
            counts = probs.new_full((self.router.experts,), index.numel() / self.router.experts)
        else:
            with torch.no_grad():
                counts = torch.bincount(index.reshape(-1), minlength=self.router.experts)
                if torch._C._current_graph_task_id() == -1:  # not a rerun inside the backward (remat)
                    self.counts = counts if self.counts is None else self.counts + counts
        keep = slots = None
        if self.capacity_factor is not None:  # a shape-only pass prices a balanced load at capacity
            if shapes_only(x):
                slots = min(index.numel(), self.capacity(index.shape[0]) * self.router.experts)
            else:
                keep = self.within_capacity(index)
        out = self.experts(tokens, index, weights, keep, slots)
        if self.shared is not None:
            out = out + self.shared(tokens)
        if self.aux_loss_coef and torch.is_grad_enabled():
            share, ranks = over_context(counts.to(probs.dtype) / index.numel(), shapes_only(x))
            aux = self.aux_loss_coef * self.router.experts * (share * probs.mean(dim=0)).sum() / ranks
            out = AuxLoss.apply(out, aux)
        return out.reshape(shape)
