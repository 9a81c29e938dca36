"""Mixtures of experts (#56): the project's GPT with MoE blocks (models/moe.py), its routers and
auxiliary loss, trains like one process running the same micro-batches under the pipeline's
schedules and the replicas' sharding; expert parallelism (ep) splits each layer's experts over
the replicas and trains the same."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from pipelaunch.launcher.plugins import build_plugins
from pipelaunch.launcher.validate import prepare
from pipelaunch.models.moe import Experts, MoE, Router, set_aux_loss_scale, within_capacity
from pipelaunch.pipeline.planner.measure.experts import add_all_to_alls, ep_local, moe_nodes
from tests.harness import FAST, check_like_one_process, compose_cfg, run_jobs

#: 4 routed experts of width 64, top-2, a shared expert, the first block dense, the aux loss on
MOE = [*FAST, "model.experts=4", "model.top_k=2", "model.expert_dim=64", "model.shared_experts=1",
       "model.dense_layers=1", "model.aux_loss_coef=0.05", "microbatches=4"]
#: DeepSeek-V3's router: sigmoid scores, 2 groups of the 4 experts, the best group kept, scaled
SIGMOID = ["model.router=sigmoid", "model.expert_groups=2", "model.topk_groups=1", "model.route_scale=2.5"]


def test_the_routers_pick_as_their_models_do() -> None:
    """softmax: the top-k of the softmax, renormalised; sigmoid: the top-k of the scores plus the
    correction bias within the best group, the scores renormalised and scaled; the aux loss
    reaches the router's gradient and leaves the output as it is."""
    torch.manual_seed(0)
    x = torch.randn(6, 8)
    router = Router(8, 4, 2)
    weights, index, probs = router(x)
    top = (x @ router.weight.T).softmax(-1).topk(2, dim=-1)
    torch.testing.assert_close(index, top.indices)
    torch.testing.assert_close(weights, top.values / top.values.sum(-1, keepdim=True))
    sig = Router(8, 4, 2, "sigmoid", groups=2, topk_groups=1, route_scale=2.5)
    sig.weight.data = router.weight.data.clone()
    sig.expert_bias += torch.tensor([0.0, 0.0, 5.0, 0.0])  # expert 2 wins its group on the biased score
    weights, index, _ = sig(x)
    scores = (x @ sig.weight.T).sigmoid()
    assert (index == 2).any(dim=-1).all() and (index >= 2).all()  # the best group is experts 2-3
    torch.testing.assert_close(weights, scores.gather(1, index) / scores.gather(1, index).sum(-1, keepdim=True) * 2.5)
    moe = MoE(8, 16, 4, 2, aux_loss_coef=1.0)
    out = moe(x.view(2, 3, 8))
    plain = MoE(8, 16, 4, 2, aux_loss_coef=0.0)
    plain.load_state_dict(moe.state_dict())
    torch.testing.assert_close(out, plain(x.view(2, 3, 8)))
    set_aux_loss_scale(1.0)
    out.sum().backward()
    with_aux = moe.router.weight.grad.clone()
    plain(x.view(2, 3, 8)).sum().backward()
    assert not torch.allclose(with_aux, plain.router.weight.grad)
    assert int(moe.counts.sum()) == 6 * 2


def test_capacity_keeps_first_choices_first_and_earlier_tokens_first() -> None:
    """GShard's priority: all first choices are queued before any second one; within a choice,
    earlier tokens first; each expert keeps `capacity` slots. A layer at a capacity below the
    load drops slots and computes less than dropless."""
    index = torch.tensor([[0, 1], [0, 2], [0, 1], [1, 0]])
    keep = within_capacity(index, experts=3, capacity=2)
    # expert 0: first choices of tokens 0, 1 (kept), 2 (dropped); token 3's second choice dropped
    # expert 1: token 3's first choice, then token 0's second (kept), token 2's second (dropped)
    assert keep.tolist() == [[True, True], [True, True], [False, False], [True, False]]
    torch.manual_seed(0)
    moe = MoE(8, 16, 4, 2, capacity_factor=0.5)
    x = torch.randn(3, 5, 8)
    dropped = moe(x)
    assert moe.capacity(15) == 4  # ceil(0.5 x 15 tokens x 2 / 4 experts)
    moe.capacity_factor = None
    assert not torch.allclose(dropped, moe(x))


