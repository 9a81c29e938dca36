"""Tensor parallelism on the graph: which tensors a plan shards, the model at its local shapes,
and a stage's graph rewritten with Megatron's collectives.

Why a rewrite of the traced graph, not DTensor's `parallelize_module`: an export-traced stage
never calls its modules (it reads weights by `get_attr` and calls `aten.linear`), so module hooks
never fire; and hooks on each projection give one backward all-reduce per projection (q, k and v:
three), where Megatron's `f` gives one per value the column-parallel projections share. Here the
graph says which value feeds which projection, so each gets exactly one `f` (identity forward,
all-reduce backward) and each row-parallel projection one `g` (all-reduce forward, identity
backward), its bias added after the reduction.

Why the model is traced again at its local shapes (`shard_meta`): a trace bakes shapes in (an
export graph's `expand([b, kv_heads, rep, s, d])`); traced with the sharded parameters' local
shapes, the user's own code computes every reshape for `heads / tp` heads, and a reshape that
bakes the full head count in fails there, on meta, before any rank exists.

Nothing here communicates: the collectives are modules the caller supplies (`Collectives`), the
runtime's real ones or the launcher's shape-only stand-ins.
"""

from __future__ import annotations

import copy
import inspect
import math
import operator
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import fx, nn
from torch.nn import functional as F  # noqa: N812
from torch.overrides import TorchFunctionMode

from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.graph.split import SplitModel, split_model
from pipelaunch.pipeline.graph.tp_refusals import local_failure
from pipelaunch.pipeline.graph.trace import TracedModel, module_key, repeated_modules_once, retarget

#: colwise: a Linear's outputs split (its input gathered by `f` in the backward); rowwise: its
#: inputs split (its output summed by `g`); vocab: an Embedding's rows or an LM head's outputs split
#: by vocabulary (the loss computed on the shards); replicate: kept whole on every tp rank;
#: sequence: kept whole, run on the tp rank's positions under sequence_parallel=true (which modules
#: can is found by graph/sequence_parallel.py for every module; naming one documents the intent)
STYLES = ("colwise", "rowwise", "vocab", "replicate", "sequence")
#: styles that leave a module's parameters whole
WHOLE = ("replicate", "sequence")
LINEARS = {F.linear, torch._C._nn.linear, torch.ops.aten.linear.default}
EMBEDDINGS = {F.embedding, torch.ops.aten.embedding.default}


def _pattern(pattern: str) -> re.Pattern:
    """transformers' plan syntax: `layers.*.mlp.up_proj`, `*` standing for one name component."""
    return re.compile("^" + r"[^.]+".join(re.escape(part) for part in pattern.split("*")) + "$")


def resolve(model: nn.Module, patterns: Mapping[str, str], key: str = "model.tp_plan") -> dict[str, str]:
    """Module qualified name -> style, for every module a pattern of `patterns` names. A pattern
    matching no module, a style not in STYLES, or a style the module's type cannot take is refused
    naming `key` and the pattern."""
    modules = dict(model.named_modules())
    resolved: dict[str, str] = {}
    for pattern, style in patterns.items():
        if style not in STYLES:
            raise ConfigError(key, f"{pattern!r}: {style!r} is not a tensor-parallel style; valid: {', '.join(STYLES)}")
        matched = [n for n in modules if n and _pattern(pattern).match(n)]
        if not matched:
            near = [n for n in modules if n.split(".")[-1] == pattern.split(".")[-1]][:3]
            raise ConfigError(key, f"{pattern!r} matches no module of the model ({'e.g. ' + ', '.join(near) if near else 'its modules are ' + ', '.join(list(modules)[1:6]) + ' ...'}); "
                                   "a pattern is a module's qualified name, `*` standing for one component")
        for name in matched:
            module = modules[name]
            fits = (style in WHOLE or isinstance(module, nn.Linear)
                    or (style == "vocab" and isinstance(module, nn.Embedding)))
            if not fits:
                raise ConfigError(key, f"{pattern!r} names {name}, a {type(module).__name__}: colwise and rowwise shard "
                                       "an nn.Linear, vocab an nn.Embedding or an nn.Linear head")
            resolved[name] = style
    return resolved


