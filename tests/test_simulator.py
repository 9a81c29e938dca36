"""The simulator: validation errors, deadlock reports, costs, transfers, memory, speed."""

from __future__ import annotations

import math

import pytest

from pipelaunch.pipeline.core.ir import B, F, I, Schedule, W
from pipelaunch.pipeline.planner.passes.lowering import lower
from pipelaunch.pipeline.planner.placement import linear, v_shape
from pipelaunch.pipeline.planner.predict.simulate import CostModel, ScheduleError, simulate, validate
from pipelaunch.pipeline.planner.schedules import build_schedule
from pipelaunch.pipeline.planner.schedules.gpipe import GPipe
from pipelaunch.pipeline.planner.schedules.one_f_one_b import OneFOneB
from pipelaunch.pipeline.planner.schedules.zbv import ZBV


def two_stage(actions) -> Schedule:
    return Schedule("handmade", 2, 2, [0, 1], actions)


def test_missing_backward_is_named() -> None:
    sched = two_stage([[F(0, 0), F(0, 1), B(0, 0)], [F(1, 0), B(1, 0), F(1, 1), B(1, 1)]])
    with pytest.raises(ScheduleError, match=r"stage 0 mb 1 has B x0"):
        validate(sched)


def test_wrong_rank_and_duplicates_are_named() -> None:
    sched = two_stage([[F(0, 0), F(0, 1), F(1, 0), B(0, 0), B(0, 1)], [F(1, 1), B(1, 0), B(1, 1)]])
    with pytest.raises(ScheduleError, match=r"1F0 runs on rank 0 but stage 1 lives on rank 1"):
        simulate(sched, CostModel.uniform(2))


def test_deadlock_lists_stuck_actions() -> None:
    # Rank 0 wants the backward of mb 0 before forwarding mb 1; rank 1 runs mb 1 first.
    sched = two_stage([[F(0, 0), B(0, 0), F(0, 1), B(0, 1)], [F(1, 1), B(1, 1), F(1, 0), B(1, 0)]])
    with pytest.raises(ScheduleError) as info:
        simulate(sched, CostModel.uniform(2))
    msg = str(info.value)
    assert "deadlock" in msg
    assert "rank 0: stuck at 0B0" in msg and "1B/I0 (rank 1)" in msg
    assert "rank 1: stuck at 1F1" in msg and "0F1 (rank 0)" in msg


def test_w_before_i_on_same_rank_deadlocks() -> None:
    sched = Schedule("w-first", 1, 1, [0], [[F(0, 0), W(0, 0), I(0, 0)]])
    with pytest.raises(ScheduleError, match=r"stuck at 0W0.*waiting for 0I0"):
        simulate(sched, CostModel.uniform(1))


def test_lowered_and_unlowered_agree() -> None:
    sched = build_schedule(ZBV(), v_shape(3), 7)
    cost = CostModel.uniform(6, output_bytes=1e6, latency_s=0.1, bandwidth_bytes_per_s=1e7)
    a, b = simulate(sched, cost), simulate(lower(sched), cost)
    assert a.makespan_s == b.makespan_s and a.events == b.events


def test_transfer_costs_delay_cross_rank_dependencies() -> None:
    sched = build_schedule(GPipe(), linear(2), 1)
    free = simulate(sched, CostModel.uniform(2))
    slow = simulate(sched, CostModel.uniform(2, output_bytes=100.0, latency_s=0.5, bandwidth_bytes_per_s=100.0))
    # One forward hop and one backward hop, each 0.5 + 100/100 s.
    assert slow.makespan_s == pytest.approx(free.makespan_s + 3.0)
    same_rank = Schedule("one-rank", 2, 1, [0, 0], [[F(0, 0), F(1, 0), B(1, 0), B(0, 0)]])
    r = simulate(same_rank, CostModel.uniform(2, output_bytes=100.0, latency_s=0.5, bandwidth_bytes_per_s=100.0))
    assert r.makespan_s == pytest.approx(6.0)


