"""The recomputation modes (#55): `remat=full` reruns each block inside its backward from its
input, `remat=selective` keeps the matmuls' outputs and reruns the rest, `remat=stage` reruns whole
stages (R actions). Every mode trains as one process on every schedule family; and the planner
prices them in order: selective holds less than none and more than full, and costs time between.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipelaunch.launcher.validate import prepare
from pipelaunch.pipeline.compute.selective import kept, selective_context
from pipelaunch.pipeline.graph.recompute import run_checkpointed
from tests.harness import FAST, check_like_one_process, compose_cfg

SCHEDULES = ("1f1b", "zbv", "interleaved_1f1b")


def _gpt(remat: str, scheduler: str, *more: str) -> tuple[str, object]:
    return (f"gpt remat={remat} {scheduler} {' '.join(more)}",
            compose_cfg([*FAST, "microbatches=4", "pp=2", f"scheduler={scheduler}", f"remat={remat}", *more]))


@pytest.mark.timeout(900)
@pytest.mark.parametrize("remat", ["full", "selective"])
def test_every_block_recomputed_trains_as_one_process(remat: str, tmp_path) -> None:
    """1f1b, zbv (the split backward reruns each block twice) and interleaved 1F1B; the
    materialised attention (model.attention=math, whose core selective reruns) on zbv."""
    cases = [_gpt(remat, s) for s in SCHEDULES] + [_gpt(remat, "zbv", "model.attention=math")]
    for _, cfg in cases:
        plan = prepare(cfg, profile=False).plan
        blocks = [b for s in plan.stages for b in (s.selective if remat == "selective" else s.recompute)]
        assert sorted(blocks) == [f"layer{i}" for i in range(6)], blocks
        assert plan.schedule.remat_stages() == []  # inside the backward, no R action
    check_like_one_process(cases, tmp_path)


@pytest.mark.timeout(900)
def test_transformers_layers_recomputed_as_regions_train_as_one_process(tmp_path) -> None:
    """An export trace's layer is dozens of operators: each runs as one checkpointed region (full
    and selective, with 1f1b and zbv), and Llama trains as one process."""
    base = [o for o in FAST if not o.startswith(("model.dim", "model.layers", "model.vocab_size"))]
    cases = [(f"llama remat={r} {s}", compose_cfg(["model=hf_llama_tiny", *base, "model.seq_len=16", "pp=2",
                                                   f"scheduler={s}", f"remat={r}"]))
             for r, s in (("full", "1f1b"), ("selective", "zbv"))]
    plan = prepare(cases[0][1], profile=False).plan
    assert [b for s in plan.stages for b in s.recompute] == [f"model.model.layers.{i}" for i in range(4)]
    check_like_one_process(cases, tmp_path)


def test_the_selective_policy_keeps_the_matmuls_and_reruns_the_rest() -> None:
    """Run under the pair of modes: in the rerun, the projections' products come from the store
    (mm / addmm do not run again), the attention core's batched products and the softmax do; the
    gradients are those of the plain block."""
    torch.manual_seed(0)
    proj, out = nn.Linear(8, 24), nn.Linear(8, 8)

    def block(x: torch.Tensor) -> torch.Tensor:
        q, k, v = proj(x).chunk(3, dim=-1)
        scores = (q @ k.transpose(-2, -1)).softmax(-1)  # the core: bmm, softmax
        return out(scores @ v).relu()

    x = torch.randn(2, 5, 8, requires_grad=True)
    block(x).sum().backward()
    expected = [t.grad.clone() for t in (x, *proj.parameters(), *out.parameters())]
    for t in (x, *proj.parameters(), *out.parameters()):
        t.grad = None
    ran: list[str] = []

    class Watch(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ran.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    y = run_checkpointed(block, True, x)
    with Watch():
        y.sum().backward()
    got = [t.grad for t in (x, *proj.parameters(), *out.parameters())]
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    assert "bmm" in ran and "_softmax" in ran  # the core was rerun
    assert kept(torch.ops.aten.addmm.default) and not kept(torch.ops.aten.bmm.default)
    forward, replay = selective_context()
    assert type(forward) is not type(replay)


def _plan(remat: str):
    cfg = compose_cfg(["model=gpt", "model.dim=64", "model.layers=4", "model.seq_len=64", "model.attention=math",
                       "pp=2", "microbatches=4", "batch_size=8", "threads=1", f"remat={remat}", "mode=plan"])
    return prepare(cfg)


@pytest.mark.timeout(300)
def test_selective_is_priced_between_none_and_full() -> None:
    """On the materialised attention, where the scores dominate a block's activations: the
    fullest device's predicted peak none > selective > full, the step none < selective < full, and
    remat=stage holds more than full (it reruns a whole stage at once)."""
    got = {r: _plan(r).prediction for r in ("none", "selective", "full", "stage")}
    peak = {r: p.peak_bytes for r, p in got.items()}
    step = {r: p.step_s for r, p in got.items()}
    assert peak["none"] > peak["selective"] > peak["full"], peak
    assert step["none"] < step["selective"] < step["full"], step
    assert peak["stage"] > peak["full"], peak


#: gpt_bench (8 blocks, dim 256, seq 128) at pp=2, two micro-batches of 16 sequences: activations
#: dominate, SGD holds no optimizer state
BENCH = ["model=gpt_bench", "pp=2", "optimizer=sgd", "batch_size=32", "microbatches=2", "steps=2", "warmup_steps=0",
         "threads=1", "predict=true", "timeout_s=300"]


def _with(base: list[str], more: list[str]) -> list[str]:
    """`base` with the keys `more` sets replaced by its values."""
    keys = {o.split("=", 1)[0] for o in more}
    return [o for o in base if o.split("=", 1)[0] not in keys] + more


def _fullest(cases: dict[str, list[str]], tmp_path) -> tuple[dict[str, float], dict[str, float]]:
    """Each case's fullest rank: its measured tensor peak and the plan's prediction of it."""
    from tests.harness import run_jobs

    cfgs = [compose_cfg(_with(BENCH, more)) for more in cases.values()]
    runs = run_jobs(cfgs, tmp_path / "logs")
    fullest, predicted = {}, {}
    for what, cfg, ranks in zip(cases, cfgs, runs, strict=True):
        reserve = float(cfg.memory.reserve_bytes)
        top = max(ranks, key=lambda r: r.rank_info.peak_tensor_bytes).rank_info
        fullest[what], predicted[what] = top.peak_tensor_bytes, top.predicted_peak_bytes - reserve
    return fullest, predicted


@pytest.mark.timeout(900)
def test_a_block_at_a_time_holds_what_the_planner_says(tmp_path) -> None:
    """Measured tensor peaks (counted as CUDA's allocator counts them, the same in every run): the
    fullest rank under remat=full holds at most 0.6x of what whole-stage recomputation
    (remat=stage, the old remat=full) holds, selective lies between them (here the last rank holds
    one micro-batch, whole under remat=stage as under none), and the plan predicts each fullest
    rank within 15% (interleaved 1F1B and ZBV, two stages a rank: the slow test below)."""
    cases = {"stage": ["remat=stage"], "full": ["remat=full"], "selective": ["remat=selective"]}
    fullest, predicted = _fullest(cases, tmp_path)
    assert fullest["full"] <= 0.6 * fullest["stage"], fullest
    assert fullest["full"] < fullest["selective"] < fullest["stage"], fullest
    for what in cases:
        assert abs(predicted[what] / fullest[what] - 1) <= 0.15, (what, predicted[what], fullest[what])


@pytest.mark.slow  # the default suite measures the recomputation modes above and checks each schedule's live
# micro-batch counts against the simulator's (tests/test_schedules.py)
@pytest.mark.timeout(900)
def test_two_stages_a_rank_hold_what_the_planner_says(tmp_path) -> None:
    """Interleaved 1F1B and ZBV, whose ranks hold two stages each: the plan predicts each fullest
    rank's measured tensor peak within 15%."""
    cases = {"interleaved": ["scheduler=interleaved_1f1b", "microbatches=4", "batch_size=16"],
             "zbv": ["scheduler=zbv", "microbatches=4", "batch_size=16"]}
    fullest, predicted = _fullest(cases, tmp_path)
    for what in cases:
        assert abs(predicted[what] / fullest[what] - 1) <= 0.15, (what, predicted[what], fullest[what])
