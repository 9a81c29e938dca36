"""partitioner=uniform: equal numbers of layers per stage, the embedding with the first stage and
the final norm and head with the last, on a transformers model's decoder layers (#24) as on the
project's own chains of `layerN` blocks (#34)."""

from __future__ import annotations

import hydra
import pytest

from pipelaunch.launcher.validate import prepare
from pipelaunch.pipeline.planner.partition.common import PartitionRequest
from pipelaunch.pipeline.planner.partition.plugins import uniform_split
from pipelaunch.pipeline.planner.partition.uniform import layer_container
from pipelaunch.pipeline.report.tables import stage_table
from tests.harness import FAST, compose_cfg

RUN = FAST[4:]  # the run's keys, not the gpt model's


def _layers_per_stage(plan) -> list[list[int]]:
    _, layer_of = layer_container({t for ts in plan.meta.stage_tensors for t in ts})
    return [sorted({layer_of[t] for t in ts if t in layer_of}) for ts in plan.meta.stage_tensors]


@pytest.mark.parametrize(("model", "pp", "want"), [
    (["model=hf_llama_tiny", "model.config.num_hidden_layers=8"], 4, [[0, 1], [2, 3], [4, 5], [6, 7]]),
    (["model=hf_llama_tiny", "model.config.num_hidden_layers=4"], 2, [[0, 1], [2, 3]]),
    (["model=hf_llama_tiny", "model.config.num_hidden_layers=8"], 3, [[0, 1, 2], [3, 4, 5], [6, 7]]),
    (["model=hf_gpt2_tiny"], 4, [[0], [1], [2], [3]]),
])
def test_uniform_gives_equal_decoder_layers(model: list[str], pp: int, want: list[list[int]]) -> None:
    plan = prepare(compose_cfg([*RUN, *model, f"pp={pp}", "partitioner=uniform"])).plan
    assert _layers_per_stage(plan) == want  # whole layers, each on one stage
    first, last = plan.meta.stage_tensors[0], plan.meta.stage_tensors[-1]
    assert any("embed_tokens" in t or ".wte." in t for t in first)
    assert any("lm_head" in t or ".wte." in t for t in last)
    rows = stage_table(plan).splitlines()[1:]
    assert "+ layer" in rows[0]  # embedding + layers
    assert rows[-1].split("  ")[-1].startswith("layer")  # the last stage holds layers, not only the head


def test_llama_table_names_what_each_stage_holds() -> None:
    plan = prepare(compose_cfg([*RUN, "model=hf_llama_tiny", "model.config.num_hidden_layers=8", "pp=4"])).plan
    rows = [r.split(None, 2)[2] for r in stage_table(plan).splitlines()[1:5]]
    assert rows[0].startswith("embed_tokens") and "+ layers 0-1" in rows[0]
    assert rows[1].startswith("layers 2-3") and rows[2].startswith("layers 4-5")
    assert rows[3].startswith("layers 6-7 + ") and "lm_head" in rows[3] and "norm" in rows[3]


# the chain models' cuts: stage -> blocks (6 layers; the embedding and head count as no layer)
CHAIN = {
    ("gpt", 2): [["embed", "layer0", "layer1", "layer2"], ["layer3", "layer4", "layer5", "head"]],
    ("gpt", 4): [["embed", "layer0", "layer1"], ["layer2", "layer3"], ["layer4"], ["layer5", "head"]],
    ("gpt", 3): [["embed", "layer0", "layer1"], ["layer2", "layer3"], ["layer4", "layer5", "head"]],
    ("mlp", 3): [["embed", "layer0", "layer1"], ["layer2", "layer3"], ["layer4", "layer5", "head"]],
}


@pytest.mark.parametrize(("model", "pp"), sorted(CHAIN))
def test_chain_of_blocks_gets_equal_layers(model: str, pp: int) -> None:
    spec = hydra.utils.instantiate(compose_cfg([*FAST, f"model={model}", "model.layers=6"]).model)
    graph = spec.trace(2).graph
    part = uniform_split(graph, pp, PartitionRequest(1e9, [1] * pp))
    stages = [sorted((n for n, s in part.assignment.items() if s == k), key=lambda n: graph.nodes[n]["order"])
              for k in range(pp)]
    assert stages == CHAIN[(model, pp)]


def test_layer_container_is_found_by_shape() -> None:
    assert layer_container(["m.layers.0.q", "m.layers.1.q", "m.layers.1.mlp.experts.3.w", "m.norm"])[0] == "m.layers"
    assert layer_container(["t.h.0.attn", "t.h.1.attn", "t.h.2.attn", "wte"])[0] == "t.h"
    assert layer_container(["layer0.mlp.0.w", "layer0.mlp.2.w", "layer1.mlp.0.w", "head.w"])[0] == "layer"
    assert layer_container(["mlp.0.w", "mlp.2.w"]) is None  # not 0..L-1
    assert layer_container(["layer1.0.conv1", "layer2.0.conv1", "conv1"]) is None  # torchvision's layer1..4
    assert layer_container(["enc.0.w", "enc.1.w", "dec.0.w", "dec.1.w"]) is None  # a tie
