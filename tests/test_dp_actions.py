"""The data-parallel collectives as actions: where planner/passes/data_parallel.py places them per
zero level, what the simulator's pricing (predict/data_parallel.py) makes of them, and the check
that replicas issued the same collectives in the same order. No rank is spawned."""

from __future__ import annotations

import pytest

from pipelaunch.launcher.validate import prepare
from pipelaunch.pipeline.core.ir import DP_KINDS, Action, Kind
from pipelaunch.pipeline.planner.passes.data_parallel import gradient_points, place_data_parallel
from pipelaunch.pipeline.planner.predict.data_parallel import (
    Collectives,
    Sharded,
    data_parallel_step,
    whole_stages,
)
from pipelaunch.pipeline.planner.predict.simulate import CostModel, compute_spans
from pipelaunch.pipeline.runtime.dp import verify_collective_order
from tests.harness import FAST, compose_cfg
from tests.schedules import training_schedules


def _plan(zero: int, sched: str, pp: int = 2, extra=()):
    return prepare(compose_cfg([*FAST, f"scheduler={sched}", f"pp={pp}", "dp=2", f"zero={zero}", "mode=plan",
                                *extra])).plan


def _gathered_at_compute(acts: list[Action]) -> bool:
    """Every compute action of a stage runs between an UNSHARD and a RESHARD of that stage."""
    held: set[int] = set()
    for a in acts:
        if a.kind is Kind.UNSHARD:
            held.add(a.stage)
        elif a.kind is Kind.RESHARD:
            held.discard(a.stage)
        elif a.is_compute and a.stage not in held:
            return False
    return not held


@pytest.mark.parametrize("sched", list(training_schedules()))
def test_every_level_places_its_collectives_where_the_program_allows(sched: str) -> None:
    """Per rank program: zero=0 one REDUCE_GRAD per stage right after its last backward (and its
    sends); 1 also one gather and one release per stage; 2 a reduction after every micro-batch's
    backward; 3 gathers and releases around every run of one stage's compute. The compute and P2P
    order is the same at every level; dp=1 has no collective at all."""
    single = _plan(0, sched, extra=["dp=1", "zero=0"]).schedule
    assert not any(a.kind in DP_KINDS for acts in single.actions for a in acts)
    plain = _plan(0, sched).schedule
    plain.actions = [[a for a in acts if a.kind not in DP_KINDS] for acts in plain.actions]
    for zero in (0, 1, 2, 3):
        plan = _plan(zero, sched)
        m = plan.microbatches
        for rank, acts in enumerate(plan.schedule.actions):
            assert [a for a in acts if a.kind not in DP_KINDS] == plain.actions[rank]
            completes, last = gradient_points([a for a in acts if a.kind not in DP_KINDS])
            reductions = [a for a in acts if a.kind is Kind.REDUCE_GRAD]
            stages = plan.schedule.stages_of(rank)
            assert sorted({a.stage for a in reductions}) == sorted(stages)
            assert len(reductions) == len(stages) * (m if zero >= 2 else 1)
            for pos, a in enumerate(acts):
                if a.kind is Kind.REDUCE_GRAD:  # after the backward completing its gradients, past its sends only
                    before = [b for b in acts[:pos] if b.kind not in DP_KINDS and not b.kind.value.startswith("SEND")]
                    assert before[-1].stage == a.stage and before[-1].kind in (Kind.B, Kind.W), (sched, zero, a)
            if zero == 0:
                assert not any(a.kind in (Kind.UNSHARD, Kind.RESHARD) for a in acts)
            else:
                assert _gathered_at_compute(acts), (sched, zero, rank)
                gathers = sum(a.kind is Kind.UNSHARD for a in acts)
                assert gathers == len(stages) if zero < 3 else gathers >= len(stages)
        assert place_data_parallel(plan.schedule, zero, 1) is plan.schedule


def test_a_zero3_gather_serves_consecutive_actions_of_one_stage() -> None:
    """GPipe's last rank runs only stage 1, its forwards then its backwards: one gather serves the
    whole step, released after the last reduction."""
    acts = [str(a) for a in _plan(3, "gpipe").schedule.actions[1]]
    assert [a for a in acts if "SHARD" in a] == ["1UNSHARD0", "1RESHARD3"]
    assert acts.index("1UNSHARD0") == acts.index("1F0") - 1 and acts[-2:] == ["1REDUCE_GRAD3", "1RESHARD3"]


def _toy(zero: int, flat: bool, v: bool) -> float:
    """Two stages: on one rank each (v=False), or both on rank 0 with stage 0's backward first done
    (v=True); compute F=I=W=1 s, one micro-batch; 8 bytes a stage on a 1 byte/s, latency-free link."""
    from pipelaunch.pipeline.core.ir import Schedule

    placement = [0, 0] if v else [0, 1]
    order = [[Action(0, Kind.F, 0), Action(1, Kind.F, 0), Action(1, Kind.B, 0), Action(0, Kind.B, 0)]] if v else \
        [[Action(0, Kind.F, 0), Action(0, Kind.B, 0)], [Action(1, Kind.F, 0), Action(1, Kind.B, 0)]]
    if v:  # stage 1's gradients are final first: its reduction overlaps stage 0's backward
        order = [[Action(0, Kind.F, 0), Action(1, Kind.F, 0), Action(1, Kind.B, 0), Action(0, Kind.B, 0)]]
    schedule = place_data_parallel(Schedule("toy", 2, 1, placement, order), zero, 2)
    cost = CostModel.uniform(2)
    spans = compute_spans(schedule, cost)
    step = data_parallel_step(schedule, spans, Sharded(zero, whole_stages([8.0, 8.0])), None,
                              Collectives(2, 0.0, 1.0), flat=flat)
    return max(e[-1][1] + g + t for e, g, t in zip(spans, step.gather_s, step.tail_s, strict=True))


