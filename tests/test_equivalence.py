"""The proof that a pipeline is right: same loss, gradients and weights as single-process training.

Real ranks (gloo on 127.0.0.1, free ports); each spawn runs every config of its world size.
"""

from __future__ import annotations

import pytest

from pipeline.reference import reference_run
from tests.harness import FAST, assert_state_close, compose_cfg, merge_state, run_jobs

SCHEDULES = ["gpipe", "1f1b"]


def _cases(world: int) -> list[tuple[str, int, int]]:
    return [(s, pp, dp) for s in SCHEDULES for pp in (1, 2, 4) for dp in (1, 2) if pp * dp == world]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_gradients_and_weights_match_single_process(world: int, tmp_path) -> None:
    cases = _cases(world)
    cfgs = [compose_cfg([*FAST, f"scheduler={s}", f"pp={pp}", f"dp={dp}", "microbatches=4"]) for s, pp, dp in cases]
    results = run_jobs(cfgs, tmp_path / "logs")
    for (sched, pp, dp), cfg, ranks in zip(cases, cfgs, results, strict=True):
        what = f"{sched} pp={pp} dp={dp}"
        ref = reference_run(cfg)
        losses = ranks[0]["losses"]
        assert losses == pytest.approx(ref["losses"], rel=1e-5), what
        for d in range(dp):
            assert_state_close(merge_state(ranks, "grads_step0", d), ref["grads_step0"], f"{what} replica {d} grads")
            assert_state_close(merge_state(ranks, "params_final", d), ref["params_final"], f"{what} replica {d} weights")
