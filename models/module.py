"""`model=module`: any callable that returns an `nn.Module`, pipelined as it is.

`model.module` names the factory by its import path (`mymodel.tiny_lm`, `diffusers.UNet2DModel`,
with `+model.module.<argument>=...`); README.md's "Your model and your data" shows the command
lines. The launcher builds it as a factory with its arguments bound (conf/model/module.yaml), so
it reaches `module` below as a callable.

The module is built on the meta device like every model (its factory must not load weights
itself); `output` picks an attribute or key of what it returns (`logits`, `sample`) or an element
of a tuple or list by position (`0`), and `extra_inputs` are constant positional arguments after
the data: a value (a diffusion timestep), or a tensor described by a mapping (`extra_tensor`: a
text encoder's states for a conditioned UNet, a class label), the same for every sample of a
batch. Buffers the module's constructor
computes (a rotary `inv_freq`, a sin-cos position table) reach every rank by name, as the
constructor computes them (`pipelaunch.pipeline.graph.buffers.ConstructorBuffers`).

On token data (`data.kind: tokens`, which module.yaml passes as `data_kind`) the defaults are a
language model's: input `[seq_len]` int64 ids, loss `causal_lm`; elsewhere float32 input and
`cross_entropy`. What still disagrees with the data is refused in `pipelaunch.launcher.validate.check_data`.

`loss=model`: a model that computes its own loss trains with it. It is given its targets by
keyword (`targets_arg`: nanoGPT's `forward(idx, targets)`, transformers' `labels=`), either the
data's targets (`labels=targets`, the next token at each position: nanoGPT) or the inputs
themselves (`labels=inputs`: transformers shifts them inside its loss), and `output` picks the
loss from what it returns (null: its `loss` field, or a tuple's last element). The data's targets
are then a second input of the traced graph, read by whichever stage computes the loss.

Packed documents (`data.packing=documents`): the model is given the data's per-token position ids
(restarting at each document) by keyword, `position_ids_arg` (null: `position_ids`, if its
forward takes it); they are one more input of the traced graph, read by every stage that needs
them. What the model makes of them (positions, a document mask) is its own: a forward that
cannot take them is refused before any rank starts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from omegaconf import OmegaConf
from torch import nn

from pipelaunch.models.list_experts import ListExperts
from pipelaunch.models.list_experts import adopt as adopt_experts
from pipelaunch.models.spec import ModelSpec, causal_lm_loss, count_tokens, model_loss
from pipelaunch.pipeline.core import POSITION_IDS
from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.graph.buffers import ConstructorBuffers
from pipelaunch.pipeline.graph.context_parallel import local_length

LOSSES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "cross_entropy": nn.functional.cross_entropy,
    "causal_lm": causal_lm_loss,
    "mse": nn.functional.mse_loss,
}
#: `model.loss=model`: the model computes its own loss from the targets it is given
OWN_LOSS = "model"
#: what a model computing its own loss is given as its targets (`model.labels`)
LABELS = ("targets", "inputs")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "long": torch.long,
          "int64": torch.long, "int32": torch.int32}


class Adapted(nn.Module):
    """The user's module, called with the data plus constant extra inputs, its output picked. A
    tensor extra input is a non-persistent buffer `extra_<position>` (one sample's), expanded to
    the batch on each call."""

    def __init__(self, inner: nn.Module, output: str | int | None, extra_inputs: Sequence[Any],
                 targets_arg: str | None = None, positions_arg: str | None = None) -> None:
        super().__init__()
        self.inner, self.output = inner, output
        #: the keyword the model's own loss takes its targets by (`model.loss=model`), else None
        self.targets_arg = targets_arg
        #: the keyword packed documents' position ids go to (`model.position_ids_arg`), else None
        self.positions_arg = positions_arg
        self.extra_inputs: tuple[Any, ...] = tuple(extra_inputs)
        for i, item in enumerate(self.extra_inputs):
            if isinstance(item, Mapping):
                self.register_buffer(f"extra_{i}", extra_tensor(item, i), persistent=False)

    def extras(self, x: torch.Tensor) -> list[Any]:
        """The constant arguments after the data, tensors expanded to the batch of `x`."""
        args = []
        for i, item in enumerate(self.extra_inputs):
            if isinstance(item, Mapping):
                value = getattr(self, f"extra_{i}")
                args.append(value.expand(x.shape[0], *value.shape))
            else:
                args.append(item)
        return args

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return pick(self.inner(x, *self.extras(x)), self.output, self.targets_arg is not None)


class TakesTargets(Adapted):
    """`model.loss=model` with `model.labels=targets`: the data's targets are a second model input,
    passed as `targets_arg` (nanoGPT's `forward(idx, targets)`); the output picked is the loss."""

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return pick(self.inner(x, *self.extras(x), **{self.targets_arg: target}), self.output, True)


class ShiftsInputs(Adapted):
    """`model.loss=model` with `model.labels=inputs`: the inputs are the labels too, which the model
    shifts itself (transformers' `model(ids, labels=ids).loss`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return pick(self.inner(x, *self.extras(x), **{self.targets_arg: x}), self.output, True)


class PackedAdapted(Adapted):
    """Adapted, on packed documents: the data's position ids by keyword (`positions_arg`)."""

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return pick(self.inner(x, *self.extras(x), **{self.positions_arg: position_ids}), self.output, False)


class PackedTakesTargets(Adapted):
    """TakesTargets, on packed documents: the position ids by keyword too."""

    def forward(self, x: torch.Tensor, target: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        kwargs = {self.targets_arg: target, self.positions_arg: position_ids}
        return pick(self.inner(x, *self.extras(x), **kwargs), self.output, True)


class PackedShiftsInputs(Adapted):
    """ShiftsInputs, on packed documents. Its labels are the inputs, with no document-end mask: the
    launcher refuses it on packed data (`check_masked_loss`), as on data=chat."""

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        kwargs = {self.targets_arg: x, self.positions_arg: position_ids}
        return pick(self.inner(x, *self.extras(x), **kwargs), self.output, True)


def _positions_arg(inner: nn.Module, positions_arg: str | None) -> str:
    """The forward's keyword packed documents' position ids go to (`model.position_ids_arg`; null:
    `position_ids`), or a ConfigError naming the key when the forward cannot take it."""
    import inspect

    try:
        params = inspect.signature(inner.forward).parameters
    except (TypeError, ValueError):
        params = {}
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    name = positions_arg or "position_ids"
    if name in params or (positions_arg is not None and takes_any):
        return name
    raise ConfigError("model.position_ids_arg", f"data.packing gives the model per-document position ids "
                                                f"by keyword, but {type(inner).__name__}.forward({', '.join(params)}) "
                                                f"takes no {name!r}: set model.position_ids_arg=<the argument taking "
                                                "them> (the model must keep each document's attention to itself), "
                                                "or data.packing=none")


def _packed(wrapper: type[Adapted], data_args: tuple[str, ...], inner: nn.Module, position_ids_arg: str | None,
            data_packing: str | None) -> tuple[type[Adapted], tuple[str, ...], str | None]:
    """(wrapper, data_args, the position ids' keyword) on packed documents: the wrapper passing
    them too, the data's `position_ids` one more input; unchanged (keyword None) otherwise."""
    if (data_packing or "none") == "none":
        return wrapper, data_args, None
    packed = {Adapted: PackedAdapted, TakesTargets: PackedTakesTargets, ShiftsInputs: PackedShiftsInputs}[wrapper]
    return packed, (*data_args, POSITION_IDS), _positions_arg(inner, position_ids_arg)


def _describe(out: Any) -> str:
    if isinstance(out, torch.Tensor):
        return f"a tensor {list(out.shape)}"
    if isinstance(out, tuple | list):
        return f"a {type(out).__name__} of {len(out)}"
    return "None" if out is None else f"a {type(out).__name__}"


def pick(out: Any, output: str | int | None, loss: bool = False) -> Any:
    """The part of a module's output to train (`model.output`): an element of a tuple or list by
    index, a key of a dict, or an attribute (`logits`, `sample`). With `loss` (the model's own
    loss) and no `model.output`: its `loss` field, or a tuple's last element (nanoGPT's `(logits,
    loss)`). What cannot be picked is a config error naming `model.output`."""
    if output is None and not loss:
        return out
    if isinstance(out, torch.fx.Proxy):  # a traced value whose structure tracing cannot see
        return out[output] if isinstance(output, int) else getattr(out, output or "loss")
    if output is None:
        output = len(out) - 1 if isinstance(out, tuple | list) and not hasattr(out, "loss") else "loss"
    sequence = isinstance(out, tuple | list) or (isinstance(out, Mapping) and hasattr(out, "to_tuple"))
    if isinstance(output, int):
        if not sequence or not -len(out) <= output < len(out):
            valid = f"0 to {len(out) - 1}" if sequence else "a name (the output is not a tuple or list)"
            raise ConfigError("model.output", f"{output} picks an element by position, but the module returns "
                                              f"{_describe(out)}; valid: {valid}")
        value = out[output]
    elif isinstance(out, Mapping) and output in out:
        value = out[output]
    elif not isinstance(out, tuple | list | torch.Tensor) and hasattr(out, output):
        value = getattr(out, output)
    else:
        hint = ("an element by position, e.g. model.output=0" if isinstance(out, tuple | list) else
                f"one of its keys: {', '.join(map(str, out))}" if isinstance(out, Mapping) else "another field")
        raise ConfigError("model.output", f"{output!r} is not a field of what the module returns ({_describe(out)}); "
                                          f"pick {hint}")
    if value is None:
        raise ConfigError("model.output", f"{output!r} picks None from what the module returns ({_describe(out)}); "
                                          "pick a tensor" + ("" if loss else ", or let the model compute its own loss "
                                                             "from the targets with model.loss=model"))
    return value


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


def _loss(loss: str | Callable) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """A loss by name, or the callable the launcher built from the option's mapping."""
    if isinstance(loss, str):
        if loss not in LOSSES:
            raise ConfigError("model.loss", f"got {loss!r}; valid: {', '.join(LOSSES)}, model (the model's own) or a "
                                            "callable named by the option (its import path and arguments)")
        return LOSSES[loss]
    if not callable(loss):
        raise ConfigError("model.loss", f"got {loss!r}, which is not a loss: name a callable that scores (output, target)")
    return loss


def _callable_name(fn: Any) -> str:
    """A factory's import path, through the partial the launcher binds its arguments with."""
    fn = getattr(fn, "func", fn)
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}"


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


def _context_input(shape: tuple[int, ...], dtype: torch.dtype, cp: int, packing: str | None
                   ) -> tuple[tuple[int, ...], torch.dtype]:
    """One sample's shape on a cp rank: 1/cp of a token sequence's positions."""
    if cp == 1:
        return shape, dtype
    if len(shape) != 1 or dtype.is_floating_point:
        raise ConfigError("cp", f"cp={cp} splits token sequences along their positions, and this module's input is "
                                f"{list(shape)} {str(dtype).removeprefix('torch.')}; valid: token data (one sequence "
                                "of ids per sample), or cp=1")
    if (packing or "none") != "none":
        raise ConfigError("data.packing", f"packed documents with cp={cp} on model=module are not supported yet (the "
                                          "module's own document mask would span one rank's positions only); set "
                                          "data.packing=none, or cp=1")
    return (local_length(shape[0], cp),), dtype


def _target(loss: str | dict, in_shape: tuple[int, ...], in_dtype: torch.dtype) -> dict:
    """What the loss scores, by default: mse the input's shape, causal_lm (or any loss on token
    input but cross_entropy, the model's own among them) a token per input position, cross_entropy
    one label."""
    if loss == "mse":
        return {"shape": list(in_shape), "dtype": "float32"}
    if loss == "causal_lm" or ((loss == OWN_LOSS or not isinstance(loss, str)) and not in_dtype.is_floating_point):
        return {"shape": list(in_shape), "dtype": "long"}
    return {"shape": [], "dtype": "long"}


def _output(output: Any) -> str | int | None:
    """`model.output` as a name or a position (`model.output=0`, also when written as a string)."""
    if output is None or (isinstance(output, int) and not isinstance(output, bool)):
        return output
    if isinstance(output, str) and output:
        return int(output) if output.lstrip("-").isdigit() else output
    raise ConfigError("model.output", f"got {output!r}; valid: null (the whole output), a field's name (logits, "
                                      "sample, loss) or an element's position in a tuple or list (0, 1)")


def _own_loss_args(inner: nn.Module, targets_arg: str | None, labels: str | None) -> tuple[str, str]:
    """(keyword, labels) for `model.loss=model`: the forward's keyword its targets go to (null:
    `labels` or `targets`, whichever it takes) and what it is given there: the data's targets
    (next-token ids, as nanoGPT expects) or the inputs (which transformers' loss shifts itself)."""
    import inspect

    try:
        params = inspect.signature(inner.forward).parameters
    except (TypeError, ValueError):
        params = {}
    kind = type(inner).__name__
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    if targets_arg is None:
        targets_arg = next((n for n in ("labels", "targets") if n in params), None)
        if targets_arg is None:
            raise ConfigError("model.targets_arg", f"model.loss=model gives the model its targets by keyword, but "
                                                   f"{kind}.forward({', '.join(params)}) takes neither `labels` nor "
                                                   "`targets`; set model.targets_arg=<the argument its loss reads>")
    elif targets_arg not in params and not takes_any:
        raise ConfigError("model.targets_arg", f"{targets_arg!r} is not an argument of {kind}.forward("
                                               f"{', '.join(params)}); valid: one of those")
    if labels is None:
        labels = "inputs" if targets_arg == "labels" else "targets"
    if labels not in LABELS:
        raise ConfigError("model.labels", f"got {labels!r}; valid: targets (the data's targets, the next token at each "
                                          "position: nanoGPT), inputs (the input ids, which the model shifts itself: "
                                          "transformers)")
    return targets_arg, labels


def _check_shift(labels: str, cp: int) -> None:
    """A loss that shifts the input ids itself reads each next token across a cp rank's chunks."""
    if labels == "inputs" and cp > 1:
        raise ConfigError("model.labels", f"model.labels=inputs with cp={cp}: the module's loss shifts the input ids by "
                                          "one position, across the chunks each cp rank holds; set "
                                          "model.labels=targets, or cp=1")


def _tp_plan(plan: Mapping[str, str] | None) -> dict[str, str]:
    """A user's tensor-parallel plan on the wrapped model's names (the module is `inner`)."""
    plan = OmegaConf.to_container(plan) if OmegaConf.is_config(plan) else plan
    return {f"inner.{k}": str(v) for k, v in (plan or {}).items()}


def _maker(factory: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    """`factory()`, refused with its error named when it fails or builds no nn.Module."""
    def make() -> nn.Module:
        try:
            inner = factory()
        except Exception as err:  # noqa: BLE001
            raise ConfigError("model.module", f"could not build {_callable_name(factory)}: {err}") from None
        if not isinstance(inner, nn.Module):
            raise ConfigError("model.module", f"{_callable_name(factory)} returned {type(inner).__name__}, not an nn.Module")
        return inner

    return make


def _ep_plan(plan: Mapping[str, str] | None) -> dict[str, str]:
    """A user's expert-parallel plan ({module-name pattern: ep_dispatch_experts})."""
    plan = OmegaConf.to_container(plan) if OmegaConf.is_config(plan) else plan
    if plan is not None and not isinstance(plan, Mapping):
        raise ConfigError("model.ep_plan", f"got {plan!r}; valid: null, or {{module-name pattern: ep_dispatch_experts}} "
                                           "(layers.*.moe.experts: ep_dispatch_experts)")
    return {str(k): str(v) for k, v in (plan or {}).items()}


def _expert_meta(inner: nn.Module) -> dict:
    """What the launcher checks of a user's mixture of experts (`ModelSpec.meta`, as model=hf's)."""
    totals = [m.total for m in inner.modules() if isinstance(m, ListExperts)]
    if not totals:
        return {}
    # its own loss may add an auxiliary loss over its routers' statistics (a cp rank's tokens only)
    return {"experts": math.gcd(*totals), "moe_layers": len(totals), "expert_counts": sorted(set(totals)),
            "router_aux_loss": True}


def module(
    module: Callable[[], nn.Module],
    input: dict | None = None,  # noqa: A002 - the config key users write
    target: dict | None = None,
    output: str | int | None = None,
    extra_inputs: Sequence[Any] = (),
    loss: str | Callable | None = None,
    leaf_modules: Sequence[str] = (),
    name: str = "module",
    vocab_size: int | None = None,
    num_classes: int | None = None,
    seq_len: int | None = None,
    data_kind: str | None = None,
    targets_arg: str | None = None,
    labels: str | None = None,
    tp_plan: Mapping[str, str] | None = None,
    position_ids_arg: str | None = None,
    data_packing: str | None = None,
    ep_plan: Mapping[str, str] | None = None,
    context_parallel: int = 1,
) -> ModelSpec:
    """A ModelSpec around `module()`, the factory the launcher built with its arguments bound (see
    the module docstring). `input`/`target`:
    `{shape: [...], dtype: ...}` of one sample (shape null: `[seq_len]`; dtype null: int64 on
    token data, else float32); `loss` null: causal_lm on integer input, else cross_entropy; the
    target defaults to what the loss needs (mse: the input's shape; causal_lm: the input's token
    positions; cross_entropy: one label). `loss=model`: the model computes its own loss, its
    targets passed as `targets_arg` (`labels`: the data's `targets` or the `inputs`), `output`
    picking the loss. `data_kind`: the data's kind (`tokens`, `images`). `tp_plan`: how tp > 1
    splits it, {its module-name pattern (`*` one component): colwise | rowwise | vocab | replicate}.
    `data_packing=documents`: the data's position ids go to the forward's `position_ids_arg`.
    `ep_plan`: {module-name pattern: ep_dispatch_experts}, the modules holding its routed experts,
    which ep > 1 splits (models/list_experts.py). `context_parallel` (`cp`): traced at 1/cp of the
    positions, its sdpa calls over the cp ranks (pipeline/graph/context_parallel.py)."""
    module, input, target, loss, extra_inputs = (
        OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v
        for v in (module, input, target, loss, extra_inputs))
    extra_inputs, leaf_modules, output = list(extra_inputs), list(leaf_modules), _output(output)
    if not callable(module):
        raise ConfigError("model.module", f"needs to name a callable that returns an nn.Module (its import path, "
                                          f"diffusers.UNet2DModel), got {module!r}")
    in_shape, in_dtype = _context_input(*_input(input, seq_len, data_kind == "tokens"), context_parallel, data_packing)
    loss = loss if loss is not None else "cross_entropy" if in_dtype.is_floating_point else "causal_lm"
    target = target if target is not None else _target(loss, in_shape, in_dtype)
    make, experts_plan = _maker(module), _ep_plan(ep_plan)
    wrapper, data_args = Adapted, ("input",)
    with torch.device("meta"):
        inner = make()
        if loss == OWN_LOSS:
            targets_arg, labels = _own_loss_args(inner, targets_arg, labels)
            wrapper, data_args = (TakesTargets, ("input", "target")) if labels == "targets" else (ShiftsInputs, ("input",))
            _check_shift(labels, context_parallel)
        else:
            targets_arg = None
        wrapper, data_args, positions_arg = _packed(wrapper, data_args, inner, position_ids_arg, data_packing)
        probe = wrapper(inner, output, extra_inputs, targets_arg, positions_arg)
        expert_names = adopt_experts(inner, experts_plan)

    def build() -> nn.Module:
        inner = make()
        adopt_experts(inner, experts_plan)
        return wrapper(inner, output, extra_inputs, targets_arg, positions_arg)

    family, whole = initialisers(probe.inner)
    meta: dict = {k: int(v) for k, v in (("vocab_size", vocab_size), ("num_classes", num_classes), ("seq_len", seq_len),
                                          ("context_parallel", context_parallel), ("cp_graph", context_parallel))
                  if v is not None} | _expert_meta(probe.inner)
    return ModelSpec(
        name=name, build=build, loss_fn=model_loss if loss == OWN_LOSS else _loss(loss), input_shape=in_shape,
        input_dtype=in_dtype, target_shape=tuple(int(d) for d in target.get("shape") or ()),
        target_dtype=_dtype(str(target.get("dtype", "long")), "model.target.dtype"),
        leaf_modules=[f"inner.{n}" for n in dict.fromkeys([*leaf_modules, *expert_names])], init=family,
        init_weights=whole, meta=meta,
        load=ConstructorBuffers(build) if any(True for _ in probe.buffers()) else None,
        data_args=data_args, own_loss=loss == OWN_LOSS,
        # under cp a rank scores its share of each sample: its own loss a mean over its tokens
        scored=count_tokens if loss == OWN_LOSS and context_parallel > 1 else None,
        tp_plan=_tp_plan(tp_plan),
    )
