"""What a device holds at each data-parallel sharding level (`zero`): the formula of
`predict.memory.Sharding` on hand-made stages, the planner's prediction of a small model at every
level, tied parameters kept whole, and a memory cap only sharding meets. No rank is spawned."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipelaunch.launcher.validate import prepare
from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.core.plan import PlanMeta
from pipelaunch.pipeline.planner.fit.budget import stage_param_factors
from pipelaunch.pipeline.planner.predict.memory import MIB, Sharding, UpdateMemory, device_memory
from pipelaunch.pipeline.planner.predict.prediction import predict
from pipelaunch.pipeline.report.tables import device_memory_table
from tests.harness import FAST, compose_cfg

#: a gpt_bench-like shape in miniature: AdamW, parameters well above activations, no reserve
BASE = [*FAST, "model.dim=128", "model.layers=4", "pp=2", "dp=2", "mode=plan", "optimizer=adamw",
        "memory.reserve_bytes=0"]


def _devices(zero: int, placement=(0, 0, 1), replicated=None, update=None, reshard="use", gpu=False):
    """Three stages of 8, 4 and 6 MiB (the first two on rank 0), cut into units of 4+3+1, 2+2 and
    3+3 MiB; AdamW's two states, dp=2."""
    units = [([4 * MIB, 3 * MIB, 1 * MIB], 0.0), ([2 * MIB, 2 * MIB], 0.0), ([3 * MIB, 3 * MIB], 0.0)]
    return device_memory([8 * MIB, 4 * MIB, 6 * MIB], list(placement), [1 * MIB, 1 * MIB], 2,
                         update=update, sharding=Sharding(zero, 2, reshard=reshard, keeps_reduce_input=gpu),
                         replicated_bytes=replicated, units=units)


@pytest.mark.parametrize(("zero", "held", "cpu", "gpu"), [
    (0, (12, 12, 24), 0, 0), (1, (12, 12, 12), 4, 4 + 4), (2, (12, 6, 12), 4 + 4, 4 + 4 + 4 + 2),
    (3, (6, 6, 12), (4 + 3) + 4, (4 + 3) + 4 + 4 + 2)])
def test_each_level_holds_what_the_table_says(zero: int, held: tuple, cpu: float, gpu: float) -> None:
    """Rank 0 holds 12 MiB of parameters in two stages, the larger cut into blocks of 4, 3 and 1
    MiB: zero=1 halves the optimizer state (the parameters gathered whole for the step, their shards'
    memory returned meanwhile) and reduce-scatters one block at a time (its 4 MiB input); zero=2 the gradients too (a block's
    gradients and their reduce-scatter input); zero=3 the parameters too (the block computing, the
    next one prefetched, a block's gradients). On a GPU each reduce-scatter's input stays until the
    next (4 MiB), and at zero >= 2, which reduces every micro-batch, the other stage keeps its last
    (2 MiB); at zero=1 a stage's one reduction ends its last backward, which drops the input."""
    rank0 = _devices(zero)[0]
    assert (rank0.params, rank0.grads, rank0.optimizer) == tuple(h * MIB for h in held)
    assert rank0.gathered == cpu * MIB and _devices(zero, gpu=True)[0].gathered == gpu * MIB
    assert rank0.total == sum(held) * MIB + rank0.activations + cpu * MIB  # in the backward phase
    assert ("gathered" in rank0.breakdown()) == bool(cpu)


def test_reshard_run_holds_the_stage_and_use_a_few_blocks() -> None:
    """reshard=run keeps every block of the stage gathered until its run ends (8 MiB), beside a
    block's gradients and their reduce-scatter input; reshard=use two blocks and the gradients."""
    assert _devices(3, reshard="run")[0].gathered == (8 + 4 + 4) * MIB
    assert _devices(3)[0].gathered == (4 + 3 + 4) * MIB
    assert Sharding(3, 2, reshard="run").window([1.0, 1.0], 2.0) == 4.0 + 3.0 + 1.0
    assert Sharding(3, 1).window([1.0]) == 0.0 and Sharding(0, 8).window([1.0]) == 0.0


def test_tied_parameters_stay_whole_at_every_level() -> None:
    """2 MiB of stage 0 and 2 MiB of stage 2 are one tied tensor: never sharded, nor in any unit."""
    rank0, rank1 = _devices(3, replicated=[2 * MIB, 0.0, 2 * MIB])
    assert rank0.params == 10 * MIB / 2 + 2 * MIB and rank0.grads == rank0.params
    assert rank0.optimizer == 2 * rank0.params and rank0.gathered == (4 + 3 + 4) * MIB
    assert rank1.params == 4 * MIB / 2 + 2 * MIB and rank1.gathered == (3 + 3 + 3) * MIB


def test_sharded_updates_hold_no_flat_copy_and_temporaries_on_the_shard() -> None:
    update = UpdateMemory([4 * MIB, 1 * MIB, 2 * MIB], temporaries=(1.0, 1.0), dp=2)
    flat, sharded = _devices(0, update=update)[0], _devices(1, update=update)[0]
    assert flat.update == 4 * MIB + 12 * MIB  # the optimizer's temporaries beat the flat copy (12 MiB)
    assert sharded.update == 4 * MIB / 2 + 12 * MIB / 2


