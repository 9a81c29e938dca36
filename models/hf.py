"""`model=hf`: a transformers causal LM, from a config dict or a `save_pretrained` directory.

No network access, ever: a config is built with `AutoConfig.for_model(**model.config)`, a
directory is read with `local_files_only=True`. The model is built on the meta device like every
other; its decoder layers (the classes transformers lists in `_no_split_modules`) are the leaf
modules, so a stage boundary falls between layers. Fresh weights are transformers' own:
`torch.manual_seed(seed); AutoModelForCausalLM.from_config(config)`, built once on the CPU and read
by name (`launcher.initial_weights`), or for a model above `init.max_bytes` transformers'
`_init_weights` seeded by name; with `model.path` they are read from the directory's safetensors
files, each rank reading only its own stages' tensors (`load_by_name`). `model.loss=model` trains
with transformers' own loss, computed on the last stage: `model(ids, labels=ids).loss` (the
default, `model.labels=inputs`), or with `model.labels=targets` on the data's own next-token
targets, `model(ids, labels=t, shift_labels=t).loss`, so a fine-tuning mask (-100 on prompts and
padding, data=chat) reaches it. Either is transformers' mean over the micro-batch's scored labels,
which the runtime rescales by the micro-batch's share of the global batch's scored tokens
(`ModelSpec.scored`): exact, so the update is one process's on the whole batch.

Packed documents (`data.packing=documents`): the model is also given the data's per-token
`position_ids`, restarting at each document, and no attention mask: transformers' own packed path
(`masking_utils.find_packed_sequence_indices`) confines each token's attention to its document
in the sdpa, eager and flex_attention implementations (any device), and flash_attention_2/3 read
them as variable-length sequences (CUDA only); the rotary positions restart with them.
`PACKED_ATTENTION` lists them; another implementation is refused before any rank starts.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipelaunch.models.hf_moe import HFExperts, balance_by_bias
from pipelaunch.models.hf_moe import adopt as adopt_experts
from pipelaunch.models.spec import ModelSpec, causal_lm_loss, count_shifted, count_tokens, model_loss
from pipelaunch.pipeline.core import POSITION_IDS
from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.graph.context_parallel import local_length
from pipelaunch.pipeline.graph.materialize import to_meta_parameters
from pipelaunch.pipeline.graph.stamp import Repeated


@contextmanager
def causal_without_mask(packed: bool) -> Iterator[None]:
    """Inside, transformers builds no causal mask for sdpa under torch.export where it builds none
    eagerly: no padding, as many queries as keys, no sliding window (`masking_utils.
    _ignore_causal_mask_sdpa`), and, unless the data packs documents, one sequence per row (eagerly
    `find_packed_sequence_indices` reads the position ids and finds none; on export's fake tensors
    it cannot read them and assumes packing). The exported graph then calls sdpa with
    `is_causal=True`, as the eager model does. transformers refuses the skip while exporting because
    an exported graph may run at other query lengths; a pipeline's graph runs at the one shape it
    was traced at (every micro-batch at model.seq_len: transformers models refuse data.buckets).
    Without the mask, sdpa takes its fused causal kernel, and no [b, 1, t, t] tensor is built, held
    or sent. On packed documents the document mask is kept, built from the position ids by every
    stage that reads it (graph/derived.py)."""
    try:
        from transformers import masking_utils
    except ImportError:  # transformers before 4.53 builds its masks elsewhere: left as it is
        yield
        return
    saved = {name: getattr(masking_utils, name) for name in ("is_torchdynamo_exporting", "find_packed_sequence_indices")}
    masking_utils.is_torchdynamo_exporting = lambda: False
    if not packed:
        masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(masking_utils, name, value)


class CausalLM(nn.Module):
    """Token ids in, logits out: how the pipeline calls a transformers causal LM. With `own_loss`
    (`model.loss=model`), its own loss out: `model(ids, labels=ids).loss`, as transformers trains
    it (the labels are the inputs, which its loss shifts by one position itself)."""

    def __init__(self, model: nn.Module, own_loss: bool = False) -> None:
        super().__init__()
        self.model, self.own_loss = model, own_loss

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        with causal_without_mask(packed=False):
            if self.own_loss:
                return self.model(ids, labels=ids, use_cache=False).loss
            return self.model(ids, use_cache=False).logits


class CausalLMOnTargets(CausalLM):
    """`model.loss=model model.labels=targets`: transformers' own loss on the data's next-token
    targets, passed as `shift_labels` (already shifted; -100 unscored), so a prompt or padding
    mask reaches the loss unchanged and the last position is scored too."""

    def forward(self, ids: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        with causal_without_mask(packed=False):
            return self.model(ids, labels=target, shift_labels=target, use_cache=False).loss


class PackedCausalLM(CausalLM):
    """CausalLM on packed documents: the data's position ids to transformers' packed path."""

    def forward(self, ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        with causal_without_mask(packed=True):
            if self.own_loss:
                return self.model(ids, labels=ids, position_ids=position_ids, use_cache=False).loss
            return self.model(ids, position_ids=position_ids, use_cache=False).logits


class PackedCausalLMOnTargets(CausalLM):
    """CausalLMOnTargets on packed documents: the position ids too (the targets mask document ends)."""

    def forward(self, ids: torch.Tensor, target: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        with causal_without_mask(packed=True):
            return self.model(ids, labels=target, shift_labels=target, position_ids=position_ids, use_cache=False).loss


#: (packed documents, transformers' loss on the data's targets) -> how the pipeline calls the model
WRAPPERS = {(False, False): CausalLM, (False, True): CausalLMOnTargets, (True, False): PackedCausalLM,
            (True, True): PackedCausalLMOnTargets}

#: attention implementation -> the devices on which it keeps packed documents apart given position
#: ids alone (transformers 5.x: masking_utils builds a packed-sequence mask for sdpa, eager and
#: flex_attention; flash attention turns the position ids into cu_seqlens, on CUDA)
PACKED_ATTENTION = {"sdpa": ("cpu", "cuda"), "eager": ("cpu", "cuda"), "flex_attention": ("cpu", "cuda"),
                    "flash_attention_2": ("cuda",), "flash_attention_3": ("cuda",)}


def attention_implementation(config: Any) -> str:
    """The attention implementation a config asks for (transformers' default: sdpa)."""
    return str(getattr(config, "_attn_implementation", None) or "sdpa")


def takes_loss_kwargs(model: nn.Module) -> bool:
    """Whether the model's forward hands extra keywords to its loss (transformers' `**kwargs`
    reaching `loss_function`, where `shift_labels` and `num_items_in_batch` are read)."""
    import inspect

    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params) and hasattr(model, "loss_function")


