"""Bad input fails before any rank is spawned, with a message naming the key and valid values."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pipelaunch.launcher.validate import prepare
from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.report.tables import stage_table
from tests.harness import FAST, ROOT, compose_cfg, use_stored_profile

#: the FAST gpt's profile, SGD's temporaries and the runtime overheads measured beside them: the
#: budget tests' splits (balanced) and recomputation (remat=auto) follow measured times, which a
#: busy machine's fresh profile moves enough to change their choice (1 of 3 fresh profiles did)
STORED = ROOT / "tests" / "data" / "validation-cache"
OVERHEADS = ["link_latency_s=0.0005090984649996245", "action_overhead_s=4.026663249987905e-05"]


@pytest.fixture
def stored_profile(tmp_path, monkeypatch) -> None:
    use_stored_profile(monkeypatch, tmp_path / "cache", STORED / "gpt-fast-profile.json",
                       STORED / "sgd-temporaries.json")


def _error(overrides: list[str]) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        prepare(compose_cfg([*FAST, *overrides]))
    return info.value


@pytest.mark.parametrize(
    ("overrides", "key", "fragment"),
    [
        (["pp=0"], "pp", ">= 1"),
        (["dp=0"], "dp", ">= 1"),
        (["batch_size=10", "dp=2", "microbatches=4"], "batch_size", "not divisible by dp x microbatches"),
        (["pp=16", "scheduler=gpipe"], "pp", "need at least 16 graph nodes"),
        (["scheduler=dualpipev", "pp=2", "microbatches=2"], "microbatches", "microbatches >= 4"),
        (["placement=explicit", "placement.ranks=[0,1,1]", "pp=2", "scheduler=1f1b"], "placement", "cannot run"),
        (["placement=explicit", "placement.ranks=[0,2,1,0]", "pp=2", "scheduler=gpipe"], "placement.ranks", "outside 0..1"),
        (["placement=explicit", "placement.ranks=[0,0]", "pp=2", "scheduler=gpipe"], "placement.ranks", "without a stage"),
        (["device=tpu"], "device", "auto, cpu, cuda"),
        (["remat=some"], "remat", "none, selective, full, stage, auto"),
        (["partitioner=manual", "partitioner.split_points=[nope]", "pp=2"], "partitioner.split_points", "valid names"),
        (["partitioner=manual", "partitioner.split_points=[layer2,layer4]", "pp=2"], "partitioner.split_points",
         "need 1 split points"),
    ],
)
def test_bad_config_is_rejected_with_a_clear_message(overrides, key, fragment) -> None:
    err = _error(overrides)
    assert err.key == key, str(err)
    assert fragment in str(err)


def test_placement_list_of_wrong_length_names_both() -> None:
    err = _error(["scheduler=zbv", "pp=2", "placement=explicit", "placement.ranks=[0,1,0]"])
    assert "zbv" in str(err) and "placement" in err.key


def test_cli_reports_config_error_without_spawning(tmp_path) -> None:
    proc = subprocess.run(
        [sys.executable, "train.py", "scheduler=dualpipev", "pp=2", "microbatches=2", f"hydra.run.dir={tmp_path}"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "Invalid config `microbatches`" in proc.stderr
    assert not (tmp_path / "logs").exists()


def test_typed_schema_rejects_non_integer_pp(tmp_path) -> None:
    proc = subprocess.run(
        [sys.executable, "train.py", "pp=four", f"hydra.run.dir={tmp_path}"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode != 0 and "pp" in proc.stderr


def test_impossible_memory_budget_states_the_smallest_cap() -> None:
    err = _error(["memory=budget", "memory.cap_bytes=1000", "memory.reserve_bytes=0", "partitioner=balanced", "pp=2"])
    assert err.key == "memory.cap_bytes"
    assert "the smallest cap that fits is" in str(err)


def test_fixed_split_over_budget_names_the_device_and_points_to_a_split_that_fits(stored_profile) -> None:
    base = [*FAST, "pp=4", "scheduler=1f1b", "microbatches=4", "memory=budget", "memory.reserve_bytes=0", *OVERHEADS]
    uniform = prepare(compose_cfg([*base, "memory.cap_bytes=1e12"]))
    with pytest.raises(ConfigError) as info:  # learn the smallest cap any split meets
        prepare(compose_cfg([*base, "memory.cap_bytes=1000", "partitioner=balanced"]))
    smallest = int(str(info.value).split("the smallest cap that fits is ")[1].split()[0])
    assert smallest < uniform.prediction.peak_bytes, "uniform is already the tightest split"
    # a tenth under uniform's peak: `smallest` prices a stage as the partitioners do, without the
    # backward's workspace and the P2P buffers the device check adds, so a cap close above it may
    # hold no split at all (with uniform's equal layers, halfway between the two did not)
    cap = int(0.9 * uniform.prediction.peak_bytes)
    assert cap > smallest
    err = _error([*base[len(FAST):], f"memory.cap_bytes={cap}"])
    fullest = max(uniform.prediction.devices, key=lambda d: d.total)
    assert err.key == "memory.cap_bytes" and f"rank {fullest.rank} needs" in str(err)
    assert "partitioner=balanced" in str(err) and "remat=auto" in str(err)
    fitted = prepare(compose_cfg([*base, f"memory.cap_bytes={cap}", "partitioner=balanced"]))
    assert fitted.prediction.peak_bytes <= cap


def test_device_memory_counts_gradients_optimizer_state_and_the_simulated_activation_peak() -> None:
    """AdamW keeps two tensors per parameter, SGD with momentum one, plain SGD none; a rank's
    activations are the simulated peak of all its stages together (two under zbv)."""
    base = [*FAST, "pp=2", "microbatches=4", "memory=budget", "memory.cap_bytes=1e12"]
    for optimizer, states in (["optimizer=adamw"], 2), (["optimizer=sgd"], 0), (["optimizer=sgd", "optimizer.momentum=0.9"], 1):
        prepared = prepare(compose_cfg([*base, *optimizer, "scheduler=zbv"]))
        pred = prepared.prediction
        for d in pred.devices:
            assert d.grads == d.params > 0 and d.optimizer == states * d.params, optimizer
            assert d.activations == pred.result.peak_activation_bytes[d.rank]
        stage_params = pred.plan.meta.partition.stage_param_bytes
        assert pred.devices[0].params == stage_params[0] + stage_params[3]  # V placement: stages 0 and 3 on rank 0
        assert all(d.reserve == 50e6 and d.workspace > 0 for d in pred.devices)  # conf/memory: reserve_bytes
    plan = prepared.plan  # the finished Plan records each device's predicted memory
    assert [d.total for d in plan.meta.device_memory] == [d.total for d in pred.devices]


def test_budget_makes_room_for_the_schedules_own_in_flight_microbatches(stored_profile) -> None:
    """GPipe holds every micro-batch on every stage, 1F1B p - s: the same cap can fit one and not the other."""
    base = ["pp=4", "microbatches=4", "memory=budget", "memory.reserve_bytes=0", "partitioner=balanced", *OVERHEADS]

    def smallest(schedule: str) -> int:
        err = _error([*base, f"scheduler={schedule}", "memory.cap_bytes=1000"])
        return int(str(err).split("the smallest cap that fits is ")[1].split()[0])

    gpipe, one_f = smallest("gpipe"), smallest("1f1b")
    assert gpipe > one_f
    cap = (gpipe + one_f) // 2
    # the device check then adds what the split does not price (the backward's workspace, the held
    # outputs): remat=auto absorbs it by recomputing a module or two
    plan = prepare(compose_cfg([*FAST, *base, "scheduler=1f1b", f"memory.cap_bytes={cap}", "remat=auto"])).plan
    assert plan.meta.partition.stage_in_flight == [4, 3, 2, 1]
    assert max(plan.meta.partition.stage_memory_bytes) <= cap
    rows = stage_table(plan).splitlines()[1:5]  # the stage table shows the counts the budget used
    assert [int(row.split()[7]) for row in rows] == [4, 3, 2, 1]
    assert _error([*base, "scheduler=gpipe", f"memory.cap_bytes={cap}"]).key == "memory.cap_bytes"


def test_final_schedule_order_is_repriced_with_its_own_counts() -> None:
    """The split is cut for the unit-cost order's counts; the final order's are recorded (the
    device check then plays the final schedule itself)."""
    from pipelaunch.pipeline.planner.fit.budget import reprice_for_schedule
    from pipelaunch.pipeline.planner.partition import evaluate
    from pipelaunch.pipeline.planner.partition.common import assignment_from_order
    from pipelaunch.pipeline.planner.placement import linear
    from pipelaunch.pipeline.planner.schedules import build_schedule
    from pipelaunch.pipeline.planner.schedules.gpipe import GPipe
    from tests.synthetic import chain

    graph = chain([1.0] * 4, activation_bytes=100)
    part = evaluate(graph, assignment_from_order(list(graph.nodes), [0, 1, 2, 3]), 4, in_flight=[4, 3, 2, 1])
    assert part.stage_memory_bytes == [400, 300, 200, 100]
    reprice_for_schedule(part, build_schedule(GPipe(), linear(4), 4))
    assert (part.stage_in_flight, part.stage_memory_bytes) == ([4, 4, 4, 4], [400] * 4)


def test_remat_full_budget_prices_the_inputs_kept_for_recomputation() -> None:
    from pipelaunch.pipeline.planner.fit.budget import reprice_for_schedule
    from pipelaunch.pipeline.planner.partition import evaluate
    from pipelaunch.pipeline.planner.partition.common import assignment_from_order
    from pipelaunch.pipeline.planner.placement import linear
    from pipelaunch.pipeline.planner.schedules import build_schedule
    from pipelaunch.pipeline.planner.schedules.one_f_one_b import OneFOneB
    from tests.synthetic import chain

    graph = chain([1.0] * 4, output_bytes=10, activation_bytes=100)
    part = evaluate(graph, assignment_from_order(list(graph.nodes), [0, 1, 2, 3]), 4, in_flight=[1, 1, 1, 1])
    reprice_for_schedule(part, build_schedule(OneFOneB(), linear(4), 4, "stage"))
    assert part.remat_stages == [0, 1, 2, 3] and part.stage_full_in_flight == [1, 1, 1, 1]
    assert part.stage_memory_bytes == [100, 100 + 10 * 3, 100 + 10 * 2, 100 + 10 * 1]


def test_remat_auto_without_a_budget_recomputes_nothing_and_milp_is_named() -> None:
    plan = prepare(compose_cfg([*FAST, "remat=auto", "pp=2"])).plan
    assert plan.meta.remat_stages == [] == plan.schedule.remat_stages()
    err = _error(["remat=auto", "pp=2", "memory=budget", "memory.cap_bytes=1e12", "partitioner=milp"])
    assert err.key == "remat" and "partitioner=balanced" in str(err)
    assert "auto" in str(_error(["remat=some"]))


def test_remat_full_split_is_priced_with_its_recomputation_by_every_partitioner() -> None:
    """balanced and milp plans under remat=stage report stage times with the forward paid twice."""
    for part in ("balanced", "milp"):
        base = [*FAST, "pp=2", "memory=budget", "memory.cap_bytes=1e12", f"partitioner={part}"]
        plain = prepare(compose_cfg([*base, "remat=none"])).plan.meta
        full = prepare(compose_cfg([*base, "remat=stage"])).plan.meta
        assert full.partition.remat_stages == [0, 1]
        # whatever the split, the stages together compute everything once plus every forward again
        assert sum(full.partition.stage_compute_s) == pytest.approx(
            sum(plain.partition.stage_compute_s) + sum(full.stage_forward_s), rel=1e-6), part


def test_impossible_budget_suggests_recomputing_only_when_it_was_not_counted() -> None:
    base = ["memory=budget", "memory.cap_bytes=1000", "memory.reserve_bytes=0", "partitioner=balanced", "pp=2"]
    plain = _error(base)
    counted = _error([*base, "remat=auto"])
    assert "remat=auto" in str(plain) and "recompute" not in str(counted)
    smallest = [int(str(e).split("the smallest cap that fits is ")[1].split()[0]) for e in (plain, counted)]
    assert smallest[1] < smallest[0]
