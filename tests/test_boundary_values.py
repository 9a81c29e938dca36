"""Values computed from the inputs alone stay home (#55): a stage reading the model's causal or
document mask, its rotary tables or its position ids builds them from the inputs it already has
(pipeline/graph/derived.py), so stages send each other the hidden state alone.

Read from the Plan for transformers' Llama, Qwen2 and Mistral and the project's GPT at pp=4; and on
real ranks, Llama at pp=4 under 1f1b and zbv trains as one process, and on packed documents as each
document alone (every stage builds the document mask from the position ids it is given).
"""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn

from pipelaunch.launcher.validate import prepare
from pipelaunch.pipeline.graph.derived import derived_nodes, rebuilt_nodes
from tests.harness import FAST, check_like_one_process, compose_cfg
from tests.test_packing import LLAMA, check_layouts, plain_llama

TINY = ["+model.config.hidden_size=64", "+model.config.intermediate_size=128", "+model.config.num_hidden_layers=4",
        "+model.config.num_attention_heads=4", "+model.config.num_key_value_heads=2", "+model.config.vocab_size=256",
        "+model.config.max_position_embeddings=128", "model.seq_len=64"]
HF = {family: ["model=hf", f"+model.config.model_type={family}", *TINY] for family in ("llama", "qwen2", "mistral")}
PLANS = {**HF, "gpt": ["model=gpt", "model.layers=8", "model.seq_len=64"],
         "llama packed": [*HF["llama"], "data=tokens", "data.packing=documents", "data.eod_id=0"]}
RUN = ["pp=4", "microbatches=4", "batch_size=4", "partitioner=uniform", "check_split=never"]


def _hidden_only(overrides: list[str], tmp_path) -> list[tuple[int, dict]]:
    cfg = compose_cfg([*overrides, *RUN])
    plan = prepare(cfg).plan
    crossing = []
    for stage in plan.stages:
        received = {n: p for n, p in stage.inputs.items() if p is not None}
        crossing.append((stage.index, {n: stage.values[n] for n in received}))
        assert all(p == stage.index - 1 for p in received.values()), (stage.index, received)
        assert all(consumers == [stage.index + 1] for consumers in stage.outputs.values()), (stage.index, stage.outputs)
    return crossing


@pytest.mark.parametrize("model", PLANS, ids=list(PLANS))
def test_every_stage_sends_the_hidden_state_only(model, tmp_path, documents_file) -> None:
    """Each stage after the first receives exactly one value from the one before it, shaped as the
    hidden state [micro-batch, seq, hidden]; the later stages rebuild the rotary tables (and on
    packed documents the document mask) themselves."""
    overrides = [*PLANS[model], *([f"data.path={documents_file}"] if "packed" in model else [])]
    crossing = _hidden_only(overrides, tmp_path)
    for index, values in crossing[1:]:
        assert len(values) == 1, (model, index, values)
        ((shape, dtype),) = values.values()
        assert shape == [1, 64, 64] and dtype == "float32", (model, index, values)


@pytest.fixture
def documents_file(tmp_path):
    from tests.test_packing import write_documents

    return write_documents(tmp_path / "docs.bin")


def test_derived_nodes_follow_the_rule() -> None:
    """A mask and a rotary table made from the input, a buffer and arange are derived; what reads a
    parameter, draws random numbers, or is written in place later is not; and a stage reading a
    derived value of another stage rebuilds it with its derived ancestors."""

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inv = nn.Buffer(torch.arange(4.0))
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            pos = torch.arange(x.shape[1])
            table = (pos[:, None] * self.inv).cos()          # derived: arange and a buffer
            noise = torch.rand_like(x)                         # random: not derived
            h = self.a(x) * table + noise                      # a parameter: not derived
            scratch = torch.zeros_like(x)
            scratch.add_(h)                                    # written in place later: not derived
            return self.b(h) * table + scratch

    gm = fx.symbolic_trace(Model())
    derived = derived_nodes(gm)
    names = {n.name: n for n in gm.graph.nodes}
    assert {"arange", "getitem_1", "mul", "cos"} <= derived, derived
    assert not derived & {"rand_like", "a", "zeros_like", "add_"}, derived
    assert not {n for n in derived if names[n].op == "call_module"}
    order = [n.name for n in gm.graph.nodes if n.op not in ("placeholder", "get_attr", "output")]
    cut = order.index("b")  # stage 1 starts at the second linear, which reads `table`
    assignment = {n: int(i >= cut) for i, n in enumerate(order)}
    rebuilt = rebuilt_nodes(gm, assignment, 2)
    assert rebuilt[0] == [] and {"arange", "cos"} <= set(rebuilt[1]), rebuilt
    assert not set(rebuilt[1]) & {"a", "rand_like", "add"}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("sched", ["zbv", pytest.param("1f1b", marks=pytest.mark.slow)])
def test_llama_at_pp4_trains_as_one_process(sched: str, tmp_path) -> None:
    """transformers' Llama at pp=4 (zbv; 1f1b in the slow suite), every later stage building its
    own rotary tables: losses, step-0 gradients and final weights within 1e-5 of one process."""
    base = [o for o in FAST if not o.startswith(("model.dim", "model.layers", "model.vocab_size"))]
    cases = [(f"llama {sched} pp=4", compose_cfg(["model=hf_llama_tiny", "model.config.num_hidden_layers=8", *base,
                                                  f"scheduler={sched}", "pp=4", "model.seq_len=16"]))]
    check_like_one_process(cases, tmp_path)


@pytest.mark.slow  # the default suite trains packed Llama at pp=2, its second stage building the document mask
# from the position ids (tests/test_packing.py), and Llama at pp=4 building its rotary tables (above)
@pytest.mark.timeout(600)
def test_packed_llama_at_pp4_trains_as_each_document_alone(tmp_path) -> None:
    """On packed documents at pp=4 (1f1b), every stage builds the document mask from the position
    ids it reads from the data: each document trains as if alone."""
    from tests.test_packing import write_documents

    path = write_documents(tmp_path / "docs.bin")
    documents = ["data=tokens", f"data.path={path}", "data.packing=documents", "data.eod_id=0"]
    check_layouts(documents, [("pp=4 1f1b", ["pp=4", "scheduler=1f1b"])], tmp_path, LLAMA, plain_llama,
                  lambda m, ids: m(ids).logits, "model.")