def test_pricing_overlaps_a_reduction_with_the_rank_s_remaining_backward() -> None:
    """Ring all-reduce of 8 bytes over 2 replicas on 1 byte/s: 8 s; reduce-scatter and all-gather
    4 s each. Two stages on one rank: stage 1's all-reduce starts after its B (at 4 s of compute)
    and runs under stage 0's B (2 s), so the step is 6 + 8 + 8 - 2 = 20 s, not the flat 22 s."""
    assert _toy(0, flat=True, v=True) == pytest.approx(6 + 16)
    assert _toy(0, flat=False, v=True) == pytest.approx(4 + 8 + 8)
    # zero=1: one gather per stage (blocking, 4 s each) and a reduce-scatter (4 s) per stage
    assert _toy(1, flat=False, v=True) == pytest.approx(6 + 8 + 4 + 4 - 2 + 0)
    # one stage per rank: nothing to overlap, placed and flat agree
    assert _toy(0, flat=False, v=False) == pytest.approx(_toy(0, flat=True, v=False))


def test_the_prediction_adds_the_collectives_and_a_shard_s_optimizer_step() -> None:
    from pipelaunch.pipeline.planner.predict.prediction import predict

    base = [*FAST, "model.dim=128", "optimizer=adamw", "scheduler=interleaved_1f1b", "pp=2", "dp=2", "mode=plan",
            "predict=true", "link_bandwidth=1e8"]
    zero0, zero1 = (predict(prepare(compose_cfg([*base, f"zero={z}"])).plan, 1e-5, 1e8) for z in (0, 1))
    assert max(zero0.data_parallel_s) > 0 and zero0.step_s > zero0.schedule_s + max(zero0.optimizer_s)
    # AdamW on half the parameters (nothing tied here); in bytes, each plan measuring its own rate
    stepped = [[s / p.plan.meta.machine.optimizer_s_per_byte for s in p.optimizer_s] for p in (zero0, zero1)]
    for a, b in zip(*stepped, strict=True):
        assert b == pytest.approx(a / 2, rel=1e-6)


def test_replicas_that_issue_other_collectives_are_caught() -> None:
    same = ["0REDUCE_GRAD3 all_reduce 10"]
    verify_collective_order([(0, same), (1, None), (0, list(same)), (1, None)])
    with pytest.raises(RuntimeError, match="ranks 0 and 2, replicas of pipeline rank 0, issued different data-parallel"):
        verify_collective_order([(0, same), (1, None), (0, ["0REDUCE_GRAD3 all_reduce 12"]), (1, None)])
    with pytest.raises(RuntimeError, match="nothing"):
        verify_collective_order([(0, same), (0, [])])


@pytest.mark.parametrize(("args", "says"), [
    (["dp=4", "zero=2", "dp_shard=3"], "a divisor of dp of at least 2: [2, 4]"),
    (["dp=4", "zero=0", "dp_shard=2"], "zero=0 shards nothing"),
    (["dp=1", "zero=2"], "set dp >= 2"),
    (["dp=2", "zero=4"], "valid: 0 (replicas hold everything)"),
])
def test_bad_sharding_keys_are_refused_before_any_rank_starts(args: list[str], says: str) -> None:
    from pipelaunch.pipeline.core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"dp_shard|zero") as err:
        prepare(compose_cfg([*FAST, "pp=1", "scheduler=1f1b", "mode=plan", *args]))
    assert says in str(err.value)


def test_hybrid_sharding_prices_a_shard_of_its_group_and_the_groups_all_reduce() -> None:
    """dp=4 in two groups of 2: a device holds half (not a quarter) of its optimizer states, and a
    reduction is a reduce-scatter over 2 plus an all-reduce of the shard over the 2 groups."""
    plan = prepare(compose_cfg([*FAST, "pp=1", "scheduler=1f1b", "dp=4", "dp_shard=2", "zero=1", "mode=plan",
                                "optimizer=adamw", "predict=true"])).plan
    assert plan.meta.dp_shard == 2
    device, stage = plan.meta.device_memory[0], plan.meta.partition.stage_param_bytes[0]
    assert device.optimizer == pytest.approx(2 * stage / 2)  # AdamW's two states over a group of two, not four
    hybrid, flat = Collectives(4, 0.0, 1.0, shard=2), Collectives(4, 0.0, 1.0)
    # within a group: 1/2 of 8 bytes; across the groups, an all-reduce of the 4-byte shard: 2 x 1/2 x 4
    assert hybrid.reduce_scatter(8.0) == pytest.approx(4.0 + 4.0) and flat.reduce_scatter(8.0) == pytest.approx(6.0)
    assert hybrid.all_gather(8.0) == pytest.approx(4.0)
