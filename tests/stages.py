"""Run a split model's stages one after the other in this process: what a pipeline computes, without one."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from pipeline.graph.split import SplitModel, rebuild_outputs


def run_stages(split: SplitModel, *args: Any, stages: Sequence[torch.nn.Module] | None = None) -> Any:
    """Run every stage in order in this process, routing values by name; returns the model's output.

    `stages` may replace `split.stages` (e.g. deep copies, so each holds its own tied-weight copy).
    """
    mods = list(stages) if stages is not None else split.stages
    if len(args) != len(split.input_names):
        raise TypeError(f"model takes {len(split.input_names)} inputs {split.input_names}, got {len(args)}")
    env: dict[str, Any] = dict(zip(split.input_names, args, strict=True))
    for io, mod in zip(split.io, mods, strict=True):
        produced = mod(**{name: env[name] for name in io.inputs})
        env.update(produced)
    result = rebuild_outputs(split.output_structure, env)
    if split.out_spec is not None:
        result = pytree.tree_unflatten(list(result), split.out_spec)
    return result