def transformers_init(root: nn.Module, module: nn.Module) -> None:
    """transformers' own per-module initialiser of the wrapped model."""
    root.model._init_weights(module)


def _config(config: dict | None, path: str | None):
    from transformers import AutoConfig

    if path is not None:
        directory = Path(path)
        if not (directory / "config.json").is_file():
            raise ConfigError("model.path", f"{path!r} is not a directory written by save_pretrained (no config.json)")
        loaded = AutoConfig.from_pretrained(directory, local_files_only=True)
        if config:  # a preset's sizes with its weights: the directory must hold that model
            check_path_agrees(config, loaded, path)
        return loaded
    if not config or "model_type" not in config:
        raise ConfigError("model.config", "needs at least `model_type` (e.g. +model.config.model_type=llama), or "
                                          "model.path=<a save_pretrained directory>; presets: model=hf_llama_tiny, "
                                          "model=hf_gpt2_tiny")
    try:
        return AutoConfig.for_model(**config)
    except (ValueError, KeyError, TypeError) as err:
        raise ConfigError("model.config", f"transformers cannot build a config from {config}: {err}") from None


def check_path_agrees(config: dict, loaded: Any, path: str) -> None:
    """Refuse (on `model.path`) a directory whose config.json differs from the `model.config` a
    preset gives (`model=llama3_8b model.path=<dir>`). Why: the directory's config builds the model,
    so a directory of another model would otherwise train silently in the preset's place. Both are
    compared as transformers normalises them (`rope_theta` read into `rope_parameters`)."""
    from transformers import AutoConfig

    try:
        given = AutoConfig.for_model(**config).to_dict()
    except (ValueError, KeyError, TypeError) as err:
        raise ConfigError("model.config", f"transformers cannot build a config from {config}: {err}") from None
    stored = loaded.to_dict()
    keys = [k for k in config if k in given] + ["rope_parameters"] * ("rope_parameters" in given)
    differ = [f"{k}={stored.get(k)!r} where model.config.{k}={given[k]!r}" for k in dict.fromkeys(keys)
              if stored.get(k) != given[k]]
    if differ:
        raise ConfigError("model.path", f"{path}'s config.json is another model than model.config describes: "
                                        f"{'; '.join(differ[:4])}{' ...' if len(differ) > 4 else ''}; use the preset "
                                        "that matches the directory, or model=hf model.path=<dir> to take its config "
                                        "as it is")


