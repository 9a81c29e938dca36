"""Every schedule of the scheduler config group (tests/schedules.py): valid, complete, deadlock-free,
and the built-ins' known bubble/memory results."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest
from hydra.utils import get_object

from pipelaunch.launcher.config import group_configs
from pipelaunch.launcher.plugins import is_search, schedule_option
from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.core.ir import Action, Kind
from pipelaunch.pipeline.planner import schedules as schedules_package
from pipelaunch.pipeline.planner.placement import (
    classify,
    from_kind,
    interleaved,
    linear,
    placement_for,
    v_shape,
    wave,
)
from pipelaunch.pipeline.planner.predict.simulate import CostModel, simulate
from pipelaunch.pipeline.planner.schedules import build_schedule
from pipelaunch.pipeline.planner.schedules.base import ScheduleGenerator
from pipelaunch.pipeline.planner.schedules.gpipe import GPipe
from pipelaunch.pipeline.planner.schedules.hanayo import Hanayo
from pipelaunch.pipeline.planner.schedules.interleaved import Interleaved1F1B
from pipelaunch.pipeline.planner.schedules.one_f_one_b import OneFOneB
from pipelaunch.pipeline.planner.schedules.zbv import ZBV
from pipelaunch.pipeline.planner.schedules.zero_bubble import ZBH1, ZBH2
from tests.schedules import build, schedules, training_schedules

EXPECTED = {"gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "hanayo", "zb_h1", "zb_h2", "zbv", "v_half", "v_min",
            "dualpipev", "looped_bfs", "inference", "torch"}
#: every schedule option of conf/scheduler/ (the built-ins and any YAML added there)
NAMES = sorted(schedules())


def unit(schedule) -> CostModel:
    return CostModel.uniform(schedule.num_stages)


def valid_schedules(gen, pps, extra_microbatches: tuple[int, ...] = ()):
    """(pp, m, schedule) for m in {pp, 2pp, 3pp + 1, *extra} wherever the generator accepts them."""
    for pp in pps:
        for m in sorted({pp, 2 * pp, 3 * pp + 1, *extra_microbatches}):
            placement = placement_for(gen, pp)
            try:
                gen.check(pp, m, placement)
            except ConfigError:
                continue
            yield pp, m, build_schedule(gen, placement, m)


def _generator_classes() -> set[type[ScheduleGenerator]]:
    """Every concrete ScheduleGenerator subclass defined in pipeline/planner/schedules/."""
    found = set()
    for info in pkgutil.iter_modules(schedules_package.__path__, f"{schedules_package.__name__}."):
        module = importlib.import_module(info.name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, ScheduleGenerator) and cls is not ScheduleGenerator and cls.__module__ == module.__name__:
                found.add(cls)
    return found


def test_every_schedule_class_has_a_yaml_in_the_scheduler_group() -> None:
    """A schedule without a YAML would be invisible to the launcher (by name and in scheduler=auto)
    and to these tests; each built-in option is named as its class names itself."""
    targets = {}
    options = group_configs("scheduler")
    assert is_search(options["auto"])  # scheduler=auto: a setting of the search, no class
    for option, cfg in options.items():
        if not is_search(cfg):
            targets.setdefault(get_object(cfg["_target_"]), []).append(option)
    classes = _generator_classes()
    assert EXPECTED <= {cls.name for cls in classes}
    for cls in classes:
        assert cls in targets, f"{cls.__module__}.{cls.__qualname__} has no conf/scheduler/*.yaml"
        assert cls.name in targets[cls], (cls, targets[cls])
    assert set(schedules()) == EXPECTED  # `auto` is the search over the others, not a schedule


@pytest.mark.parametrize("name", NAMES)
def test_every_schedule_is_complete_on_the_right_ranks(name: str) -> None:
    gen = build(name)
    for pp, m, sched in valid_schedules(gen, range(1, 9), extra_microbatches=(1,)):
        placement = sched.placement
        result = simulate(sched, unit(sched))  # validates, raises on deadlock
        seen: dict[tuple[int, int, Kind], int] = {}
        for rank, acts in enumerate(sched.actions):
            for a in acts:
                assert placement[a.stage] == rank, f"{name} pp={pp} m={m}: {a} on rank {rank}"
                seen[(a.stage, a.mb, a.kind)] = seen.get((a.stage, a.mb, a.kind), 0) + 1
        for s in range(len(placement)):
            for mb in range(m):
                assert seen.get((s, mb, Kind.F)) == 1
                if not gen.training:
                    continue
                if gen.split_backward:  # split, or fused back into one B where splitting buys nothing
                    split = seen.get((s, mb, Kind.I)) == 1 and seen.get((s, mb, Kind.W)) == 1
                    fused = seen.get((s, mb, Kind.B)) == 1 and (s, mb, Kind.I) not in seen
                    assert split or fused
                else:
                    assert seen.get((s, mb, Kind.B)) == 1
        assert result.makespan_s > 0


def test_every_schedule_accepts_some_microbatch_counts() -> None:
    for pp in (1, 2, 4, 8):
        names = set()
        for name, gen in schedules().items():
            try:
                gen.check(pp, 2 * pp, placement_for(gen, pp))
            except ConfigError:
                continue
            names.add(name)
        assert names == set(NAMES), f"pp={pp}: {set(NAMES) - names} reject m=2pp"


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 13), (8, 8), (8, 32)])
def test_gpipe_and_1f1b_bubble_and_memory(pp: int, m: int) -> None:
    expected = (pp - 1) / (m + pp - 1)
    g = simulate(build_schedule(GPipe(), linear(pp), m), CostModel.uniform(pp))
    o = simulate(build_schedule(OneFOneB(), linear(pp), m), CostModel.uniform(pp))
    for res in (g, o):
        assert res.bubble == pytest.approx([expected] * pp)
    assert o.peak_activation_microbatches[0] == pp
    assert o.peak_activation_microbatches == [pp - r for r in range(pp)]
    assert g.peak_activation_microbatches[0] == m


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 12), (8, 16), (8, 24)])
def test_zb_h1_third_of_1f1b_bubble_same_peak_memory(pp: int, m: int) -> None:
    ref = simulate(build_schedule(OneFOneB(), linear(pp), m), CostModel.uniform(pp))
    zb = simulate(build_schedule(ZBH1(), linear(pp), m), CostModel.uniform(pp))
    # Idle time per rank: 1F1B waits 3(p-1) units (F + I + W per hop of the fill and drain); ZB-H1
    # only the p-1 units of the forward fill, i.e. exactly a third. As a share of the makespan it is
    # (p-1)/(3m+p-1) vs (p-1)/(m+p-1): a third only as m grows, so compare idle seconds.
    assert max(zb.idle_s) == pytest.approx(pp - 1)
    assert max(zb.idle_s) == pytest.approx(max(ref.idle_s) / 3)
    assert zb.excess_bubble == pytest.approx(0.0)
    # Peak activation memory is 1F1B's (rank 0, p micro-batches); other ranks hold at most p
    # micro-batches, r of them only half (waiting for W).
    assert max(zb.peak_activation_bytes) == pytest.approx(max(ref.peak_activation_bytes))
    assert max(zb.peak_activation_microbatches) <= pp


@pytest.mark.parametrize("pp", [1, 2, 3, 4, 6, 8])
def test_zb_h2_zero_bubble_bounded_memory(pp: int) -> None:
    for m in (pp, pp + 1, 2 * pp - 1, 2 * pp, 3 * pp + 1):
        res = simulate(build_schedule(ZBH2(), linear(pp), m), CostModel.uniform(pp))
        # The makespan is the lower bound 3m + p - 1 (only the fill of the first micro-batch) from
        # m >= p; from m >= 2p - 1 (a full warm-up) no rank idles between its first and last action.
        assert res.makespan_s == pytest.approx(3 * m + pp - 1)
        assert res.excess_bubble == pytest.approx(0.0)
        if m >= 2 * pp - 1:
            assert res.internal_bubble == pytest.approx([0.0] * pp), (pp, m)
        assert max(res.peak_activation_microbatches) <= 2 * pp - 1


@pytest.mark.parametrize("pp", [1, 2, 3, 4, 5, 6, 7, 8, 12, 16])
def test_zbv_zero_bubble_for_m_at_least_2p(pp: int) -> None:
    one_f_one_b_peak = pp * 2.0  # 1F1B holds p micro-batches of a 2-stage-sized chunk on rank 0
    for m in sorted({2 * pp, 2 * pp + 1, 3 * pp, 4 * pp + 3}):
        res = simulate(build_schedule(ZBV(), v_shape(pp), m), CostModel.uniform(2 * pp))
        assert res.excess_bubble == pytest.approx(0.0), (pp, m)
        assert res.makespan_s == pytest.approx(6 * m + pp - 1)
        assert max(res.peak_activation_bytes) <= one_f_one_b_peak


def test_zbv_serves_small_microbatch_counts() -> None:
    for pp in (2, 4, 8):
        for m in range(1, 2 * pp):
            simulate(build_schedule(ZBV(), v_shape(pp), m), CostModel.uniform(2 * pp))


@pytest.mark.parametrize("pp,m,v", [(2, 4, 2), (4, 8, 2), (4, 8, 3), (4, 16, 2), (8, 16, 2), (3, 3, 2)])
def test_interleaved_beats_1f1b(pp: int, m: int, v: int) -> None:
    gen = Interleaved1F1B(stages_per_rank=v)
    sched = build_schedule(gen, interleaved(pp, v), m)
    # Each of the v chunks is 1/v of a 1F1B stage.
    res = simulate(sched, CostModel.uniform(pp * v, f=1 / v, i=1 / v, w=1 / v))
    assert res.mean_bubble < (pp - 1) / (m + pp - 1)


def test_hanayo_beats_1f1b_and_supports_waves() -> None:
    for pp, m in ((2, 4), (4, 8), (8, 16)):
        for waves in (1, 2):
            k = 2 * waves
            sched = build_schedule(Hanayo(waves=waves), wave(pp, waves), m)
            res = simulate(sched, CostModel.uniform(pp * k, f=1 / k, i=1 / k, w=1 / k))
            assert res.mean_bubble < (pp - 1) / (m + pp - 1)
    assert from_kind("v", 4, Hanayo(waves=2).stages_per_rank()) == wave(4, 2)
    assert classify(wave(4, 2)) == "v"


def test_check_errors_name_the_key() -> None:
    with pytest.raises(ConfigError, match="microbatches.*at least one micro-batch"):
        Interleaved1F1B().check(4, 0, interleaved(4, 2))
    with pytest.raises(ConfigError, match="placement"):
        Interleaved1F1B(stages_per_rank=3).check(4, 8, interleaved(4, 2))
    with pytest.raises(ConfigError, match="scheduler.stages_per_rank"):
        Interleaved1F1B(stages_per_rank=0)
    with pytest.raises(ConfigError, match="scheduler.waves"):
        Hanayo(waves=0)
    with pytest.raises(ConfigError, match="microbatches >= 1"):
        OneFOneB().check(4, 0, linear(4))
    with pytest.raises(ConfigError, match="placement"):
        ZBV().check(4, 8, linear(4))
    with pytest.raises(ConfigError, match="placement"):
        ZBH1().check(4, 8, v_shape(4))
    with pytest.raises(ConfigError, match="placement"):
        ZBH2().check(2, 8, [1, 0])
    with pytest.raises(ConfigError, match="microbatches"):
        ZBV().check(4, 0, v_shape(4))


def test_interleaved_stages_per_rank_is_field_and_callable() -> None:
    gen = Interleaved1F1B(stages_per_rank=3)
    assert gen.stages_per_rank == 3 and gen.stages_per_rank() == 3
    assert placement_for(gen, 4) == interleaved(4, 3)
    assert placement_for(gen, 4, "auto") == placement_for(gen, 4, "interleaved") == interleaved(4, 3)


def test_remat_full_simulates_with_less_memory() -> None:
    cost = CostModel.uniform(4, activation_bytes=10.0, input_bytes=1.0)
    for gen in (OneFOneB(), ZBH1(), GPipe()):
        plain = simulate(build_schedule(gen, linear(4), 8), cost)
        remat = simulate(build_schedule(gen, linear(4), 8, remat="stage"), cost)
        assert max(remat.peak_activation_bytes) < max(plain.peak_activation_bytes)
        assert remat.makespan_s > plain.makespan_s  # recomputation costs time
        assert any(e["kind"] == "R" for e in remat.events)


def test_auto_is_the_search_over_the_training_schedules_and_builds_none_itself() -> None:
    """scheduler=auto compares the group's training options (the launcher's plan search,
    tests/test_plan_search.py); the option itself refuses to be built as a schedule."""
    names = set(training_schedules())
    assert "inference" not in names and "auto" not in names and {"1f1b", "zbv", "zb_h1"} <= names
    for pp, m in ((4, 8), (2, 4)):
        simulated = 0
        for gen in training_schedules().values():
            try:
                sched = build_schedule(gen, placement_for(gen, pp), m)
            except ConfigError:
                continue
            simulated += 1
            assert simulate(sched, CostModel.uniform(sched.num_stages)).makespan_s > 0
        assert simulated >= 3
    with pytest.raises(ConfigError, match="scheduler=auto is a search"):
        schedule_option(group_configs("scheduler")["auto"], "auto")


@pytest.mark.parametrize("pp", [2, 4])
def test_zbv_runs_each_w_right_after_its_i_until_the_cool_down(pp: int) -> None:
    """At unit costs the eager-W order loses nothing, so ZBV keeps it: each W follows its I while
    the rank still has forwards (the W reuses what its I just touched); only the cool-down defers W."""
    from pipelaunch.pipeline.planner.schedules.zbv import ZBV

    for acts in ZBV().compute_actions(v_shape(pp), 4 * pp):
        last_f = max(i for i, a in enumerate(acts) if a.kind is Kind.F)
        for i, a in enumerate(acts[:last_f]):
            if a.kind is Kind.I:
                assert acts[i + 1] == Action(a.stage, Kind.W, a.mb), acts


@pytest.mark.parametrize("pp", [2, 4])
def test_play_through_keeps_eager_w_only_when_the_simulator_finds_it_no_slower(pp: int) -> None:
    from pipelaunch.pipeline.planner.schedules.base import ScheduleCosts, makespan
    from pipelaunch.pipeline.planner.schedules.zbv import ZBV
    from pipelaunch.pipeline.planner.schedules.zero_bubble import list_schedule

    m, placement = 4 * pp, v_shape(pp)
    f = ([1.0, 2.0, 1.5, 3.0] * pp)[: 2 * pp]
    costs = (f, f, [c / 2 for c in f])
    chosen = makespan(ZBV().compute_actions(placement, m, ScheduleCosts.of(*costs)), placement, m, costs)
    for eager in (False, True):
        other = list_schedule(placement, m, split_backward=True, cap=[2 * pp] * pp, forward_first=True,
                              costs=costs, reserve_deeper=True, eager_w=eager)
        assert chosen <= makespan(other, placement, m, costs) + 1e-9


@pytest.mark.parametrize("name", NAMES)
def test_in_flight_counts_per_stage_agree_with_the_simulated_memory(name: str) -> None:
    """Schedule.peak_in_flight (what a memory budget makes room for) against the simulator's
    time-based peak per rank: equal where a rank holds one stage, between the largest and the sum of
    its stages' counts where it holds several; GPipe holds all m, 1F1B p - s."""
    gen = build(name)
    for pp, m, sched in valid_schedules(gen, (1, 2, 4)):
        placement = sched.placement
        counts = sched.peak_in_flight()
        if not gen.training:
            assert counts == [1] * len(placement)
            continue
        peak = simulate(sched, unit(sched)).peak_activation_microbatches
        for r in range(pp):
            mine = [counts[s] for s in sched.stages_of(r)]
            if len(mine) == 1:
                assert peak[r] == mine[0], (name, pp, m, r)
            else:
                assert max(mine) <= peak[r] <= sum(mine), (name, pp, m, r)
        if name == "gpipe":
            assert counts == [m] * pp
        if name == "1f1b":
            assert counts == [min(pp - s, m) for s in range(pp)]


def test_in_flight_with_full_remat_is_one_recomputed_microbatch() -> None:
    assert build_schedule(OneFOneB(), linear(4), 8, "stage").peak_in_flight() == [1, 1, 1, 1]
