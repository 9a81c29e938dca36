"""cpu_affinity=auto: each local rank on its own cores when they cover all ranks, else the OS decides."""

from __future__ import annotations

import os

import pytest

from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.runtime.cpu_affinity import rank_cores
from tests.harness import FAST, compose_cfg, run_jobs


def test_rank_cores_gives_disjoint_blocks_when_cores_suffice() -> None:
    allowed = [7, 3, 5, 1, 2, 4, 6, 0]
    blocks = [rank_cores(allowed, r, 4, 2) for r in range(4)]
    assert blocks == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert rank_cores(allowed, 1, 2, 3) == [3, 4, 5]  # cores left over stay unused


def test_rank_cores_leaves_oversubscribed_or_prebound_ranks_alone() -> None:
    assert rank_cores([0, 1], 0, 4, 1) is None  # 4 ranks, 2 cores
    assert rank_cores([0, 1, 2, 3], 0, 2, 4) is None  # 2 ranks x 4 threads on 4 cores
    # SLURM's --cpu-bind gave this task its own 2 cores: 2 local ranks x 2 threads do not fit in them
    assert rank_cores([8, 9], 1, 2, 2) is None
    assert rank_cores([0, 1], 0, 1, 0) is None


def test_bad_cpu_affinity_is_named() -> None:
    with pytest.raises(ConfigError, match="cpu_affinity.*auto, none"):
        compose_cfg(["cpu_affinity=numa"])


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux affinity calls")
@pytest.mark.timeout(180)
@pytest.mark.parametrize("choice", ["auto", "none"])
def test_spawned_ranks_report_their_cores(tmp_path, choice) -> None:
    allowed = sorted(os.sched_getaffinity(0))
    cfg = compose_cfg([*FAST, "pp=2", "scheduler=1f1b", "steps=1", f"cpu_affinity={choice}"])
    (ranks,) = run_jobs([cfg], tmp_path / "logs")
    cores = [r.rank_info.cpu_cores for r in ranks]
    if choice == "auto" and len(allowed) >= 2:
        assert cores == [[allowed[0]], [allowed[1]]]
    else:  # left to the OS: every rank may run anywhere it was allowed to
        assert cores == [allowed, allowed]