def constructed(make) -> nn.Module:
    """`make()`; on the meta device under a fixed seed, with every parameter on the meta device.

    Why: on the meta device a constructor may still make a parameter with a factory the device
    context does not reach (DiffLlama's `nn.Parameter(torch.normal(0, std, size=...))` lands on the
    CPU, drawn from whatever the global generator holds). Left real, each rank would keep its own
    draw; on meta it gets its value by name like every other weight. Built for real (the initial
    weights, `torch.manual_seed(seed); build()`), the constructor runs as transformers runs it:
    under the caller's seed, untouched, so the weights equal `from_config`'s."""
    if torch.empty(0).device.type != "meta":
        return make()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = make()
    to_meta_parameters(model)
    return model


def no_dropout(config: Any) -> None:
    """Every dropout probability of a config and of its sub-configs (a multimodal model's text
    and vision configs) to 0."""
    for key, value in config.to_dict().items():
        if ("dropout" in key or key.endswith("_pdrop")) and isinstance(value, float):
            setattr(config, key, 0.0)
    for key in getattr(config, "sub_configs", None) or ():
        sub = getattr(config, key, None)
        if sub is not None and hasattr(sub, "to_dict"):
            no_dropout(sub)


def decoder_layers(model: nn.Module) -> list[str]:
    """Qualified names of the modules transformers never splits (its decoder layers)."""
    classes = set(getattr(model, "_no_split_modules", None) or ())
    return [name for name, m in model.named_modules() if type(m).__name__ in classes]


def repeated_layers(model: nn.Module, text: Any) -> Repeated | None:
    """Where the decoder layers are, for an export at full depth made from one at depths 2 and 3
    (`pipeline/graph/stamp.py`: an 80-layer export ~8 s, this ~1 s): the one ModuleList of
    `num_hidden_layers` modules, cut by shortening it and the config's count together. None where
    the config sets layers apart (a `layer_types` list of more than one kind: sliding and full
    attention) or no such list is found; the stamp itself checks the rest."""
    layers = getattr(text, "num_hidden_layers", None)
    per_layer = [v for v in vars(text).values() if isinstance(v, list) and len(v) == layers]
    if not isinstance(layers, int) or any(len({repr(x) for x in v}) > 1 for v in per_layer):
        return None
    found = [n for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) == layers]
    return Repeated(f"model.{found[0]}", partial(cut_layers, f"model.{found[0]}")) if len(found) == 1 else None


@contextmanager
def cut_layers(path: str, model: nn.Module, depth: int) -> Iterator[None]:
    """Inside, `model` (the wrapped transformers model) runs its first `depth` layers only: the
    ModuleList at `path` shortened (the same layer objects) and every config counting its layers
    told so (transformers' forward slices the layers by `config.num_hidden_layers`)."""
    owner, attr = path.rsplit(".", 1)
    parent = model.get_submodule(owner)
    layers = getattr(parent, attr)
    configs = {id(c): c for m in model.modules()
               if getattr(c := getattr(m, "config", None), "num_hidden_layers", None) == len(layers)}
    setattr(parent, attr, nn.ModuleList(list(layers)[:depth]))
    for config in configs.values():
        config.num_hidden_layers = depth
    try:
        yield
    finally:
        setattr(parent, attr, layers)
        for config in configs.values():
            config.num_hidden_layers = len(layers)


