"""Sharding under precision=bf16 (`runtime/sharding.py` `mixed_precision`): FSDP2 gathers and
computes with bf16 copies of the parameters and keeps fp32 shards, gradients and reductions. On
real gloo ranks (gloo all-gathers bf16) at pp=2 dp=2 it trains like one process under bf16
autocast, within bf16's rounding; the memory model prices the bf16 window (`Sharding.gathered`)."""

from __future__ import annotations

import pytest
import torch

from pipelaunch.launcher.validate import prepare
from pipelaunch.pipeline.planner.fit.budget import stage_param_factors
from pipelaunch.pipeline.planner.predict.memory import Sharding
from tests.harness import FAST, compose_cfg, merge_state, run_jobs
from tests.reference import reference_run

#: the split backward (I/W) and a V at zero=1; full recomputation and active clipping at zero=3
CASES = {"zbv zero=1": ["scheduler=zbv", "zero=1"],
         "zb_h1 zero=3 remat clip": ["scheduler=zb_h1", "zero=3", "remat=full", "clip_grad_norm=0.05"]}


def _relative(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """The largest per-tensor difference relative to the reference tensor's norm."""
    assert set(got) == set(ref)
    return max(float((got[n] - r).norm()) / max(float(r.norm()), 1e-12) for n, r in ref.items())


@pytest.mark.timeout(300)
def test_bf16_sharding_trains_like_one_process_under_bf16(tmp_path) -> None:
    """Losses within 1e-2 of one process's bf16 (seen: 4e-5), step 0's gradients and the final
    weights within 3e-2 of its own, relative to each tensor's norm (seen: 1.5e-2, a LayerNorm's
    small bias), all of them fp32: the master weights and the reduced gradients."""
    cfgs = [compose_cfg([*FAST, "pp=2", "dp=2", "precision=bf16", "steps=2", *args]) for args in CASES.values()]
    for what, cfg, ranks in zip(CASES, cfgs, run_jobs(cfgs, tmp_path / "logs"), strict=True):
        ref = reference_run(cfg)
        assert ranks[0].losses == pytest.approx(ref["losses"], rel=1e-2), what
        for d in range(cfg.dp):
            for key in ("grads_step0", "params_final"):
                got = merge_state(ranks, key, d)
                assert {t.dtype for t in got.values()} == {torch.float32}, (what, key)
                assert _relative(got, ref[key]) < 3e-2, (what, key, d)


def test_the_bf16_window_is_priced_in_the_compute_and_reduce_dtypes() -> None:
    """Per sharded byte of a stage: zero=3 holds bf16 parameters (0.5) and fp32 gradients for the
    reduce-scatter (1.0); zero=2 the fp32 gradients; zero=1 a micro-batch's bf16 gradients before
    they join the fp32 ones; at zero 2 and 3 also the kept fp32 reduce-scatter input (1.0, whatever
    the precision); nothing over one replica. The partitioners count the same."""
    assert [Sharding(z, 2, "bf16").gathered(1.0) for z in range(4)] == [0.0, 0.5, 1.0 + 1.0, 1.5 + 1.0]
    assert [Sharding(z, 2).gathered(1.0) for z in range(4)] == [0.0, 0.0, 1.0 + 1.0, 2.0 + 1.0]
    assert Sharding(3, 1, "bf16").gathered(1.0) == 0.0
    assert stage_param_factors(2, Sharding(3, 2, "bf16"))[0] == 0.5 + 0.5 + 1.0 + 2.5
    memory = {p: prepare(compose_cfg([*FAST, "pp=2", "dp=2", "zero=3", "mode=plan", f"precision={p}"]))
              .plan.meta.device_memory for p in ("fp32", "bf16")}
    for fp32, bf16 in zip(memory["fp32"], memory["bf16"], strict=True):
        # one stage per rank: 1.5 + 1 (bf16) against 2 + 1 (fp32) per sharded byte
        assert fp32.gathered > 0 and bf16.gathered == pytest.approx(2.5 / 3 * fp32.gathered)
        assert (bf16.params, bf16.grads, bf16.optimizer) == (fp32.params, fp32.grads, fp32.optimizer)
