"""transformers' mixtures of experts through model=hf (models/hf_moe.py): each layer's experts
module is one call in the traced graph, running transformers' own expert code; expert parallelism
(ep) splits its experts over the replicas and carries the tokens by the runtime's all-to-all, and
Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE and DeepSeek-V3 train like one process running transformers'
model under pp, dp, ep and sharding, transformers' auxiliary loss included."""

from __future__ import annotations

import copy
import subprocess
import sys
from collections import Counter

import pytest
import torch

from pipelaunch.launcher.plugins import build_plugins
from pipelaunch.launcher.validate import prepare
from pipelaunch.models.hf_moe import HFExperts
from pipelaunch.pipeline.planner.measure.experts import add_all_to_alls, ep_local, moe_nodes
from tests.harness import ROOT, check_like_one_process, compose_cfg

COMMON = ["data=synthetic", "batch_size=8", "steps=2", "warmup_steps=0", "optimizer=sgd", "timeout_s=120",
          "threads=1", "microbatches=2", "model.seq_len=16"]
PP2 = ["pp=2", "dp=2", "ep=2"]


def _exchanged(ranks: list[dict], layers: int, m: int) -> None:
    """Every rank's first step carried its tokens to its ep peers: per MoE layer of its stages, one
    dispatch and one combine per micro-batch (debug.record_p2p's log), rows really sent."""
    names = set()
    for rank in ranks:
        log = rank.extras["expert_log"]
        assert log, "no all-to-all: the experts were not split"
        counts = Counter(e.rsplit(" ", 1)[0] for e in log)
        assert set(counts.values()) == {m}, counts
        names |= {e.split()[0] for e in log}
        assert sum(int(e.rsplit(" ", 1)[1].split(">")[0]) for e in log if " dispatch " in e) > 0
    assert len(names) == layers, sorted(names)


def _model(preset: str, *extra: str):
    return build_plugins(compose_cfg([*COMMON, f"model={preset}", *extra])).model.build()


def _split_run(experts: HFExperts, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, ep: int):
    """The experts module's forward with its experts split over `ep` copies of it, each computing
    the rows of its own experts by `compute`, as a rank does (without processes)."""
    copies = []
    for r in range(ep):
        part = copy.deepcopy(experts)
        local = experts.total // ep
        for name, p in list(part.named_parameters(recurse=False)):
            setattr(part, name, torch.nn.Parameter(p.data[r * local:(r + 1) * local].clone()))
        part.first, part.local = r * local, local
        copies.append(part)

    def dispatch(owner, rows, flat):
        out = rows.new_zeros(rows.shape[0], x.shape[-1]).to(x.dtype)
        for part in copies:
            part._packing = owner._packing
            mine = ((flat >= part.first) & (flat < part.first + part.local)).nonzero(as_tuple=True)[0]
            out = out.index_copy(0, mine, part.compute(rows[mine], flat[mine] - part.first))
        return out

    front = copies[0]
    front.dispatch = dispatch
    return front(x, index, weights), copies