def default_tp_plan(model: nn.Module, own_loss: bool) -> dict[str, str]:
    """transformers' own tensor-parallel plan of the architecture (`base_model_tp_plan`: attention
    by heads, key/value heads included, the MLP by its width), the token embedding split by
    vocabulary, and the LM head by vocabulary too unless the model computes its own loss (its
    cross-entropy would read the split logits: the head is then replicated)."""
    base = getattr(model.config, "base_model_tp_plan", None) or {}
    prefix = f"model.{model.base_model_prefix}."
    plan = {prefix + pattern: ("colwise" if style.startswith("colwise") else "rowwise" if style.startswith("rowwise")
                               else style) for pattern, style in base.items()}
    if not plan:
        return {}
    embeddings = model.get_input_embeddings()
    plan.update({prefix + n: "vocab" for n, m in model.base_model.named_modules() if m is embeddings})
    if not own_loss:
        head = model.get_output_embeddings()
        plan.update({f"model.{n}": "vocab" for n, m in model.named_modules() if m is head})
    return plan


def hf(config: dict | None = None, path: str | None = None, seq_len: int = 128, name: str | None = None,
       leaf_modules: list[str] | None = None, dropout: bool = False, vocab_size: int | None = None,
       loss: str = "causal_lm", tp_plan: dict[str, str] | None = None, labels: str = "inputs",
       data_packing: str | None = None, bias_update_rate: float | None = None,
       context_parallel: int = 1) -> ModelSpec:
    """A transformers causal LM as a ModelSpec (see the module docstring). `dropout=False` sets the
    config's dropout probabilities to 0, so a pipeline and one process compute the same thing.
    `loss`: `causal_lm` (next-token cross-entropy on the logits, every position scored against the
    data's targets) or `model` (transformers' own loss; `labels`: `inputs`, the input ids shifted by
    transformers, or `targets`, the data's targets as `shift_labels`, masks kept). `tp_plan`: how tp >
    1 splits it, patterns on the wrapped model's names (`model.model.layers.*.mlp.up_proj`); null:
    transformers' own (`tp_plan` below). `data_packing=documents`: position ids too (module docstring).
    `bias_update_rate`: `moe.bias_update_rate`, a DeepSeek-V3 gate's (models/hf_moe.py).
    `context_parallel` (set by `cp`): the ranks a sequence is split over; the model is traced at
    1/cp of it and its attention made to cross them (`_context_parallel`)."""
    own_loss, on_targets = _loss_mode(loss, labels)

    cfg = _config(dict(config) if config else None, path)
    as_given = copy.deepcopy(cfg)  # what an export writes back: dropout as the user's config has it
    if not dropout:
        no_dropout(cfg)
    text = cfg.get_text_config()  # a multimodal model's vocabulary and positions are its text model's
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):  # ids outside a tiny vocabulary only warn
        value = getattr(cfg, key, None)
        if isinstance(value, int) and value >= text.vocab_size:
            setattr(cfg, key, None)
    if vocab_size is not None and int(vocab_size) != text.vocab_size:
        raise ConfigError("model.vocab_size", f"{vocab_size} differs from the model's own vocabulary of {text.vocab_size}"
                                              " (the data is drawn below model.vocab_size)")
    positions = getattr(text, "max_position_embeddings", getattr(text, "n_positions", None))
    if isinstance(positions, int) and 0 < positions < seq_len:
        raise ConfigError("model.seq_len", f"{seq_len} exceeds the model's {positions} positions")

    packed = (data_packing or "none") != "none"  # documents or stream: the data's position ids
    local = _context_parallel(cfg, context_parallel, seq_len, own_loss and not on_targets)

    def build() -> nn.Module:
        return WRAPPERS[packed, on_targets](transformers_model(cfg, bias_update_rate), own_loss)

    with torch.device("meta"):
        meta_model = transformers_model(cfg, bias_update_rate)
    if on_targets and not takes_loss_kwargs(meta_model):
        raise ConfigError("model.labels", f"{type(meta_model).__name__}.forward takes no keywords for its loss "
                                          "(shift_labels), so its own loss cannot be given the data's targets; use "
                                          "model.loss=causal_lm (pipelaunch scores the logits, token-weighted)")
    if leaf_modules is None:
        leaf_modules = [f"model.{n}" for n in decoder_layers(meta_model)]
    spec = ModelSpec(
        name=name or f"hf_{cfg.model_type}",
        build=build,
        loss_fn=model_loss if own_loss else causal_lm_loss,
        input_shape=(local,),
        target_shape=(local,),
        leaf_modules=leaf_modules,
        init=transformers_init,
        meta={"vocab_size": text.vocab_size, "seq_len": seq_len, "hf_model_type": cfg.model_type,
              "context_parallel": context_parallel, "cp_graph": context_parallel,
              "heads": getattr(text, "num_attention_heads", None),
              # transformers adds its routers' auxiliary loss to its own loss when the config says so
              "router_aux_loss": bool(getattr(text, "output_router_logits", False)),
              "attn_implementation": attention_implementation(cfg),
              "tp_divides": {f"model.config.{k}": getattr(text, k) for k in
                             ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size")
                             if isinstance(getattr(text, k, None), int)},
              **expert_meta(meta_model, text)},
        own_loss=own_loss, repeated=repeated_layers(meta_model, text),
        tp_plan=default_tp_plan(meta_model, own_loss) if tp_plan is None else dict(tp_plan),
        data_args=(("input", "target") if on_targets else ("input",)) + ((POSITION_IDS,) if packed else ()),
        scored=(count_tokens if on_targets else count_shifted) if own_loss else None,
        masked_refusal=("model.labels=inputs gives transformers' loss the input ids, which carry no mask: it would "
                        "score the prompt and the padding; set model.labels=targets (the data's targets, -100 "
                        "unscored, as shift_labels)") if own_loss and not on_targets else None,
    )
    if path is not None:
        spec.load = SafetensorsDir(Path(path), prefix="model.", model=meta_model)
        check_complete(meta_model, spec.load, path)
    uncomputed = uncomputed_buffers(meta_model, spec.load.keys() if spec.load is not None else set())
    spec.save = partial(save_pretrained_dir, as_given)
    spec.trace = partial(checked_trace, spec, uncomputed, not dropout)  # type: ignore[method-assign]
    return spec