@dataclass(frozen=True)
class Sharded:
    """A parameter split over the tp ranks along `dim` (each holds `size / tp` of it)."""

    module: str
    dim: int


def sharded_params(model: nn.Module, modules: Mapping[str, str]) -> dict[str, Sharded]:
    """Every parameter name (tied aliases included) a plan splits -> how."""
    by_object: dict[int, Sharded] = {}
    for name, style in modules.items():
        if style in WHOLE:
            continue
        module = model.get_submodule(name)
        dims = {"weight": 1 if style == "rowwise" else 0}
        if style != "rowwise":
            dims["bias"] = 0
        for attr, dim in dims.items():
            p = getattr(module, attr, None)
            if p is None:
                continue
            earlier = by_object.get(id(p))
            if earlier is not None and earlier.dim != dim:
                raise ConfigError("model.tp_plan", f"{name}.{attr} is tied to {earlier.module}'s, which the plan "
                                                   f"splits along another dimension; plan both as vocab (or colwise)")
            by_object.setdefault(id(p), Sharded(name, dim))
    return {n: by_object[id(p)] for n, p in model.named_parameters(remove_duplicate=False) if id(p) in by_object}


def shard_meta(model: nn.Module, modules: Mapping[str, str], tp: int) -> dict[str, Sharded]:
    """Give the planned parameters of a meta `model` their local shapes (ties kept); refuse a
    dimension `tp` does not divide, naming the module. Returns `sharded_params`."""
    sharded = sharded_params(model, modules)
    replaced: dict[int, nn.Parameter] = {}
    for name, how in sharded.items():
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner)
        p = module._parameters[attr]
        if id(p) not in replaced:
            size = p.shape[how.dim]
            if size % tp:
                what = "input features" if how.dim == 1 else "rows (its vocabulary)" if \
                    isinstance(module, nn.Embedding) else "output features"
                raise ConfigError("tp", f"tp={tp} does not divide the {size} {what} of {how.module}; valid: a tp "
                                        f"dividing {size} (and every other sharded dimension: heads, key/value heads, "
                                        "the MLP width, the vocabulary)")
            shape = list(p.shape)
            shape[how.dim] //= tp
            replaced[id(p)] = nn.Parameter(torch.empty(shape, dtype=p.dtype, device="meta"), p.requires_grad)
        module._parameters[attr] = replaced[id(p)]
    return sharded


@dataclass
class Collectives:
    """Makes the modules the rewrite inserts: `copy()` (Megatron's f), `reduce()` (g), and
    `embedding(padding_idx)`, called as `(ids, local_weight)`, a vocabulary-parallel lookup
    whose output is summed over the tp ranks."""

    copy: Callable[[str], nn.Module]
    reduce: Callable[[str], nn.Module]
    embedding: Callable[[str, int | None], nn.Module]


class _Lookup(nn.Module):
    """The vocabulary-parallel lookup's shape: ids in, one row of the local table per id out."""

    reduce_output = True  # as the real lookup's (sequence parallelism turns it off)

    def forward(self, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids.clamp(0, weight.shape[0] - 1), weight)


#: stand-ins with the collectives' shapes and no communication: the launcher's check, the planner
SHAPE_ONLY = Collectives(copy=lambda what: nn.Identity(), reduce=lambda what: nn.Identity(),
                         embedding=lambda what, padding: _Lookup())


@dataclass
class Rewritten:
    """What the rewrite did to one graph: the collectives it inserted (name -> kind) and the
    output values that are vocabulary-sharded logits (scored by the vocabulary-parallel loss)."""

    inserted: dict[str, str] = field(default_factory=dict)
    vocab_outputs: set[str] = field(default_factory=set)
    #: inserted module -> the graph node whose work it belongs to (a projection, a lookup, or the
    #: call of a block the collectives were placed inside): where the planner prices it
    at: dict[str, str] = field(default_factory=dict)
    #: a node whose readers now read another (a row-parallel projection's: its `g`, its bias) ->
    #: that node: what a stage boundary at the node carries
    carried: dict[str, str] = field(default_factory=dict)


