"""Tied parameters read in the compute dtype of a sharded stage (precision=bf16, zero >= 1).

FSDP2's MixedPrecisionPolicy casts the parameters it manages to bf16 for the compute, but tied
parameters (`Plan.shared_params`) are kept out of FSDP2 (`ignored_params`: held by several stages,
even two of one rank, they stay whole and are summed across stages), so without this they would
stay fp32 inside a stage whose other parameters are bf16. An op that autocast does not cast then
mixes the two: an fp32 tied embedding's lookup feeds a LayerNorm with bf16 weights, which torch's
CPU layer_norm refuses ("mixed dtype (CPU): expect parameter to have scalar type of Float"; CPU
autocast has no rule for layer_norm, CUDA's runs it in fp32). Here every read of a tied parameter
inside such a stage is a differentiable cast of it to the policy's dtype, so the whole stage
computes under one policy on any device, and the gradient reaches the fp32 parameter as fp32.

The cast is made when the stage's graph runs (which reads the parameter by `get_attr`, as an
export trace does, or inside a leaf module), and again when a leaf module that reads it runs alone:
a checkpointed module recomputing in the backward (`pipeline/graph/recompute.py`) sees the cast too.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx, nn


class CastOnUse:
    """While the graph or one of its leaf modules that read a tied parameter runs, the modules
    holding that parameter hold its cast to `dtype` instead (one cast per run, restored after)."""

    def __init__(self, gm: fx.GraphModule, tied: list[nn.Parameter], dtype: torch.dtype) -> None:
        ids = {id(p) for p in tied}
        self.dtype = dtype
        #: (module, attribute, parameter) for every place a tied parameter is held, aliases included
        self.slots = [(m, name, p) for m in gm.modules(remove_duplicate=False)
                      for name, p in m._parameters.items() if p is not None and id(p) in ids]
        self.depth = 0
        for reader in [gm, *_leaf_readers(gm, ids)]:
            reader.register_forward_pre_hook(self._enter)
            reader.register_forward_hook(self._exit, always_call=True)

    def _enter(self, *_: Any) -> None:
        self.depth += 1
        if self.depth > 1:
            return  # an outer run holds the cast already
        casts: dict[int, torch.Tensor] = {}
        for module, name, p in self.slots:
            module._parameters[name] = casts.setdefault(id(p), p.to(self.dtype))

    def _exit(self, *_: Any) -> None:
        self.depth -= 1
        if self.depth == 0:
            for module, name, p in self.slots:
                module._parameters[name] = p


def _leaf_readers(gm: fx.GraphModule, ids: set[int]) -> list[nn.Module]:
    """The leaf modules the graph calls (directly, or through `checkpointed`) that hold a tied parameter."""
    targets = {n.target for n in gm.graph.nodes if n.op in ("call_module", "get_attr")}
    modules = [m for m in (_attr(gm, t) for t in targets) if isinstance(m, nn.Module)]
    return [m for m in modules if any(id(p) in ids for p in m.parameters())]


def _attr(gm: nn.Module, target: str) -> object:
    """What a node's dotted target names: a submodule, or a parameter or buffer."""
    obj: object = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj
