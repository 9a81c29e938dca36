"""Every causal LM transformers ships, built tiny and trained through the pipeline against
transformers' own forward and backward (issue #25).

    python -m tests.hf_sweep                       # the sweep, a table on stdout
    python -m tests.hf_sweep llama mixtral         # some architectures only
    python -m tests.hf_sweep --write-docs          # regenerate docs/transformers.md

For each entry of `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`: a tiny config (`tiny_config`: few layers,
small hidden size, heads and key-value heads that divide it, a small vocabulary, the
architecture's own fields kept), a model built on the CPU by transformers and written with
`save_pretrained`; then `model=hf model.path=<dir>` is validated and planned by the launcher
(`pipelaunch.launcher.validate.prepare`, where an architecture the pipeline cannot reproduce is refused) and
every rank's stages are built in this process exactly as a rank builds them
(`pipelaunch.pipeline.runtime.stage.build_stage_modules`: a fresh meta model, cut, only its own stages
materialised, weights read by name). The stages run one after the other; first loss, every
gradient and the weights after three SGD steps must equal transformers' own model trained on the
same micro-batches (1e-5 relative).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import re
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

SEQ_LEN = 16
BATCH = 8
MICROBATCHES = 4  # micro-batches of 2: pp=4 under 1f1b needs 4
STEPS = 3
LR = 0.01  # at 0.1 a tiny model moves its weights by tens of percent a step: rounding noise grows past 1e-5
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, VOCAB, LAYERS = 64, 4, 2, 16, 128, 256, 4
SPECIAL_IDS = 16  # the model's vocabulary is VOCAB + SPECIAL_IDS: pad, image... ids the data never draws
EXPERTS, TOP_K = 4, 2
POSITIONS = 64
WINDOW = 8  # below SEQ_LEN, so a sliding window really masks something

LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers")
HIDDEN_KEYS = ("hidden_size", "n_embd", "d_model")
HEAD_KEYS = ("num_attention_heads", "n_head", "n_heads", "num_heads", "decoder_attention_heads")
KV_KEYS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "num_query_groups")
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
TOPK_KEYS = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k", "top_k")
POSITION_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "max_target_positions")
WINDOW_KEYS = ("sliding_window", "sliding_window_size", "attention_window_size")
PERIOD = re.compile(r"(period|pattern|every_n|interval|_step)$")
SMALL_DIM = re.compile(r"(intermediate|ffn|inner|lora_rank|_head_dim|head_size|_dim|_rank)")


def _first(d: dict, keys: tuple[str, ...]) -> Any:
    return next((d[k] for k in keys if isinstance(d.get(k), int) and not isinstance(d.get(k), bool)), None)


def _shrink_list(values: list, layers: int) -> list:
    """A per-layer list cut to `layers` entries, keeping every distinct kind it had (a hybrid's
    attention layer, a sliding/full pattern's full layer) in its last entries."""
    out = list(values[:layers])
    plain = all(isinstance(v, str | int | float | bool) for v in values)
    missing = [v for v in dict.fromkeys(values) if v not in out] if plain else []
    for i, v in enumerate(missing[: max(layers - 1, 0)]):
        out[-(i + 1)] = v
    return out


def _shrink_layer_map(v: dict, layers: int) -> dict:
    """A {layer index: settings} map cut to the first `layers` layers; when none of its layers is
    left, its first entry moves to the last layer (the variant stays in the model)."""
    kept = {k: x for k, x in v.items() if int(k) < layers}
    if not kept:
        first = next(iter(v))
        kept = {type(first)(layers - 1): v[first]}
    return kept


def shrink(d: dict, layers: int = LAYERS) -> dict:
    """Overrides that make the config `d` (a `to_dict()`) tiny, by the meaning of its keys and by
    equality with its own sizes (any key equal to its hidden size becomes the tiny hidden size)."""
    out: dict[str, Any] = {}
    n_layers, hidden, heads = _first(d, LAYER_KEYS), _first(d, HIDDEN_KEYS), _first(d, HEAD_KEYS)
    kv, inter, vocab = _first(d, KV_KEYS), d.get("intermediate_size"), d.get("vocab_size")
    experts, topk = _first(d, EXPERT_KEYS), _first(d, TOPK_KEYS)
    for key, v in d.items():
        if isinstance(v, dict) and v and all(str(k).isdigit() for k in v):
            out[key] = _shrink_layer_map(v, layers)
            continue
        if isinstance(v, dict) and key.endswith(("_config", "config")):
            out[key] = {**v, **shrink(v, layers)}
            continue
        if isinstance(v, list) and n_layers and len(v) == n_layers and n_layers > layers:
            out[key] = _shrink_list(v, layers)
            continue
        if key.endswith(("token_id", "token_index")):
            if isinstance(v, int) and v >= VOCAB:  # a special id: above the ids the data draws
                out[key] = VOCAB + len([k for k in out if k.endswith(("token_id", "token_index"))])
            continue
        if v is None and key in ("head_dim", *KV_KEYS, *TOPK_KEYS, "n_group", "topk_group"):
            # left unset by the default config, where the model's code needs a number (None ** -0.5)
            out[key] = HEAD_DIM if key == "head_dim" else KV_HEADS if key in KV_KEYS else TOP_K if key in TOPK_KEYS else 1
            continue
        if not isinstance(v, int) or isinstance(v, bool):
            continue
        new = _tiny_value(key, v, n_layers, hidden, heads, kv, inter, vocab, experts, topk, layers)
        if new is not None and new != v:
            out[key] = new
    return out


def _tiny_value(key: str, v: int, n_layers, hidden, heads, kv, inter, vocab, experts, topk, layers) -> int | None:
    """The tiny value of one integer config field, or None to keep it."""
    if key in LAYER_KEYS or (n_layers and v == n_layers and v > layers and "layer" in key):
        return min(v, layers)
    if key in HIDDEN_KEYS or (hidden and v == hidden and v > HIDDEN):
        return HIDDEN
    if key in HEAD_KEYS or key in ("linear_num_heads", "linear_num_key_heads", "linear_num_value_heads"):
        return min(v, HEADS)
    if key in KV_KEYS:
        return HEADS if kv is not None and heads is not None and v >= heads else min(v, KV_HEADS)
    if key in ("head_dim", "attention_head_dim", "v_head_dim", "qk_rope_head_dim", "qk_nope_head_dim",
               "linear_head_dim", "linear_key_head_dim", "linear_value_head_dim"):
        return HEAD_DIM
    if key == "rotary_dim":
        return HEAD_DIM // 2  # partial rotary, as the architecture's default has it
    if key == "vocab_size" or (vocab and v == vocab and v > VOCAB):
        return VOCAB + SPECIAL_IDS
    if key in EXPERT_KEYS:
        return min(v, EXPERTS)
    if key in TOPK_KEYS:
        return min(v, TOP_K)
    if key in ("n_group", "num_expert_group", "topk_group", "n_shared_experts", "num_shared_experts"):
        return min(v, 1)
    if key in POSITION_KEYS or key == "original_max_position_embeddings":
        return max(min(v, POSITIONS), SEQ_LEN)
    if key.endswith("chunk_size") and v > SEQ_LEN:  # a scan padded to 256 positions would dwarf the model
        return SEQ_LEN // 2
    if key in WINDOW_KEYS:
        return min(v, WINDOW)
    if key in ("first_k_dense_replace", "num_dense_layers", "moe_layer_start_index"):
        return min(v, 1)
    if PERIOD.search(key) and v > 2:
        return 2
    if key.endswith("_offset") and v > 1:
        return 1
    if inter and v == inter:
        return INTERMEDIATE
    if SMALL_DIM.search(key) and v > 2 * HIDDEN:
        return HIDDEN // 2 if "head" in key or "rank" in key else INTERMEDIATE
    return None


def tiny_config(model_type: str, layers: int = LAYERS, extra: dict | None = None):
    """A tiny config of `model_type`: its defaults with the sizes shrunk (`shrink`), then `extra`."""
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type).to_dict()
    return AutoConfig.for_model(model_type, **{**shrink(default, layers), **(extra or {})})


def is_decoder_only(model_type: str, config) -> str | None:
    """None for a decoder-only causal LM, else why it is skipped (an encoder or an encoder-decoder
    whose decoder transformers also lists as a causal LM)."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
        MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES,
    )

    if getattr(config, "is_encoder_decoder", False) or model_type in MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES \
            or model_type in MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES:
        return "encoder-decoder (its decoder with cross-attention)"
    if model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return "encoder (a masked LM run as a decoder)"
    return None


def no_dropout(config) -> None:
    """Every dropout probability of the config (and its sub-configs) to 0: the comparison is exact."""
    for key, value in config.to_dict().items():
        if ("dropout" in key or key.endswith("_pdrop")) and isinstance(value, float):
            setattr(config, key, 0.0)
    for key in config.sub_configs if hasattr(config, "sub_configs") else ():
        sub = getattr(config, key, None)
        if sub is not None and hasattr(sub, "to_dict"):
            no_dropout(sub)


def batches(steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global batches of every step: ids below VOCAB (never a special id), the next ids as targets."""
    gen = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ_LEN + 1), generator=gen)
        out.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    return out


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


@dataclass
class Trained:
    """First loss, first-step gradients and final weights of a run, by the wrapper's names (`model.` + HF's)."""

    loss: float
    grads: dict[str, torch.Tensor]
    weights: dict[str, torch.Tensor]
    losses: list[float] = field(default_factory=list)


def _train(params: dict[str, list[torch.Tensor]], forward, data) -> Trained:
    """SGD over micro-batches; `params` maps each name to the tensors holding it (copies on several
    ranks), whose gradients are summed and which step together, as the runtime's shared grads do."""
    distinct = {id(t): t for ts in params.values() for t in ts}
    opt = torch.optim.SGD(list(distinct.values()), lr=LR)
    losses, grads = [], {}
    for step, (ids, targets) in enumerate(data):
        losses.append(0.0)
        for x, y in zip(ids.chunk(MICROBATCHES), targets.chunk(MICROBATCHES), strict=True):
            loss = lm_loss(forward(x), y) / MICROBATCHES
            loss.backward()
            losses[-1] += float(loss.detach())
        for ts in params.values():
            held = list({id(t): t for t in ts}.values())
            if any(t.grad is not None for t in held):
                total = sum((t.grad if t.grad is not None else torch.zeros_like(t)) for t in held)
                for t in held:
                    t.grad = total.clone()
        if step == 0:
            grads = {n: ts[0].grad.detach().clone() for n, ts in params.items() if ts[0].grad is not None}
        opt.step()
        opt.zero_grad(set_to_none=True)
    return Trained(losses[0], grads, {n: ts[0].detach().clone() for n, ts in params.items()}, losses)


def reference(model: torch.nn.Module, data) -> Trained:
    """transformers' own model, forward and backward, trained on the same micro-batches."""
    model = copy.deepcopy(model).train()
    params = {f"model.{n}": [p] for n, p in model.named_parameters() if p.requires_grad}
    return _train(params, lambda x: model(x, use_cache=False).logits, data)


def overrides(directory: Path, pp: int) -> list[str]:
    return ["model=hf", f"model.path={directory}", f"model.seq_len={SEQ_LEN}", f"model.vocab_size={VOCAB + SPECIAL_IDS}",
            "data=synthetic", f"pp={pp}", "dp=1", "scheduler=1f1b", "partitioner=uniform", f"batch_size={BATCH}",
            f"microbatches={MICROBATCHES}", f"steps={STEPS}", "warmup_steps=0", "optimizer=sgd", f"optimizer.lr={LR}",
            "threads=1", "timeout_s=120"]


@contextlib.contextmanager
def traced_once():
    """`ModelSpec.trace` traces each (model, micro-batch size) once and hands out deep copies.

    Why this is what a rank does: tracing is deterministic (every rank and the planner derive the
    same graph), and a rank's stage modules get their real tensors by name from the model it
    materialises (`materialize(..., also=stages)`), never from the traced copy. An export trace of
    a transformers model takes seconds; the sweep would trace each architecture ten times."""
    from pipelaunch.models.spec import ModelSpec

    original, cache = ModelSpec.trace, {}

    def trace(self, micro_batch_size, model=None, repeat=False):
        key = (self.name, repr(self.load.directory if self.load is not None else None), micro_batch_size, repeat)
        if key not in cache:  # the planner's export made from a cut model's (repeat), the ranks' whole
            cache[key] = original(self, micro_batch_size, repeat=repeat)
        return copy.deepcopy(cache[key])

    ModelSpec.trace = trace
    try:
        yield
    finally:
        ModelSpec.trace = original