def test_shape_only_passes_route_evenly() -> None:
    """On meta tensors (planning), which expert a token picks is unknown: every expert computes an
    even share, the output of the input's shape."""
    with torch.device("meta"):
        moe = MoE(8, 16, 4, 2, shared=1, aux_loss_coef=0.01)
        out = moe(torch.randn(2, 5, 8))
    assert out.shape == (2, 5, 8) and out.is_meta


@pytest.mark.slow  # the default suite trains MoE blocks under these schedules at ep=2 (below)
@pytest.mark.timeout(900)
def test_moe_blocks_train_as_one_process(tmp_path) -> None:
    """1f1b and zbv (the split backward through the routed experts and the aux loss) at pp=2, the
    sigmoid router, and two replicas sharding the optimizer state."""
    cases = [("moe 1f1b pp=2", compose_cfg([*MOE, "pp=2", "scheduler=1f1b"])),
             ("moe zbv pp=2", compose_cfg([*MOE, "pp=2", "scheduler=zbv"])),
             ("moe sigmoid 1f1b pp=2", compose_cfg([*MOE, *SIGMOID, "pp=2", "scheduler=1f1b"])),
             ("moe 1f1b pp=2 dp=2 zero=1", compose_cfg([*MOE, "pp=2", "dp=2", "zero=1", "scheduler=1f1b"]))]
    check_like_one_process(cases, tmp_path)


@pytest.mark.timeout(900)
def test_expert_parallel_trains_as_one_process(tmp_path) -> None:
    """ep splits each layer's experts over the replicas, carrying tokens by all-to-all: the same
    loss, gradients and updated weights as one process, under 1f1b, DualPipeV (its split backward
    through the exchanges; ZBV in the slow suite), ep below dp (two copies of each expert share),
    ep == dp with the other parameters' optimizer state sharded, and token dropping."""
    cases = [("ep=2 1f1b pp=2 dp=2", compose_cfg([*MOE, "pp=2", "dp=2", "ep=2", "scheduler=1f1b"])),
             ("ep=2 dualpipev pp=2 dp=2", compose_cfg([*MOE, *SIGMOID, "pp=2", "dp=2", "ep=2", "scheduler=dualpipev"])),
             ("ep=2 pp=1 dp=4", compose_cfg([*MOE, "pp=1", "dp=4", "ep=2", "scheduler=gpipe", "microbatches=2"])),
             ("ep=4 pp=1 dp=4 zero=1", compose_cfg([*MOE, "pp=1", "dp=4", "ep=4", "zero=1", "scheduler=gpipe", "microbatches=2"])),
             # token dropping: each replica's layer drops its own micro-batch's overflow, as one process does
             ("ep=2 capacity dualpipev pp=2 dp=2", compose_cfg([*MOE, "pp=2", "dp=2", "ep=2", "scheduler=dualpipev",
                                                                 "moe.capacity_factor=0.75"]))]
    check_like_one_process(cases, tmp_path)


@pytest.mark.slow  # DualPipeV's split backward runs through the exchanges in the default test above
@pytest.mark.timeout(900)
def test_expert_parallel_trains_as_one_process_under_zbv(tmp_path) -> None:
    """ZBV's split backward (input and weight halves apart) through the all-to-alls."""
    check_like_one_process([("ep=2 zbv pp=2 dp=2", compose_cfg([*MOE, "pp=2", "dp=2", "ep=2", "scheduler=zbv"]))],
                           tmp_path)


