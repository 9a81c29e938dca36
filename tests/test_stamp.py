"""The planner's export of a deep model made from a cut of it (pipeline/graph/stamp.py) is the whole
export's graph, node for node, or it is not made: transformers' architectures (tests/hf_sweep's tiny
configs at 6 layers), blocks configured apart, and a block whose code branches on its index."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from pipelaunch.models.hf import hf
from pipelaunch.pipeline.graph.stamp import Repeated, same_graph, stamped_export
from pipelaunch.pipeline.graph.trace import _export_trace, _quiet_export
from tests import hf_sweep
from tests.test_hf_sweep import REPRESENTATIVE

LAYERS = 6


def _spec(name: str):
    config = hf_sweep.tiny_config(name, LAYERS, REPRESENTATIVE[name][1]).to_dict()
    return hf(config=config, seq_len=16)


#: the architectures whose layers are alike: the stamp is made for them (the others are exported whole)
STAMPED = {"llama", "gpt2", "mixtral", "qwen2_moe", "gpt_neox", "phi", "qwen3", "olmo2"}
#: the default suite's: dense, mixture of experts, sliding-window layers apart, dense layers first
DEFAULT = {"llama", "mixtral", "gemma2", "deepseek_v3"}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", [n if n in DEFAULT else pytest.param(n, marks=pytest.mark.slow) for n in REPRESENTATIVE])
def test_the_planners_export_is_the_whole_export(name: str) -> None:
    spec = _spec(name)
    whole = dataclasses.replace(spec, repeated=None).trace(2)
    planned = spec.trace(2, repeat=True)
    assert same_graph(planned.gm, whole.gm), name
    assert list(planned.graph.nodes(data=True)) == list(whole.graph.nodes(data=True)), name
    made = None
    if spec.repeated is not None:
        with _quiet_export():
            made = stamped_export(spec.build_meta(), lambda m: _export_trace(m, spec.meta_args(2)), spec.repeated)
    assert (made is not None) == (name in STAMPED), name


def test_a_config_setting_layers_apart_is_exported_whole() -> None:
    """gemma2's `layer_types` alternates sliding and full attention: no stamp is offered."""
    assert _spec("gemma2").repeated is None
    assert _spec("llama").repeated is not None


class _Block(nn.Module):
    def __init__(self, index: int, kinks: int) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.index, self.kinks = index, kinks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.lin(x)
        return torch.relu(x) if self.kinks and self.index % self.kinks == self.kinks - 1 else x


class _Stack(nn.Module):
    def __init__(self, depth: int, kinks: int = 0, skip: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block(i, kinks) for i in range(depth))
        self.skip = skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seen = [x]
        for block in self.blocks:
            out = block(seen[-1])
            seen.append(out + seen[-2] if self.skip and len(seen) > 1 else out)
        return seen[-1]


def _cut(model: nn.Module, depth: int):
    from contextlib import contextmanager

    @contextmanager
    def inside():
        blocks = model.blocks
        model.blocks = nn.ModuleList(list(blocks)[:depth])
        try:
            yield
        finally:
            model.blocks = blocks
    return inside()


def _stamped(model: nn.Module):
    args = (torch.empty(2, 8, device="meta"),)
    with _quiet_export():
        return stamped_export(model, lambda m: _export_trace(m, args), Repeated("blocks", _cut)), \
            _export_trace(model, args)


def test_alike_blocks_stamp_to_the_whole_export() -> None:
    with torch.device("meta"):
        model = _Stack(7)
    made, whole = _stamped(model)
    assert made is not None and same_graph(made[0], whole[0])
    assert sorted(n for n, _ in made[0].named_parameters()) == sorted(n for n, _ in whole[0].named_parameters())


def test_blocks_the_cut_shows_apart_or_reading_further_back_are_exported_whole() -> None:
    with torch.device("meta"):
        every_third = _Stack(6, kinks=3)  # the third block differs in code, not in a setting
        skipping = _Stack(6, skip=True)  # each block reads the one two back
    assert _stamped(every_third)[0] is None
    assert _stamped(skipping)[0] is None