#: the graphs `fx.symbolic_trace` gave modules configured alike (`trace.module_key`): a 128-block
#: model traces one block, not 128 (28 ms each at a 1T GPT's width, for every tp degree planned)
_TRACED: dict[tuple, fx.Graph] = {}


class _OpaqueTracer(fx.Tracer):
    """Traces a block keeping whole each submodule `opaque` says the plan does not split: a
    module whose forward reads values (a mixture of experts' routing: which expert a token picks)
    cannot be traced through, and need not be when nothing inside it is split."""

    def __init__(self, opaque: frozenset[str]) -> None:
        super().__init__()
        self.opaque = opaque

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return super().is_leaf_module(m, module_qualified_name) or module_qualified_name in self.opaque


def _symbolic_trace(module: nn.Module, passed: int = 1, named: frozenset[str] = frozenset(),
                    opaque: frozenset[str] | None = None) -> fx.GraphModule:
    """`fx.symbolic_trace(module)` as it is called: with `passed` positional arguments and the
    keywords `named`, every other parameter of its forward at its default (a proxy would take an
    `if x is None:` branch for a call that never passes x); from a copy of the graph a module
    configured alike, called alike, gave. `opaque`: the submodules (by name in `module`) kept as
    calls (`_OpaqueTracer`); None: every one traced through, as fx does."""
    concrete = _defaults_not_passed(module, passed, named)

    def trace() -> fx.Graph:
        if opaque is None:
            return fx.symbolic_trace(module, concrete_args=concrete or None).graph
        return _OpaqueTracer(opaque).trace(module, concrete_args=concrete or None)

    mk = module_key(module)
    if mk is None:
        return fx.GraphModule(module, trace(), class_name=type(module).__name__)
    key = (mk, tuple(sorted(concrete)), opaque)  # which submodules stay calls is the block's plan's
    if key not in _TRACED:
        if len(_TRACED) > 256:
            _TRACED.clear()
        _TRACED[key] = trace()
    return fx.GraphModule(module, copy.deepcopy(_TRACED[key]), class_name=type(module).__name__)


def _defaults_not_passed(module: nn.Module, passed: int, named: frozenset[str]) -> dict[str, object]:
    """The forward's parameters a call with `passed` positional arguments and keywords `named`
    leaves at their defaults, with those defaults."""
    params = list(inspect.signature(module.forward).parameters.values())
    return {p.name: p.default for i, p in enumerate(params)
            if i >= passed and p.name not in named and p.default is not inspect.Parameter.empty
            and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}


def _param_target(node: fx.Node) -> str | None:
    return node.target if isinstance(node, fx.Node) and node.op == "get_attr" else None