def test_uneven_costs_and_events() -> None:
    cost = CostModel(forward_s=[1.0, 2.0], backward_input_s=[1.0, 2.0], backward_weight_s=[0.5, 1.0])
    res = simulate(build_schedule(OneFOneB(), linear(2), 4), cost)
    assert res.busy_s == pytest.approx([4 * 2.5, 4 * 5.0])
    assert res.makespan_s >= 1.0 + 4 * 5.0 + 1.5
    assert all(0 <= b < 1 for b in res.bubble)
    first = res.events[0]
    assert set(first) == {"rank", "action", "kind", "stage", "mb", "start_s", "end_s"}
    assert first["action"] == "0F0" and first["kind"] == "F" and first["start_s"] == 0.0
    for rank in range(2):
        evs = [e for e in res.events if e["rank"] == rank]
        assert all(x["end_s"] <= y["start_s"] + 1e-12 for x, y in zip(evs, evs[1:], strict=False))


def test_split_backward_memory_half_freed_by_i() -> None:
    sched = Schedule("split", 1, 1, [0], [[F(0, 0), I(0, 0), W(0, 0)]])
    res = simulate(sched, CostModel.uniform(1, activation_bytes=8.0))
    assert res.peak_activation_bytes == [8.0] and res.peak_activation_microbatches == [1]


def test_remat_memory_accounting() -> None:
    cost = CostModel.uniform(2, activation_bytes=10.0, input_bytes=1.0)
    gp = simulate(build_schedule(GPipe(), linear(2), 4), cost)
    rm = simulate(build_schedule(GPipe(), linear(2), 4, remat="stage"), cost)
    assert gp.peak_activation_bytes[0] == pytest.approx(40.0)
    # 4 kept inputs, plus one rematerialised micro-batch at a time.
    assert rm.peak_activation_bytes[0] == pytest.approx(4 * 1.0 + 10.0)


def test_uniform_and_resplit() -> None:
    cost = CostModel.uniform(4, f=2.0, i=1.0, w=1.0, output_bytes=5.0)
    two = cost.resplit(2)
    assert two.forward_s == pytest.approx([4.0, 4.0]) and two.output_bytes == [5.0, 5.0]
    eight = cost.resplit(8)
    assert sum(eight.forward_s) == pytest.approx(8.0)
    assert cost.recompute_s == cost.forward_s
    assert math.isinf(cost.bandwidth_bytes_per_s)


def test_large_schedule_builds_and_simulates_exactly() -> None:
    """pp=64, m=128 ZBV: the closed-form makespan. How long it takes is measured in bench/RESULTS.md's
    plan-time figures, not asserted here (wall-clock asserts fail on a shared machine: 2.06 s once)."""
    sched = build_schedule(ZBV(), v_shape(64), 128)
    res = simulate(sched, CostModel.uniform(128))
    assert res.makespan_s == pytest.approx(6 * 128 + 63)


def test_fused_backward_priced_apart_from_its_halves() -> None:
    """A measured fused B (cheaper than I + W run apart) is what the simulator charges for B."""
    sched = build_schedule(OneFOneB(), linear(2), 4)
    split_price = CostModel(forward_s=[1.0, 1.0], backward_input_s=[1.0, 1.0], backward_weight_s=[1.0, 1.0])
    fused_price = CostModel(forward_s=[1.0, 1.0], backward_input_s=[1.0, 1.0], backward_weight_s=[1.0, 1.0],
                            backward_s=[1.5, 1.5])
    assert split_price.backward_s == [2.0, 2.0]
    assert simulate(sched, split_price).busy_s == pytest.approx([12.0, 12.0])
    assert simulate(sched, fused_price).busy_s == pytest.approx([10.0, 10.0])
    assert fused_price.resplit(4).backward_s == pytest.approx([0.75] * 4)


def test_costs_from_events_keep_fused_and_split_backwards_apart() -> None:
    from types import SimpleNamespace

    from pipelaunch.pipeline.planner.predict.costs import cost_model_from_events

    plan = SimpleNamespace(stages=[SimpleNamespace(recv_bytes=0, send_bytes=0, inputs={}, index=s) for s in range(2)],
                           moe_overlap=False)
    events = [{"stage": s, "kind": k, "start_s": 0.0, "end_s": d}
              for s, k, d in [(0, "F", 1.0), (0, "I", 0.6), (0, "W", 0.7), (0, "B", 1.1),
                              (1, "F", 2.0), (1, "B", 3.0)]]
    cost = cost_model_from_events(plan, events, 0.0, math.inf)
    assert cost.backward_s == pytest.approx([1.1, 3.0])
    assert (cost.backward_input_s, cost.backward_weight_s) == (pytest.approx([0.6, 1.5]), pytest.approx([0.7, 1.5]))