@pytest.mark.slow  # 8 ranks (62 s); the issue's own slow case. The planner's side is checked by default (below)
@pytest.mark.timeout(900)
def test_expert_parallel_beside_tensor_parallel_trains_as_one_process(tmp_path) -> None:
    """pp=2 dp=2 tp=2 ep=2: the experts fold over the replicas at each tp coordinate, every tp rank
    routes and exchanges the same tokens (the MoE layer whole on it, attention split), with and
    without sequence parallelism (the layer then gets the whole sequence), under 1f1b and DualPipeV."""
    cases = [("ep=2 tp=2 1f1b pp=2 dp=2", compose_cfg([*MOE, "pp=2", "dp=2", "tp=2", "ep=2", "scheduler=1f1b"])),
             ("ep=2 tp=2 sp dualpipev pp=2 dp=2",
              compose_cfg([*MOE, *SIGMOID, "pp=2", "dp=2", "tp=2", "ep=2", "sequence_parallel=true",
                           "scheduler=dualpipev"]))]
    check_like_one_process(cases, tmp_path)


def test_the_planner_holds_half_the_experts_beside_tensor_parallelism() -> None:
    """At pp=2 dp=2 tp=2 ep=2 each device holds half the experts, as at tp=1."""
    held = {tp: prepare(compose_cfg([*MOE, "pp=2", "dp=2", f"tp={tp}", "ep=2", "scheduler=1f1b", "mode=plan"]))
            .prediction for tp in (1, 2)}
    whole = prepare(compose_cfg([*MOE, "pp=2", "dp=2", "tp=2", "scheduler=1f1b", "mode=plan"])).prediction
    halves = held[2].plan.meta.stage_expert_param_bytes
    assert halves == held[1].plan.meta.stage_expert_param_bytes
    for rank in range(2):
        assert whole.devices[rank].params - held[2].devices[rank].params == pytest.approx(halves[rank])


def test_each_moe_layer_exchanges_once_per_micro_batch_each_way(tmp_path) -> None:
    """The ep group's log of the first step: per MoE layer and micro-batch one dispatch and one
    combine (their backward rides in the autograd of the same exchanges), the same sequence on both
    ranks of an ep group (NCCL matches collectives by order), and every row a rank sends, the
    other ranks receive."""
    m = 4
    cfg = compose_cfg([*MOE, "pp=2", "dp=2", "ep=2", "scheduler=1f1b", f"microbatches={m}", "steps=1",
                       "debug.record_p2p=true"])
    ranks = run_jobs([cfg], tmp_path / "logs")[0]
    plan = prepare(cfg).plan
    by_stage: dict[int, list[list[str]]] = {}
    for rank in ranks:
        by_stage.setdefault(rank.rank_info.pp_rank, []).append(rank.extras["expert_log"])
    moe_layers = [i for i in range(cfg.model["layers"]) if i >= cfg.model["dense_layers"]]
    names = set()
    for logs in by_stage.values():
        a, b = ([e.rsplit(" ", 1)[0] for e in log] for log in logs)
        assert a == b  # one order of exchanges on both ranks of the ep group
        names |= {e.split()[0] for e in a}
        counts = Counter(a)
        assert set(counts.values()) == {m}  # each layer: one dispatch and one combine per micro-batch
        sent = [sum(int(e.rsplit(" ", 1)[1].split(">")[0]) for e in log if " dispatch " in e) for log in logs]
        got = [sum(int(e.rsplit(" ", 1)[1].split(">")[1]) for e in log if " dispatch " in e) for log in logs]
        assert sum(sent) == sum(got)
    assert len(names) == len(moe_layers) and len(plan.stages) == 2


@pytest.mark.timeout(600)
@pytest.mark.parametrize("resumed", [("ep4", ["pp=1", "dp=4", "ep=4", "microbatches=2"]),
                                     pytest.param(("pp4", ["pp=4", "microbatches=8"]), marks=pytest.mark.slow)],
                         ids=["ep4", "pp4"])