class _Rewriter:
    def __init__(self, gm: fx.GraphModule, sharded: Mapping[str, Sharded], modules: Mapping[str, str],
                 make: Collectives, prefix: str = "") -> None:
        self.gm, self.graph, self.sharded, self.modules, self.make = gm, gm.graph, sharded, modules, make
        self.prefix = prefix
        self.copies: dict[fx.Node, fx.Node] = {}
        self.out = Rewritten()

    def _add(self, kind: str, module: nn.Module, owner: str, node: fx.Node) -> str:
        # named inside the module traced (a block's own name left out): copies of a block stay alike,
        # so shape-only passes and the pricing see them as one (`trace.module_key`)
        base = f"_tp_{kind}_{re.sub(r'[^0-9a-zA-Z]+', '_', owner.removeprefix(self.prefix))}"
        name, k = base, 1
        while hasattr(self.gm, name):
            name, k = f"{base}_{k}", k + 1
        self.gm.add_module(name, module)
        self.out.inserted[name] = kind
        self.out.at[name] = node.name
        return name

    def _style(self, weight: str) -> tuple[str, str] | None:
        how = self.sharded.get(self.prefix + weight)
        if how is None:
            return None
        return how.module, self.modules[how.module]

    def lower_modules(self) -> None:
        """call_module nodes of planned Linears and Embeddings become functional calls on get_attr
        weights; a call of a module holding planned ones (an eager block) is traced and rewritten."""
        for node in list(self.graph.nodes):
            if node.op != "call_module":
                continue
            module = self.gm.get_submodule(node.target)
            full = self.prefix + node.target
            if full in self.modules and isinstance(module, (nn.Linear, nn.Embedding)):
                self._lower(node, module)
            elif any(m.startswith(full + ".") and s not in WHOLE for m, s in self.modules.items()):
                self._trace_inside(node, module, full)

    def _lower(self, node: fx.Node, module: nn.Module) -> None:
        with self.graph.inserting_before(node):
            weight = self.graph.get_attr(f"{node.target}.weight")
            if isinstance(module, nn.Linear):
                bias = self.graph.get_attr(f"{node.target}.bias") if module.bias is not None else None
                node.op, node.target, node.args, node.kwargs = "call_function", F.linear, (node.args[0], weight, bias), {}
            else:
                if module.max_norm is not None or module.sparse:
                    raise ConfigError("model.tp_plan", f"{node.target}: an embedding with max_norm or sparse gradients "
                                                       "cannot be split by vocabulary")
                node.op, node.target = "call_function", F.embedding
                node.args, node.kwargs = (node.args[0], weight, module.padding_idx), {}

    def _trace_inside(self, node: fx.Node, module: nn.Module, full: str) -> None:
        split = [m for m, s in self.modules.items() if s not in WHOLE]
        # the submodules nothing the plan splits is inside of (names within `module`)
        unsplit = frozenset(n for n, _ in module.named_modules() if n and not any(
            m == f"{full}.{n}" or m.startswith(f"{full}.{n}.") for m in split))
        try:
            try:
                inner = _symbolic_trace(module, len(node.args), frozenset(node.kwargs))
            except Exception:  # noqa: BLE001 - traced again, what the plan leaves whole kept as calls
                inner = _symbolic_trace(module, len(node.args), frozenset(node.kwargs), opaque=unsplit)
        except Exception as err:  # noqa: BLE001 - any tracing failure is the same refusal
            raise ConfigError("model.tp_plan", f"{full} holds modules the plan splits, and torch.fx cannot trace "
                                               f"it to place the collectives: {type(err).__name__}: {err}") from err
        sub = _Rewriter(inner, self.sharded, self.modules, self.make, prefix=full + ".")
        sub.run()
        for name, kind in sub.out.inserted.items():
            self.out.inserted[f"{node.target}.{name}"] = kind
            self.out.at[f"{node.target}.{name}"] = node.name
        if sub.out.vocab_outputs:  # the block returns vocabulary-split logits: so does its call
            self._vocab_output(node, full)
        # the block stays itself (its class, its place in the tree: FSDP2 may wrap it, names hold):
        # only its forward becomes the rewritten graph's, which reads the very same submodules
        module.forward = inner.forward

    def run(self) -> Rewritten:
        self.lower_modules()
        for node in list(self.graph.nodes):
            for arg in node.all_input_nodes:
                target = _param_target(arg)
                style = self._style(target) if target else None
                if style is not None:
                    self._rewrite_use(node, arg, target, *style)
        self.graph.lint()
        self.gm.recompile()
        return self.out

    def _rewrite_use(self, node: fx.Node, weight: fx.Node, target: str, module: str, style: str) -> None:
        if node.op == "call_function" and node.target in LINEARS and len(node.args) > 1 and node.args[1] is weight:
            if style == "rowwise":
                self._row(node, module)
            else:
                self._column(node, module, style)
        elif node.op == "call_function" and node.target in LINEARS and len(node.args) > 2 and node.args[2] is weight:
            pass  # a bias: its linear is rewritten through its weight
        elif node.op == "call_function" and node.target in EMBEDDINGS and style == "vocab":
            self._embedding(node, weight, module)
        else:
            raise ConfigError("model.tp_plan", f"{module} ({target}) is read by {node.format_node()}, which tensor "
                                               "parallelism cannot shard: a split weight may only feed a linear "
                                               f"projection{' or an embedding lookup' if style == 'vocab' else ''}")

    def _column(self, node: fx.Node, module: str, style: str) -> None:
        x = node.args[0]
        if x not in self.copies:
            with self.graph.inserting_after(x):
                self.copies[x] = self.graph.call_module(self._add("copy", self.make.copy(module), module, node), (x,))
        node.args = (self.copies[x], *node.args[1:])
        if style == "vocab":
            self._vocab_output(node, module)

    def _vocab_output(self, node: fx.Node, module: str) -> None:
        users = [u for u in node.users if u.op != "output"]
        if users:
            raise ConfigError("model.tp_plan", f"{module}'s vocabulary-split logits are read by "
                                               f"{', '.join(u.format_node() for u in users)}; only a loss computed on "
                                               "the shards (the stage's output scored by the launcher's "
                                               f"cross-entropy) may read them: plan {module} as replicate, or use "
                                               "model.loss=causal_lm")
        self.out.vocab_outputs.add(node.name)

    def _row(self, node: fx.Node, module: str) -> None:
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        node.args, node.kwargs = (node.args[0], node.args[1]), {}
        users = list(node.users)
        with self.graph.inserting_after(node):
            reduced = self.graph.call_module(self._add("reduce", self.make.reduce(module), module, node), (node,))
        last = reduced
        if bias is not None:
            with self.graph.inserting_after(reduced):
                last = self.graph.call_function(operator.add, (reduced, bias))
        for user in users:
            user.replace_input_with(node, last)
        self.out.carried[node.name] = last.name

    def _embedding(self, node: fx.Node, weight: fx.Node, module: str) -> None:
        if node.target is F.embedding:
            ids, padding = node.args[0], (node.args[2] if len(node.args) > 2 else node.kwargs.get("padding_idx"))
        else:  # aten.embedding(weight, indices, padding_idx=-1, ...)
            ids, padding = node.args[1], (node.args[2] if len(node.args) > 2 else -1)
        padding = None if padding is None or padding < 0 else int(padding)
        name = self._add("embedding", self.make.embedding(module, padding), module, node)
        node.op, node.target, node.args, node.kwargs = "call_module", name, (ids, weight), {}