def _loss_mode(loss: str, labels: str) -> tuple[bool, bool]:
    """(transformers' own loss, given the data's targets) as `model.loss` and `model.labels` ask."""
    if loss not in ("causal_lm", "model"):
        raise ConfigError("model.loss", f"got {loss!r}; valid: causal_lm (next-token cross-entropy on the logits), "
                                        "model (transformers' own loss, model(ids, labels=ids).loss)")
    if labels not in ("inputs", "targets"):
        raise ConfigError("model.labels", f"got {labels!r}; valid: inputs (model(ids, labels=ids): transformers "
                                          "shifts the ids itself), targets (the data's next-token targets as "
                                          "shift_labels, -100 unscored: fine-tuning masks)")
    return loss == "model", loss == "model" and labels == "targets"


def _context_parallel(config: Any, cp: int, seq_len: int, shifts_inputs: bool) -> int:
    """The positions a rank traces and runs under `cp` (1/cp of `seq_len`), refusing what a split
    sequence cannot run here: attention other than torch's sdpa (eager materialises the scores,
    flash attention's CUDA kernels take no cp group) and transformers' loss on the input ids (it
    shifts them by one position, across the rank's chunks). Packed documents are kept apart by the
    data's position ids, which replace transformers' document mask in the graph."""
    if cp == 1:
        return seq_len
    implementation = attention_implementation(config)
    if implementation != "sdpa":
        raise ConfigError("model.config.attn_implementation", f"{implementation} with cp={cp}: only sdpa attention "
                                                              "(transformers' default) is split over the cp ranks; "
                                                              "set +model.config.attn_implementation=sdpa, or cp=1")
    if shifts_inputs:
        raise ConfigError("model.labels", f"model.loss=model with model.labels=inputs and cp={cp}: transformers "
                                          "shifts the input ids by one position inside its loss, across the chunks "
                                          "each cp rank holds; set model.labels=targets (the data's targets), or "
                                          "model.loss=causal_lm")
    return local_length(seq_len, cp)


