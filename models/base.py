"""What the pipeline needs to know about a model: its blocks, how to build it, and its loss."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from pipeline.init import init_by_name

BlockFactory = Callable[[], nn.Module]


@dataclass
class ModelSpec:
    """A model as the planner sees it.

    `blocks` are the model's top-level pieces in execution order, each built by its own factory
    so that a rank can build only the blocks of its stages. `loss_fn(output, target)` returns the
    mean loss of one micro-batch. `input_dtype` and `sample_shape(batch)` describe one input so
    that shapes can be propagated on the meta device without building real weights.
    """

    name: str
    blocks: list[tuple[str, BlockFactory]]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    input_shape: tuple[int, ...]  # per sample, e.g. (seq,) for tokens
    input_dtype: torch.dtype = torch.long
    target_shape: tuple[int, ...] = ()
    target_dtype: torch.dtype = torch.long
    meta: dict = field(default_factory=dict)

    @property
    def block_names(self) -> list[str]:
        return [name for name, _ in self.blocks]

    def build_blocks(self, names: list[str], seed: int, device: torch.device | str = "cpu") -> nn.Sequential:
        """Materialise only the named blocks, initialised from (seed, parameter name)."""
        wanted = set(names)
        factories = [(n, f) for n, f in self.blocks if n in wanted]
        missing = wanted - {n for n, _ in factories}
        if missing:
            raise KeyError(f"model {self.name!r} has no block(s) {sorted(missing)}")
        seq = nn.Sequential(OrderedDict((n, f()) for n, f in factories))
        init_by_name(seq, seed)
        return seq.to(device)

    def build_full(self, seed: int, device: torch.device | str = "cpu") -> nn.Sequential:
        """The whole model in one process: the single-process reference."""
        return self.build_blocks(self.block_names, seed, device)


def causal_lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position of the micro-batch."""
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
