"""Context parallelism (`cp`, #57) on models written without it: transformers' Llama (`model=hf`,
grouped-query attention, rotary positions) and nanoGPT's model.py as written (`model=module`,
learned positions, tied embeddings, its own loss). Their traced graphs' attention and position
calls are retargeted (pipeline/graph/context_parallel.py); on real gloo ranks they train like one
process running the author's model on the same micro-batches whole (losses, step 0's gradients,
the final weights within 1e-5)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from pipelaunch.launcher.validate import prepare
from pipelaunch.pipeline.core.errors import ConfigError
from tests.harness import assert_state_close, compose_cfg, merge_state, run_jobs
from tests.reference import reference_run
from tests.test_own_loss import _nanogpt_script

COMMON = ["data=synthetic", "batch_size=8", "steps=2", "warmup_steps=0", "optimizer=sgd", "timeout_s=90",
          "threads=1", "microbatches=4", "model.seq_len=16"]
LLAMA = [*COMMON, "model=hf_llama_tiny"]
NANOGPT = [*COMMON, "model=module", "model.module._target_=tests.zoo.nanogpt", "model.vocab_size=64",
           "model.loss=model"]


@pytest.mark.timeout(600)
def test_transformers_llama_and_nanogpt_train_as_one_process_under_context_parallelism(tmp_path) -> None:
    """Llama at pp=2 cp=2 under 1f1b (the ring moving its 2 key/value heads) and ZBV (all-to-all
    over its 4 query and 2 key/value heads; the backward split); nanoGPT at pp=2 cp=2 (its position table read at the rank's global positions,
    its tied embedding on both stages, its own token-mean loss weighted by the tokens each rank
    scores); transformers' DeepSeek-V3 at pp=2 cp=2 (values of another head size than the keys,
    padded as they travel the ring; its experts routing each rank's positions)."""
    cases = [("llama pp=2 cp=2 1f1b ring", compose_cfg([*LLAMA, "pp=2", "cp=2", "scheduler=1f1b"])),
             ("llama pp=2 cp=2 zbv alltoall", compose_cfg([*LLAMA, "pp=2", "cp=2", "scheduler=zbv",
                                                           "cp_method=alltoall"])),
             ("nanogpt pp=2 cp=2 1f1b ring", compose_cfg([*NANOGPT, "pp=2", "cp=2", "scheduler=1f1b"])),
             # DeepSeek-V3's attention (MLA: keys of 24, values of 16 per head) and its routed experts
             ("deepseek-v3 pp=2 cp=2 1f1b ring", compose_cfg([*COMMON, "model=hf_deepseek_v3_tiny", "pp=2", "cp=2",
                                                             "scheduler=1f1b"]))]
    runs = dict(zip([what for what, _ in cases], run_jobs([cfg for _, cfg in cases], tmp_path / "logs"), strict=True))
    for what, cfg in cases:
        ranks = runs[what]
        if what.startswith("nanogpt"):  # the author's own loop, its own loss (tests/test_own_loss.py)
            expected = _nanogpt_script(cfg)
            assert ranks[0].losses == pytest.approx(expected["losses"], rel=1e-5), what
            got = {n.removeprefix("inner."): p for n, p in merge_state(ranks, "params_final").items()}
            assert_state_close(got, expected["params"], f"{what} weights")
            continue
        ref = reference_run(cfg)
        assert ranks[0].losses == pytest.approx(ref["losses"], rel=1e-5), what
        for d in range(cfg.dp):
            assert_state_close(merge_state(ranks, "grads_step0", d), ref["grads_step0"], f"{what} {d} grads")
            assert_state_close(merge_state(ranks, "params_final", d), ref["params_final"], f"{what} {d} weights")
    # the collective log: per attention and micro-batch one rotation of the keys and values
    # forward (cp - 1), one backward and cp = 2 of their gradients; nothing else on the cp group
    m, layers = 4, 2  # 4 decoder layers over 2 stages
    for what in ("llama pp=2 cp=2 1f1b ring", "nanogpt pp=2 cp=2 1f1b ring"):
        for rank in runs[what]:
            log = Counter(e.split(" to ")[0] for e in rank.extras["cp_log"])
            assert log == {"ring kv": m * layers, "ring kv backward": m * layers,
                           "ring dkv backward": 2 * m * layers}, (what, log)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_transformers_mixtures_of_experts_train_as_one_process_under_context_parallelism(tmp_path) -> None:
    """Mixtral at pp=2 cp=2 and Qwen3-MoE at pp=1 dp=2 ep=2 cp=2 (its experts' gradients summed
    over their expert replicas and the cp ranks), and Llama at pp=1 dp=2 cp=2 zero=3 (sharded over
    dp x cp; model=gpt's is in the default suite: tests/test_context_parallel.py)."""
    from tests.harness import check_like_one_process

    check_like_one_process([
        ("llama pp=1 dp=2 cp=2 zero=3", compose_cfg([*LLAMA, "pp=1", "dp=2", "cp=2", "zero=3", "scheduler=1f1b"])),
        ("mixtral pp=2 cp=2", compose_cfg([*COMMON, "model=hf_mixtral_tiny", "pp=2", "cp=2", "scheduler=1f1b"])),
        ("qwen3-moe dp=2 ep=2 cp=2", compose_cfg([*COMMON, "model=hf_qwen3_moe_tiny", "pp=1", "dp=2", "ep=2", "cp=2",
                                                  "scheduler=1f1b"]))], tmp_path)