#: config keys transformers' MoE families count their routed experts by
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def transformers_model(config: Any, bias_update_rate: float | None = None) -> nn.Module:
    """`AutoModelForCausalLM.from_config(config)` (`constructed`), its routed experts modules made
    one call each, which ep > 1 hooks, and those beside a correction bias given `bias_update_rate`
    (models/hf_moe.py)."""
    from transformers import AutoModelForCausalLM

    model = constructed(lambda: AutoModelForCausalLM.from_config(config))
    adopt_experts(model)
    balance_by_bias(model, bias_update_rate)
    return model


def expert_meta(model: nn.Module, text: Any) -> dict[str, Any]:
    """What the launcher checks of a mixture of experts (`ModelSpec.meta`): whether transformers
    computes its auxiliary loss from every layer's router logits (`output_router_logits`); the
    routed experts of each MoE layer models/hf_moe.py hooks (`experts`, the count ep must divide;
    `moe_layers`, how many layers have them), or why a config counting experts has none it hooks
    (`experts_unsplit`)."""
    import math

    layers = [m for m in model.modules() if isinstance(m, HFExperts)]
    experts = [m.total for m in layers]
    meta: dict[str, Any] = {"output_router_logits": bool(getattr(text, "output_router_logits", False))}
    if experts:
        # what the runtime moves the gates' correction bias by (launcher/validate.py checks it)
        rates = {m.bias_update_rate for m in layers if m.bias_update_rate}
        return meta | {"experts": math.gcd(*experts), "moe_layers": len(experts), "expert_counts": sorted(set(experts)),
                       "bias_update_rate": rates.pop() if rates else None}
    counted = {k: v for k in EXPERT_KEYS if isinstance(v := getattr(text, k, None), int) and v > 1}
    if counted:
        key, value = next(iter(counted.items()))
        meta["experts_unsplit"] = (f"its {value} experts ({key}) are not a stacked experts module that transformers' "
                                   f"expert-parallel plan (base_model_ep_plan) dispatches tokens to ({text.model_type})")
    return meta


def checked_trace(spec: ModelSpec, uncomputed: set[str], deterministic: bool, micro_batch_size: int,
                  model: nn.Module | None = None, repeat: bool = False):
    """`ModelSpec.trace`, refusing what no rank could reproduce, before any rank starts: unless
    dropout was asked for, a training forward that draws random numbers (ranks draw from other
    generator states than one process, so no pipeline could train it exactly as transformers
    does). The buffers the traced forward reads that no initialiser computes (`uncomputed_buffers`)
    go to `spec.meta["uncomputed_buffers_read"]`: initialising by name would start them from zeros,
    which the launcher refuses (`launcher.initial_weights.choose`); the constructor's weights hold them."""
    from pipelaunch.pipeline.graph.trace import random_ops

    traced = ModelSpec.trace(spec, micro_batch_size, model, repeat)
    read = sorted(uncomputed & {n for n, _ in traced.gm.named_buffers(remove_duplicate=False)})
    spec.meta["uncomputed_buffers_read"] = [n.removeprefix("model.") for n in read]
    found = random_ops(traced.gm) if deterministic else []
    if found:
        ops = sorted({op for op, _ in found})
        where = sorted({m.removeprefix("model.") for _, m in found if m})
        raise ConfigError("model", f"model={spec.name} draws random numbers in its training forward ({', '.join(ops)} "
                                   f"in {', '.join(where[:3]) or 'its forward'}{' ...' if len(where) > 3 else ''}), "
                                   "beyond dropout: a pipeline's ranks draw from other generator states than one "
                                   "process, so it could not train as transformers does. Turn the sampling off in "
                                   "the model's config if it has a switch (router jitter or sampling), or set "
                                   "+model.dropout=true to accept a run that differs from one process")
    return traced


