"""A mixture-of-experts language model as a user writes one (not the launcher's code): a softmax
top-2 router in the block, its experts an `nn.ModuleList` of GELU MLPs called the way transformers
calls its experts modules, `experts(hidden, top_k_index, top_k_weights)`, a loop over the experts
picking each one's tokens. What `model=module model.ep_plan=...` splits under ep (models/list_experts.py)."""

from __future__ import annotations

import torch
from torch import nn


class Expert(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.gelu(self.up(x)))


class ExpertBank(nn.Module):
    def __init__(self, dim: int, hidden: int, n: int) -> None:
        super().__init__()
        self.mlps = nn.ModuleList(Expert(dim, hidden) for _ in range(n))

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e, mlp in enumerate(self.mlps):
            token, slot = torch.where(top_k_index == e)
            if token.numel():
                out = out.index_add(0, token, mlp(x[token]) * top_k_weights[token, slot, None])
        return out


class MoEBlock(nn.Module):
    def __init__(self, dim: int, hidden: int, n: int, k: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.gate = nn.Linear(dim, n, bias=False)
        self.bank = ExpertBank(dim, hidden, n)
        self.k = k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x).reshape(-1, x.shape[-1])
        weights, index = self.gate(h).softmax(dim=-1).topk(self.k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return x + self.bank(h, index, weights).reshape(x.shape)


class TinyMoELM(nn.Module):
    def __init__(self, vocab_size: int = 64, dim: int = 16, hidden: int = 24, experts: int = 4, k: int = 2,
                 layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.blocks = nn.ModuleList(MoEBlock(dim, hidden, experts, k) for _ in range(layers))
        self.head = nn.Linear(dim, vocab_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)