def test_the_partitioners_stage_factor_is_the_same_formula() -> None:
    """A stage alone on its device, before its blocks exist: what it holds through the step (zero=0
    counts 2 + k), and with reshard=run its whole parameters gathered; parameters maybe tied never
    count less than unsharded."""
    assert stage_param_factors(2, Sharding(0, 2)) == (4.0, 4.0)
    assert stage_param_factors(2, Sharding(1, 2)) == (3.0, 4.0)
    assert stage_param_factors(2, Sharding(3, 4)) == (1.0, 4.0)
    assert stage_param_factors(2, Sharding(3, 4, reshard="run")) == (1.0 + 1.0, 4.0)
    assert Sharding(2, 1).degree == 1 and Sharding(0, 4).degree == 1 and Sharding(3, 1).gathered([([1.0], 0.0)]) == 0.0


@pytest.fixture(scope="module")
def plans():
    return {z: prepare(compose_cfg([*BASE, f"zero={z}"])).plan for z in range(4)}


def test_zero3_holds_about_half_the_parameters_gradients_and_optimizer_state_of_zero0(plans) -> None:
    def held(plan):
        return max(d.params + d.grads + d.optimizer for d in plan.meta.device_memory)

    assert all(p.meta.zero == z and p.meta.device_memory for z, p in plans.items())
    assert held(plans[3]) <= 0.55 * held(plans[0])
    assert held(plans[3]) < held(plans[2]) < held(plans[1]) < held(plans[0])
    assert all(0 < d1.gathered < d2.gathered < d3.gathered for d1, d2, d3 in zip(
        *(plans[z].meta.device_memory for z in (1, 2, 3)), strict=True))
    # a block at a time: the peak falls with the level (one block per unit here: 0.8 MiB a stage of 1.6)
    assert max(d.total for d in plans[3].meta.device_memory) < max(d.total for d in plans[0].meta.device_memory)
    # the levels' peaks differ on one plan (their step times: tests/test_dp_actions.py)
    same = [predict(replace(plans[0], meta=replace(plans[0].meta, zero=z)), 1e-4, 1e9) for z in range(4)]
    assert len({p.peak_bytes for p in same}) > 1


def test_the_memory_table_says_the_level_and_shows_the_window(plans) -> None:
    table = device_memory_table(plans[3])
    assert "zero=3 over dp=2: optimizer states, gradients and parameters sharded" in table
    assert "gathered" in table.splitlines()[3]
    zero0 = device_memory_table(plans[0]).splitlines()
    # zero=0 shards nothing; its units are the buckets it all-reduces
    assert "zero=" not in zero0[1] and zero0[1].startswith("units") and "gathered" not in zero0[2]
    assert "reshard=use" in table and table.splitlines()[2].startswith("units (gathered and reduced together)")
    assert "layer1 0.8" in table.splitlines()[2]


def test_a_plan_json_keeps_the_window_and_an_older_one_loads(plans) -> None:
    meta = plans[3].meta
    assert PlanMeta.from_json(meta.to_json()) == meta
    old = {"zero": 3, "device_memory": [{"rank": 0, "params": 1.0, "grads": 1.0, "optimizer": 2.0,
                                         "activations": 3.0, "total": 7.0}]}
    loaded = PlanMeta.from_json(old)
    assert loaded.device_memory[0].gathered == 0.0 and loaded.stage_replicated_param_bytes is None


def test_tied_embeddings_are_counted_whole() -> None:
    plan = prepare(compose_cfg([*BASE, "zero=3", "+model.tie_embeddings=true"])).plan
    tied = plan.meta.stage_replicated_param_bytes
    assert plan.shared_params and tied[0] == tied[-1] == 64 * 128 * 4  # vocab x dim, fp32
    stage_bytes = plan.meta.partition.stage_param_bytes
    rank0 = plan.meta.device_memory[0]
    assert rank0.params == pytest.approx((stage_bytes[0] - tied[0]) / 2 + tied[0])
    assert "tied parameters whole" in device_memory_table(plan)


def test_a_cap_zero0_misses_is_met_by_sharding(plans) -> None:
    """Under memory=budget the same run plans at zero=1 where zero=0 is over the cap."""
    low, high = (max(d.total for d in plans[z].meta.device_memory) for z in (1, 0))
    cap = (low + high) / 2
    budget = [*BASE, "memory=budget", f"memory.cap_bytes={cap:.0f}"]
    with pytest.raises(ConfigError, match="memory.cap_bytes"):
        prepare(compose_cfg([*budget, "zero=0"]))
    plan = prepare(compose_cfg([*budget, "zero=1"])).plan
    assert max(d.total for d in plan.meta.device_memory) <= cap