def pipeline(directory: Path, pp: int, data) -> Trained:
    """Every rank's stages built as a rank builds them (`build_stage_modules`: fresh meta model,
    only its stages materialised, from the file of the constructor's weights the launcher writes,
    then the checkpoint's weights read by name), run in order in this process, as the launcher's
    split check builds and runs them (`pipelaunch.launcher.split_compare`)."""
    from hydra.utils import instantiate

    from pipelaunch.launcher.initial_weights import launcher_initial_weights
    from pipelaunch.launcher.split_compare import every_stage, stage_parameters
    from pipelaunch.launcher.validate import prepare
    from pipelaunch.pipeline.graph.split import run_in_order
    from tests.harness import compose_cfg

    cfg = compose_cfg(overrides(directory, pp))
    prepared = prepare(cfg)
    spec = instantiate(cfg.model)
    with launcher_initial_weights(cfg, spec, prepared.model) as initial:  # the constructor's non-persistent buffers
        split, mods = every_stage(spec, prepared.plan, cfg.seed, initial_weights=initial.path)
    params = {n: [p for p in ts if p.requires_grad] for n, ts in stage_parameters(mods).items()}
    return _train({n: ts for n, ts in params.items() if ts}, lambda x: run_in_order(split, x, stages=mods), data)


def worst(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The largest relative difference over tensors (`pipelaunch.launcher.split_compare.relative_differences`:
    relative to its own norm, or to 1e-4 of the largest norm for a tensor that is zero in exact
    arithmetic), and its name."""
    from pipelaunch.launcher.split_compare import relative_differences

    if set(got) != set(ref):
        return float("inf"), f"names differ: {sorted(set(got) ^ set(ref))[:4]}"  # inf: "differs by" below
    rels = relative_differences(got, ref)
    name = max(rels, key=rels.get, default="")
    return rels.get(name, 0.0), name


TOLERANCE = 1e-5


@dataclass
class Result:
    """What the sweep found for one architecture. `status`: exact (at every pp in `exact_at`),
    refused (the launcher said why, before training), skipped (not a decoder), unbuilt
    (transformers itself cannot build or run it from the tiny config), wrong (accepted and not
    equal: a bug), error (accepted, then failed: a bug too)."""

    model_type: str
    status: str
    reason: str = ""
    exact_at: list[int] = field(default_factory=list)
    layers: int = 0
    detail: dict = field(default_factory=dict)
    seconds: float = 0.0


def build(model_type: str, layers: int = LAYERS, extra: dict | None = None):
    """transformers' own model from the tiny config, dropout off, seeded; or the reason it cannot be built."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type, layers, extra)
    no_dropout(config)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).train()
    with torch.no_grad():
        model(batches(1)[0][0][:2], use_cache=False)  # transformers runs it at all
    return config, model


def reloaded(model: torch.nn.Module, directory: str) -> None:
    """`save_pretrained` into `directory`; transformers' own `from_pretrained` must give back every
    tensor (else transformers cannot round-trip its own model, and there is nothing to compare to)."""
    from transformers import AutoModelForCausalLM

    model.save_pretrained(directory)
    again = AutoModelForCausalLM.from_pretrained(directory)
    theirs = dict(again.state_dict())
    for name, t in model.state_dict().items():
        if name not in theirs or not torch.equal(theirs[name], t):
            raise ValueError(f"from_pretrained gives {name} another value than the model saved")


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:240] if text else ''}"


