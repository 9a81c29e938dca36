"""Sharded data parallel (`zero>=1`) on models nobody here wrote: transformers causal LMs built from
a config (no hub), their input and output embeddings tied, so the tied weight is read by both
stages and kept whole beside FSDP2's shards. At pp=2 dp=2 on real gloo ranks in NCCL-semantics
mode they train like one process running the author's own `torch.manual_seed(seed); factory()`.
diffusers' UNet2DModel (skips across stages) is in the slow suite. (The same models at zero=0:
tests/test_bring_your_own.py; bf16 with a tied embedding: tests/test_zero_bf16.py.)"""

from __future__ import annotations

import pytest

from pipelaunch.launcher.validate import prepare
from tests.harness import check_like_one_process, compose_cfg
from tests.test_bring_your_own import UNET

COMMON = ["data=synthetic", "batch_size=16", "steps=2", "warmup_steps=0", "optimizer=sgd", "timeout_s=90",
          "threads=1", "microbatches=4", "model.seq_len=16", "pp=2", "dp=2"]
#: GPT-2 ties its embeddings by default; Llama does when its config says so
CASES = {
    "hf_gpt2_tiny 1f1b zero=3": ["model=hf_gpt2_tiny", "scheduler=1f1b", "zero=3"],
    "hf_llama_tiny tied interleaved_1f1b zero=1": ["model=hf_llama_tiny", "+model.config.tie_word_embeddings=true",
                                                   "scheduler=interleaved_1f1b", "zero=1"],
}


@pytest.mark.timeout(600)
def test_transformers_models_with_tied_embeddings_train_like_one_process_under_sharding(tmp_path) -> None:
    """Losses, step 0's gradients and the final weights of both replicas within 1e-5 of one process,
    the tied embedding held by two stages on two pipeline ranks (whole on each)."""
    cases = [(what, compose_cfg([*COMMON, *args])) for what, args in CASES.items()]
    for what, cfg in cases:
        plan = prepare(cfg, profile=False).plan
        assert any(len({plan.stages[s].rank for s in stages}) == 2 for stages in plan.shared_params.values()), \
            (what, plan.shared_params)
    check_like_one_process(cases, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_diffusers_unet_trains_like_one_process_under_sharding(tmp_path) -> None:
    """diffusers' UNet2DModel, its skips crossing stages, at zero=3 on a V and zero=1 under 1f1b."""
    common = [*(a for a in COMMON if not a.startswith("model.")), *UNET]
    cases = [(f"unet2d {sched} zero={zero}", compose_cfg([*common, f"scheduler={sched}", f"zero={zero}"]))
             for sched, zero in (("zbv", 3), ("1f1b", 1))]
    check_like_one_process(cases, tmp_path)
