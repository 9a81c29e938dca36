"""A model whose named block raises in its forward: to test that one failing rank stops the job."""

from __future__ import annotations

from torch import nn

from models.base import ModelSpec
from models.gpt import gpt


class Explode(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        raise RuntimeError("deliberate failure injected by tests.faulty")


def faulty_gpt(fail_block: str = "layer5", **kwargs) -> ModelSpec:
    spec = gpt(**kwargs)
    spec.blocks = [(n, (lambda f=f: Explode(f())) if n == fail_block else f) for n, f in spec.blocks]
    return spec
