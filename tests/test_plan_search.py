"""plan=auto: the joint search over schedule x partitioner x micro-batches x stages per rank x remat,
under a per-device memory budget."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pipelaunch.launcher.plugins import build_plugin
from pipelaunch.launcher.validate import prepare
from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.planner.predict.memory import BudgetExceeded, DeviceMemory
from pipelaunch.pipeline.planner.predict.simulate import CostModel, simulate
from pipelaunch.pipeline.planner.search.choose import (
    Candidate,
    candidates,
    microbatch_counts,
    run_search,
    scheduler_variants,
)
from tests.harness import FAST, assert_state_close, compose_cfg, merge_state, run_jobs
from tests.reference import reference_run

# ---------------------------------------------------------------------------------------- pure parts


def test_microbatch_counts_are_multiples_of_pp_that_split_the_replica_batch() -> None:
    assert microbatch_counts(2, 1, 16, 4, None) == [2, 4, 8, 16]
    assert microbatch_counts(4, 2, 32, 4, None) == [4, 8, 16]  # 16 sequences per replica
    assert microbatch_counts(2, 1, 12, 3, None) == [2, 3, 4]  # 8 and 16 do not divide 12
    assert microbatch_counts(2, 1, 16, 4, [3, 8]) == [8]
    # a cluster's layouts (plan.devices): micro-batches of one sequence too
    assert microbatch_counts(4, 32, 1792, 4, None, smallest=True) == [4, 8, 56]
    assert microbatch_counts(4, 32, 1792, 4, [8], smallest=True) == [8]
    # ... and 3pp and 6pp, as Megatron's batch over micro-batch gives (SC21's 146B: pp=8, m=48)
    assert microbatch_counts(8, 24, 2304, 8, None, smallest=True) == [8, 16, 24, 32, 48, 96]
    with pytest.raises(ConfigError, match="plan.microbatches"):
        microbatch_counts(2, 1, 16, 4, [3, 5])


def test_scheduler_variants_try_each_listed_setting() -> None:
    b, i = (f"pipelaunch.pipeline.planner.schedules.{m}" for m in ("one_f_one_b.OneFOneB", "interleaved.Interleaved1F1B"))
    options = {"1f1b": build_plugin("scheduler", {"_target_": b}, "1f1b"),
               "interleaved_1f1b": build_plugin("scheduler", {"_target_": i, "stages_per_rank": 2}, "interleaved_1f1b")}
    got = scheduler_variants(options, None, {"interleaved_1f1b": {"stages_per_rank": [2, 4]}})
    assert [(label, dict(p.config)) for label, p in got] == [
        ("1f1b", {"_target_": b}),
        ("interleaved_1f1b(stages_per_rank=2)", {"_target_": i, "stages_per_rank": 2}),
        ("interleaved_1f1b(stages_per_rank=4)", {"_target_": i, "stages_per_rank": 4})]
    assert [dict(p.kwargs) for _, p in got] == [{}, {"stages_per_rank": 2}, {"stages_per_rank": 4}]
    with pytest.raises(ConfigError, match="plan.schedulers"):
        scheduler_variants(options, ["zbv"], None)


class _Pred:
    """The parts of a Prediction the search reads."""

    def __init__(self, step_s: float, peaks: list[float], stages: int = 2) -> None:
        self.result = simulate_one(step_s)
        self.devices = [DeviceMemory(r, p, 0, 0, 0) for r, p in enumerate(peaks)]
        self.plan = SimpleNamespace(stages=[None] * stages)

    @property
    def step_s(self) -> float:
        return self.result.makespan_s

    @property
    def peak_bytes(self) -> float:
        return max(d.total for d in self.devices)


def simulate_one(step_s: float):
    from pipelaunch.pipeline.core.ir import Schedule
    from pipelaunch.pipeline.planner.schedules import build_schedule
    from pipelaunch.pipeline.planner.schedules.one_f_one_b import OneFOneB

    schedule: Schedule = build_schedule(OneFOneB(), [0], 1)
    return simulate(schedule, CostModel.uniform(1, f=step_s / 2, i=step_s / 4, w=step_s / 4))


def test_search_ranks_what_fits_and_keeps_what_the_budget_or_a_rule_ruled_out() -> None:
    cands = candidates([("gpipe", {}), ("1f1b", {}), ("zbv", {})], {"uniform": {}}, [4], ["none"])
    step = {"gpipe": 3.0, "1f1b": 2.0, "zbv": 1.0}

    def evaluate(c: Candidate):
        pred = _Pred(step[c.scheduler], [100.0, 50.0])
        if c.scheduler == "zbv":  # the fastest is over the budget on rank 0
            raise BudgetExceeded([DeviceMemory(0, 150.0, 0, 0, 0)], 120.0, "remedies", pred)
        return pred

    result = run_search(cands, evaluate, cap=120.0, given=cands[0])
    assert [o.candidate.scheduler for o in result.ranked] == ["1f1b", "gpipe"]
    assert result.winner.candidate.scheduler == "1f1b"
    assert [o.candidate.scheduler for o in result.excluded] == ["zbv"]
    table = result.table()
    assert "<- runs" in table and "over the budget (1)" in table and "rank 0 needs" in table
    why = result.why()
    assert "50.0% faster than the best other schedule, gpipe" in why
    assert "faster than the configuration as given" in why
    assert "1 faster candidate(s) did not fit the budget, the fastest zbv" in why

    # within a 3% tie the one holding less runs, and the reason says so
    tied = run_search(cands[1:], lambda c: _Pred({"1f1b": 1.0, "zbv": 0.98}[c.scheduler],
                                                 {"1f1b": [50.0], "zbv": [90.0]}[c.scheduler]), cap=None, tie=0.03)
    assert tied.ranked[0].candidate.scheduler == "zbv" and tied.winner.candidate.scheduler == "1f1b"
    assert "is within the 3% the predictions hold to" in tied.why()
    assert "the best other schedule" not in tied.why()  # zbv, the fastest, is named once
    assert "<- runs" in next(line for line in tied.table().splitlines() if " 1f1b " in line)

    # within the tie, fewer stages come before less memory (a transfer per stage the predictions
    # price least well), and the reason says so
    fewer = run_search(cands[1:], lambda c: _Pred({"1f1b": 1.0, "zbv": 0.98}[c.scheduler],
                                                  {"1f1b": [90.0], "zbv": [50.0]}[c.scheduler],
                                                  {"1f1b": 2, "zbv": 4}[c.scheduler]), cap=None, tie=0.03)
    assert fewer.winner.candidate.scheduler == "1f1b"
    assert "cuts the model into 4 stages against 2" in fewer.why()
    # then fewer micro-batches before less memory (each adds actions and messages priced short)
    sizes = candidates([("zb_h2", {})], {"uniform": {}}, [4, 8], ["none"])
    batches = run_search(sizes, lambda c: _Pred({4: 1.0, 8: 0.98}[c.microbatches], {4: [90.0], 8: [50.0]}[c.microbatches]),
                         cap=None, tie=0.03)
    assert batches.ranked[0].candidate.microbatches == 8 and batches.winner.candidate.microbatches == 4
    assert "cuts the batch into 8 micro-batches against 4" in batches.why()
    apart = run_search(cands[1:], lambda c: _Pred({"1f1b": 1.0, "zbv": 0.9}[c.scheduler],
                                                  {"1f1b": [90.0], "zbv": [50.0]}[c.scheduler],
                                                  {"1f1b": 2, "zbv": 4}[c.scheduler]), cap=None, tie=0.03)
    assert apart.winner.candidate.scheduler == "zbv"  # 10% apart: no tie, the fastest runs

    def fails(c: Candidate):
        raise ConfigError("microbatches", "zbv needs at least 2p")

    nothing = run_search(cands, fails, cap=None)
    with pytest.raises(ConfigError, match="plan=auto found no configuration that runs"):
        _ = nothing.winner
    assert "could not be planned (3)" in nothing.table()


# ---------------------------------------------------------------------------- planning a real model

AUTO = [*FAST, "plan=auto", "pp=2", "optimizer=adamw"]


def test_plan_auto_searches_jointly_and_wins_over_the_config_as_given() -> None:
    prepared = prepare(compose_cfg([*AUTO, "scheduler=1f1b", "microbatches=4"]))
    result = prepared.search
    labels = {o.candidate.label for o in result.outcomes}
    assert len(labels) == len(result.outcomes) >= 40  # schedules (with variants) x partitioners x counts
    assert {o.candidate.scheduler for o in result.outcomes} >= {
        "gpipe", "1f1b", "zb_h1", "zb_h2", "zbv", "interleaved_1f1b(stages_per_rank=2)", "hanayo(waves=1)",
        "interleaved_zb(stages_per_rank=2)", "dualpipev", "v_half", "v_min"}  # #26's new ones too
    assert "looped_bfs" not in {o.candidate.scheduler for o in result.outcomes}  # searched when named
    assert {o.candidate.microbatches for o in result.outcomes} == {2, 4, 8, 16}
    assert {o.candidate.partitioner for o in result.outcomes} == {"uniform", "balanced"}  # milp: a chain
    win = result.winner
    assert prepared.plan.schedule is win.prediction.plan.schedule and prepared.plan.microbatches == win.candidate.microbatches
    fastest = result.ranked[0].prediction
    assert win.prediction.step_s <= fastest.step_s * (1 + result.tie)  # plan.tie: 0.03
    tied = [o for o in result.ranked if o.prediction.step_s <= fastest.step_s * (1 + result.tie)]
    fewest = min(len(o.prediction.plan.stages) for o in tied)
    assert len(win.prediction.plan.stages) == fewest
    assert win.prediction.peak_bytes == min(o.prediction.peak_bytes for o in tied
                                            if len(o.prediction.plan.stages) == fewest)
    given = next(o for o in result.outcomes if o.candidate == result.given)
    assert given.candidate.label == "1f1b / uniform / 4 mbs / remat=none"
    assert win.prediction.step_s <= given.prediction.step_s


def test_a_schedule_left_out_of_the_default_search_is_searched_when_named() -> None:
    """looped_bfs (`searched_by_default = False`: its CPU steps measure far above its predictions)
    is not in scheduler=auto's candidates, and is in plan=auto's when plan.schedulers names it."""
    alone = prepare(compose_cfg([*FAST, "pp=2", "scheduler=auto", "mode=plan"])).search
    assert "looped_bfs" not in {o.candidate.scheduler for o in alone.outcomes}
    named = prepare(compose_cfg([*AUTO, "plan.schedulers=[looped_bfs,1f1b]", "plan.partitioners=[uniform]",
                                 "plan.microbatches=[4]", "plan.remat=[none]"])).search
    assert {o.candidate.scheduler for o in named.outcomes} == {"looped_bfs", "1f1b"}


def test_plan_auto_under_a_budget_lists_each_excluded_candidate_with_its_device_and_bytes() -> None:
    free = prepare(compose_cfg([*AUTO, "memory=budget", "memory.cap_bytes=1e12", "plan.remat=[none]"])).search
    peaks = sorted(o.prediction.peak_bytes for o in free.ranked)
    cap = peaks[len(peaks) // 2]  # half the candidates fit
    result = prepare(compose_cfg([*AUTO, "memory=budget", f"memory.cap_bytes={cap}", "plan.remat=[none]"])).search
    assert result.excluded and result.ranked
    assert all(o.prediction.peak_bytes <= cap for o in result.ranked)
    assert any(o.over for o in result.excluded)
    for o in result.excluded:
        if o.over:  # simulated: the devices over the cap, with their bytes
            assert all(d.total > cap for d in o.over) and o.prediction.peak_bytes > cap
        else:  # no split of it fits: the partitioner's smallest cap says by how much
            assert "the smallest cap that fits is" in o.split_over
    assert not any("memory.cap_bytes" in (o.error or "") for o in result.failed)
    # no budget makes a step faster than the fastest without one (the winners may differ within plan.tie)
    assert result.winner.prediction.step_s >= min(o.prediction.step_s for o in free.ranked)
    table = result.table(top=len(result.outcomes))
    assert f"over the budget ({len(result.excluded)})" in table and "needs" in table and "over the" in table


@pytest.mark.timeout(300)
def test_plan_auto_winner_trains_like_one_process(tmp_path) -> None:
    cfg = compose_cfg([*AUTO, "optimizer=sgd"])
    cfg.microbatches = prepare(cfg).plan.microbatches  # what the launcher records for the ranks
    (ranks,) = run_jobs([cfg], tmp_path / "logs")
    ref = reference_run(cfg)
    assert ranks[0].losses == pytest.approx(ref["losses"], rel=1e-5)
    assert_state_close(merge_state(ranks, "params_final"), ref["params_final"], "plan=auto winner")
    for r in ranks:  # each rank reports its measured peak beside the plan's prediction for its device
        info = r.rank_info
        assert info.predicted_peak_bytes > 0 and info.peak_above_start_bytes > 0


def test_ranks_sharing_too_few_cores_are_predicted_taking_turns(monkeypatch) -> None:
    """Four one-thread ranks on two cores: the prediction plays the schedule with busy ranks
    sharing the cores, which is never faster than each rank alone or all the work over the cores."""
    import pipelaunch.pipeline.planner
    from pipelaunch.pipeline.planner.predict.shared_cores import shared_makespan

    monkeypatch.setattr(pipelaunch.pipeline.planner, "available_cores", lambda: 2)
    p = prepare(compose_cfg([*FAST, "pp=4", "threads=1", "predict=true", "scheduler=1f1b"])).prediction
    assert p.plan.meta.machine.rank_slots == 2
    assert p.schedule_s == pytest.approx(shared_makespan(p.plan.schedule, p.cost, 2))
    assert p.schedule_s >= max(p.result.makespan_s, sum(p.result.busy_s) / 2) - 1e-9
    monkeypatch.setattr(pipelaunch.pipeline.planner, "available_cores", lambda: 4)  # a core each: the makespan
    alone = prepare(compose_cfg([*FAST, "pp=4", "threads=1", "predict=true", "scheduler=1f1b"])).prediction
    assert not alone.plan.meta.machine.rank_slots
    assert alone.schedule_s == pytest.approx(alone.result.makespan_s)


def test_profiles_are_kept_apart_per_thread_count_and_host_allocator(tmp_path, monkeypatch) -> None:
    """Ranks time their ops with their own thread count and malloc: a profile taken under other
    settings is measured again, not reused."""
    monkeypatch.setenv("PIPELAUNCH_CACHE", str(tmp_path))
    base = [*FAST, "partitioner=balanced", "pp=2"]

    def profiles() -> int:
        return len(list(tmp_path.glob("*.json")))

    prepare(compose_cfg(base))
    assert profiles() == 1
    prepare(compose_cfg(base))
    assert profiles() == 1  # same settings: the cached profile
    prepare(compose_cfg([*base, "threads=2"]))
    assert profiles() == 2
    prepare(compose_cfg([*base, "host_allocator=system"]))
    assert profiles() == 3


def test_a_split_backward_is_priced_as_profiled_not_as_a_share_of_the_fused_one(tmp_path, monkeypatch) -> None:
    """I and W are timed per node with the runtime's own split backward (which costs more than the
    fused one) and summed per stage; the first stage, which receives no input, runs its whole
    backward in W at the fused price. The simulator reads exactly these."""
    import json

    from pipelaunch.pipeline.planner.predict.costs import cost_model_from_plan

    monkeypatch.setenv("PIPELAUNCH_CACHE", str(tmp_path))
    plan = prepare(compose_cfg([*FAST, "partitioner=balanced", "scheduler=zbv", "pp=2", "microbatches=4"])).plan
    (profile,) = tmp_path.glob("*.json")
    nodes = json.loads(profile.read_text())["nodes"]
    meta = plan.meta
    i, w, b = meta.stage_backward_input_s, meta.stage_backward_weight_s, meta.stage_backward_s
    assert i[0] == 0.0 and w[0] == b[0]
    for s in range(1, len(plan.stages)):
        blocks = plan.stages[s].blocks
        assert i[s] == pytest.approx(sum(nodes[n]["backward_input_s"] for n in blocks)) and i[s] > 0
        assert w[s] == pytest.approx(sum(nodes[n]["backward_weight_s"] for n in blocks)) and w[s] > 0
    cost = cost_model_from_plan(plan, 0.0, 1e12)
    fixed = meta.machine.action_overhead_s  # the runtime's fixed cost per action, on top of the profile
    assert cost.backward_input_s == pytest.approx([x + fixed for x in i])
    assert cost.backward_weight_s == pytest.approx([x + fixed for x in w])
    assert cost.backward_s == pytest.approx([x + fixed for x in b])
