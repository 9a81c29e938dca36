"""Sharding under precision=bf16 (`runtime/sharding.py` `mixed_precision`): FSDP2 gathers and
computes with bf16 copies of the parameters and keeps fp32 shards, gradients and reductions. On
real gloo ranks (gloo all-gathers bf16) at pp=2 dp=2 it trains like one process under bf16
autocast, within bf16's rounding; the memory model prices the bf16 window (`Sharding.gathered`)."""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn

from pipelaunch.launcher.validate import prepare
from pipelaunch.pipeline.graph.recompute import recompute_blocks
from pipelaunch.pipeline.graph.trace import _export_trace, retarget
from pipelaunch.pipeline.planner.fit.budget import stage_param_factors
from pipelaunch.pipeline.planner.predict.memory import Sharding
from pipelaunch.pipeline.runtime.tied_cast import CastOnUse
from tests.harness import FAST, compose_cfg, merge_state, run_jobs
from tests.reference import reference_run

#: transformers' GPT-2 from its config (export-traced, embeddings tied) on FAST's data and steps
HF_GPT2 = [*(a for a in FAST if not a.startswith("model.")), "model=hf_gpt2_tiny", "model.seq_len=16"]
#: the split backward (I/W) and a V at zero=1; full recomputation and active clipping at zero=3; a
#: tied embedding (kept out of FSDP2, fp32) feeding a sharded LayerNorm (bf16): at zero=2 with both
#: ends of the tie on one rank of the V, and in GPT-2 (its position embedding's `.to(device)` too)
CASES = {"zbv zero=1": [*FAST, "scheduler=zbv", "zero=1"],
         "zb_h1 zero=3 remat clip": [*FAST, "scheduler=zb_h1", "zero=3", "remat=full", "clip_grad_norm=0.05"],
         "zbv zero=2 tied": [*FAST, "scheduler=zbv", "zero=2", "+model.tie_embeddings=true"],
         "hf_gpt2_tiny 1f1b zero=3 tied": [*HF_GPT2, "scheduler=1f1b", "zero=3"]}


