"""Small language models that a traced, cut and materialised pipeline gets wrong, or used to, in
silence (#25): what the launcher's split check (`launcher/split_check.py`) must refuse or pass.

- `quantized_lm`: each block rounds its input through a straight-through estimator, a custom
  `torch.autograd.Function` (round forward, identity backward) as quantisation-aware training
  uses. torch.fx traces through `apply` into the forward, so the stages compute the same loss with
  the rounding's zero gradient instead of the custom backward: every parameter below the last
  rounding trains differently. Kept whole as leaf modules (`model.leaf_modules=[1,2,3,4]`), each
  block runs its own forward and backward and the stages are exact.
- `rotary_lm`: each block rotates features by position with a rotary `inv_freq` its constructor
  computes as a non-persistent buffer. Built on the meta device the buffer has no value; through
  `model=module` the ranks read the constructor's values by name, through a model family written
  as a plain `ModelSpec` (`rotary_spec`, as `models/gpt.py` is written) they would start it from
  the fallback, zeros.
- `scaled_lm`: each block multiplies by a tensor kept as a plain attribute, which no build on the
  meta device can give a value: the ranks would fail building their stages.
"""

from __future__ import annotations

import torch
from torch import nn

from pipelaunch.models.spec import ModelSpec, causal_lm_loss


class RoundSTE(torch.autograd.Function):
    """Round in the forward, pass the gradient through unchanged in the backward."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor) -> torch.Tensor:
        return torch.round(x)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> torch.Tensor:
        return grad


class QuantizedBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(RoundSTE.apply(self.norm(x) * 4) / 4)


def quantized_lm(vocab_size: int = 64, dim: int = 16, layers: int = 4) -> nn.Module:
    return nn.Sequential(nn.Embedding(vocab_size, dim), *[QuantizedBlock(dim) for _ in range(layers)],
                         nn.Linear(dim, vocab_size))


class Rotary(nn.Module):
    """Rotates feature pairs by position-dependent angles (a rotary position embedding)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        angles = torch.outer(torch.arange(x.shape[1], dtype=torch.float32, device=x.device), self.inv_freq)
        cos, sin = angles.cos(), angles.sin()
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.cat([even * cos - odd * sin, even * sin + odd * cos], dim=-1)


class RotaryBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.rotary = Rotary(dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(self.rotary(self.norm(x)))


def rotary_lm(vocab_size: int = 64, dim: int = 16, layers: int = 4) -> nn.Module:
    return nn.Sequential(nn.Embedding(vocab_size, dim), *[RotaryBlock(dim) for _ in range(layers)],
                         nn.Linear(dim, vocab_size))


def rotary_spec(vocab_size: int = 64, seq_len: int = 8, **_: object) -> ModelSpec:
    """`rotary_lm` as a model family's own factory returns it: a `ModelSpec` with no `load`
    (`model._target_=tests.split_models.rotary_spec`; the other keys of model=gpt are ignored)."""
    return ModelSpec(name="rotary", build=lambda: rotary_lm(vocab_size), loss_fn=causal_lm_loss,
                     input_shape=(seq_len,), target_shape=(seq_len,), meta={"vocab_size": vocab_size, "seq_len": seq_len})


class ScaledBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.scale = torch.full((dim,), 0.5)  # a plain attribute: neither a parameter nor a buffer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(x) * self.scale


def scaled_lm(vocab_size: int = 64, dim: int = 16, layers: int = 4) -> nn.Module:
    return nn.Sequential(nn.Embedding(vocab_size, dim), *[ScaledBlock(dim) for _ in range(layers)],
                         nn.Linear(dim, vocab_size))