def check(model_type: str, pps: tuple[int, ...] = (1, 2, 4), extra: dict | None = None) -> Result:
    """One architecture through the comparison at each pp (pp=4 only with 4 or more layers);
    `extra`: config fields set on top of the tiny config (e.g. {"rotary_pct": 0.5})."""
    start = time.monotonic()
    try:
        skip = is_decoder_only(model_type, tiny_config(model_type, extra=extra))
        if skip is not None:
            return Result(model_type, "skipped", skip, seconds=time.monotonic() - start)
        config, model = build(model_type, extra=extra)
    except Exception as err:  # noqa: BLE001 - any failure of transformers itself is "cannot build"
        return Result(model_type, "unbuilt", _first_line(err), seconds=time.monotonic() - start)
    from pipelaunch.pipeline.core.errors import ConfigError

    data = batches()
    text = config.get_text_config()
    layers = getattr(text, "num_hidden_layers", None) or _first(text.to_dict(), LAYER_KEYS) or 0
    result = Result(model_type, "exact", layers=layers)
    with tempfile.TemporaryDirectory() as tmp, traced_once():
        try:
            reloaded(model, tmp)
        except Exception as err:  # noqa: BLE001 - transformers cannot save or reload its own model
            result.status, result.reason = "unbuilt", f"save_pretrained/from_pretrained: {_first_line(err)}"
            result.seconds = time.monotonic() - start
            return result
        ref = reference(model, data)
        for pp in pps:
            if pp > max(layers, 1) and pp > 1:
                continue
            try:
                got = pipeline(Path(tmp), pp, data)
            except ConfigError as err:
                result.status, result.reason = "refused", str(err)
                break
            except Exception as err:  # noqa: BLE001 - accepted, then failed: recorded as a bug
                result.status, result.reason = "error", f"pp={pp}: {_first_line(err)}"
                result.detail["traceback"] = traceback.format_exc()[-3000:]
                break
            bad = _differs(got, ref)
            if bad:
                result.status, result.reason = "wrong", f"pp={pp}: {bad}"
                break
            result.exact_at.append(pp)
    result.seconds = time.monotonic() - start
    return result


def _differs(got: Trained, ref: Trained) -> str:
    """Empty when loss, gradients and final weights are within TOLERANCE; else what differs."""
    if abs(got.loss - ref.loss) > TOLERANCE * abs(ref.loss):
        return f"first loss {got.loss:.6f}, transformers {ref.loss:.6f}"
    unused = set(ref.weights) - set(ref.grads)  # tensors the forward never reads: a stage need not hold them
    weights = {n: t for n, t in ref.weights.items() if n not in unused or n in got.weights}
    for what, g, r in (("gradient", got.grads, ref.grads), ("weights after 3 steps", got.weights, weights)):
        rel, name = worst(g, r)
        if rel > TOLERANCE:
            return f"{what} of {name} differs by {rel:.2e} (relative)"
    return ""


def architectures() -> list[str]:
    """Every entry of transformers' causal-LM mapping."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


@contextlib.contextmanager
def quiet():
    """transformers' and torch's warnings and progress bars off; one thread (the machine is shared)."""
    from transformers.utils import logging as hf_logging

    threads, verbosity = torch.get_num_threads(), hf_logging.get_verbosity()
    torch.set_num_threads(1)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        torch.set_num_threads(threads)
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()


DOCS = Path(__file__).resolve().parents[1] / "docs" / "transformers.md"
STATUS_WORDS = {"exact": "trains exactly", "refused": "refused", "skipped": "skipped", "unbuilt": "not built",
                "wrong": "WRONG", "error": "ERROR"}


def summary(results: list[Result]) -> dict[str, int]:
    """The counts the README and the docs state."""
    decoders = [r for r in results if r.status in ("exact", "refused", "wrong", "error")]
    return {"entries": len(results), "built": len([r for r in results if r.status != "unbuilt"]),
            "decoders": len(decoders), "exact_pp2": len([r for r in decoders if 2 in r.exact_at]),
            "exact_pp4": len([r for r in decoders if 4 in r.exact_at]),
            "refused": len([r for r in results if r.status == "refused"]),
            "skipped": len([r for r in results if r.status == "skipped"]),
            "unbuilt": len([r for r in results if r.status == "unbuilt"]),
            "wrong": len([r for r in results if r.status in ("wrong", "error")])}


#: what docs/transformers.md says after the table (written by hand): mixtures of experts under ep
DOCS_MOE = """\
## Mixtures of experts: expert parallelism (`ep`)

The MoE families above train at `ep=1` as any other. At `ep > 1` each rank of an ep group holds `experts / ep` whole, consecutive experts of every MoE layer, and the tokens reach them by the same dropless all-to-all as `model=gpt`'s (`pipeline/runtime/experts.py`). That works for the families whose experts transformers' own expert-parallel plan dispatches tokens to (`base_model_ep_plan`, style `ep_dispatch_experts`, e.g. `layers.*.mlp.experts`) and holds as one stacked module (`@use_experts_implementation`: every parameter `[num_experts, ...]`, called as `experts(hidden_states, top_k_index, top_k_weights)`). `tests/test_hf_moe.py` trains these on real gloo ranks exactly like transformers' model in one process (losses, step 0's gradients and the final weights of every replica within 1e-5):