def test_the_trace_is_retargeted_at_one_ranks_length() -> None:
    """The graph is traced at 1/cp of the positions; its two attention calls and the one arange
    making transformers' cache positions are retargeted, nothing else."""
    from pipelaunch.pipeline.compute import context_parallel as cp

    spec = prepare(compose_cfg([*LLAMA, "pp=2", "cp=2"]), profile=False).spec
    assert spec.input_shape == (8,)
    gm = spec.trace(2).gm
    targets = Counter(n.target for n in gm.graph.nodes if n.op == "call_function")
    assert targets[cp.sdpa] == 4 and targets[cp.arange] == 1, targets


@pytest.mark.parametrize(("overrides", "key", "words"), [
    ([*LLAMA, "+model.config.attn_implementation=eager"], "model.config.attn_implementation", "only sdpa"),
    ([*LLAMA, "model.loss=model"], "model.labels", "set model.labels=targets"),
    ([*COMMON, "model=hf_mixtral_tiny", "+model.config.output_router_logits=true", "model.loss=model",
      "model.labels=targets"], "model.loss", "auxiliary loss over one cp rank's tokens"),
    ([*COMMON, "model=module", "model.module._target_=tests.zoo.sequential", "model.vocab_size=64"], "cp",
     "calls no scaled_dot_product_attention"),
    ([*COMMON, "model=module", "model.module._target_=tests.test_context_parallel_models.MaskedAttention",
      "model.vocab_size=64"], "cp", "is given a mask"),
    ([*COMMON, "model=module", "model.module._target_=tests.test_context_parallel_models.EagerAttention",
      "model.vocab_size=64"], "cp", "computes attention its own way"),
])
def test_refused_before_spawn(overrides: list[str], key: str, words: str) -> None:
    with pytest.raises(ConfigError) as err:
        prepare(compose_cfg([*overrides, "pp=1", "cp=2"]), profile=False)
    assert err.value.key == key and words in str(err.value), str(err.value)


def test_packed_documents_replace_the_models_mask_in_its_graph() -> None:
    """Under packing, transformers builds a document mask from the position ids and hands it to
    sdpa: in the cp graph each attention takes the position ids instead (the mask's nodes gone)."""
    from pipelaunch.models.hf import hf
    from pipelaunch.pipeline.compute import context_parallel as cp

    spec = hf(config={"model_type": "llama", "hidden_size": 32, "num_attention_heads": 2, "num_hidden_layers": 2,
                      "intermediate_size": 64, "vocab_size": 64}, seq_len=16, data_packing="documents",
              context_parallel=2)
    traced = spec.trace(2)
    calls = [n for n in traced.gm.graph.nodes if n.target is cp.sdpa]
    assert len(calls) == 2 and all(n.kwargs["position_ids"].op == "placeholder" and len(n.args) == 3 for n in calls)
    assert set(traced.graph.nodes) == {n.name for n in traced.gm.graph.nodes if n.op in ("call_function",
                                                                                          "call_module", "call_method")}


class _TinyAttention(torch.nn.Module):
    """A token model of one attention, computed by `attend(q, k, v)` (its subclasses: what cp
    cannot split)."""

    def __init__(self, vocab_size: int = 64, dim: int = 16) -> None:
        super().__init__()
        self.embed, self.qkv = torch.nn.Embedding(vocab_size, dim), torch.nn.Linear(dim, 3 * dim)
        self.head = torch.nn.Linear(dim, vocab_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.embed(ids)).chunk(3, dim=-1)
        return self.head(self.attend(q, k, v))


class MaskedAttention(_TinyAttention):
    """Attention given a causal mask it builds at the rank's length (cp cannot split it)."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        t = q.shape[1]
        mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
        return torch.nn.functional.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None], attn_mask=mask)[:, 0]


class EagerAttention(_TinyAttention):
    """Attention scores materialised by the model itself (cp cannot split them)."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.softmax(q @ k.transpose(-1, -2) / 4.0, dim=-1) @ v
