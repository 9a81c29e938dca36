"""A user's own mixture of experts through `model=module model.ep_plan=...` (models/list_experts.py):
the experts module its plan names keeps the user's forward, is one call in the trace, and under
ep > 1 each rank holds its share of the `nn.ModuleList` under the experts' own names, the tokens
carried by the runtime's all-to-alls. It trains like the user's model in one process, and its
checkpoint holds every expert whole under its name, whatever ep wrote it."""

from __future__ import annotations

import copy

import pytest
import torch

from pipelaunch.launcher.plugins import build_plugins
from pipelaunch.launcher.validate import prepare
from pipelaunch.models.list_experts import ListExperts
from pipelaunch.pipeline.core.errors import ConfigError
from tests.harness import check_like_one_process, compose_cfg
from tests.user_moe import ExpertBank

MODEL = ["model=module", "model.module._target_=tests.user_moe.TinyMoELM", "model.vocab_size=64",
         "model.ep_plan={blocks.*.bank: ep_dispatch_experts}"]
COMMON = [*MODEL, "data=synthetic", "batch_size=8", "steps=2", "warmup_steps=0", "optimizer=sgd", "timeout_s=120",
          "threads=1", "microbatches=2", "model.seq_len=16", "debug.record_p2p=true"]


def _spec(*extra: str):
    return build_plugins(compose_cfg([*COMMON, *extra])).model.build()


