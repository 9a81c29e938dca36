"""Which blocks each stage holds, and the stage modules a rank builds from that."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from models.base import ModelSpec
from pipeline.errors import ConfigError


def split_uniform(block_names: Sequence[str], num_stages: int) -> list[list[str]]:
    """Equal numbers of blocks per stage; the first `len % num_stages` stages take one more."""
    if num_stages > len(block_names):
        raise ConfigError(
            "pp",
            f"{num_stages} pipeline stages need at least {num_stages} blocks, but the model has "
            f"{len(block_names)} ({', '.join(block_names)}); lower pp, use fewer stages per rank, "
            f"or a model with more layers (e.g. model.layers)",
        )
    base, extra = divmod(len(block_names), num_stages)
    stages, start = [], 0
    for s in range(num_stages):
        size = base + (1 if s < extra else 0)
        stages.append(list(block_names[start : start + size]))
        start += size
    return stages


def split_manual(block_names: Sequence[str], split_points: Sequence[str], num_stages: int) -> list[list[str]]:
    """Stage boundaries start at the named blocks: k split points give k+1 stages."""
    names = list(block_names)
    unknown = [p for p in split_points if p not in names]
    if unknown:
        raise ConfigError(
            "partitioner.split_points",
            f"{unknown} are not blocks of the model; valid names: {', '.join(names[1:])}",
        )
    idx = sorted(names.index(p) for p in split_points)
    if len(set(idx)) != len(idx) or (idx and idx[0] == 0):
        raise ConfigError(
            "partitioner.split_points",
            f"{list(split_points)} must be distinct blocks other than the first ({names[0]})",
        )
    if len(idx) + 1 != num_stages:
        raise ConfigError(
            "partitioner.split_points",
            f"{len(idx)} split points give {len(idx) + 1} stages but the schedule needs {num_stages}; "
            f"give {num_stages - 1} split points",
        )
    bounds = [0, *idx, len(names)]
    return [names[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def stage_boundary_shapes(
    spec: ModelSpec, stage_blocks: Sequence[Sequence[str]], micro_batch_size: int
) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of each stage's output for one micro-batch, computed on the meta device.

    Receivers allocate buffers from these, so no shape metadata travels with activations.
    """
    x = torch.empty((micro_batch_size, *spec.input_shape), dtype=spec.input_dtype, device="meta")
    factories = dict(spec.blocks)
    shapes = []
    with torch.device("meta"), torch.no_grad():
        for blocks in stage_blocks:
            for name in blocks:
                x = factories[name]()(x)
            shapes.append((tuple(x.shape), x.dtype))
    return shapes


class BlockStage(nn.Module):
    """One stage of a sequential model: a contiguous run of blocks, named as in the full model,
    reading one named value and writing one (the executor routes values by name)."""

    def __init__(self, index: int, blocks: nn.Sequential, input_name: str, output_name: str) -> None:
        super().__init__()
        self.index = index
        self.blocks = blocks
        self.input_name = input_name
        self.output_name = output_name

    def forward(self, **values: torch.Tensor) -> dict[str, torch.Tensor]:
        return {self.output_name: self.blocks(values[self.input_name])}

    def named_model_parameters(self):
        """Parameters under their names in the full model."""
        return self.blocks.named_parameters()
