"""Per-block recomputation: the plan field, the runtime rewrite and the ILP that chooses the blocks.

The runtime is judged like every schedule: real gloo ranks against single-process training. The
ILP is judged against brute force over every subset on small instances.
"""

from __future__ import annotations

import itertools
import json
import re
import subprocess
import sys
from pathlib import Path

import networkx as nx
import pytest
import torch
from hydra.utils import instantiate
from hypothesis import given, settings
from hypothesis import strategies as st

from pipelaunch.launcher.validate import prepare
from pipelaunch.pipeline.compute.backward import backward_input, backward_weight
from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.core.plan import Plan
from pipelaunch.pipeline.graph.recompute import recompute_blocks
from pipelaunch.pipeline.planner.passes.remat import (
    RecomputeInfeasible,
    RecomputeOption,
    choose_recompute,
    recompute_options,
)
from pipelaunch.pipeline.runtime.stage import StageModule, build_stage_modules
from tests.harness import FAST, ROOT, assert_state_close, compose_cfg, merge_state, run_jobs
from tests.reference import reference_run

# ---------------------------------------------------------------------------------------------- plan


def _plan(overrides: list[str]) -> tuple[dict, Plan]:
    cfg = compose_cfg([*FAST, "microbatches=4", *overrides])
    return cfg, prepare(cfg).plan


def test_recompute_round_trips_through_plan_json_and_old_plans_load(tmp_path: Path) -> None:
    _, plan = _plan(["scheduler=1f1b", "pp=2"])
    plan = plan.with_recompute({1: ["layer3", "layer5"]})
    assert Plan.from_dict(plan.to_dict()).stages[1].recompute == ["layer3", "layer5"]
    plan.write(tmp_path / "plan.json")
    assert [s.recompute for s in Plan.read(tmp_path / "plan.json").stages] == [[], ["layer3", "layer5"]]
    old = plan.to_dict()
    for s in old["stages"]:
        del s["recompute"]
    assert [s.recompute for s in Plan.from_dict(old).stages] == [[], []]


# ------------------------------------------------------------------------------------------- runtime


def _stage(cfg: dict, plan: Plan, index: int, recompute: list[str]) -> StageModule:
    plan = plan.with_recompute({index: recompute})
    spec = instantiate(cfg.model)
    return build_stage_modules(spec, plan, plan.stages[index].rank, cfg.seed, torch.device("cpu"))[index]


def _count_forwards(stage: StageModule, names: list[str]) -> dict[str, int]:
    """Forward calls of each named submodule, counted on entry (a recompute stops early, at the
    last tensor it must save, so a forward hook at exit would not see it)."""
    calls = dict.fromkeys(names, 0)
    for name in names:
        stage.gm.get_submodule(name).register_forward_pre_hook(lambda *_, name=name: calls.__setitem__(name, calls[name] + 1))
    return calls


