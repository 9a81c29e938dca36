"""`model=module`: any callable that returns an `nn.Module`, pipelined as it is.

    python train.py model=module model.module._target_=mymodel.tiny_lm model.seq_len=64 \
        data=tokens data.path=train.bin
    python train.py model=module model.module._target_=diffusers.UNet2DModel \
        +model.module.sample_size=32 ... 'model.input.shape=[3,32,32]' model.input.dtype=float32 \
        model.output=sample 'model.extra_inputs=[10]' model.loss=mse

The module is built on the meta device like every model (its factory must not load weights
itself); `output` picks an attribute or key of what it returns (`logits`, `sample`), and
`extra_inputs` are constant positional arguments after the data: a value (a diffusion timestep),
or a tensor described by a mapping (`extra_tensor`: a text encoder's states for a conditioned
UNet, a class label), the same for every sample of a batch. Buffers the module's constructor
computes (a rotary `inv_freq`, a sin-cos position table) reach every rank by name, as the
constructor computes them (`pipelaunch.pipeline.graph.buffers.ConstructorBuffers`).

On token data (`data.kind: tokens`, which module.yaml passes as `data_kind`) the defaults are a
language model's: input `[seq_len]` int64 ids, loss `causal_lm`; elsewhere float32 input and
`cross_entropy`. What still disagrees with the data is refused in `pipelaunch.launcher.validate.check_data`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, ListConfig, OmegaConf
from torch import nn

from pipelaunch.models.spec import ModelSpec, causal_lm_loss
from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.graph.buffers import ConstructorBuffers

LOSSES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "cross_entropy": nn.functional.cross_entropy,
    "causal_lm": causal_lm_loss,
    "mse": nn.functional.mse_loss,
}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "long": torch.long,
          "int64": torch.long, "int32": torch.int32}


class Adapted(nn.Module):
    """The user's module, called with the data plus constant extra inputs, its output picked. A
    tensor extra input is a non-persistent buffer `extra_<position>` (one sample's), expanded to
    the batch on each call."""

    def __init__(self, inner: nn.Module, output: str | None, extra_inputs: Sequence[Any]) -> None:
        super().__init__()
        self.inner, self.output = inner, output
        self.extra_inputs: tuple[Any, ...] = tuple(extra_inputs)
        for i, item in enumerate(self.extra_inputs):
            if isinstance(item, Mapping):
                self.register_buffer(f"extra_{i}", extra_tensor(item, i), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        args = []
        for i, item in enumerate(self.extra_inputs):
            if isinstance(item, Mapping):
                value = getattr(self, f"extra_{i}")
                args.append(value.expand(x.shape[0], *value.shape))
            else:
                args.append(item)
        out = self.inner(x, *args)
        if self.output is None:
            return out
        return out[self.output] if isinstance(out, dict) and self.output in out else getattr(out, self.output)


EXTRA_KEYS = ("shape", "dtype", "fill", "seed")


def extra_tensor(item: Mapping, index: int) -> torch.Tensor:
    """One sample's tensor extra input, `{shape: [...], dtype: float32, fill: null, seed: 0}`: `fill`
    everywhere, or else drawn from N(0, 1) with `seed` (a float dtype). Made on the CPU and put on
    the device being built on (meta, where the rank then reads the value by name)."""
    key = f"model.extra_inputs[{index}]"
    unknown = sorted(set(item) - set(EXTRA_KEYS))
    shape = item.get("shape")
    if unknown or not isinstance(shape, Sequence) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise ConfigError(key, f"got {dict(item)}; a tensor input is {{shape: [sizes of one sample], dtype: float32, "
                               "fill: <a number, or null: N(0,1) values>, seed: 0}, e.g. {shape:[4,16]}")
    dtype = _dtype(str(item.get("dtype") or "float32"), f"{key}.dtype")
    fill = item.get("fill")
    if fill is None and not dtype.is_floating_point:
        raise ConfigError(f"{key}.fill", f"is null for a {dtype} tensor; random values are float: give a fill value")
    if fill is not None:
        value = torch.full(tuple(shape), fill, dtype=dtype, device="cpu")
    else:
        gen = torch.Generator().manual_seed(int(item.get("seed") or 0))
        value = torch.randn(tuple(shape), generator=gen, device="cpu").to(dtype)
    return value.to(torch.get_default_device())


def _family_init(root: nn.Module, module: nn.Module) -> None:
    """The wrapped module's own per-module initialiser (transformers', nanoGPT's `_init_weights`)."""
    root.inner._init_weights(module)


def _whole_init(root: nn.Module) -> None:
    """The wrapped module's own model-wide initialiser (torchtitan's and timm's `init_weights()`)."""
    root.inner.init_weights()


def initialisers(inner: nn.Module) -> tuple[Callable | None, Callable | None]:
    """(per-module, model-wide) initialisers by name of a module: a model-wide `init_weights()` that
    takes no argument (torchtitan's convention; timm's) wins, except on a transformers model, whose
    `_init_weights(module)` is the family's documented one."""
    import inspect

    whole = getattr(inner, "init_weights", None)
    per_module = getattr(inner, "_init_weights", None)
    takes_none = False
    if callable(whole):
        try:
            takes_none = all(p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
                             for p in inspect.signature(whole).parameters.values())
        except (TypeError, ValueError):
            takes_none = False
    transformers_model = any(c.__module__.startswith("transformers.") and c.__name__ == "PreTrainedModel"
                             for c in type(inner).__mro__)
    if takes_none and not (transformers_model and callable(per_module)):
        return None, _whole_init
    return (_family_init if callable(per_module) else None), None


def _dtype(value: str, key: str) -> torch.dtype:
    if value not in DTYPES:
        raise ConfigError(key, f"got {value!r}; valid: {', '.join(DTYPES)}")
    return DTYPES[value]


def _loss(loss: str | dict) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    if isinstance(loss, str):
        if loss not in LOSSES:
            raise ConfigError("model.loss", f"got {loss!r}; valid: {', '.join(LOSSES)} or a `_target_` callable")
        return LOSSES[loss]
    try:
        return instantiate(loss)
    except Exception as err:  # noqa: BLE001 - any failure to build the loss is a config error
        raise ConfigError("model.loss", f"could not build {loss.get('_target_')}: {err}") from None


def _input(input: dict | None, seq_len: int | None, tokens: bool) -> tuple[tuple[int, ...], torch.dtype]:  # noqa: A002
    """One sample's shape and dtype: on token data `[seq_len]` int64 unless given."""
    input = dict(input or {})  # noqa: A001
    dtype = _dtype(str(input.get("dtype") or ("int64" if tokens else "float32")), "model.input.dtype")
    shape = input.get("shape")
    if shape is None:
        if seq_len is None:
            if tokens or not dtype.is_floating_point:
                raise ConfigError("model.seq_len", "is unset: token data is cut into windows of model.seq_len ids; "
                                                   "set model.seq_len=<tokens per sample>, e.g. model.seq_len=64")
            raise ConfigError("model.input.shape", "is unset: give one sample's shape, e.g. 'model.input.shape=[3,32,32]'")
        shape = [seq_len]
    return tuple(int(d) for d in shape), dtype


def _target(loss: str | dict, in_shape: tuple[int, ...], in_dtype: torch.dtype) -> dict:
    """What the loss scores, by default: mse the input's shape, causal_lm (or any loss on token
    input but cross_entropy) a token per input position, cross_entropy one label."""
    if loss == "mse":
        return {"shape": list(in_shape), "dtype": "float32"}
    if loss == "causal_lm" or (not isinstance(loss, str) and not in_dtype.is_floating_point):
        return {"shape": list(in_shape), "dtype": "long"}
    return {"shape": [], "dtype": "long"}


def module(
    module: dict,
    input: dict | None = None,  # noqa: A002 - the config key users write
    target: dict | None = None,
    output: str | None = None,
    extra_inputs: Sequence[Any] = (),
    loss: str | dict | None = None,
    leaf_modules: Sequence[str] = (),
    name: str = "module",
    vocab_size: int | None = None,
    num_classes: int | None = None,
    seq_len: int | None = None,
    data_kind: str | None = None,
) -> ModelSpec:
    """A ModelSpec around `instantiate(module)` (see the module docstring). `input`/`target`:
    `{shape: [...], dtype: ...}` of one sample (shape null: `[seq_len]`; dtype null: int64 on
    token data, else float32); `loss` null: causal_lm on integer input, else cross_entropy; the
    target defaults to what the loss needs (mse: the input's shape; causal_lm: the input's token
    positions; cross_entropy: one label). `data_kind`: the data's kind (`tokens`, `images`)."""
    module, input, target, loss, extra_inputs = (
        OmegaConf.to_container(v, resolve=True) if isinstance(v, DictConfig | ListConfig) else v
        for v in (module, input, target, loss, extra_inputs))
    extra_inputs = list(extra_inputs)
    leaf_modules = list(leaf_modules)
    if not isinstance(module, dict) or "_target_" not in module:
        raise ConfigError("model.module", "needs a `_target_` naming a callable that returns an nn.Module, "
                                          "e.g. model.module._target_=diffusers.UNet2DModel")
    in_shape, in_dtype = _input(input, seq_len, data_kind == "tokens")
    if loss is None:
        loss = "cross_entropy" if in_dtype.is_floating_point else "causal_lm"
    if target is None:
        target = _target(loss, in_shape, in_dtype)
    factory_cfg = dict(module)

    def build() -> nn.Module:
        try:
            inner = instantiate(factory_cfg)
        except Exception as err:  # noqa: BLE001
            raise ConfigError("model.module", f"could not build {factory_cfg['_target_']}: {err}") from None
        if not isinstance(inner, nn.Module):
            raise ConfigError("model.module", f"{factory_cfg['_target_']} returned {type(inner).__name__}, not an nn.Module")
        return Adapted(inner, output, extra_inputs)

    with torch.device("meta"):
        probe = build()
    family, whole = initialisers(probe.inner)
    meta: dict = {}
    if vocab_size is not None:
        meta["vocab_size"] = int(vocab_size)
    if num_classes is not None:
        meta["num_classes"] = int(num_classes)
    if seq_len is not None:
        meta["seq_len"] = int(seq_len)
    return ModelSpec(
        name=name, build=build, loss_fn=_loss(loss), input_shape=in_shape, input_dtype=in_dtype,
        target_shape=tuple(int(d) for d in target.get("shape") or ()),
        target_dtype=_dtype(str(target.get("dtype", "long")), "model.target.dtype"),
        leaf_modules=[f"inner.{n}" for n in leaf_modules], init=family, init_weights=whole, meta=meta,
        load=ConstructorBuffers(build) if any(True for _ in probe.buffers()) else None,
    )
