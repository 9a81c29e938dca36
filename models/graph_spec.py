"""A model the planner sees as one module to trace, rather than a list of sequential blocks.

Why a second spec type: U-Nets and ResNets are not chains (long skips jump over many layers), so they
cannot be written as `ModelSpec.blocks`. The planner traces `build()` with torch.fx instead and cuts
the graph; `leaf_modules` names submodules to keep whole, so the graph can be coarse or fine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from pipeline.init import init_by_name


@dataclass
class GraphModelSpec:
    """How to build, feed and score a non-sequential model."""

    name: str
    build: Callable[[], nn.Module]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    input_shape: tuple[int, ...]  # per sample
    input_dtype: torch.dtype = torch.float32
    target_shape: tuple[int, ...] = ()
    target_dtype: torch.dtype = torch.long
    leaf_modules: Sequence[str] = ()
    meta: dict = field(default_factory=dict)

    def build_full(self, seed: int, device: torch.device | str = "cpu") -> nn.Module:
        """The whole model, initialised from (seed, parameter name) like `ModelSpec` blocks."""
        model = self.build()
        init_by_name(model, seed)
        return model.to(device)

    def example_batch(
        self, batch: int, seed: int = 0, device: torch.device | str = "cpu"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A deterministic random (input, target) pair of the right shapes and dtypes."""
        gen = torch.Generator().manual_seed(seed)

        def make(shape: tuple[int, ...], dtype: torch.dtype, high: int) -> torch.Tensor:
            if dtype.is_floating_point:
                return torch.randn((batch, *shape), generator=gen).to(device=device, dtype=dtype)
            return torch.randint(0, high, (batch, *shape), generator=gen).to(device=device, dtype=dtype)

        high = int(self.meta.get("num_classes", self.meta.get("vocab_size", 2)))
        return make(self.input_shape, self.input_dtype, high), make(
            self.target_shape, self.target_dtype, high
        )
