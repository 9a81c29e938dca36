"""Why a model cannot run at one tp rank's shapes, said in the model's own terms (#58).

When the model, its planned modules split over tp ranks (`tensor_parallel.shard_meta`), fails to
trace or propagate shapes, the error torch gives names an fx node or a reshape's arguments. What
the user needs is the module, the operation and the size: a fused projection split by a full
width (nanoGPT's `c_attn(x).split(n_embd)`: on a tp rank the fused output holds 1/tp of q, k and
v, so the split gives fewer parts), or heads that tp does not divide (`view(b, t, -1, head_dim)`
of a rank's 1/tp of the width: not a whole number of heads). The trace is rerun once, only on
failure, under a log of the shape operations the model runs on real (meta) tensors; the last one
before the failure, with the module running it, is the cause. Anything else is reported by its
first line, cut at a word.
"""

from __future__ import annotations

import math
import re
import textwrap
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import fx, nn
from torch.overrides import TorchFunctionMode

from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.graph.trace import ShapeFailure, innermost_module

#: shape operations whose sizes can disagree with a tp rank's share of a dimension
_SPLITS = {torch.Tensor.split, torch.split, torch.Tensor.chunk, torch.chunk, torch.Tensor.tensor_split}
_VIEWS = {torch.Tensor.view, torch.Tensor.reshape, torch.reshape, torch.Tensor.unflatten}


def short(text: str, width: int = 300) -> str:
    """The first line of `text`, cut at a word (never mid-word) to about `width` characters."""
    line = next((s for s in str(text).splitlines() if s.strip()), "")
    return textwrap.shorten(line, width=width, placeholder=" ...")


class ShapeOpLog(TorchFunctionMode):
    """The shape operations a forward runs on tensors (not fx proxies), each logged before it runs
    (a failing one is the last): (module running it, function name, input shape, arguments)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.last: tuple[str, str, tuple[int, ...], tuple[Any, ...], dict[str, Any]] | None = None
        self.where: list[str] = []
        self._hooks = [h for name, m in model.named_modules() for h in (
            m.register_forward_pre_hook(lambda mod, args, name=name: self.where.append(name)),
            m.register_forward_hook(lambda mod, args, out: self._leave()))]

    def _leave(self) -> None:  # a hook returning a value would replace the module's output
        if self.where:
            self.where.pop()

    def close(self) -> None:
        for h in self._hooks:
            h.remove()

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if (func in _SPLITS or func in _VIEWS) and args and isinstance(args[0], torch.Tensor):
            self.last = (self.where[-1] if self.where else "", func.__name__, tuple(args[0].shape),
                         tuple(args[1:]), dict(kwargs or {}))
        return func(*args, **(kwargs or {}))


def _producer(node: fx.Node | None, modules: Mapping[str, str], depth: int = 4) -> str | None:
    """The planned module whose output a failing node reads (through a few ops), if any."""
    frontier = [node] if node is not None else []
    for _ in range(depth):
        nxt = []
        for n in frontier:
            for inp in n.all_input_nodes:
                if inp.op == "call_module" and str(inp.target) in modules:
                    return str(inp.target)
                nxt.append(inp)
        frontier = nxt
    return None


def _sizes(args: tuple[Any, ...]) -> list[int]:
    flat = list(args[0]) if len(args) == 1 and isinstance(args[0], (list, tuple, torch.Size)) else list(args)
    return [int(a) for a in flat if isinstance(a, int)]


def _name(path: str) -> str:
    return path.removeprefix("inner.").removeprefix("model.") or "the model"


def _pattern(path: str) -> str:
    """A module's name as a plan pattern: each layer index `*` (transformer.h.*.attn.c_attn)."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)", "*", _name(path))


def _split_refusal(where: str, shape: tuple[int, ...], args: tuple, kwargs: dict, tp: int,
                   producer: str | None) -> ConfigError | None:
    """A fused tensor split by a full width: its parts are not where the split looks on a tp rank."""
    size = args[0] if args else kwargs.get("split_size_or_sections", kwargs.get("split_size"))
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    if not isinstance(size, int) or not isinstance(dim, int) or not shape:
        return None
    local = shape[dim]
    source = f"the output of {_name(producer)} (split over the tp ranks by model.tp_plan)" if producer else \
        "a tensor model.tp_plan splits over the tp ranks"
    return ConfigError("model.tp_plan", (
        f"{_name(where)} splits {source} by {size} (split({size}, dim={dim})): at full size its {local * tp} "
        f"features make {local * tp // size} parts, but a tp rank holds {local} of them, {math.ceil(local / size)} "
        f"part{'s' if math.ceil(local / size) > 1 else ''} by that width. A fused projection (q, k and v in one "
        f"Linear) split by a width of the whole model cannot be cut over tp={tp} ranks: plan "
        f"{_pattern(producer) if producer else 'that projection'} (and the projection after it) as replicate, project "
        "q, k and v with Linears of their own, or set tp=1"))


def _heads_refusal(where: str, shape: tuple[int, ...], args: tuple, tp: int) -> ConfigError | None:
    """A view into (.., -1, head_dim) of a rank's 1/tp of the width: tp does not divide the heads."""
    sizes = _sizes(args)
    if not shape or len(sizes) < 2 or sizes[-1] <= 0 or -1 not in sizes:
        return None
    head_dim, width = sizes[-1], shape[-1]
    whole = width * tp
    if width % head_dim == 0 or whole % head_dim:
        return None
    heads = whole // head_dim
    valid = [d for d in range(1, heads + 1) if heads % d == 0]
    return ConfigError("tp", (
        f"tp={tp} does not divide the {heads} heads of {_name(where)}: its {whole} features are {heads} heads of "
        f"{head_dim}, and a tp rank would hold {width} features, {width / head_dim:.3g} heads "
        f"(view(..., -1, {head_dim}) fails). Valid: a tp dividing {heads} ({', '.join(map(str, valid))})"))


def local_failure(err: BaseException, model: nn.Module, trace: Callable[[nn.Module], Any],
                  modules: Mapping[str, str], tp: int) -> ConfigError:
    """The refusal for `model` (at one tp rank's shapes) failing to trace with `err` (module
    docstring): rerun under `ShapeOpLog` to find the shape operation that failed."""
    log = ShapeOpLog(model)
    try:
        with log, torch.no_grad():
            trace(model)
    except Exception as again:  # noqa: BLE001 - the same failure, now logged
        err = again
    finally:
        log.close()
    node = err.node if isinstance(err, ShapeFailure) else None
    cause = err.cause if isinstance(err, ShapeFailure) else err
    if log.last is not None:
        where, func, shape, args, kwargs = log.last
        where = where or (innermost_module(node) if node is not None else "") or ""
        found = _split_refusal(where, shape, args, kwargs, tp, _producer(node, modules)) if func in (
            "split", "chunk", "tensor_split") else _heads_refusal(where, shape, args, tp)
        if found is not None:
            return found
        at = f" at {func}({', '.join(map(str, [*args, *(f'{k}={v}' for k, v in kwargs.items())]))}) of a " \
             f"{list(shape)} tensor in {_name(where)}"
    else:
        at = f" in {_name(innermost_module(node))}" if node is not None and innermost_module(node) else ""
    return ConfigError("tp", f"the model cannot run with its planned modules split over tp={tp} ranks: at one tp "
                             f"rank's shapes it fails{at} ({type(cause).__name__}: {short(str(cause))}). A forward "
                             "that sizes a split tensor by a count or width of the whole model cannot be cut; plan "
                             "that module as replicate, or set tp=1")