| family | preset | what it adds | layouts trained |
|---|---|---|---|
| Mixtral | `model=hf_mixtral_tiny` | softmax top-2, renormalised | pp=2 dp=2 ep=2 1f1b; the same with transformers' loss and its aux loss |
| Qwen2-MoE | `model=hf_qwen2_moe_tiny` | a sigmoid-gated shared expert, top-k not renormalised | pp=2 dp=2 ep=2 zbv |
| Qwen3-MoE | `model=hf_qwen3_moe_tiny` | QK norm, top-k renormalised | pp=1 dp=4 ep=4 zero=1 |
| OLMoE | `model=hf_olmoe_tiny` | QK norm | pp=1 dp=4 ep=2 (two copies of each expert) |
| DeepSeek-V3 | `model=hf_deepseek_v3_tiny` | multi-head latent attention, a dense first layer, a shared expert, sigmoid scores plus the correction bias, group-limited top-k, scaled | pp=2 dp=2 ep=2 dualpipev |

    python train.py model=hf_mixtral_tiny pp=2 dp=2 ep=2
    python train.py model=hf_deepseek_v3_tiny pp=2 dp=2 ep=2 scheduler=dualpipev microbatches=4

In transformers 5.24, 52 causal LMs hold their experts that way (GLM-4-MoE, Qwen3.5-MoE, Ernie-4.5-MoE, GraniteMoE, MiniMax, DeepSeek-V2, gpt-oss, Jamba, ...). For each of the 50 that build from a tiny config, the same test checks that an experts module split in two computes what transformers' forward computes on the whole module, gradients included; beyond the five above, none is trained at `ep > 1` on real ranks here. A config that counts experts but holds them otherwise (JetMoE, Llama 4) trains at `ep=1` and is refused at `ep > 1` before any rank starts, as are `ep` not dividing the routed experts (the valid values listed) and `ep > 1` on a model without experts.