#: plan=auto over the sharding levels only
LEVELS = ["plan=auto", "plan.schedulers=[1f1b]", "plan.partitioners=[uniform]", "plan.microbatches=[4]",
          "plan.remat=[none]", "plan.zero=[0,1,2,3]"]


def test_plan_auto_runs_the_lowest_level_that_fits(plans) -> None:
    """Without a cap the level predicted fastest runs (the lowest of those within `plan.tie` of
    it: each level's collectives and its optimizer step on a shard are priced); under a cap zero=0
    misses, the lowest level that fits runs, and the labels and the summary carry each level."""
    free = prepare(compose_cfg([*BASE, *LEVELS]))
    steps = {o.candidate.zero: o.prediction.step_s for o in free.search.outcomes if o.prediction is not None}
    assert sorted(steps) == [0, 1, 2, 3]
    tied = [z for z, step in steps.items() if step <= min(steps.values()) * (1 + free.search.tie)]
    assert free.plan.meta.zero == min(tied)
    assert free.search.winner.candidate.label.endswith(f"/ zero={min(tied)}")
    cap = max(d.total for d in plans[0].meta.device_memory) - 1000
    capped = prepare(compose_cfg([*BASE, *LEVELS, "memory=budget", f"memory.cap_bytes={cap:.0f}"]))
    fitting = min(z for z, p in plans.items() if max(d.total for d in p.meta.device_memory) <= cap)
    assert capped.plan.meta.zero == fitting > 0
    summary = capped.plan.meta.search
    assert summary.chosen["zero"] == fitting and f"zero={fitting}" in summary.chosen["label"]
    # a block at a time, zero=2 and 3 hold less than zero=0 too: only zero=0 is over the cap
    assert sorted(row["zero"] for row in summary.excluded) == [0]
    assert "lower sharding levels of it (zero=0)" in summary.why
    assert " zero " in capped.search.table().splitlines()[0]


def test_plan_zero_names_levels_dp_can_shard() -> None:
    with pytest.raises(ConfigError, match="plan.zero"):
        prepare(compose_cfg([*BASE, *LEVELS, "plan.zero=[4]"]))
    with pytest.raises(ConfigError, match="dp=1 has one"):
        prepare(compose_cfg([*BASE, *LEVELS, "dp=1"]))


def test_the_memory_table_after_a_run_sets_the_state_against_params_grads_and_optimizer(plans) -> None:
    """A rank's measured state at its optimizer step shows beside the predicted params + grads +
    optim of its pipeline rank (the larger of its replicas'); a rank without one shows a dash."""
    from pipelaunch.pipeline.core.results import RankFacts

    plan = plans[3]
    held = [d.params + d.grads + d.optimizer for d in plan.meta.device_memory]

    def facts(rank: int, pp_rank: int, state: float | None) -> RankFacts:
        return RankFacts(rank, pp_rank, rank // 2, [pp_rank], {}, 1.0, 0.0, 1.0, None, None, state, 0.0, 0.0,
                         "cpu", None, False, [], "by_name")

    table = device_memory_table(plan, [facts(0, 0, 0.9 * held[0]), facts(2, 0, held[0]), facts(1, 1, None)])
    head, rank0, rank1 = table.splitlines()[3:6]
    assert head.split()[-6:] == ["state", "ratio", "tensors", "ratio", "resident", "ratio"]
    columns = head.split().index("state")  # after the prediction's 11 columns (gathered among them)
    assert rank0.split()[columns:columns + 2] == [f"{held[0] / MIB:.1f}", "1.00"]
    assert rank1.split()[columns] == "-"


def test_plan_auto_weighs_the_release_points_and_a_cap_refuses_with_the_one_that_fits() -> None:
    """At zero=3 `plan.reshard=[use,run]` tries both: without a cap the faster runs (run gathers
    each block once per run of actions, use once per action: never slower on the simulated step),
    under a cap between their peaks only use fits. A plan over the cap says which setting would fit."""
    search = [*LEVELS[:-1], "plan.zero=[3]", "plan.reshard=[use,run]"]
    free = prepare(compose_cfg([*BASE, *search]))
    steps = {o.candidate.reshard: o.prediction for o in free.search.outcomes}
    assert set(steps) == {"use", "run"} and steps["run"].step_s <= steps["use"].step_s
    assert steps["run"].peak_bytes > steps["use"].peak_bytes
    assert free.plan.meta.reshard == free.search.winner.candidate.reshard
    assert "reshard=" in free.search.winner.candidate.label
    cap = (steps["run"].peak_bytes + steps["use"].peak_bytes) / 2
    capped = prepare(compose_cfg([*BASE, *search, "memory=budget", f"memory.cap_bytes={cap:.0f}"]))
    assert capped.plan.meta.reshard == "use" and capped.plan.meta.search.chosen["reshard"] == "use"
    with pytest.raises(ConfigError, match="memory.cap_bytes") as err:
        prepare(compose_cfg([*BASE, "zero=3", "reshard=run", "memory=budget", f"memory.cap_bytes={cap:.0f}"]))
    assert "zero=3 reshard=use would hold" in str(err.value) and "within the cap" in str(err.value)
