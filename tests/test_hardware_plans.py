"""Planning for a named device (`hardware=<file>`, #45): the profile priced on the file's figures on
meta, its memory as the budget, its links by where a layout's ranks sit, and the refusals a
cluster plan must give before anything runs."""

from __future__ import annotations

import functools

import pytest
import torch

from pipelaunch.launcher.validate import prepare
from pipelaunch.launcher.winner_command import winner_commands
from pipelaunch.models.gpt import DecoderBlock, gpt
from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.core.hardware import configured_hardware, known_hardware, load_hardware
from pipelaunch.pipeline.planner.measure.analytic import forward_backward
from pipelaunch.pipeline.planner.measure.analytic_profile import price_graphs
from pipelaunch.pipeline.planner.measure.host_memory import check_host_memory, profile_bytes
from pipelaunch.pipeline.planner.measure.profile import ProfileJob, profile_graph
from tests.harness import compose_cfg

SMALL = ["model.dim=256", "model.heads=8", "model.layers=4", "model.seq_len=128", "model.vocab_size=512",
         "batch_size=32", "precision=bf16"]
#: a cluster of 4 devices in nodes of 2: tp stays inside one, pipelines and replicas cross them
SEARCH = ["mode=plan", "plan=auto", "plan.devices=4", "hardware.devices_per_node=2", "plan.schedulers=[1f1b]",
          "plan.partitioners=[uniform]", "plan.remat=[none]", "plan.microbatches=[4]"]


@functools.cache
def searched(name: str):
    """The small cluster search on hardware file `name`, planned once per test process."""
    return prepare(compose_cfg([*SEARCH, *SMALL, f"hardware={name}"]))


@pytest.mark.parametrize("name", known_hardware())
def test_every_hardware_file_plans_a_cluster_deterministically_within_its_memory(name):
    overrides = [*SEARCH, *SMALL, f"hardware={name}"]
    cfg = compose_cfg(overrides)
    hw = configured_hardware(cfg.hardware)
    assert hw.name == load_hardware(name).name and hw.devices_per_node == 2
    first = searched(name)
    if name == "a100_80gb":  # planned twice: the same predictions, the same winner
        again = prepare(compose_cfg(overrides))
        assert first.search.winner.candidate == again.search.winner.candidate
        assert [o.row() for o in first.search.ranked] == [o.row() for o in again.search.ranked]
    tps = {o.candidate.tp or 1 for o in first.search.outcomes}
    assert tps == {1, 2}  # every degree inside a node of 2, none across (4 divides the devices)
    assert first.search.ranked and all(o.prediction.peak_bytes <= hw.memory_bytes for o in first.search.ranked)
    meta = first.plan.meta
    assert meta.device_type == "cuda" and meta.memory_cap == hw.memory_bytes
    assert meta.reserve_bytes == hw.reserve_bytes and meta.machine.cost_source == hw.source
    win = first.search.winner.candidate
    pp_link, dp_link = hw.links(win.pp, win.dp, win.tp or 1)
    assert meta.machine.link_latency_s == pp_link.latency_s and meta.machine.dp_link == [dp_link.latency_s,
                                                                                         dp_link.bandwidth]
    tokens, mfu = first.search.per_device(first.search.winner)
    assert tokens > 0 and 0 < mfu < 1


def test_links_follow_where_the_ranks_sit():
    hw = load_hardware("a100_80gb")  # 8 a node; tp fastest, then pp, then dp (runtime/context.py)
    assert hw.links(pp=2, dp=4, tp=1) == (hw.intra_node, hw.intra_node)  # the whole job in one node
    assert hw.links(pp=4, dp=2, tp=2) == (hw.intra_node, hw.inter_node)  # a pipeline per node
    assert hw.links(pp=4, dp=1, tp=4) == (hw.inter_node, hw.inter_node)  # a pipeline over two nodes


def test_the_analytic_profile_prices_each_block_as_the_module_alone():
    """The traced model's blocks priced in the graph cost what the same block costs priced alone
    (one roofline, whichever way it is reached), and copies cost the same."""
    hw = load_hardware("h100_sxm")
    spec = gpt(name="gpt", vocab_size=512, dim=256, layers=3, heads=8, seq_len=128, mlp_ratio=4, dropout=0.0)
    traced = spec.trace(2, spec.build_meta())
    x, y = spec.example_batch(2, 0)
    price_graphs([ProfileJob(traced, spec.model_args(x, y), None, (spec.loss_fn, y))], hw, torch.bfloat16)
    nodes = traced.graph.nodes
    assert nodes["layer0"]["forward_s"] == nodes["layer2"]["forward_s"]
    with torch.device("meta"):
        block = DecoderBlock(256, 8).to(torch.bfloat16)
        h = torch.empty(2, 128, 256, dtype=torch.bfloat16)
    fwd, bwd = forward_backward(block, (h,), hw, master_weights=True)
    assert nodes["layer0"]["forward_s"] == pytest.approx(fwd.seconds, rel=1e-6)
    assert nodes["layer0"]["backward_s"] == pytest.approx(bwd.seconds, rel=1e-6)
    assert traced.graph.graph["model_flops"] > 3 * 6 * 2 * 128 * sum(p.numel() for p in block.parameters())
    assert nodes["head"]["loss_activation_bytes"] > 0  # the loss is priced on the node producing the output