def parallelize(gm: fx.GraphModule, sharded: Mapping[str, Sharded], modules: Mapping[str, str],
                make: Collectives) -> Rewritten:
    """Rewrite a stage's graph (at local shapes) in place with the collectives its split
    parameters need; refuse, naming the module, a split weight read by anything but a linear
    projection or an embedding lookup, and vocabulary-split logits read by anything but the
    stage's output. `sharded` is keyed by the stage graph's own parameter names."""
    return _Rewriter(gm, sharded, modules, make).run()


#: the rewrite's inserted modules whose output every tp rank holds whole and equal
_SAME_AFTER = ("_tp_copy_", "_tp_reduce_", "_tp_embedding_")


def replicated_values(gm: fx.GraphModule, sharded: Mapping[str, Sharded], inputs: Sequence[bool] | None = None,
                      prefix: str = "") -> dict[str, bool]:
    """Per node of a rewritten graph: whether every tp rank computes the very same value
    (replicated) or its own part of it (split). A split parameter's reads are split, `f`, `g` and the
    vocabulary-parallel lookup give replicated values, anything else is replicated when all it reads
    is (dropout too: the tp ranks of a pipeline rank draw from one random stream). An eager block
    the rewrite traced inside is followed into its graph. `inputs`: the placeholders' status in
    order (default: replicated, as the data is). Why: a replicated value crossing a stage boundary
    need only be sent 1/tp by each rank (Megatron's scatter-gather)."""
    same: dict[fx.Node, bool] = {}
    placeholders = iter(inputs or ())
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            same[node] = next(placeholders, True)
        elif node.op == "get_attr":
            same[node] = prefix + str(node.target) not in sharded
        elif node.op == "call_module" and str(node.target).rsplit(".", 1)[-1].startswith(_SAME_AFTER):
            same[node] = True
        elif node.op == "call_module":
            module = gm.get_submodule(node.target)
            inner = getattr(module.forward, "__self__", None)
            args = [same.get(a, True) if isinstance(a, fx.Node) else True for a in node.args]
            if isinstance(inner, fx.GraphModule) and inner is not module:  # a block rewritten inside
                out = replicated_values(inner, sharded, args, f"{prefix}{node.target}.")
                same[node] = out["output"] and all(same[a] for a in node.kwargs.values() if isinstance(a, fx.Node))
            else:
                own = not any(f"{prefix}{node.target}.{n}" in sharded for n, _ in module.named_parameters())
                same[node] = own and all(same[a] for a in node.all_input_nodes)
        else:
            same[node] = all(same[a] for a in node.all_input_nodes)
    return {n.name: v for n, v in same.items()}  # the output node's name is "output"