def uncomputed_buffers(model: nn.Module, stored: set[str]) -> set[str]:
    """Buffers (our names) the constructor computes on the meta device, so without a value, that
    neither transformers' own initialiser computes again nor the checkpoint (`stored`) holds: a
    rank would start them from the generic fallback (zeros). transformers recomputes the buffers
    it knows (rotary `inv_freq`...) in `_init_weights`, as its own `from_pretrained` needs."""
    from pipelaunch.pipeline.graph.init import uncovered_tensors

    buffers = {f"model.{n}" for n, t in model.named_buffers() if t.device.type == "meta"} - stored
    return buffers & set(uncovered_tensors(CausalLM(model), transformers_init)) if buffers else set()


def check_complete(model: nn.Module, load: SafetensorsDir, path: str) -> None:
    """Refuse a checkpoint that lacks a tensor the model keeps in its state dict: the run would
    start that tensor from its initialiser, where `from_pretrained` draws its own random values,
    so the two would differ from step 0. (A tied tensor stored once under another name is there.)"""
    held = load.keys()
    names: dict[int, list[str]] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        names.setdefault(id(t), []).append(f"model.{name}")
    lacking = [ns[0].removeprefix("model.") for ns in names.values() if not any(n in held for n in ns)]
    if lacking:
        raise ConfigError("model.path", f"{path} lacks {len(lacking)} tensor(s) the model holds "
                                        f"({', '.join(lacking[:6])}{' ...' if len(lacking) > 6 else ''}), read through "
                                        "transformers' own checkpoint conversions; from_pretrained would start them "
                                        "from random values this run cannot reproduce. Save the model with "
                                        "save_pretrained (all its weights), or train from the config instead "
                                        "(model.config=..., no model.path)")