def test_the_adopted_module_computes_the_users_forward_and_its_split() -> None:
    """Adopted, the module's forward is the user's; cut to two ranks' shares, each computing its
    own experts' rows by `compute` (one expert per row at its weight, the user's forward), the
    rows summed per token give the same output and gradients."""
    torch.manual_seed(0)
    raw = ExpertBank(8, 12, 4)
    from pipelaunch.models.list_experts import adopt

    adopted = copy.deepcopy(raw)
    holder = torch.nn.Module()
    holder.bank = adopted
    assert adopt(holder, {"bank": "ep_dispatch_experts"}) == ["bank"] and isinstance(adopted, ListExperts)
    x, weights = torch.randn(10, 8), torch.rand(10, 2)
    index = torch.stack([torch.randperm(4)[:2] for _ in range(10)])
    torch.testing.assert_close(adopted(x, index, weights), raw(x, index, weights), rtol=0, atol=0)
    assert adopted.counts.sum() == 20 and adopted.top_k == 2

    parts = []
    for r in range(2):
        part = copy.deepcopy(adopted)
        part.keep(2 * r, 2)
        parts.append(part)
    assert [n for n, _ in parts[1].expert_parameters()][0] == "mlps.2.up.weight" and parts[1].local == 2

    def dispatch(owner, rows, flat):
        out = rows.new_zeros(rows.shape[0], 8)
        for part in parts:
            part._packing = owner._packing
            mine = ((flat >= part.first) & (flat < part.first + part.local)).nonzero(as_tuple=True)[0]
            out = out.index_copy(0, mine, part.compute(rows[mine], flat[mine] - part.first))
        return out

    parts[0].dispatch = dispatch
    xs = x.clone().requires_grad_()
    got = parts[0](xs, index, weights)
    torch.testing.assert_close(got, raw(x, index, weights))
    got.square().sum().backward()
    xr = x.clone().requires_grad_()
    raw(xr, index, weights).square().sum().backward()
    torch.testing.assert_close(xs.grad, xr.grad)
    for e in range(4):
        torch.testing.assert_close(parts[e // 2].mlps[e % 2].up.weight.grad, raw.mlps[e].up.weight.grad)


def test_the_plan_names_the_experts_and_the_trace_calls_each_once() -> None:
    """The spec counts the experts (what ep must divide), keeps each named module one call in the
    fx trace, reads top_k from it, and the planner's one-rank model holds half the experts under
    their names while the whole model's shapes are every expert's."""
    from pipelaunch.pipeline.planner.measure.experts import ep_local, whole_shapes

    spec = _spec()
    assert spec.meta["experts"] == 4 and spec.meta["moe_layers"] == 4
    traced = spec.trace(2)
    calls = [str(n.target) for n in traced.gm.graph.nodes if n.op == "call_module" and n.target.endswith(".bank")]
    assert calls == [f"inner.blocks.{i}.bank" for i in range(4)] and spec.meta["top_k"] == 2
    whole = dict(spec.build_meta().named_parameters())
    local = ep_local(spec.build_meta(), 2)
    held = dict(local.named_parameters())
    assert len(held) == len(whole) - 4 * 2 * 4 and "inner.blocks.0.bank.mlps.1.up.weight" in held
    assert {n: tuple(p.shape) for n, p in whole.items()} == whole_shapes(local)


@pytest.mark.parametrize(("plan", "words"), [
    ("{blocks.*.bunk: ep_dispatch_experts}", "names no module"),
    ("{blocks.*.norm: ep_dispatch_experts}", "one nn.ModuleList"),
    ("{blocks.*.bank: colwise}", "valid: ep_dispatch_experts"),
])
def test_a_plan_naming_no_experts_module_is_refused(plan: str, words: str) -> None:
    cfg = compose_cfg([*COMMON[:3], f"model.ep_plan={plan}", *COMMON[4:], "dp=2", "ep=2"])
    with pytest.raises(ConfigError) as err:
        prepare(cfg, profile=False)
    assert err.value.key == "model.ep_plan" and words in str(err.value), str(err.value)


def test_ep_not_dividing_the_users_experts_is_refused() -> None:
    cfg = compose_cfg([*COMMON, "+model.module.experts=6", "dp=4", "ep=4"])
    with pytest.raises(ConfigError) as err:
        prepare(cfg, profile=False)
    assert err.value.key == "ep" and "valid: 1, 2, 3, 6" in str(err.value)


@pytest.mark.timeout(900)
def test_a_users_moe_trains_as_one_process_under_expert_parallelism(tmp_path) -> None:
    """pp=2 dp=2 ep=2 under 1f1b, and pp=1 dp=4 ep=4 with the other parameters' optimizer state
    sharded (zero=1): losses, step 0's gradients and the final weights within 1e-5 of the user's
    model in one process; each rank's log holds one dispatch and one combine per MoE layer of its
    stages and micro-batch."""
    cases = [("ep=2 1f1b", compose_cfg([*COMMON, "pp=2", "dp=2", "ep=2", "scheduler=1f1b"])),
             ("ep=4 zero=1", compose_cfg([*COMMON, "pp=1", "dp=4", "ep=4", "zero=1", "scheduler=gpipe"]))]
    ranks = check_like_one_process(cases, tmp_path)
    for what, layers_per_rank in (("ep=2 1f1b", 2), ("ep=4 zero=1", 4)):
        for rank in ranks[what]:
            log = rank.extras["expert_log"]
            names = {e.split()[0] for e in log}
            assert len(names) == layers_per_rank and len(log) == 2 * 2 * layers_per_rank, log


@pytest.mark.timeout(600)
def test_a_users_expert_parallel_checkpoint_resumes_without_ep(tmp_path) -> None:
    """Checkpointed at pp=2 dp=2 ep=2 (AdamW), the checkpoint holds each expert whole under its
    name; it resumes at pp=2 dp=1 on the uninterrupted run's losses and final weights."""
    from tests.test_long_runs import check_resumed

    base = [*MODEL, "data=synthetic", "batch_size=8", "model.seq_len=16", "threads=1", "timeout_s=120",
            "optimizer=adamw", "checkpoint.every=2", "steps=4"]
    ref = check_resumed([*base, "pp=2", "dp=2", "ep=2", "microbatches=2"], [*base, "pp=2", "microbatches=4"],
                        tmp_path, 2, 4)
    assert {f"inner.blocks.1.bank.mlps.{e}.down.bias" for e in range(4)} <= set(ref)