def test_an_expert_parallel_checkpoint_resumes_under_other_layouts(resumed, tmp_path) -> None:
    """pp=2 dp=2 ep=2 (AdamW, cosine, clipping that bites) checkpointed at step 3 holds every
    expert whole: it resumes at pp=1 dp=4 ep=4 (and, in the slow suite, at pp=4 without ep) on the
    uninterrupted run's losses, and its final weights match its own. The aux loss is a product of means over a
    micro-batch's tokens (as Megatron and transformers compute it), so each layout draws the same
    eight micro-batches (dp x microbatches = 8) to train the same objective."""
    from tests.test_cli import metrics
    from tests.test_long_runs import RESUME, _run, _weights

    moe = [o for o in MOE[len(FAST):] if o.startswith("model.")]
    base = [*RESUME, *moe, "checkpoint.every=3", "steps=6"]
    _run([*base, "pp=2", "dp=2", "ep=2", "microbatches=4", f"checkpoint.dir={tmp_path / 'ep'}"], tmp_path / "eprun")
    straight = metrics(tmp_path / "eprun")["losses"]
    ref = _weights(tmp_path / "ep")
    assert ref["layer1.mlp.experts.gate_up_proj"].shape[0] == 4  # every expert, whole
    # exported as one safetensors file by parameter name, every expert whole
    from safetensors.torch import load_file

    from pipelaunch.launcher.export import export

    exported = load_file(export(tmp_path / "ep" / "step_0000006", tmp_path / "exported") / "model.safetensors")
    assert {k: v.shape for k, v in exported.items()} == {k: v.shape for k, v in ref.items()}
    assert torch.equal(exported["layer1.mlp.experts.down_proj"], ref["layer1.mlp.experts.down_proj"])
    for name, layout in (resumed,):
        _run([*base, *layout, f"resume={tmp_path / 'ep' / 'step_0000003'}", f"checkpoint.dir={tmp_path / name}"],
             tmp_path / f"{name}run")
        resumed = metrics(tmp_path / f"{name}run")
        assert resumed["start_step"] == 3 and resumed["losses"][3:] == pytest.approx(straight[3:], rel=1e-5), name
        got = _weights(tmp_path / name)
        assert set(ref) == set(got)
        for key, r in ref.items():
            assert float((got[key] - r).norm()) <= 1e-5 * float(r.norm()) + 1e-7, (name, key)


@pytest.mark.parametrize(("overrides", "key", "words"), [
    ([*MOE, "dp=2", "ep=4"], "ep", "a divisor of dp"),
    ([*FAST, "dp=2", "ep=2"], "ep", "has none"),
    ([*MOE, "model.experts=6", "model.top_k=2", "dp=4", "ep=4", "batch_size=16", "microbatches=1"], "ep", "valid: 1, 2, 3, 6"),
    ([*MOE, "model.top_k=5"], "model.top_k", "more than the model's 4 experts"),
    ([*MOE, *SIGMOID, "model.expert_groups=3"], "model.expert_groups", "must divide the experts"),
    ([*MOE, "moe.capacity_factor=0"], "moe.capacity_factor", "a number > 0"),
    ([*FAST, "moe.capacity_factor=1.25"], "moe.capacity_factor", "has no experts"),
])
def test_refused_before_spawn(overrides: list[str], key: str, words: str) -> None:
    """Each layout or model ep cannot run is refused by prepare, naming the option and what fits."""
    from pipelaunch.pipeline.core.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        prepare(compose_cfg(overrides))
    assert err.value.key == key and words in str(err.value), str(err.value)