@pytest.mark.parametrize("preset", ["hf_mixtral_tiny", "hf_qwen2_moe_tiny", "hf_deepseek_v3_tiny"])
def test_split_experts_compute_what_transformers_computes(preset: str) -> None:
    """A layer's experts split in two, each row computed by the half holding its expert through
    transformers' own code at its own routing weight, and summed back per token: the output and
    every gradient (the experts', the tokens', the routing weights') of transformers' forward on
    the whole module, routed by the model's own router."""
    torch.manual_seed(0)
    model = _model(preset).build_full(0)
    layer = next(m for m in model.modules() if hasattr(m, "experts") and isinstance(m.experts, HFExperts))
    experts = layer.experts
    assert type(experts).__bases__[1].__module__.startswith("transformers.models.")  # its own class, under ours
    x = torch.randn(24, experts.down_proj.shape[1], requires_grad=True)
    _, weights, index = layer.gate(x)
    weights = weights.detach().requires_grad_()  # the routing weights as a leaf, its gradient compared
    whole = type(experts).__bases__[1].forward(experts, x, index, weights)  # transformers' forward, unhooked
    grads = torch.autograd.grad(whole.square().sum(), [x, weights, *experts.parameters()])
    got, copies = _split_run(experts, x, index, weights, 2)
    assert {int(i) // (experts.total // 2) for i in index.unique()} == {0, 1}  # both halves compute
    split_grads = torch.autograd.grad(got.square().sum(), [x, weights, *copies[0].parameters(),
                                                           *copies[1].parameters()])
    torch.testing.assert_close(got, whole, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(split_grads[0], grads[0], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(split_grads[1], grads[1], rtol=1e-5, atol=1e-7)
    n = len(list(experts.parameters()))
    for i in range(n):
        joined = torch.cat([split_grads[2 + i], split_grads[2 + n + i]])
        torch.testing.assert_close(joined, grads[2 + i], rtol=1e-5, atol=1e-7)


def _split_matches(experts: HFExperts, tokens: int = 24) -> None:
    """`_split_run` of a random routing (each token's distinct top-k experts, random positive
    weights) against transformers' forward on the whole module: output and every gradient."""
    down = experts.down_proj
    hidden = down.shape[2] if experts.is_transposed else down.shape[1]
    k = min(2, experts.total)
    x = torch.randn(tokens, hidden, requires_grad=True)
    index = torch.rand(tokens, experts.total).topk(k, dim=-1).indices
    weights = torch.rand(tokens, k).requires_grad_()
    whole = type(experts).__bases__[1].forward(experts, x, index, weights)
    grads = torch.autograd.grad(whole.square().sum(), [x, weights, *experts.parameters()])
    got, copies = _split_run(experts, x, index, weights, 2)
    split = torch.autograd.grad(got.square().sum(), [x, weights, *copies[0].parameters(), *copies[1].parameters()])
    torch.testing.assert_close(got, whole, rtol=1e-5, atol=1e-6)
    n = len(list(experts.parameters()))
    for g, ref in zip([split[0], split[1], *(torch.cat([split[2 + i], split[2 + n + i]]) for i in range(n))], grads,
                      strict=True):
        torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # every family (38 s); the default suite splits Mixtral's, Qwen2-MoE's and DeepSeek-V3's (above)
@pytest.mark.timeout(600)
def test_every_family_of_the_kind_computes_its_split_experts_as_transformers_does() -> None:
    """Every transformers causal LM whose experts models/hf_moe.py hooks (tests/hf_sweep's tiny
    configs): an experts module split in two computes, on a random routing, what transformers'
    forward computes on the whole module, gradients included (its own activation, biases,
    transposed or interleaved layouts). At least the five families trained above are among them."""
    from transformers import AutoModelForCausalLM

    from pipelaunch.models.hf_moe import adopt, experts_modules
    from tests import hf_sweep

    hooked, failures = [], []
    for name in hf_sweep.architectures():
        with hf_sweep.quiet():
            try:
                config = hf_sweep.tiny_config(name)
                torch.manual_seed(0)
                model = AutoModelForCausalLM.from_config(config)
            except Exception:  # noqa: BLE001 - transformers cannot build it from a tiny config: not ours
                continue
            found = list(experts_modules(model))
            if not found or found[0][1].num_experts < 2:
                continue
            hooked.append(name)
            adopt(model)
            try:
                _split_matches(found[0][1])
            except AssertionError as err:
                failures.append(f"{name}: {str(err)[:300]}")
    assert not failures, "\n".join(failures)
    assert {"mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3"} <= set(hooked), hooked


def test_the_traced_graph_calls_each_experts_module_once() -> None:
    """An export of the model holds each MoE layer's experts as one call of the module (its
    parameters under transformers' names, the rest of the layer as operators), where ep hooks it;
    DeepSeek-V3's dense first layer has none."""
    spec = _model("hf_deepseek_v3_tiny")
    model = spec.build_meta()
    traced = spec.trace(2, model)
    calls = [n for n in traced.gm.graph.nodes if n.op == "call_module"]
    assert [str(n.target) for n in calls] == [f"model.model.layers.{i}.mlp.experts" for i in (1, 2, 3)]
    for node in calls:
        module = traced.gm.get_submodule(str(node.target))
        assert module is model.get_submodule(str(node.target)) and module.top_k == 2
        assert traced.graph.nodes[node.name]["params"] == [f"{node.target}.gate_up_proj", f"{node.target}.down_proj"]
    assert spec.meta["experts"] == 4 and spec.meta["moe_layers"] == 3
    assert sorted(n for n, _ in traced.gm.named_parameters()) == sorted(n for n, _ in model.named_parameters())


@pytest.mark.timeout(900)
def test_transformers_moe_trains_as_one_process_under_expert_parallelism(tmp_path) -> None:
    """Mixtral at pp=2 dp=2 ep=2 under 1f1b: losses, step 0's gradients and the final weights of
    both replicas within 1e-5 of transformers' model in one process, every MoE layer's tokens
    carried by its all-to-alls. DeepSeek-V3 (multi-head latent attention, a dense first layer, a
    shared expert, the sigmoid grouped router) trains so under DualPipeV, its gates' bias moving,
    in tests/test_moe_bias.py."""
    cases = [("mixtral ep=2 1f1b", compose_cfg([*COMMON, "model=hf_mixtral_tiny", *PP2, "scheduler=1f1b"]))]
    ranks = check_like_one_process(cases, tmp_path)
    _exchanged(ranks["mixtral ep=2 1f1b"], 4, 2)


@pytest.mark.slow  # the default suite trains Mixtral (above) and DeepSeek-V3 (test_moe_bias.py) under ep, and model=gpt's experts
# at ep < dp and at ep = dp with zero=1 (tests/test_moe.py)
@pytest.mark.timeout(900)
def test_more_families_and_layouts_train_as_one_process(tmp_path) -> None:
    """Qwen2-MoE (a gated shared expert, top-k not renormalised) under ZBV's split backward;
    Qwen3-MoE at ep=dp=4 with the other parameters' optimizer state sharded (zero=1); OLMoE at
    ep=2 below dp=4 (two copies of each expert, their gradients summed); Mixtral with
    transformers' own loss and its load-balancing aux loss from every layer's router logits,
    across the stages, at ep=2."""
    pp1 = ["pp=1", "dp=4", "scheduler=gpipe"]
    cases = [("qwen2_moe ep=2 zbv", compose_cfg([*COMMON, "model=hf_qwen2_moe_tiny", *PP2, "scheduler=zbv"])),
             ("mixtral aux loss ep=2", compose_cfg([*COMMON, "model=hf_mixtral_tiny", *PP2, "scheduler=1f1b",
                                                    "model.loss=model", "+model.config.output_router_logits=true",
                                                    "+model.config.router_aux_loss_coef=0.1"])),
             ("qwen3_moe ep=4 zero=1", compose_cfg([*COMMON, "model=hf_qwen3_moe_tiny", *pp1, "ep=4", "zero=1"])),
             ("olmoe ep=2 dp=4", compose_cfg([*COMMON, "model=hf_olmoe_tiny", *pp1, "ep=2"]))]
    ranks = check_like_one_process(cases, tmp_path)
    for what, layers in (("qwen2_moe ep=2 zbv", 4), ("qwen3_moe ep=4 zero=1", 4), ("olmoe ep=2 dp=4", 4)):
        _exchanged(ranks[what], layers, 2)


@pytest.mark.parametrize(("overrides", "key", "words"), [
    (["model=hf_mixtral_tiny", "model.config.num_local_experts=6", "dp=4", "ep=4"], "ep", "valid: 1, 2, 3, 6"),
    (["model=hf_llama_tiny", "dp=2", "ep=2"], "ep", "has none"),
    (["model=hf", "+model.config={model_type: jetmoe, hidden_size: 64, num_hidden_layers: 2, num_attention_heads: 4,"
      " num_key_value_heads: 2, kv_channels: 16, vocab_size: 256, num_local_experts: 4, num_experts_per_tok: 2}",
      "model.seq_len=16", "dp=2", "ep=2"], "ep", "not of a kind it splits"),
    (["model=hf_mixtral_tiny", "+model.config.output_router_logits=true"], "model.config.output_router_logits",
     "model.loss=model"),
])
def test_refused_before_spawn(overrides: list[str], key: str, words: str) -> None:
    """ep not dividing the routed experts, ep on a transformers model without experts or with
    experts of another kind, and an aux loss the logits' loss would drop: refused by prepare,
    naming the option and what fits."""
    from pipelaunch.pipeline.core.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        prepare(compose_cfg([*COMMON, *overrides]), profile=False)
    assert err.value.key == key and words in str(err.value), str(err.value)


def test_the_planner_prices_one_ep_ranks_experts_and_its_exchanges() -> None:
    """mode=plan under ep=2: each device holds half of every layer's routed experts (the rest of
    its stage whole), and each experts call's node adds its two exchanges each way."""
    base = [*COMMON, "model=hf_mixtral_tiny", "pp=2", "dp=2", "scheduler=1f1b"]
    plans = {ep: prepare(compose_cfg([*base, f"ep={ep}", "mode=plan"])).prediction for ep in (1, 2)}
    spec = build_plugins(compose_cfg([*base, "ep=2"])).model.build()
    expert_bytes = sum(p.numel() * p.element_size() for m in spec.build_meta().modules() if isinstance(m, HFExperts)
                       for p in m.parameters())
    held = plans[2].plan.meta.stage_expert_param_bytes
    assert plans[1].plan.meta.stage_expert_param_bytes is None
    assert sum(held) == pytest.approx(expert_bytes / 2) and all(b > 0 for b in held)
    for rank in range(2):
        assert plans[1].devices[rank].params - plans[2].devices[rank].params == pytest.approx(held[rank])

    traced = spec.trace(2, ep_local(spec.build_meta(), 2), repeat=True)
    g = traced.graph
    for n in g.nodes:
        g.nodes[n].update(forward_s=1.0, backward_s=1.0)
    add_all_to_alls(traced, 2, (1e-5, 1e9))
    moe = moe_nodes(traced)
    assert len(moe) == 4
    for name, layers in moe.items():
        node = g.nodes[name]
        assert node["op"] == "call_module" and layers[0].local == 2 and layers[0].total == 4
        rows = node["output_bytes"] * 2  # top-2 of the tokens' hidden states
        assert node["ep_collectives"] == [("dispatch", rows), ("combine", rows)]
        counts = 1e-5 + 8 * 4 / 2 / 1e9  # the token counts first, an int64 per expert
        assert node["forward_s"] == pytest.approx(1.0 + 2 * (1e-5 + rows / 2 / 1e9) + counts)
    assert all(".experts." in p for p in g.graph["expert_params"]) and len(g.graph["expert_params"]) == 8


def test_a_named_gpu_prices_mixtral_whose_router_renormalises_in_place() -> None:
    """hardware=h100_sxm prices every node on meta; Mixtral's router divides its top-k weights in
    place (`/=`), which autograd refuses on the leaf inputs pricing gives a node: that node is
    priced on its inputs as given (it failed the whole plan before), and the experts still cost."""
    cfg = compose_cfg([*COMMON, "model=hf_mixtral_tiny", "pp=2", "ep=2", "dp=2", "scheduler=1f1b",
                       "mode=plan", "hardware=h100_sxm"])
    prediction = prepare(cfg).prediction
    assert prediction.plan.meta.stage_expert_param_bytes is not None
    assert len(prediction.plan.meta.stage_forward_s) == 2 and all(f > 0 for f in prediction.plan.meta.stage_forward_s)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_an_expert_parallel_checkpoint_resumes_without_ep_and_exports_whole_experts(tmp_path) -> None:
    """Mixtral at pp=2 dp=2 ep=2 (AdamW, cosine, clipping) checkpointed at step 3 holds every
    expert whole: it resumes at pp=2 without ep on the uninterrupted run's losses and final
    weights, and `python -m pipelaunch.launcher.export` writes a directory whose `from_pretrained`
    Mixtral holds those weights, its experts whole."""
    from transformers import AutoModelForCausalLM

    from tests.test_cli import metrics
    from tests.test_long_runs import _run, _weights

    base = ["model=hf_mixtral_tiny", "data=synthetic", "batch_size=8", "model.seq_len=16", "threads=1",
            "timeout_s=120", "optimizer=adamw", "lr_scheduler=cosine", "lr_scheduler.warmup_steps=2",
            "lr_scheduler.total_steps=6", "clip_grad_norm=0.05", "checkpoint.every=3", "steps=6"]
    _run([*base, "pp=2", "dp=2", "ep=2", "microbatches=2", f"checkpoint.dir={tmp_path / 'ep'}"], tmp_path / "eprun")
    straight = metrics(tmp_path / "eprun")["losses"]
    ref = _weights(tmp_path / "ep")
    assert ref["model.model.layers.0.mlp.experts.gate_up_proj"].shape[0] == 4  # every expert, whole
    _run([*base, "pp=2", "microbatches=4", f"resume={tmp_path / 'ep' / 'step_0000003'}",
          f"checkpoint.dir={tmp_path / 'one'}"], tmp_path / "onerun")
    resumed = metrics(tmp_path / "onerun")
    assert resumed["start_step"] == 3 and resumed["losses"][3:] == pytest.approx(straight[3:], rel=1e-5)
    got = _weights(tmp_path / "one")
    assert set(ref) == set(got)
    for key, r in ref.items():
        assert float((got[key] - r).norm()) <= 1e-5 * float(r.norm()) + 1e-7, key

    proc = subprocess.run([sys.executable, "-m", "pipelaunch.launcher.export", str(tmp_path / "ep" / "step_0000006"),
                           str(tmp_path / "exported")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    exported = dict(AutoModelForCausalLM.from_pretrained(tmp_path / "exported").named_parameters())
    assert exported["model.layers.0.mlp.experts.gate_up_proj"].shape[0] == 4
    for name, p in exported.items():
        assert torch.equal(p.detach(), ref[f"model.{name}"]), name