def trace_local(model: nn.Module, trace: Callable[[nn.Module], TracedModel], modules: Mapping[str, str],
                tp: int) -> tuple[TracedModel, dict[str, Sharded]]:
    """The meta `model` at one tp rank's shapes (`shard_meta`), traced by `trace`: the model's own
    code runs at the local shapes, so a split or reshape by a size of the whole model fails here,
    refused in the model's terms (`tp_refusals.local_failure`)."""
    sharded = shard_meta(model, modules, tp)
    try:
        traced = trace(model)
    except ConfigError:
        raise
    except Exception as err:  # noqa: BLE001 - whatever the model's code raised on the local shapes
        raise local_failure(err, model, trace, modules, tp) from None
    return traced, sharded


#: the calls that regroup a tensor's dimensions, whose local result must split the head (outer) factor
_RESHAPES = {torch.Tensor.view, torch.Tensor.reshape, torch.reshape}


class _ReshapeLog(TorchFunctionMode):
    """Every view/reshape a forward runs: (the module running it, input shape, output shape)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.calls: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
        self.where: list[str] = []
        self._hooks = [h for name, m in model.named_modules() for h in (
            m.register_forward_pre_hook(lambda mod, args, name=name: self._enter(name)),
            m.register_forward_hook(lambda mod, args, out: self._leave()))]

    def _enter(self, name: str) -> None:
        self.where.append(name)

    def _leave(self) -> None:  # a hook returning a value would replace the module's output
        self.where.pop()

    def close(self) -> None:
        for h in self._hooks:
            h.remove()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _RESHAPES and isinstance(out, torch.Tensor) and isinstance(args[0], torch.Tensor):
            self.calls.append((self.where[-1] if self.where else "", tuple(args[0].shape), tuple(out.shape)))
        return out


def _reshapes(model: nn.Module, args: Sequence[torch.Tensor]) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    log = _ReshapeLog(model)
    try:  # a block repeated alike is checked once (its copies reshape alike)
        with repeated_modules_once(model), log, torch.no_grad():
            model(*args)
    finally:
        log.close()
    return log.calls


def _split_as_heads(full_in: Sequence[int], full_out: Sequence[int], local_in: Sequence[int],
                    tp: int) -> tuple[int, ...] | None:
    """What a reshape of `full_in` to `full_out` gives on a tp rank whose input is `local_in` (one
    dimension 1/tp, a contiguous block of it), when the block is the outermost factor of the output
    dimensions that dimension is cut into (heads, not the width of a head); None: no split dimension."""
    split = [i for i, (a, b) in enumerate(zip(full_in, local_in, strict=True)) if a != b]
    if len(split) != 1:
        return None
    i = split[0]
    before = math.prod(full_in[:i])
    out = list(full_out)
    for j in range(len(out)):  # the first output dimension starting at or after the split one's start
        if math.prod(full_out[:j]) >= before and out[j] > 1:
            if out[j] % tp:
                return None
            out[j] //= tp
            return tuple(out)
    return None


_GRAPH_RESHAPES = {torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default,
                   torch.reshape, "view", "reshape"}


def _graph_reshapes(traced: TracedModel) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    """The view/reshape nodes of a traced graph with their shapes (what a forward that cannot run
    eagerly on meta is checked on; reshapes inside leaf modules are not in it)."""
    calls = []
    for node in traced.gm.graph.nodes:
        if node.op in ("call_function", "call_method") and node.target in _GRAPH_RESHAPES and node.args:
            src, out = getattr(node.args[0], "meta", {}).get("tensor_meta"), node.meta.get("tensor_meta")
            if hasattr(src, "shape") and hasattr(out, "shape"):
                stack = node.meta.get("nn_module_stack") or {}
                where = next(reversed(stack.values()))[0] if stack else node.name
                calls.append((str(where), tuple(src.shape), tuple(out.shape)))
    return calls


def check_local_reshapes(full: nn.Module, local: nn.Module, args: Sequence[torch.Tensor], tp: int,
                         trace: Callable[[nn.Module], TracedModel]) -> None:
    """Refuse a forward that reshapes a split tensor by a size of its own: run on meta at the full
    shapes and at one tp rank's, each view/reshape of a split dimension must cut the tp rank's
    block as the outermost factor (`view(b, t, -1, head_dim)` gives the rank's heads); a count
    baked in (`view(b, t, self.heads, -1)`) keeps the shapes consistent but narrows every head,
    which would train a different model without an error. A forward that cannot run eagerly on
    meta (transformers' mask helpers read values) is checked on its traced graphs instead."""
    try:
        full_calls, local_calls = _reshapes(full, args), _reshapes(local, args)
    except Exception:  # noqa: BLE001 - a forward reading values: its traced graphs carry the shapes
        full_calls, local_calls = _graph_reshapes(trace(full)), _graph_reshapes(trace(local))
    if len(full_calls) != len(local_calls):
        return  # a forward branching on shapes: the cut check (`local_split`) refuses it
    for (where, full_in, full_out), (_, local_in, local_out) in zip(full_calls, local_calls, strict=True):
        if len(full_in) != len(local_in) or tuple(full_in) == tuple(local_in):
            continue
        expected = _split_as_heads(full_in, full_out, local_in, tp)
        if expected is not None and tuple(local_out) != expected:
            raise ConfigError("model.tp_plan", f"{where or 'the model'} reshapes a tensor split over tp={tp} ranks "
                                               f"with a size of its own: {list(full_in)} -> {list(full_out)} at full "
                                               f"size gives {list(local_out)} on a tp rank, where its share of the "
                                               f"heads would be {list(expected)}. Its forward bakes a count in "
                                               "(view(b, t, self.heads, -1)); read it from the tensor "
                                               "(view(b, t, -1, head_dim)), or plan that module as replicate")


def local_split(model: nn.Module, trace: Callable[[nn.Module], TracedModel], assignment: Mapping[str, int],
                num_stages: int, modules: Mapping[str, str], tp: int,
                device: torch.device | None = None) -> tuple[SplitModel, dict[str, Sharded]]:
    """The meta `model` at its local shapes (`trace_local`), cut by the plan's `assignment` (on
    `device` when given: a rank's). The trace must give the very nodes the plan cut (a forward
    whose graph changes with the shapes cannot be split by the same assignment)."""
    traced, sharded = trace_local(model, trace, modules, tp)
    if set(assignment) - {n.name for n in traced.gm.graph.nodes}:
        missing = sorted(set(assignment) - {n.name for n in traced.gm.graph.nodes})[:5]
        raise ConfigError("tp", f"traced with its planned modules split over tp={tp} ranks, the model's graph has "
                                f"other operators than at full size (missing {', '.join(missing)}): its forward "
                                "branches on shapes, and the plan's split cannot be applied; use tp=1")
    if device is not None:
        retarget(traced.gm, device)
    return split_model(traced, dict(assignment), num_stages), sharded