def test_split_backward_holds_the_weight_stash_from_i_to_w() -> None:
    """I frees what lies above W's restarts and adds the gradients W restarts from; W frees the rest."""
    sched = Schedule("split", 1, 2, [0], [[F(0, 0), F(0, 1), I(0, 0), I(0, 1), W(0, 0), W(0, 1)]])
    cost = CostModel.uniform(1, activation_bytes=8.0)
    assert cost.input_grad_freed_bytes == [4.0]  # the textbook default: half
    cost.input_grad_freed_bytes = [0.0]  # I keeps the whole graph
    assert simulate(sched, cost).peak_activation_bytes == [16.0]
    cost.weight_stash_bytes, cost.input_grad_freed_bytes = [3.0], [2.0]
    assert simulate(sched, cost).peak_activation_bytes == [18.0]  # 8 + 8 - 2 + 3 - 2 + 3
    fused = Schedule("fused", 1, 2, [0], [[F(0, 0), F(0, 1), B(0, 0), B(0, 1)]])
    assert simulate(fused, cost).peak_activation_bytes == [16.0]  # a fused backward keeps no stash
    two = cost.resplit(2)
    assert two.weight_stash_bytes == [1.5, 1.5] and two.input_grad_freed_bytes == [1.0, 1.0]


def test_ranks_sharing_cores_take_turns() -> None:
    """Processor sharing: busy ranks split the cores; a waiting rank leaves its share to the others."""
    from pipelaunch.pipeline.planner.predict.shared_cores import shared_makespan
    from pipelaunch.pipeline.planner.schedules.inference import Inference

    forward = build_schedule(Inference(), linear(2), 2)
    cost = CostModel.uniform(2, f=1.0)
    assert simulate(forward, cost).makespan_s == pytest.approx(3.0)
    # 0F0 alone (1 s), then 0F1 and 1F0 at half speed each (2 s), then 1F1 alone (1 s)
    assert shared_makespan(forward, cost, slots=1) == pytest.approx(4.0)
    assert shared_makespan(forward, cost, slots=2, replicas=2) == pytest.approx(4.0)
    assert shared_makespan(forward, cost, slots=2) == pytest.approx(3.0)
    for gen, placement in ((OneFOneB(), linear(4)), (ZBV(), v_shape(4)), (GPipe(), linear(4))):
        sched = build_schedule(gen, placement, 8)
        cost = CostModel(forward_s=[1.0, 1.3, 0.8, 1.1] * (sched.num_stages // 4),
                         backward_input_s=[1.0, 1.2, 0.9, 1.4] * (sched.num_stages // 4),
                         backward_weight_s=[0.7, 0.9, 0.8, 1.0] * (sched.num_stages // 4), latency_s=0.05)
        alone = simulate(sched, cost)
        assert shared_makespan(sched, cost, slots=4) == pytest.approx(alone.makespan_s)  # a core each
        for slots in (1, 2, 3):
            shared = shared_makespan(sched, cost, slots=slots)
            assert shared >= alone.makespan_s - 1e-9 and shared >= sum(alone.busy_s) / slots - 1e-9
        cost.latency_s = 0.0  # one core and instant transfers: never idle, all the work one after another
        assert shared_makespan(sched, cost, slots=1) == pytest.approx(sum(simulate(sched, cost).busy_s))


def test_compute_end_times_are_the_simulated_ends_in_program_order() -> None:
    from pipelaunch.pipeline.planner.predict.simulate import compute_end_times

    sched = build_schedule(ZBV(), v_shape(4), 8)
    cost = CostModel.uniform(8, f=1.0, i=1.5, w=0.5, output_bytes=2.0, latency_s=0.1, bandwidth_bytes_per_s=10.0)
    ends = [[e["end_s"] for e in simulate(sched, cost).events if e["rank"] == r] for r in range(4)]
    assert compute_end_times(sched, cost) == ends


def test_events_are_built_once_and_only_when_read() -> None:
    """A generator comparing candidates reads only the step's numbers: the per-action event dicts
    wait until something reads them, and are the same then."""
    sched = build_schedule(OneFOneB(), linear(3), 4)
    result = simulate(sched, CostModel.uniform(3, f=1.0, i=1.0, w=1.0))
    assert "events" not in vars(result) and result.event_source is not None
    events = result.events
    assert result.events is events and result.event_source is None
    assert len(events) == 3 * 4 * 2 and events[0] == {"rank": 0, "action": "0F0", "kind": "F", "stage": 0, "mb": 0,
                                                       "start_s": 0.0, "end_s": 1.0}