def _stage_input(plan: Plan, index: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    out = {}
    for name in plan.stages[index].inputs:
        shape, dtype = plan.stages[index].values[name]
        out[name] = torch.randn(shape, generator=gen, dtype=getattr(torch, dtype)).requires_grad_(True)
    return out


def _grads(stage: StageModule, inputs: dict[str, torch.Tensor], split: bool) -> dict[str, torch.Tensor]:
    """Gradients of every parameter and input for the stage outputs' sum, fused or split into I, W."""
    for p in stage.parameters():
        p.grad = None
    xs = {n: x.detach().requires_grad_(True) for n, x in inputs.items()}
    outs = list(stage(**xs).values())
    grads = [torch.ones_like(o) for o in outs]
    if split:
        got, stash = backward_input(outs, grads, xs, list(stage.parameters()))
        backward_weight(stash)
    else:
        torch.autograd.backward(outs, grads)
        got = {n: x.grad for n, x in xs.items()}
    return {**{f"in:{n}": g for n, g in got.items()}, **{n: p.grad.clone() for n, p in stage.gm.named_parameters()}}


@pytest.mark.parametrize("split", [False, True], ids=["fused", "split-I-W"])
def test_a_recomputed_module_reruns_its_forward_in_the_backward_and_gradients_are_unchanged(split: bool) -> None:
    """Once in a fused backward; twice with I and W (once in I, once for all of W's restarts)."""
    cfg, plan = _plan(["scheduler=1f1b", "pp=2"])
    assert plan.stages[1].blocks == ["layer3", "layer4", "layer5", "head"]
    plain = _stage(cfg, plan, 1, [])
    ckpt = _stage(cfg, plan, 1, ["layer3", "layer5"])
    assert [n for n, _ in ckpt.gm.named_parameters()] == [n for n, _ in plain.gm.named_parameters()]
    calls = _count_forwards(ckpt, ["layer3", "layer4", "layer5"])
    inputs = _stage_input(plan, 1)
    expected = _grads(plain, inputs, split)
    got = _grads(ckpt, inputs, split)
    assert calls == {"layer3": 3 if split else 2, "layer4": 1, "layer5": 3 if split else 2}
    assert set(got) == set(expected)
    for name, g in expected.items():
        torch.testing.assert_close(got[name], g, rtol=0, atol=0, msg=name)


def test_recompute_under_dropout_replays_the_same_random_mask() -> None:
    """Non-reentrant checkpoint restores the RNG state before it reruns a forward."""
    cfg, plan = _plan(["scheduler=1f1b", "pp=2", "model.dropout=0.5"])
    plain, ckpt = _stage(cfg, plan, 1, []), _stage(cfg, plan, 1, ["layer3", "layer4"])
    inputs = _stage_input(plan, 1)
    torch.manual_seed(3)
    expected = _grads(plain, inputs, split=False)
    torch.manual_seed(3)
    got = _grads(ckpt, inputs, split=False)
    for name, g in expected.items():
        torch.testing.assert_close(got[name], g, rtol=0, atol=0, msg=name)


def test_stage_remat_and_layer_recompute_together() -> None:
    """An `R` action reruns the stage forward with grad after a no-grad forward; the checkpointed
    module then runs a third time in the backward."""
    cfg, plan = _plan(["scheduler=1f1b", "pp=2"])
    plain, ckpt = _stage(cfg, plan, 1, []), _stage(cfg, plan, 1, ["layer4"])
    calls = _count_forwards(ckpt, ["layer4"])
    inputs = _stage_input(plan, 1)
    with torch.no_grad():
        ckpt(**inputs)
    got = _grads(ckpt, inputs, split=False)
    assert calls == {"layer4": 3}
    for name, g in _grads(plain, inputs, split=False).items():
        torch.testing.assert_close(got[name], g, rtol=0, atol=0, msg=name)


def test_recompute_names_must_be_blocks_of_the_stage() -> None:
    """A block is the outermost numbered module (`layer3`); the head, or another stage's layer, is none."""
    cfg, plan = _plan(["scheduler=1f1b", "pp=2"])
    with pytest.raises(ValueError, match="layer0"):
        _stage(cfg, plan, 1, ["layer3", "layer0"])
    with pytest.raises(ValueError, match="'head'"):
        _stage(cfg, plan, 1, ["head"])
    cfg, plan = _plan(["scheduler=1f1b", "pp=2", "model.granularity=op"])
    spec = instantiate(cfg.model)
    gm = spec.trace(plan.micro_batch_size).gm
    not_a_block = next(n.name for n in gm.graph.nodes if n.op == "call_function")
    with pytest.raises(ValueError, match=not_a_block):
        recompute_blocks(gm, [not_a_block])


def test_an_operator_level_block_runs_as_one_checkpointed_region() -> None:
    """At operator granularity a layer is dozens of nodes: they become one checkpointed call, the
    parameter names unchanged, the gradients those of the plain stage, fused and split."""
    cfg, plan = _plan(["scheduler=1f1b", "pp=2", "model.granularity=op"])
    blocks = sorted({b for n in plan.stages[1].blocks if (b := _block(cfg, plan, n))})
    assert blocks and all(b.startswith("layer") for b in blocks)
    plain, ckpt = _stage(cfg, plan, 1, []), _stage(cfg, plan, 1, blocks[:2])
    assert [n for n, _ in ckpt.gm.named_parameters()] == [n for n, _ in plain.gm.named_parameters()]
    assert sum(1 for n in ckpt.gm.graph.nodes if n.op != "get_attr") < sum(1 for n in plain.gm.graph.nodes)
    inputs = _stage_input(plan, 1)
    for split in (False, True):
        expected, got = _grads(plain, inputs, split), _grads(ckpt, inputs, split)
        for name, g in expected.items():
            torch.testing.assert_close(got[name], g, rtol=0, atol=0, msg=name)


def _block(cfg: dict, plan: Plan, node: str) -> str | None:
    return instantiate(cfg.model).trace(plan.micro_batch_size).graph.nodes[node]["block"]


# ------------------------------------------------------------------------------ real ranks, reference


def _mixed(cfg: dict, plan: Plan, stages: list[int], offset: int) -> dict[int, list[str]]:
    """Every other block (from `offset`) of the given stages: some blocks, or a one-block stage's one."""
    graph = instantiate(cfg.model).trace(plan.micro_batch_size).graph
    out = {}
    for s in stages:
        blocks = list(dict.fromkeys(b for n in plan.stages[s].blocks if (b := graph.nodes[n]["block"])))
        out[s] = blocks[offset::2]
        assert out[s], (s, blocks)
    return out


def _run(cases: list[tuple[dict, Plan]], log_dir: Path) -> list[list[dict]]:
    """`tests.harness.run_jobs` with the plans given (carrying their recompute choices)."""
    return run_jobs([cfg for cfg, _ in cases], log_dir, plans=[plan for _, plan in cases])


def _case(overrides: list[str], stages: list[int], offset: int) -> tuple[dict, Plan, str]:
    cfg, plan = _plan(overrides)
    plan = plan.with_recompute(_mixed(cfg, plan, stages, offset))
    what = " ".join(overrides) + f" recompute={ {s.index: s.recompute for s in plan.stages if s.recompute} }"
    return cfg, plan, what


WORLDS = {
    2: [(["scheduler=1f1b", "pp=2"], [1], 0),
        (["scheduler=zbv", "pp=2"], [1, 3], 0),  # I/W split, 4 stages, V placement
        (["scheduler=1f1b", "pp=2", "remat=stage"], [1], 1),  # with the stage-level R actions
        (["scheduler=zb_h1", "pp=2", "model.granularity=op"], [0, 1], 1)],  # operator-level leaves
    4: [(["scheduler=gpipe", "pp=2", "dp=2"], [0, 1], 1)],
}


@pytest.mark.timeout(300)
# world 4 (gpipe with replicas) in the slow suite: tests/test_zero.py recomputes blocks at dp=2 by default
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_layer_recompute_matches_single_process(world: int, tmp_path: Path) -> None:
    cases = [_case(*c) for c in WORLDS[world]]
    results = _run([(cfg, plan) for cfg, plan, _ in cases], tmp_path / "logs")
    for (cfg, _, what), ranks in zip(cases, results, strict=True):
        ref = reference_run(cfg)
        assert ranks[0].losses == pytest.approx(ref["losses"], rel=1e-5), what
        for d in range(cfg.dp):
            assert_state_close(merge_state(ranks, "grads_step0", d), ref["grads_step0"], f"{what} replica {d} grads")
            assert_state_close(merge_state(ranks, "params_final", d), ref["params_final"], f"{what} replica {d} weights")


# ----------------------------------------------------------------------------------------------- ILP


def _cost(options: list[RecomputeOption], chosen: dict[int, list[RecomputeOption]]) -> float:
    return sum(o.cost_s for picked in chosen.values() for o in picked)


@st.composite
def _instances(draw):
    stages = draw(st.integers(1, 4))
    rank_of_stage = {s: draw(st.integers(0, 2)) for s in range(stages)}
    held = {s: draw(st.integers(0, 4)) for s in range(stages)}
    n = draw(st.integers(0, 10))
    # rerun buffers: none, or up to a few times what a module saves (a module read by many later
    # ones keeps little of its activations when checkpointed)
    reruns = draw(st.sampled_from([0.0, 1.0, 3.0]))
    options = []
    for i in range(n):
        saves = draw(st.floats(1.0, 1e9))
        options.append(RecomputeOption(f"m{i}", draw(st.integers(0, stages - 1)), saves, draw(st.floats(0.0, 1.0)),
                                       saves * draw(st.floats(0.0, reruns)) if reruns else 0.0))
    excess = {r: draw(st.floats(-1e9, 3e9)) for r in set(rank_of_stage.values())}
    return options, held, rank_of_stage, excess


def _net(subset, held) -> float:
    """Bytes a set frees: per micro-batch held, less the largest rerun buffer among them."""
    return sum(held[o.stage] * o.saves_bytes for o in subset) - max((o.rerun_bytes for o in subset), default=0.0)


@settings(max_examples=150, deadline=None)
@given(_instances(), st.integers(1, 8))
def test_choice_is_feasible_and_as_cheap_as_brute_force(instance, microbatches: int) -> None:
    """Net of the rerun buffer the choice adds (the largest recomputed module's activations, which
    the device holds again while it reruns), as the device's peak prices it."""
    options, held, rank_of_stage, excess = instance
    best: dict[int, float | None] = {}
    most: dict[int, float] = {}
    for rank, need in excess.items():
        mine = [o for o in options if rank_of_stage[o.stage] == rank and held[o.stage] > 0]
        subsets = [subset for k in range(len(mine) + 1) for subset in itertools.combinations(mine, k)]
        costs = [sum(o.cost_s for o in subset) for subset in subsets if _net(subset, held) >= need]
        best[rank] = min(costs) if costs else None
        most[rank] = max(_net(subset, held) for subset in subsets)
    if any(b is None for b in best.values()):
        with pytest.raises(RecomputeInfeasible) as info:
            choose_recompute(options, held, rank_of_stage, excess, microbatches)
        rank = info.value.rank
        assert best[rank] is None and info.value.excess_bytes == excess[rank]
        assert info.value.max_saves_bytes == pytest.approx(most[rank])
        return
    chosen = choose_recompute(options, held, rank_of_stage, excess, microbatches)
    assert all(picked and all(o.stage == s for o in picked) for s, picked in chosen.items())
    for rank, need in excess.items():
        mine = {s: picked for s, picked in chosen.items() if rank_of_stage[s] == rank}
        if need <= 0:
            assert not mine
            continue
        assert _net([o for picked in mine.values() for o in picked], held) >= need
        top = max((o.cost_s for o in options if rank_of_stage[o.stage] == rank), default=0.0)
        assert _cost(options, mine) <= best[rank] + 1e-5 * top + 1e-12


def test_no_excess_chooses_nothing_and_infeasible_names_the_numbers() -> None:
    options = [RecomputeOption("layer1", 0, 100.0, 1.0), RecomputeOption("layer2", 1, 50.0, 1.0)]
    rank_of_stage, held = {0: 0, 1: 1}, {0: 2, 1: 1}
    assert choose_recompute(options, held, rank_of_stage, {0: 0.0, 1: -5.0}, 4) == {}
    assert choose_recompute(options, held, rank_of_stage, {0: 150.0}, 4) == {0: [options[0]]}
    with pytest.raises(RecomputeInfeasible, match="rank 1") as info:
        choose_recompute(options, held, rank_of_stage, {0: 150.0, 1: 51.0}, 4)
    assert (info.value.rank, info.value.excess_bytes, info.value.max_saves_bytes) == (1, 51.0, 50.0)
    assert isinstance(info.value, ValueError)


def test_options_from_a_cost_graph() -> None:
    """Per block: full saves its activations minus the inputs checkpoint keeps and costs its
    forward; selective also keeps what the policy keeps and costs its share of the forward; the
    rerun charged twice where the backward is split into I and W (but on the first stage, whose
    whole backward is W); the rerun holds again what it rebuilds. Unnumbered nodes are no block,
    nor is the block making the output."""
    g = nx.DiGraph(outputs=["head"])
    g.add_node("embed", block=None, activation_bytes=80, output_bytes=100, forward_s=1.0)
    g.add_node("block0", block="layer0", activation_bytes=900, output_bytes=100, forward_s=2.0,
               selective_kept_bytes=300, selective_share=0.25)
    g.add_node("add", block="layer1", activation_bytes=0, output_bytes=100, forward_s=0.1)
    g.add_node("block1", block="layer1", activation_bytes=700, output_bytes=100, forward_s=2.9)
    g.add_node("linear", block=None, activation_bytes=100, output_bytes=100, forward_s=0.5)
    g.add_node("head", block="layer9", activation_bytes=5000, output_bytes=100, forward_s=4.0)
    g.add_edges_from([("embed", "block0"), ("block0", "add"), ("embed", "add"), ("add", "block1"),
                      ("block0", "block1"), ("block1", "linear"), ("linear", "head")])
    assignment = {"embed": 0, "block0": 0, "add": 1, "block1": 1, "linear": 1, "head": 1}
    full0, sel0 = RecomputeOption("layer0", 0, 800.0, 2.0, 900.0, rerun_s=2.0), \
        RecomputeOption("layer0", 0, 500.0, 0.5, 600.0, selective=True, rerun_s=0.5)
    # layer1's backward runs after linear's and head's: their 5100 bytes are freed when it reruns
    full1 = RecomputeOption("layer1", 1, 500.0, pytest.approx(3.0), 700.0, rerun_s=pytest.approx(3.0), later_bytes=5100.0)
    sel1 = RecomputeOption("layer1", 1, 500.0, pytest.approx(3.0), 700.0, selective=True, rerun_s=pytest.approx(3.0),
                           later_bytes=5100.0)
    assert recompute_options(g, assignment, False) == [full0, sel0, full1, sel1]
    twice = recompute_options(g, assignment, {1})
    assert [o.cost_s for o in twice] == [2.0, 0.5, pytest.approx(6.0), pytest.approx(6.0)]
    assert [o.cost_s for o in recompute_options(g, assignment, True)] == [2.0, 0.5, pytest.approx(6.0),
                                                                          pytest.approx(6.0)]


def test_one_option_a_block() -> None:
    """A block's full and selective options exclude each other: the cheapest cover takes one."""
    options = [RecomputeOption("layer0", 0, 100.0, 1.0, 0.0), RecomputeOption("layer0", 0, 60.0, 0.2, 0.0,
                                                                              selective=True),
               RecomputeOption("layer1", 0, 100.0, 1.0, 0.0), RecomputeOption("layer1", 0, 60.0, 0.2, 0.0,
                                                                              selective=True)]
    chosen = choose_recompute(options, {0: 1}, {0: 0}, {0: 120.0}, 4)[0]
    assert len({o.node for o in chosen}) == len(chosen)
    assert sorted((o.node, o.selective) for o in chosen) == [("layer0", True), ("layer1", True)]
    chosen = choose_recompute(options, {0: 1}, {0: 0}, {0: 150.0}, 4)[0]
    assert sorted((o.node, o.selective) for o in chosen) == [("layer0", False), ("layer1", True)] or \
        sorted((o.node, o.selective) for o in chosen) == [("layer0", True), ("layer1", False)]


def test_options_of_a_traced_gpt_are_its_blocks() -> None:
    cfg, plan = _plan(["scheduler=1f1b", "pp=2"])
    graph = instantiate(cfg.model).trace(plan.micro_batch_size).graph
    for n in graph.nodes:
        graph.nodes[n].update(activation_bytes=10 * graph.nodes[n]["output_bytes"], forward_s=1.0)
    options = [o for o in recompute_options(graph, plan.assignment, False) if not o.selective]
    assert [o.node for o in options] == ["layer0", "layer1", "layer2", "layer3", "layer4", "layer5"]
    assert all(o.saves_bytes == 9 * graph.nodes[o.node]["output_bytes"] for o in options)


# ------------------------------------------------------------------- block granularity under a cap

#: README's example: gpt_bench at block granularity (the default), 1f1b, uniform, pp=4
README_BUDGET = ["model=gpt_bench", "pp=4", "memory=budget"]
#: between the remat=none peak (rank 0 about 165 MiB, rank 3 about 139) and what recomputing every block
#: leaves (about 113 MiB)
README_CAP = 140e6


def test_a_cap_no_recompute_meets_is_met_by_recomputing_blocks_not_whole_stages() -> None:
    with pytest.raises(ConfigError, match="memory.cap_bytes"):
        prepare(compose_cfg([*README_BUDGET, f"memory.cap_bytes={README_CAP}"]))
    prepared = prepare(compose_cfg([*README_BUDGET, f"memory.cap_bytes={README_CAP}", "remat=auto"]))
    plan = prepared.plan
    assert plan.schedule.remat_stages() == []  # blocks are recomputed, not whole stages
    assert any(s.recompute for s in plan.stages)
    assert all(set(s.recompute) <= set(s.blocks) for s in plan.stages)
    assert max(d.total for d in prepared.prediction.devices) <= README_CAP


def test_a_cap_below_what_recomputing_everything_leaves_names_the_smallest_cap_that_works() -> None:
    with pytest.raises(ConfigError) as info:
        prepare(compose_cfg([*README_BUDGET, "memory.cap_bytes=90e6", "remat=auto"]))
    message = str(info.value)
    assert "those are the peaks with every candidate block recomputed" in message and "(remat=auto)" not in message
    smallest = re.search(r"smallest cap this split and schedule meet is [\d.]+ MiB \(memory.cap_bytes=(\d+e6)\)",
                         message)
    assert smallest, message
    plan = prepare(compose_cfg([*README_BUDGET, f"memory.cap_bytes={smallest.group(1)}", "remat=auto"])).plan
    assert any(s.recompute for s in plan.stages)


def _readme_budget_ranks(tmp_path: Path) -> tuple[list[dict], float]:
    """The README's remat=auto example, 3 steps: each rank's facts from metrics.json, and the reserve
    every device's prediction holds beyond its tensors."""
    run = tmp_path / "run"
    subprocess.run([sys.executable, "train.py", "remat=auto", *README_BUDGET, f"memory.cap_bytes={README_CAP:.0f}",
                    "steps=3", f"hydra.run.dir={run}"], cwd=ROOT, check=True, timeout=400,
                   capture_output=True, text=True)
    metrics = json.loads((run / "metrics.json").read_text())
    assert len(metrics["ranks"]) == 4
    return metrics["ranks"], float(metrics["config"]["memory"]["reserve_bytes"])


@pytest.mark.timeout(420)
def test_readme_budget_example_trains_with_every_rank_under_the_cap(tmp_path: Path) -> None:
    """Measured, not only predicted. The tensors' peak (counted like CUDA's allocated peak, the
    same in every run) stays under the cap less the reserve, and within 20% below its prediction
    (here 0.88-0.99). The resident set's rise also holds what glibc keeps of freed blocks, which
    varies with the machine and the run (here 0.68-1.09 of the whole prediction; 1.28 on the loss
    rank at 8 micro-batches with huge_pages=false), so it is only checked against a gross excess,
    such as a rank holding what it sent to the step's end."""
    ranks, reserve = _readme_budget_ranks(tmp_path)
    for r in ranks:
        tensors, predicted = r["peak_tensor_bytes"], r["predicted_peak_bytes"] - reserve
        assert tensors < README_CAP - reserve, (r["rank"], tensors)
        assert 0.8 * predicted < tensors < 1.05 * predicted, (r["rank"], tensors, predicted)
        assert r["peak_above_start_bytes"] < 1.5 * r["predicted_peak_bytes"], (
            r["rank"], r["peak_above_start_bytes"], r["predicted_peak_bytes"])


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_readme_budget_example_keeps_every_rank_resident_set_under_the_cap(tmp_path: Path) -> None:
    """The resident set's rise under the cap itself: the loss rank's heap fragments by an amount
    that varies with the machine and the run (here 106-133 MB against 140; at 8 micro-batches
    without huge pages up to 160; in CI it once measured 148 MB), which the 50 MB reserve does not
    always cover, so this runs with the slow suite."""
    ranks, _ = _readme_budget_ranks(tmp_path)
    for r in ranks:
        assert r["peak_above_start_bytes"] < README_CAP, (r["rank"], r["peak_above_start_bytes"])


def test_plan_auto_remat_candidates_differ_from_their_twins_where_the_twin_is_over_the_cap() -> None:
    """Every remat=auto candidate whose remat=none twin misses the cap either fits or reports a
    lower peak on the twin's fullest device (its floor): recomputation is never a no-op. Compared
    where both have the same split: balanced cuts a remat=auto candidate by the partitioner's
    pricing of recomputation, which on some profiles moves parameters onto the fullest device."""
    # five schedule families (one stage a rank, zero bubble, V in three memory settings): 19 pairs
    search = prepare(compose_cfg([*README_BUDGET, "plan=auto", "memory.cap_bytes=120e6",
                                  "plan.schedulers=[1f1b,zb_h1,zbv,v_half,v_min]"])).search
    by_key = {(o.candidate.label.replace("remat=auto", "remat=none"), o.candidate.remat): o for o in search.outcomes}
    compared = 0
    for (label, remat), auto in by_key.items():
        twin = by_key.get((label, "none"))
        if remat != "auto" or twin is None or twin.prediction is None or not twin.over:
            continue
        assert auto.prediction is not None or not auto.over, auto.candidate.label
        if auto.prediction is None or auto.prediction.plan.assignment != twin.prediction.plan.assignment:
            continue
        compared += 1
        fullest = max(twin.over, key=lambda d: d.total)
        if auto.over:
            assert auto.prediction.devices[fullest.rank].total < fullest.total, auto.candidate.label
    assert compared >= 10