def test_the_analytic_profile_counts_what_autograd_saves_as_the_measured_one_does():
    """In fp32, the bytes each block saves for backward, counted on meta, are the bytes the CPU
    profile measures (weights excluded: a linear's transposed weight is the weight)."""
    hw = load_hardware("a100_80gb")
    spec = gpt(name="gpt", vocab_size=256, dim=64, layers=2, heads=4, seq_len=32, mlp_ratio=4, dropout=0.0)
    x, y = spec.example_batch(2, 0)
    priced, measured = spec.trace(2, spec.build_meta()), spec.trace(2, spec.build_meta())
    price_graphs([ProfileJob(priced, spec.model_args(x, y), None, (spec.loss_fn, y))], hw)
    profile_graph(measured, spec.model_args(x, y), repeats=1, use_cache=False, loss=(spec.loss_fn, y))
    for node in ("layer0", "layer1", "head"):
        assert priced.graph.nodes[node]["activation_bytes"] == pytest.approx(
            measured.graph.nodes[node]["activation_bytes"], rel=0.1), node
        assert priced.graph.nodes[node]["output_bytes"] == measured.graph.nodes[node]["output_bytes"]


def test_a_layout_over_the_device_memory_is_refused_naming_the_device_and_bytes():
    cfg = compose_cfg(["mode=plan", "hardware=h100_sxm", "hardware.memory_bytes=4e9", "pp=2", "model.dim=2048",
                       "model.heads=16", "model.layers=4", "model.vocab_size=32000", "model.seq_len=512",
                       "batch_size=8", "microbatches=2"])
    with pytest.raises(ConfigError) as err:
        prepare(cfg)
    text = str(err.value)
    assert err.value.key == "memory.cap_bytes" and "NVIDIA H100 80GB HBM3" in text and "MiB" in text
    assert "rank 0 needs" in text and "hardware=h100_sxm" in text


def test_tensor_parallelism_across_nodes_and_cpu_training_are_refused():
    with pytest.raises(ConfigError, match="stays inside a node") as err:
        prepare(compose_cfg(["mode=plan", "hardware=a100_80gb", "hardware.devices_per_node=4", "pp=1", "tp=8"]))
    assert err.value.key == "tp"
    with pytest.raises(ConfigError, match="stays inside a node") as err:
        prepare(compose_cfg([*SEARCH, *SMALL, "hardware=a100_80gb", "plan.tp=[4]"]))
    assert err.value.key == "plan.tp"
    with pytest.raises(ConfigError, match="mode=plan") as err:
        prepare(compose_cfg(["hardware=h100_sxm", "device=cpu"]))
    assert err.value.key == "hardware"


def test_a_profile_the_host_cannot_hold_is_refused_before_it_starts():
    spec = gpt(name="gpt", vocab_size=50000, dim=512, layers=2, heads=8, seq_len=256, mlp_ratio=4, dropout=0.0)
    traced = spec.trace(4, spec.build_meta())
    need, node = profile_bytes(traced)
    embedding = 50000 * 512 * 4
    logits = 4 * 256 * 50000 * 4
    assert need == 3 * (embedding + 256 * 512 * 4) + 4 * logits and node == "embed"
    weights = sum(p.numel() * 4 for p in spec.build_meta().parameters())
    assert need > 2 * weights  # the largest layer with its batch decides here, not the model
    check_host_memory([traced], [4], available=2 * need)
    with pytest.raises(ConfigError, match="hardware=h100_sxm") as err:
        check_host_memory([traced], [4], available=need / 2)
    assert err.value.key == "hardware" and f"{need / 2**30:.1f} GiB" in str(err.value)
    with pytest.raises(ConfigError, match="weights and their gradients alone") as err:
        check_host_memory([traced], [4], available=weights)
    assert f"{2 * weights / 2**30:.1f} GiB" in str(err.value)


def test_the_winner_command_sets_what_the_search_chose_and_keeps_the_rest():
    hw = load_hardware("a100_80gb")
    result = searched("a100_80gb").search
    win = result.winner.candidate
    given = ["mode=plan", "plan=auto", "plan.devices=16", "hardware=a100_80gb", "model.dim=256", "pp=3", "+x.y=[1, 2]"]
    here, slurm = winner_commands(given, win, 16, hw)  # 16 devices, 8 a node
    assert here.startswith("python train.py hardware=a100_80gb model.dim=256 '+x.y=[1, 2]' ")
    assert f"pp={win.pp} dp={win.dp} tp={win.tp}" in here and "pp=3" not in here and "plan" not in here
    assert "scheduler=1f1b" in here and f"microbatches={win.microbatches}" in here
    assert slurm.startswith("python train.py -m hydra/launcher=submitit_slurm hydra.launcher.nodes=2 "
                            "hydra.launcher.tasks_per_node=8 hydra.launcher.gpus_per_node=8 device=cuda ")


def test_an_op_level_graph_prices_the_same_when_copies_reuse_their_twins_outputs(monkeypatch):
    """An exported transformers model (aten operators, its layers' copies alike) is priced with
    each repeated operator handed its twin's output instead of running its meta kernel: every
    node's priced fields are those of the pass that runs every operator."""
    import pipelaunch.pipeline.planner.measure.analytic_profile as analytic_profile
    from pipelaunch.launcher.plugins import build_plugins

    hw = load_hardware("h100_sxm")
    spec = build_plugins(compose_cfg(["model=hf_llama_tiny", "model.seq_len=32"])).model.build()
    x, y = spec.example_batch(2, 0)

    def priced():
        traced = spec.trace(2, spec.build_meta())
        price_graphs([ProfileJob(traced, spec.model_args(x, y), None, (spec.loss_fn, y))], hw, torch.bfloat16)
        return {n: {k: v for k, v in d.items() if k != "samples"} for n, d in traced.graph.nodes(data=True)}

    reused = priced()
    monkeypatch.setattr(analytic_profile, "_owned", lambda value: False)  # every operator run
    assert reused == priced()
    assert len(reused) > 100