def _relative(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """The largest per-tensor difference relative to the reference tensor's norm, or to 1e-2 of the
    largest norm (about bf16's epsilon) for a tensor that is zero in exact arithmetic: a key bias's
    gradient (softmax ignores a shift shared by every key) is bf16 rounding noise, 1e-5 to 2e-4
    against a largest gradient of 0.6 to 3.8, whose relative difference means nothing."""
    assert set(got) == set(ref)
    floor = 1e-2 * max(float(r.norm()) for r in ref.values())
    return max(float((got[n] - r).norm()) / max(float(r.norm()), floor, 1e-12) for n, r in ref.items())


@pytest.mark.timeout(300)
def test_bf16_sharding_trains_like_one_process_under_bf16(tmp_path) -> None:
    """Losses within 1e-2 of one process's bf16 (seen: 4e-5; 1e-3 tied, whose embedding's lookup
    is bf16 here and fp32 there), step 0's gradients and the final weights within 3e-2 of its own,
    relative to each tensor's norm (seen: 1.6e-2, a LayerNorm's small bias), all of them fp32: the
    master weights and the reduced gradients."""
    cfgs = [compose_cfg([*args, "pp=2", "dp=2", "precision=bf16", "steps=2"]) for args in CASES.values()]
    for what, cfg, ranks in zip(CASES, cfgs, run_jobs(cfgs, tmp_path / "logs"), strict=True):
        ref = reference_run(cfg)
        assert ranks[0].losses == pytest.approx(ref["losses"], rel=1e-2), what
        for d in range(cfg.dp):
            for key in ("grads_step0", "params_final"):
                got = merge_state(ranks, key, d)
                assert {t.dtype for t in got.values()} == {torch.float32}, (what, key)
                assert _relative(got, ref[key]) < 3e-2, (what, key, d)


def test_the_bf16_window_is_priced_in_the_compute_and_reduce_dtypes() -> None:
    """For a stage of blocks of 4 and 2 bytes: zero=3 holds bf16 parameters (0.5 a byte: the block
    computing and the next) and a block's bf16 gradients, then their fp32 reduce-scatter input;
    zero=2 a block's bf16 gradients and their fp32 reduce-scatter input; zero=1 that input, in the
    last backward; nothing over one replica. The level's held states do not change with the
    precision; the partitioners count the same."""
    units = [([4.0, 2.0], 0.0)]
    assert [Sharding(z, 2, "bf16").gathered(units) for z in range(4)] == [0.0, 4.0, 2.0 + 4.0,
                                                                         0.5 * 6 + 0.5 * 4 + (4.0 - 2.0)]
    assert [Sharding(z, 2).gathered(units) for z in range(4)] == [0.0, 4.0, 4.0 + 4.0, 6.0 + 4.0]
    assert Sharding(3, 1, "bf16").gathered(units) == 0.0
    assert stage_param_factors(2, Sharding(3, 2, "bf16"))[0] == 0.5 + 0.5 + 1.0
    memory = {p: prepare(compose_cfg([*FAST, "pp=2", "dp=2", "zero=3", "mode=plan", f"precision={p}"]))
              .plan.meta.device_memory for p in ("fp32", "bf16")}
    for fp32, bf16 in zip(memory["fp32"], memory["bf16"], strict=True):
        assert 0 < bf16.gathered < fp32.gathered
        assert (bf16.params, bf16.grads, bf16.optimizer) == (fp32.params, fp32.grads, fp32.optimizer)


class _Front(nn.Module):
    """An embedding and the LayerNorm after it, one leaf module (as a checkpointed block is)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.ln = nn.Embedding(16, 8), nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(self.embed(x))


class _TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block0, self.head = _Front(), nn.Linear(8, 16, bias=False)  # block0: a block, numbered
        self.head.weight = self.block0.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block0(x))


class _FrontIsLeaf(fx.Tracer):
    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return isinstance(m, _Front) or super().is_leaf_module(m, qualname)


def _tied_stage(recompute: bool) -> fx.GraphModule:
    """A traced stage whose LayerNorm is bf16 (as FSDP2 gathers it) and whose tied embedding is not."""
    torch.manual_seed(0)
    root = _TiedLM()
    gm = fx.GraphModule(root, _FrontIsLeaf().trace(root))
    gm.block0.ln.to(torch.bfloat16)
    if recompute:
        recompute_blocks(gm, ["block0"])
    return gm


def test_a_tied_parameter_is_read_in_the_compute_dtype_also_when_recomputed() -> None:
    """CPU layer_norm refuses an fp32 input with bf16 weights under autocast; with `CastOnUse` the
    graph, and the checkpointed block rerunning alone in the backward, read the tied weight as
    bf16; its gradient reaches the fp32 parameter as fp32, the same with and without recomputation,
    and the modules hold the parameter itself again after each run."""
    x = torch.randint(0, 16, (2, 4))
    with pytest.raises(RuntimeError, match="mixed dtype"), torch.autocast("cpu", dtype=torch.bfloat16):
        _tied_stage(False)(x)
    grads = []
    for recompute in (False, True):
        gm = _tied_stage(recompute)
        tied = gm.head.weight
        CastOnUse(gm, [tied], torch.bfloat16)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = gm(x)
        assert out.dtype == torch.bfloat16 and gm.block0.embed.weight is tied and gm.head.weight is tied
        out.float().sum().backward()
        assert tied.grad is not None and tied.grad.dtype == torch.float32
        grads.append(tied.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)


class _ToDevice(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.to(x.device) * 2, x.to(torch.float32) * 2


def test_an_exported_to_device_keeps_its_values_dtype_after_retarget() -> None:
    """Export records `x.to(device)` with the dtype x had while tracing (fp32); retargeted, the
    graph's `.to(device)` keeps a bf16 value bf16 as the eager call does, while `.to(torch.float32)`
    still casts."""
    gm, _ = _export_trace(_ToDevice(), (torch.randn(3, device="meta"),))  # as the project traces
    retarget(gm, torch.device("cpu"))
    to_device = [n for n in gm.graph.nodes if n.target is torch.ops.aten.to.dtype_layout]
    assert to_device and all(n.kwargs["dtype"] is None for n in to_device)
    assert [n.args[1] for n in gm.graph.nodes if n.target is torch.ops.aten.to.dtype] == [torch.float32]
    moved, cast = gm(torch.randn(3).to(torch.bfloat16))
    assert (moved.dtype, cast.dtype) == (torch.bfloat16, torch.float32)