def save_pretrained_dir(config: Any, tensors: dict[str, torch.Tensor], directory: Path) -> None:
    """A directory `from_pretrained` reads, written by transformers' own `save_pretrained`: the
    trained tensors (our `CausalLM` wrapper's `model.` dropped) are put into a model built on the
    meta device, so the files hold exactly what transformers saves for it: its checkpoint names
    and layouts (Mixtral's experts one matrix each), a tied output embedding once."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    own = {k.removeprefix("model."): v for k, v in tensors.items()}
    model.load_state_dict(own, strict=False, assign=True)
    model.tie_weights()
    lacking = [n for n, t in model.state_dict().items() if t.device.type == "meta"]
    if lacking:
        raise ConfigError("checkpoint", f"the checkpoint lacks {', '.join(lacking[:6])} of the model; nothing written")
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


class SafetensorsDir:
    """Reads tensors by name from a `save_pretrained` directory, opening only the files that hold
    the names asked for and reading only those tensors (`safe_open`). `prefix` is what our module
    tree puts before the checkpoint's own names (the `CausalLM` wrapper's `model.`).

    Why a map and not the names as they are: transformers saves many architectures under older
    names and layouts than its modules have (GPT-NeoX's `embed_out` is `lm_head`; Mixtral's experts
    are stored one matrix each, the module holds them stacked) and converts them when it loads.
    Given the model (on the meta device), the checkpoint's names go through transformers' own
    conversions (`CheckpointMap`), so each module tensor is read from the stored tensors it comes
    from, converted as `from_pretrained` converts it."""

    #: pretrained values: the split check gives the unsplit reference these very tensors
    checkpoint = True

    def __init__(self, directory: Path, prefix: str = "", model: nn.Module | None = None) -> None:
        self.directory, self.prefix = directory, prefix
        index = directory / "model.safetensors.index.json"
        if index.is_file():
            self.file_of = {k: directory / v for k, v in json.loads(index.read_text())["weight_map"].items()}
        else:
            single = directory / "model.safetensors"
            if not single.is_file():
                raise ConfigError("model.path", f"{directory} holds no model.safetensors (or its index); save the "
                                                "model with save_pretrained(..., safe_serialization=True)")
            from safetensors import safe_open

            with safe_open(single, "pt") as f:
                self.file_of = {k: single for k in f.keys()}  # noqa: SIM118 - safe_open has keys(), not iteration
        self.map = CheckpointMap(model, self._shapes()) if model is not None else None
        self.read: list[str] = []

    def _shapes(self) -> dict[str, torch.Tensor]:
        """Every stored tensor as a meta tensor of its shape and dtype (read from the headers only)."""
        from safetensors import safe_open

        out = {}
        for path in dict.fromkeys(self.file_of.values()):
            with safe_open(path, "pt") as f:
                for key in f.keys():  # noqa: SIM118
                    view = f.get_slice(key)
                    out[key] = torch.empty(view.get_shape(), dtype=_DTYPES.get(view.get_dtype(), torch.float32),
                                           device="meta")
        return out

    def keys(self) -> set[str]:
        """The model's own names (with `prefix`) this checkpoint holds a value for."""
        names = self.map.targets if self.map is not None else self.file_of
        return {self.prefix + k for k in names}

    def _get(self, key: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(self.file_of[key], "pt") as f:
            self.read.append(key)
            return f.get_tensor(key)

    def load(self, tensors: Iterable[tuple[str, torch.Tensor]], aliases: dict[str, str]) -> list[str]:
        """Copy each (name, real tensor) from the checkpoint; a name the checkpoint lacks is read
        under its tied alias (`aliases`: name -> the names it shares a tensor with). Returns the
        names found nowhere (left to the initialisers)."""
        known = self.keys()
        missing, wanted = [], {}
        for name, t in tensors:
            key = next((k.removeprefix(self.prefix) for k in (name, *aliases.get(name, ())) if k in known), None)
            if key is None:
                missing.append(name)
            else:
                wanted[key] = t
        values = self.map.read(wanted, self._get) if self.map is not None else {k: self._get(k) for k in wanted}
        for key, t in wanted.items():
            value: Any = values[key]
            if tuple(value.shape) != tuple(t.shape):
                raise ConfigError("model.path", f"{key} in {self.directory} has shape {tuple(value.shape)}, the model "
                                                f"expects {tuple(t.shape)}")
            with torch.no_grad():
                t.copy_(value)
        return missing


class CheckpointMap:
    """How each of a transformers model's tensors comes from a checkpoint's stored tensors:
    transformers' own renamings and converters (`conversion_mapping.get_model_conversion_mapping`,
    applied by name as `from_pretrained` applies them). Each group of stored tensors that one
    converter turns into module tensors is converted once on the meta device here, so the names
    and shapes it yields are known before anything is read."""

    def __init__(self, model: nn.Module, stored: dict[str, torch.Tensor]) -> None:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            dot_natural_key,
            rename_source_key,
        )

        self.model = model
        meta = model.state_dict()
        transforms = get_model_conversion_mapping(model)
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        self.converter_of = {p: c for c in converters for p in c.source_patterns}
        #: first target name -> [(stored key, converter source pattern or None)]
        self.groups: dict[str, list[tuple[str, str | None]]] = {}
        for key in sorted(stored, key=dot_natural_key):
            target, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, meta)
            if target not in meta and key in meta:
                target, pattern = key, None
            if target in meta:
                self.groups.setdefault(target, []).append((key, pattern))
        self.targets: dict[str, str] = {}  # module tensor name -> its group
        for first, members in self.groups.items():
            for name in self._convert(first, members, stored.__getitem__):
                self.targets[name] = first

    def _convert(self, first: str, members: list[tuple[str, str | None]], get) -> dict[str, torch.Tensor]:
        pattern = members[0][1]
        if pattern is None:
            return {first: get(members[0][0])}
        converter = copy.deepcopy(self.converter_of[pattern])
        for key, pat in members:
            converter.add_tensor(first, key, pat, get(key))
        out = converter.convert(first, model=self.model, config=self.model.config)
        return {k: v[0] if isinstance(v, list) else v for k, v in out.items()}

    def read(self, wanted: Iterable[str], get) -> dict[str, torch.Tensor]:
        """The module tensors named in `wanted`, each read (`get(stored key)`) and converted once per group."""
        out: dict[str, torch.Tensor] = {}
        for first in dict.fromkeys(self.targets[n] for n in wanted):
            out.update(self._convert(first, self.groups[first], get))
        return {n: out[n] for n in wanted}
