"""Router statistics: how many tokens each expert of every mixture-of-experts layer got in a
step, over the whole global batch, as MoE users watch for a collapsing router (one expert taking
every token, others starving).

Each rank's `MoE` layers count the expert picks of their own forwards (`MoE.counts`; a rerun
inside the backward, recomputation's, is not counted). At the step's end the counts are summed
over the replicas of each pipeline rank (its dp group: every token of the batch passes each layer
on one of them), and rank 0 gathers every layer's min / mean / max tokens per expert: one
all-reduce on the dp group and one gather per step, after the optimizer step's own collectives,
in the same order on every rank.

The same summed counts move the routers' correction bias after a step that trained (DeepSeek-V3's
auxiliary-loss-free balancing, `moe.bias_update_rate`: `models.moe.update_bias`): every rank
holding a layer (its replicas, ep ranks and tp ranks, each with the router whole) applies the same
update to the same counts, so the bias stays one value everywhere, as in one process. No
collective of its own.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist
from torch import nn

from pipelaunch.models.hf_moe import HFExperts, correction_bias_name
from pipelaunch.models.moe import MoE, move_bias, update_bias


def moe_layers(modules: list[nn.Module]) -> list[tuple[str, MoE | HFExperts]]:
    """This rank's MoE layers by their name in the full model, in one order on every replica
    (model=hf: each transformers experts module, which counts its tokens as `MoE` does)."""
    found: dict[str, MoE | HFExperts] = {}
    for module in modules:
        aliases = getattr(module, "aliases", {})
        for name, sub in module.named_modules():
            if isinstance(sub, (MoE, HFExperts)):
                found.setdefault(aliases.get(name, name).removeprefix("gm."), sub)
    return sorted(found.items())


def reset_counts(layers: list[tuple[str, MoE | HFExperts]]) -> None:
    """Start a step's count (evaluation's forwards in between are not the step's)."""
    for _, layer in layers:
        layer.counts = None


def expert_load(layers: list[tuple[str, MoE | HFExperts]], dp_group: dist.ProcessGroup | None, counted_here: bool,
                device: torch.device, trained: list[nn.Module] | None = None) -> dict[str, dict[str, float]] | None:
    """Collective over every rank: {layer: {"min", "mean", "max"} tokens per expert} over the
    step's global batch on rank 0, None elsewhere. `counted_here`: this rank's layers are the
    ones reported (tp rank 0: the tp ranks of a layer route the same tokens). `trained`: after a
    step that trained (its optimizer step done), the rank's stage modules: each layer with a
    `bias_update_rate` moves its router's correction bias by the global counts (module docstring;
    transformers' DeepSeek-V3 keeps it beside the experts, `hf_moe.correction_bias_name`)."""
    stats: dict[str, dict[str, float]] = {}
    if layers:
        counts = torch.stack([layer.counts if layer.counts is not None
                              else torch.zeros(layer.router.experts if isinstance(layer, MoE) else layer.total,
                                               dtype=torch.long, device=device)
                              for _, layer in layers]).to(torch.float64)
        if dp_group is not None:
            dist.all_reduce(counts, group=dp_group)
        moving = [(name, layer, row) for (name, layer), row in zip(layers, counts, strict=True)
                  if layer.bias_update_rate] if trained is not None else []
        biases = _buffers(trained) if any(isinstance(layer, HFExperts) for _, layer, _ in moving) else {}
        for name, layer, row in moving:
            if isinstance(layer, MoE):
                update_bias(layer.router, row, layer.bias_update_rate)
            else:  # transformers' DeepSeek-V3: the gate's own buffer beside the experts
                move_bias(biases[correction_bias_name(name)], row, layer.bias_update_rate)
        if counted_here:
            for (name, _), row in zip(layers, counts.cpu().tolist(), strict=True):
                stats[name] = {"min": min(row), "mean": sum(row) / len(row), "max": max(row)}
    gathered: list | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(stats, gathered, dst=0)
    if gathered is None:
        return None
    merged = {name: s for part in gathered for name, s in part.items()}
    return dict(sorted(merged.items(), key=lambda kv: _layer_order(kv[0])))


def _buffers(modules: list[nn.Module]) -> dict[str, torch.Tensor]:
    """The stages' buffers by their name in the full model (what a checkpoint keys them by)."""
    found = {}
    for module in modules:
        aliases = getattr(module, "aliases", {})
        for name, buffer in module.named_buffers():
            found.setdefault(aliases.get(name, name).removeprefix("gm."), buffer)
    return found


def _layer_order(name: str) -> tuple:
    """Names in model order (layer10 after layer9)."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


def worst_ratio(load: dict[str, dict[str, float]]) -> float:
    """The busiest expert's tokens over the mean, worst over the layers (1.0: perfectly balanced)."""
    return max((s["max"] / s["mean"] for s in load.values() if s["mean"] > 0), default=1.0)
