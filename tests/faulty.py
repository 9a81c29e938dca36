"""A model whose named block raises in its forward on real data: to test that one failing rank
stops the job (planning traces it on the meta device, where it passes through)."""

from __future__ import annotations

from torch import nn

from pipelaunch.models.gpt import gpt
from pipelaunch.models.spec import ModelSpec


class Explode(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        if x.device.type == "meta":
            return self.inner(x)
        raise RuntimeError("deliberate failure injected by tests.faulty")


def faulty_gpt(fail_block: str = "layer5", **kwargs) -> ModelSpec:
    spec = gpt(**kwargs)
    build = spec.build

    def build_faulty() -> nn.Module:
        model = build()
        setattr(model, fail_block, Explode(getattr(model, fail_block)))
        return model

    spec.build = build_faulty
    return spec


class NaNAfter(nn.Module):
    """Its block's output turns to NaN after `calls` forwards on real data."""

    def __init__(self, inner: nn.Module, calls: int) -> None:
        super().__init__()
        self.inner, self.calls, self.seen = inner, calls, 0

    def forward(self, x):
        out = self.inner(x)
        if x.device.type != "meta":
            self.seen += 1
            if self.seen > self.calls:
                return out * float("nan")
        return out


def nan_gpt(nan_block: str = "layer5", calls: int = 8, **kwargs) -> ModelSpec:
    """A GPT whose `nan_block` starts producing NaN after `calls` forwards (with 4 micro-batches
    and no recomputation: at step calls / 4)."""
    spec = gpt(**kwargs)
    build = spec.build

    def build_nan() -> nn.Module:
        model = build()
        setattr(model, nan_block, NaNAfter(getattr(model, nan_block), calls))
        return model

    spec.build = build_nan
    return spec
