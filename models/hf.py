"""`model=hf`: a transformers causal LM, from a config dict or a `save_pretrained` directory.

No network access, ever: a config is built with `AutoConfig.for_model(**model.config)`, a
directory is read with `local_files_only=True`. The model is built on the meta device like every
other; its decoder layers (the classes transformers lists in `_no_split_modules`) are the leaf
modules, so a stage boundary falls between layers. Fresh weights come from transformers' own
`_init_weights`, seeded by name; with `model.path` they are read from the directory's safetensors
files, each rank reading only its own stages' tensors (`load_by_name`).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from models.spec import ModelSpec, causal_lm_loss
from pipeline.core.errors import ConfigError


class CausalLM(nn.Module):
    """Token ids in, logits out: how the pipeline calls a transformers causal LM."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids, use_cache=False).logits


def transformers_init(root: nn.Module, module: nn.Module) -> None:
    """transformers' own per-module initialiser of the wrapped model."""
    root.model._init_weights(module)


def _config(config: dict | None, path: str | None):
    from transformers import AutoConfig

    if path is not None:
        directory = Path(path)
        if not (directory / "config.json").is_file():
            raise ConfigError("model.path", f"{path!r} is not a directory written by save_pretrained (no config.json)")
        return AutoConfig.from_pretrained(directory, local_files_only=True)
    if not config or "model_type" not in config:
        raise ConfigError("model.config", "needs at least `model_type` (e.g. +model.config.model_type=llama), or "
                                          "model.path=<a save_pretrained directory>; presets: model=hf_llama_tiny, "
                                          "model=hf_gpt2_tiny")
    try:
        return AutoConfig.for_model(**config)
    except (ValueError, KeyError, TypeError) as err:
        raise ConfigError("model.config", f"transformers cannot build a config from {config}: {err}") from None


def decoder_layers(model: nn.Module) -> list[str]:
    """Qualified names of the modules transformers never splits (its decoder layers)."""
    classes = set(getattr(model, "_no_split_modules", None) or ())
    return [name for name, m in model.named_modules() if type(m).__name__ in classes]


def hf(config: dict | None = None, path: str | None = None, seq_len: int = 128, name: str | None = None,
       leaf_modules: list[str] | None = None, dropout: bool = False, vocab_size: int | None = None) -> ModelSpec:
    """A transformers causal LM as a ModelSpec (see the module docstring). `dropout=False` sets the
    config's dropout probabilities to 0, so a pipeline and one process compute the same thing."""
    from transformers import AutoModelForCausalLM

    cfg = _config(dict(config) if config else None, path)
    as_given = copy.deepcopy(cfg)  # what an export writes back: dropout as the user's config has it
    if not dropout:
        for key, value in cfg.to_dict().items():
            if ("dropout" in key or key.endswith("_pdrop")) and isinstance(value, float):
                setattr(cfg, key, 0.0)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):  # ids outside a tiny vocabulary only warn
        value = getattr(cfg, key, None)
        if isinstance(value, int) and value >= cfg.vocab_size:
            setattr(cfg, key, None)
    if vocab_size is not None and int(vocab_size) != cfg.vocab_size:
        raise ConfigError("model.vocab_size", f"{vocab_size} differs from the model's own vocabulary of {cfg.vocab_size}"
                                              " (the data is drawn below model.vocab_size)")
    positions = getattr(cfg, "max_position_embeddings", getattr(cfg, "n_positions", None))
    if positions is not None and seq_len > positions:
        raise ConfigError("model.seq_len", f"{seq_len} exceeds the model's {positions} positions")

    def build() -> nn.Module:
        return CausalLM(AutoModelForCausalLM.from_config(cfg))

    if leaf_modules is None:
        with torch.device("meta"):
            leaf_modules = [f"model.{n}" for n in decoder_layers(AutoModelForCausalLM.from_config(cfg))]
    spec = ModelSpec(
        name=name or f"hf_{cfg.model_type}",
        build=build,
        loss_fn=causal_lm_loss,
        input_shape=(seq_len,),
        target_shape=(seq_len,),
        leaf_modules=leaf_modules,
        init=transformers_init,
        meta={"vocab_size": cfg.vocab_size, "seq_len": seq_len, "hf_model_type": cfg.model_type},
    )
    if path is not None:
        spec.load = SafetensorsDir(Path(path), prefix="model.")
    spec.save = partial(save_pretrained_dir, as_given)
    return spec


def save_pretrained_dir(config: Any, tensors: dict[str, torch.Tensor], directory: Path) -> None:
    """A directory `from_pretrained` reads: config.json and model.safetensors under transformers'
    own names (our `CausalLM` wrapper's `model.` dropped). A tied output embedding is stored once,
    under its owner's name, as transformers itself saves it."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(directory)
    save_file({k.removeprefix("model."): v.contiguous() for k, v in tensors.items()}, directory / "model.safetensors",
              metadata={"format": "pt"})


class SafetensorsDir:
    """Reads tensors by name from a `save_pretrained` directory, opening only the files that hold
    the names asked for and reading only those tensors (`safe_open`). `prefix` is what our module
    tree puts before the checkpoint's own names (the `CausalLM` wrapper's `model.`)."""

    def __init__(self, directory: Path, prefix: str = "") -> None:
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
        self.read: list[str] = []

    def keys(self) -> set[str]:
        return {self.prefix + k for k in self.file_of}

    def load(self, tensors: Iterable[tuple[str, torch.Tensor]], aliases: dict[str, str]) -> list[str]:
        """Copy each (name, real tensor) from the checkpoint; a name the checkpoint lacks is read
        under its tied alias (`aliases`: name -> the name it shares a tensor with). Returns the
        names found nowhere (left to the initialisers)."""
        from safetensors import safe_open

        by_file: dict[Path, list[tuple[str, str, torch.Tensor]]] = {}
        missing = []
        for name, t in tensors:
            key = next((k.removeprefix(self.prefix) for k in (name, *aliases.get(name, ()))
                        if k.startswith(self.prefix) and k.removeprefix(self.prefix) in self.file_of), None)
            if key is None:
                missing.append(name)
            else:
                by_file.setdefault(self.file_of[key], []).append((name, key, t))
        for path, items in by_file.items():
            with safe_open(path, "pt") as f:
                for _, key, t in items:
                    value: Any = f.get_tensor(key)
                    if tuple(value.shape) != tuple(t.shape):
                        raise ConfigError("model.path", f"{key} in {path.name} has shape {tuple(value.shape)}, the model "
                                                        f"expects {tuple(t.shape)}")
                    with torch.no_grad():
                        t.copy_(value)
                    self.read.append(key)
        return missing
