"""Bad input fails before any rank is spawned, with a message naming the key and valid values."""

from __future__ import annotations

import subprocess
import sys

import pytest

from launcher.validate import prepare
from pipeline.errors import ConfigError
from tests.harness import FAST, ROOT, compose_cfg


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
        (["pp=16", "scheduler=gpipe"], "pp", "at least 16 blocks"),
        (["scheduler=1f1b", "pp=4", "microbatches=2"], "microbatches", "microbatches >= 4"),
        (["placement=explicit", "placement.ranks=[0,1,1]", "pp=2", "scheduler=1f1b"], "placement", "cannot run"),
        (["placement=explicit", "placement.ranks=[0,2,1,0]", "pp=2", "scheduler=gpipe"], "placement.ranks", "outside 0..1"),
        (["placement=explicit", "placement.ranks=[0,0]", "pp=2", "scheduler=gpipe"], "placement.ranks", "without a stage"),
        (["device=tpu"], "device", "auto, cpu, cuda"),
        (["remat=some"], "remat", "none, full"),
        (["partitioner=manual", "partitioner.split_points=[nope]", "pp=2"], "partitioner.split_points", "valid names"),
        (["partitioner=manual", "partitioner.split_points=[layer2,layer4]", "pp=2"], "partitioner.split_points",
         "give 1 split points"),
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
        [sys.executable, "train.py", "pp=4", "microbatches=2", f"hydra.run.dir={tmp_path}"],
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
    err = _error(["memory=budget", "memory.cap_bytes=1000", "partitioner=balanced", "pp=2"])
    assert err.key == "memory.cap_bytes"
    assert "the smallest cap that fits is" in str(err)


def test_fixed_split_over_budget_points_to_a_split_that_fits() -> None:
    base = [*FAST, "pp=4", "scheduler=gpipe", "microbatches=4", "memory=budget"]
    uniform = prepare(compose_cfg([*base, "memory.cap_bytes=1e12"])).plan.meta["partition"]
    peak = max(uniform["stage_memory_bytes"])
    with pytest.raises(ConfigError) as info:  # learn the smallest cap any split meets
        prepare(compose_cfg([*base, "memory.cap_bytes=1000", "partitioner=balanced"]))
    smallest = int(str(info.value).split("the smallest cap that fits is ")[1].split()[0])
    assert smallest < peak, "uniform is not the tightest split here"
    cap = (smallest + peak) // 2
    err = _error([*base[len(FAST):], f"memory.cap_bytes={cap}"])
    assert err.key == "memory.cap_bytes" and "use partitioner=balanced" in str(err)
    fitted = prepare(compose_cfg([*base, f"memory.cap_bytes={cap}", "partitioner=balanced"])).plan
    assert max(fitted.meta["partition"]["stage_memory_bytes"]) <= cap
