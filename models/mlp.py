"""A token-wise residual MLP language model: the smallest model that still pipelines."""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from pipelaunch.models.gpt import Embedding, LMHead, sequential
from pipelaunch.models.spec import ModelSpec, causal_lm_loss, require_positive_ints


class ResidualMLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))


def mlp(vocab_size: int = 256, dim: int = 64, hidden: int = 256, layers: int = 6, seq_len: int = 32) -> ModelSpec:
    """Blocks: `embed`, `layer0` .. `layer{layers-1}`, `head`."""
    require_positive_ints(vocab_size=vocab_size, dim=dim, hidden=hidden, layers=layers, seq_len=seq_len)
    blocks = [("embed", partial(Embedding, vocab_size, dim, seq_len))]
    blocks += [(f"layer{i}", partial(ResidualMLP, dim, hidden)) for i in range(layers)]
    blocks.append(("head", partial(LMHead, dim, vocab_size)))
    return ModelSpec(
        name="mlp",
        build=partial(sequential, blocks),
        loss_fn=causal_lm_loss,
        input_shape=(seq_len,),
        target_shape=(seq_len,),
        leaf_modules=[n for n, _ in blocks],
        meta={"vocab_size": vocab_size, "seq_len": seq_len, "dim": dim},
    )