@pytest.mark.timeout(300)
def test_router_statistics_count_every_token_once(tmp_path) -> None:
    """metrics.json's expert_load: per step and MoE layer, the min / mean / max tokens per expert
    over the global batch (every replica's tokens, each counted once: top_k picks per token even
    under remat=full, whose rerun inside the backward is not counted); the progress line shows the
    worst busiest-over-mean ratio."""
    from tests.test_cli import metrics, train

    args = [*MOE, "pp=2", "dp=2", "ep=2", "scheduler=1f1b", "remat=full", "steps=2", "log_every=1"]
    proc = train(args, tmp_path / "run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = metrics(tmp_path / "run")
    cfg = compose_cfg(args)
    picks = cfg.batch_size * cfg.model["seq_len"] * cfg.model["top_k"]
    layers = [f"layer{i}.mlp" for i in range(cfg.model["dense_layers"], cfg.model["layers"])]
    assert len(data["expert_load"]) == 2
    for step in data["expert_load"]:
        assert list(step) == layers
        for s in step.values():
            assert s["mean"] == picks / cfg.model["experts"] and s["min"] <= s["mean"] <= s["max"] <= picks
    worst = max(s["max"] / s["mean"] for s in data["expert_load"][-1].values())
    assert f"experts max/mean {worst:4.2f}" in proc.stdout


def test_the_planner_prices_one_ep_ranks_experts_and_its_exchanges() -> None:
    """Under ep each device holds 1/ep of every layer's routed experts (the rest of its stage
    whole), and each MoE layer's node adds its two exchanges each way, priced on the ep link."""
    plans = {ep: prepare(compose_cfg([*MOE, "pp=2", "dp=2", f"ep={ep}", "scheduler=1f1b", "mode=plan"])).prediction
             for ep in (1, 2)}
    cfg = compose_cfg([*MOE, "pp=2", "dp=2", "ep=2", "scheduler=1f1b"])
    spec = build_plugins(cfg).model.build()
    whole = spec.build_meta()
    expert_bytes = sum(p.numel() * p.element_size() for m in whole.modules() if isinstance(m, Experts)
                       for p in m.parameters())
    held = plans[2].plan.meta.stage_expert_param_bytes
    assert plans[1].plan.meta.stage_expert_param_bytes is None
    assert sum(held) == pytest.approx(expert_bytes / 2) and all(b > 0 for b in held)
    for rank in range(2):  # one stage a rank: the device holds the other half of its experts fewer
        assert plans[1].devices[rank].params - plans[2].devices[rank].params == pytest.approx(held[rank])

    traced = spec.trace(2, ep_local(spec.build_meta(), 2), repeat=True)
    g = traced.graph
    for n in g.nodes:
        g.nodes[n].update(forward_s=1.0, backward_s=1.0, backward_input_s=0.5)
    add_all_to_alls(traced, 2, (1e-5, 1e9))
    moe = moe_nodes(traced)
    assert len(moe) == 6 - 1  # every block but the dense first
    for name, layers in moe.items():
        node = g.nodes[name]
        assert len(layers) == 1
        rows = node["output_bytes"] * layers[0].router.top_k
        assert node["ep_collectives"] == [("dispatch", rows), ("combine", rows)]
        exchange = 2 * (1e-5 + rows / 2 / 1e9)  # dispatch + combine, each one send of half the rows
        counts = 1e-5 + 8 * 4 / 2 / 1e9  # the forward's token counts first: an int64 per expert
        assert node["ep_counts"] == [8 * 4]
        assert node["forward_s"] == pytest.approx(1.0 + exchange + counts)
        assert node["backward_s"] == pytest.approx(1.0 + exchange)
        assert node["backward_input_s"] == pytest.approx(0.5 + exchange)
    assert all(g.nodes[n]["forward_s"] == 1.0 for n in g.nodes if n not in moe)
    assert g.graph["ep"] == 2 and all(".experts." in p or "experts" in p for p in g.graph["expert_params"])


#: experts dominate the parameters (3 MiB of the 3.3 in each block), AdamW's two states each
HEAVY = [*FAST, "model.dim=128", "model.layers=4", "model.seq_len=16", "model.experts=8", "model.top_k=2",
         "model.expert_dim=256", "model.dense_layers=0", "optimizer=adamw", "pp=2", "dp=2", "scheduler=1f1b",
         "batch_size=16", "microbatches=4", "steps=2", "warmup_steps=0", "threads=1", "predict=true", "timeout_s=300"]


@pytest.mark.timeout(900)
def test_expert_parallel_ranks_hold_half_the_experts_as_planned(tmp_path) -> None:
    """Measured tensor peaks (no copy of the state taken: `capture=False`): at ep=2 the fullest
    rank holds its stage's experts' weights, gradients and both AdamW states at half, and the plan
    predicts each fullest rank within 15%."""
    cfgs = [compose_cfg([*HEAVY, f"ep={ep}"]) for ep in (1, 2)]
    runs = run_jobs(cfgs, tmp_path / "logs", capture=False)
    fullest, predicted = [], []
    for cfg, ranks in zip(cfgs, runs, strict=True):
        top = max(ranks, key=lambda r: r.rank_info.peak_tensor_bytes).rank_info
        fullest.append(top.peak_tensor_bytes)
        predicted.append(top.predicted_peak_bytes - float(cfg.memory.reserve_bytes))
    for got, want in zip(fullest, predicted, strict=True):
        assert abs(want / got - 1) <= 0.15, (fullest, predicted)
    spec = build_plugins(cfgs[0]).model.build()
    # a stage's two blocks' experts, at 4 bytes per value in each of weights, gradients, 2 states
    stage_experts = sum(p.numel() * 4 for m in spec.build_meta().modules() if isinstance(m, Experts)
                        for p in m.parameters()) / 2
    assert fullest[0] - fullest[1] >= 0.9 * 4 * stage_experts / 2, (fullest, stage_experts)


@pytest.mark.timeout(900)
def test_dualpipev_overlaps_each_pairs_exchanges_with_its_partner(tmp_path) -> None:
    """moe.overlap: every forward DualPipeV follows with another stage's backward runs beside it
    (the two spans intersect, an all-to-all of the pair in flight inside them), the same losses to
    the bit as one action at a time, where no two compute actions of a rank overlap."""
    from pipelaunch.pipeline.core.ir import overlapped_pairs

    base = [*MOE, *SIGMOID, "pp=2", "dp=2", "ep=2", "scheduler=dualpipev", "microbatches=8", "batch_size=32",
            "steps=2"]
    cfgs = [compose_cfg([*base, f"moe.overlap={o}"]) for o in ("true", "false")]
    plan = prepare(cfgs[0]).plan
    assert plan.moe_overlap and not prepare(cfgs[1]).plan.moe_overlap
    pairs = {r: overlapped_pairs(plan.schedule.actions[r]) for r in range(2)}
    assert all(len(p) >= 3 for p in pairs.values()), pairs
    on, off = run_jobs(cfgs, tmp_path / "logs")
    assert on[0].losses == off[0].losses
    for ranks, overlapped in ((on, True), (off, False)):
        events = ranks[0].events
        for r in range(2):
            mine = [e for e in events if e["rank"] == r and e["kind"] != "A2A"]
            by_action = {e["action"]: e for e in mine}
            for pos in pairs[r]:
                f, b = (by_action[str(plan.schedule.actions[r][pos + i])] for i in (0, 1))
                intersect = min(f["end_s"], b["end_s"]) - max(f["start_s"], b["start_s"])
                assert (intersect > 0) == overlapped, (r, f, b)
            if not overlapped:
                spans = sorted((e["start_s"], e["end_s"]) for e in mine if e["kind"] in ("F", "B", "I", "W"))
                assert all(a[1] <= b[0] + 1e-9 for a, b in zip(spans, spans[1:], strict=False)), r
        exchanges = [e for e in events if e["kind"] == "A2A"]
        assert exchanges and all(e["lane"] == "dp" for e in exchanges)