How ep reaches transformers' experts (`models/hf_moe.py`). Each such module's class is swapped in place for a subclass of it: the same parameters, names and `isinstance` checks, and outside ep transformers' own forward. Under torch.export it is one opaque call, turned back into a call of the module itself once the graph is made (`ModelSpec.trace`), so a stage runs transformers' expert code eagerly where the runtime can hook it; the router stays in the exported graph, so each model routes as it does (softmax top-k, DeepSeek-V3's grouped sigmoid). Under ep the module keeps its rank's experts (transformers' `num_experts` set to the local count, so its code indexes them by local id), and each (token, expert) row travels with its routing weight as one more column; the receiving rank runs transformers' own forward on its rows, one expert per row at the row's own weight, so the activation and the weighting (inside the experts, as transformers does it) are the model's own, and the weighted rows come back to be summed per token in slot order, as transformers' `grouped_mm` sums them. The experts' gradients are summed over their replicas, checkpoints hold every expert whole (an ep=2 checkpoint resumes without ep), and `python -m pipelaunch.launcher.export` writes transformers' own layout. `mode=plan` prices it as for `model=gpt`: one ep rank's experts, a balanced routing, each layer's all-to-alls on the ep link. Router statistics (`expert_load`, the progress line) count each experts module's picks.

The auxiliary loss. With `model.config.output_router_logits=true` (off by default in these families; DeepSeek-V3 has none) transformers computes its load-balancing loss at the top of the model from every layer's router logits and adds it to its own loss when given labels. Under `model.loss=model` that trains exactly under pp, dp and ep: the layers' router logits cross the stage boundaries to the last stage like any other value, and each micro-batch's loss is transformers' on that micro-batch, as one process accumulating the same micro-batches computes it (so it depends on the micro-batch size, as there). Under `model.loss=causal_lm` the pipeline scores the logits alone, and the aux loss would be computed and dropped: that is refused before spawn, naming `model.config.output_router_logits`.

Not done: ep with tp > 1, and zero with ep < dp (refused, as for `model=gpt`); experts split by tensor parallelism (transformers' `packed_colwise` and `moe_tp_experts` styles are refused by the tp plan; a plan leaving the experts whole trains); fused dispatch kernels (`experts_implementation=deepgemm_megamoe`); an update of DeepSeek-V3's correction bias between steps (a buffer, left as transformers' own training leaves it). The exchanges read the token counts on the host (one stream sync per layer on a GPU), and the rows travel in the wider of the hidden states' and the routing weights' dtypes (fp32 routing weights: fp32 rows under `precision=bf16` too). Exactness is tested in fp32 on CPU.
"""


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")[:400]


def docs_table(results: list[Result]) -> str:
    """docs/transformers.md: one row per architecture, with what was measured and on which versions."""
    import transformers

    n = summary(results)
    lines = [
        "# transformers causal LMs through the pipeline",
        "",
        f"Generated by `tests/hf_sweep.py` (its `--write-docs` option; transformers {transformers.__version__}, "
        f"torch {torch.__version__.split('+')[0]}); do not edit by hand.",
        "",
        f"Every entry of transformers' `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` ({n['entries']}) is built from a tiny "
        f"config ({LAYERS} layers, hidden size {HIDDEN}, {HEADS} heads and {KV_HEADS} key-value heads where it has "
        f"them, a vocabulary of {VOCAB} + {SPECIAL_IDS} special ids, the architecture's own fields kept), saved with "
        "`save_pretrained` and run as `model=hf model.path=<dir>`: the launcher validates and plans it, every rank's "
        "stages are built as a rank builds them (only its own stages, weights read by name), and the first loss, "
        f"every gradient and the weights after {STEPS} SGD steps (lr {LR}, {MICROBATCHES} micro-batches of "
        f"{BATCH // MICROBATCHES} x {SEQ_LEN} tokens) must equal transformers' own forward and backward on the same "
        f"weights and batches within {TOLERANCE:g} (relative), at pp 1, 2 and 4 (4 needs 4 layers). "
        "`tests/test_hf_sweep.py` runs it: a dozen in the default suite (two of them on real ranks, exported "
        "by `pipelaunch.launcher.export` and reloaded by `from_pretrained`), all of them in the slow suite.",
        "",
        f"**{n['exact_pp2']} of the {n['decoders']} decoder-only causal LMs transformers builds from a tiny config "
        f"train exactly at pp=2** ({n['exact_pp4']} at pp=4 too); {n['refused']} are refused before training, "
        f"with the reason; {n['skipped']} are skipped (encoders, encoder-decoders); {n['unbuilt']} could not be "
        f"built, saved and reloaded by transformers itself from a tiny config; {n['wrong']} accepted and wrong.",
        "",
        "Mixtures of experts under expert parallelism (`ep`): the section after the table.",
        "",
        "| architecture | result | exact at pp | why (refused, skipped, not built) |",
        "|---|---|---|---|",
    ]
    for r in sorted(results, key=lambda r: r.model_type):
        pps = "/".join(map(str, r.exact_at)) if r.status == "exact" else ""
        lines.append(f"| `{r.model_type}` | {STATUS_WORDS[r.status]} | {pps} | {_cell(r.reason)} |")
    return "\n".join(lines) + "\n\n" + DOCS_MOE


def load_results(path: Path) -> list[Result]:
    """Results appended by `--json` (the last line per architecture wins)."""
    import json

    by_name: dict[str, Result] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        by_name[row["model_type"]] = Result(**{k: v for k, v in row.items() if k != "traceback"})
    return list(by_name.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.hf_sweep", description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="model types (default: every causal LM transformers ships)")
    parser.add_argument("--json", type=Path, help="append each result as a JSON line to this file")
    parser.add_argument("--from-json", type=Path, help="no sweep: read the results --json wrote")
    parser.add_argument("--write-docs", action="store_true", help=f"write {DOCS.relative_to(DOCS.parents[1])}")
    args = parser.parse_args(argv)
    import json

    results = load_results(args.from_json) if args.from_json else []
    for name in [] if args.from_json else (args.names or architectures()):
        with quiet():
            r = check(name)
        results.append(r)
        print(f"{r.model_type:28s} {r.status:8s} {r.exact_at} {r.seconds:5.1f}s {r.reason[:150]}", flush=True)
        if args.json:
            with args.json.open("a") as f:
                f.write(json.dumps({k: v for k, v in vars(r).items() if k != "detail"} | {
                    "traceback": r.detail.get("traceback", "")}) + "\n")
    print(summary(results))
    if args.write_docs:
        DOCS.write_text(docs_table(results))
        print(f"wrote {DOCS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
