"""Trace a model into a torch.fx GraphModule plus a networkx cost graph.

Why: the partitioners reason about a plain DAG (nodes with costs, edges with bytes), while the stage
builder needs the fx graph to cut real code. Both come from one trace so node names line up.

The cost graph holds only compute nodes (call_module / call_function / call_method). Placeholders are
model inputs that any stage can read from the data loader, and get_attr nodes (parameters, buffers,
constants) are replicated into whichever stage reads them, so neither is something to place or send.
Their parameter names are folded into the consumer's `params` attribute, which is how tied weights show
up: one canonical parameter name listed by nodes in two stages.
"""

from __future__ import annotations

import io
import logging
import sys
import textwrap
import types
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, redirect_stderr
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.passes.shape_prop import ShapeProp, TensorMetadata, _extract_tensor_metadata

from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.graph.derived import derived_nodes, sent_bytes
from pipelaunch.pipeline.graph.recompute import block_of
from pipelaunch.pipeline.graph.stamp import Repeated, stamped_export

COMPUTE_OPS = ("call_module", "call_function", "call_method")


class TraceError(ConfigError):
    """Neither torch.fx nor torch.export could capture the model. The message names the submodule
    and the source line where tracing broke, and what to do: keep that submodule whole as a leaf
    module (then every partitioner works, `partitioner=manual` with split points included)."""

    def __init__(self, module_name: str, fx_error: BaseException, export_error: BaseException | None,
                 site: tuple[str, str] | None = None) -> None:
        detail = f"torch.fx: {type(fx_error).__name__}: {_first_line(fx_error)}"
        if export_error is not None:
            detail += f"; torch.export: {type(export_error).__name__}: {_first_line(export_error)}"
        if site is None:
            where, fix = "", ("mark the submodules that cannot be traced as leaf modules (`model.leaf_modules=[...]`, "
                              "each kept whole on one stage)")
        elif site[0]:
            where = f" in submodule {site[0]!r} at {site[1]}"
            fix = (f"keep that submodule whole as a leaf module (`model.leaf_modules=[{site[0]}]`: it is then "
                   "called as one operation and placed on one stage)")
        else:
            where = f" in the model's own forward at {site[1]}"
            fix = ("move that operation into a submodule and list it in `model.leaf_modules`, since the top-level "
                   "forward itself must be traceable")
        super().__init__(
            "partitioner",
            f"cannot trace model {module_name!r}{where} ({detail}). Automatic partitioning needs a traced "
            f"graph: {fix}; then any partitioner works, or choose the cuts yourself with `partitioner=manual "
            "partitioner.split_points=[...]`.",
        )


@contextmanager
def _quiet_export() -> Iterator[None]:
    """torch.export logs and prints to stderr each graph it gives up on; our TraceError says it
    once. What it writes on success is passed on."""
    logger = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level, captured = logger.level, io.StringIO()
    logger.setLevel(logging.ERROR)
    try:
        with redirect_stderr(captured):
            yield
        sys.stderr.write(captured.getvalue())
    finally:
        logger.setLevel(level)


def _first_line(exc: BaseException) -> str:
    """An error's first line, cut at a word to about 300 characters (never mid-word)."""
    text = str(exc).strip().splitlines()
    return textwrap.shorten(text[0], width=300, placeholder=" ...") if text else ""


def failure_site(model: nn.Module, exc: BaseException) -> tuple[str, str] | None:
    """(qualified submodule name, 'file:line: source') of the innermost frame of `exc` that runs a
    forward of one of `model`'s modules: where tracing broke, in the user's code."""
    import linecache

    names = {id(m): name for name, m in model.named_modules()}
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        frames.append(tb)
        tb = tb.tb_next
    for tb in reversed(frames):
        owner = tb.tb_frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and id(owner) in names:
            code = tb.tb_frame.f_code
            line = linecache.getline(code.co_filename, tb.tb_lineno).strip()
            return names[id(owner)], f"{code.co_filename}:{tb.tb_lineno} ({type(owner).__name__}.{code.co_name}): {line}"
    return None


@dataclass
class TracedModel:
    """One trace of a model: the fx GraphModule and the cost graph derived from it.

    `input_names` are the placeholder targets in call order; `output_node` is the fx output node's
    name. `out_spec` is set for torch.export traces, whose graphs return a flat tuple.
    """

    gm: fx.GraphModule
    graph: nx.DiGraph
    input_names: list[str]
    output_node: str
    method: str = "fx"
    out_spec: Any = None
    param_aliases: dict[str, str] = field(default_factory=dict)

    def topological_order(self) -> list[str]:
        """Compute nodes in fx program order (always a topological order of the DAG)."""
        return [n for n in self.graph.nodes]


class LeafTracer(fx.Tracer):
    """An fx tracer that keeps the user-named submodules (and anything inside them) opaque."""

    def __init__(self, leaf_modules: Iterable[str] = ()) -> None:
        super().__init__()
        self.leaf_names = set(leaf_modules)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if module_qualified_name in self.leaf_names:
            return True
        return super().is_leaf_module(m, module_qualified_name)


def _check_leaf_names(module: nn.Module, leaf_modules: Iterable[str]) -> list[str]:
    names = list(leaf_modules)
    valid = {n for n, _ in module.named_modules() if n}
    unknown = [n for n in names if n not in valid]
    if unknown:
        raise ConfigError(
            "model.leaf_modules",
            f"unknown submodule(s) {unknown}; valid names include {sorted(valid)[:50]}",
        )
    return names


def _as_tuple(example_inputs: Any) -> tuple[Any, ...]:
    if isinstance(example_inputs, tuple):
        return example_inputs
    if isinstance(example_inputs, list):
        return tuple(example_inputs)
    return (example_inputs,)


def _fx_trace(module: nn.Module, leaf_modules: Sequence[str]) -> fx.GraphModule:
    tracer = LeafTracer(leaf_modules)
    graph = tracer.trace(module)
    name = module.__class__.__name__
    return fx.GraphModule(tracer.root, graph, name)


def _fake_on_cpu(t: torch.Tensor, mode: FakeTensorMode) -> torch.Tensor:
    fake = FakeTensor(mode, t, torch.device("cpu"))
    return nn.Parameter(fake, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else fake


@contextmanager
def _no_stack_traces() -> Iterator[None]:
    """Export without each node's Python stack trace (`node.meta["stack_trace"]`): nothing here
    reads it (a node's module comes from `nn_module_stack`, which export still records), and
    capturing and symbolizing one per node was a quarter of an 80-layer model's export."""
    before = torch.fx.config.do_not_emit_stack_traces
    torch.fx.config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        torch.fx.config.do_not_emit_stack_traces = before


def _export_trace(module: nn.Module, args: tuple[Any, ...]) -> tuple[fx.GraphModule, Any]:
    """torch.export of a model whose tensors are on the meta device. Export runs on fake tensors
    that claim to live on the CPU (a meta tensor plus a device), so constants the forward makes on
    its input's device (diffusers' `torch.tensor([t], device=sample.device)`) keep their values; the
    exported module is then pointed back at the model's own meta tensors, by name. Shapes come from
    export's own `val` metadata, so nothing runs twice."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    swapped = []
    for mod in module.modules():
        for store in (mod._parameters, mod._buffers):
            for key, t in list(store.items()):
                if t is not None and t.device.type == "meta":
                    swapped.append((store, key, t))
                    store[key] = _fake_on_cpu(t, mode)
    fake_args = tuple(FakeTensor(mode, a, torch.device("cpu")) if isinstance(a, torch.Tensor) and a.device.type == "meta"
                      else a for a in args)
    try:
        with _no_stack_traces():
            ep = torch.export.export(module, fake_args, strict=False)
    finally:
        for store, key, t in swapped:
            store[key] = t
    gm = ep.module(check_guards=False)
    for path, sub in gm.named_modules():
        for store in (sub._parameters, sub._buffers):
            for key, t in list(store.items()):
                if isinstance(t, FakeTensor):
                    owner = module.get_submodule(path) if path else module
                    store[key] = owner._parameters.get(key, owner._buffers.get(key))
    for node in list(gm.graph.nodes):  # guard-check stubs and metadata asserts: no users, nothing to place
        stub = node.op == "call_module" and node.target.startswith("_guards")
        check = node.op == "call_function" and node.target is torch.ops.aten._assert_tensor_metadata.default
        if (stub or check) and not node.users:
            gm.graph.erase_node(node)
    for node in gm.graph.nodes:
        if "val" in node.meta:
            node.meta["tensor_meta"] = _metadata(node.meta["val"])
    gm.graph.lint()
    gm.recompile()
    return gm, getattr(gm, "_out_spec", None)


_SIMPLE = (int, float, str, bool, type(None), torch.dtype, torch.device)
_SKIP_ATTRS = {"training", "_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"}


def module_key(module: nn.Module) -> tuple | None:
    """What a module's output shapes can depend on besides its inputs: its class, every
    submodule's class and plain settings (stride, heads, eps...), every tensor's shape and dtype.
    None when a setting is not a plain value (then the module is run, not looked up)."""
    parts = []
    for name, sub in module.named_modules():
        settings = []
        for key, value in sorted(vars(sub).items()):
            if key in _SKIP_ATTRS or key.endswith("hooks") or key.startswith("_"):
                continue
            if key == "forward":  # a forward the tp rewrite replaced (`module.forward = graph.forward`): its code
                code = getattr(getattr(value, "__self__", None), "code", None)
                if not isinstance(code, str):
                    return None
                settings.append((key, code))
                continue
            if isinstance(value, types.FunctionType) and value.__closure__ is None:  # a module-level function
                settings.append((key, f"{value.__module__}.{value.__qualname__}"))  # (ep_local's dispatch)
                continue
            flat = value if isinstance(value, (tuple, list)) else (value,)
            if not all(isinstance(v, _SIMPLE) for v in flat):
                return None
            settings.append((key, tuple(flat) if isinstance(value, (tuple, list)) else value))
        tensors = [(k, tuple(t.shape), t.dtype) for k, t in [*sub._parameters.items(), *sub._buffers.items()]
                   if t is not None]
        parts.append((name, type(sub), tuple(settings), tuple(tensors)))
    return tuple(parts)


def _args_key(args: Any) -> tuple | None:
    flat = []
    for a in torch.utils._pytree.tree_leaves(args):
        if isinstance(a, torch.Tensor):
            flat.append(("t", tuple(a.shape), a.dtype, a.device.type, a.requires_grad))
        elif isinstance(a, _SIMPLE):
            flat.append(a)
        else:
            return None
    return tuple(flat)


class RepeatedOutputs:
    """A module's output looked up, not recomputed, when a module configured alike already ran on
    inputs laid out alike: for passes on meta or fake tensors that read only shapes and dtypes
    (shape propagation, pricing, autocast's dtypes, the tp reshape check). A chain of 128 identical
    decoder blocks then runs one of them: meta kernels are Python decompositions, milliseconds per
    op, and a 1T GPT's block took 25 ms a pass. Outputs are fresh tensors of the recorded shapes,
    strides and dtypes on the recorded device (fake ones under an active FakeTensorMode). Only
    without autograd: a looked-up output has no history to differentiate."""

    def __init__(self, shapes_only: bool = False) -> None:
        #: `shapes_only`: outputs are read for their metadata alone, so autograd may be on (the
        #: looked-up output keeps `requires_grad`, with no history)
        self._seen: dict[tuple, Any] = {}
        self.shapes_only = shapes_only

    def call(self, module: nn.Module, fn: Callable[..., Any], args: Any, kwargs: Any, mkey: tuple | None = None) -> Any:
        """`fn(*args, **kwargs)`, the forward of `module`, or the recorded output of its twin
        (`mkey`: the module's `module_key`, when known)."""
        if torch.is_grad_enabled() and not self.shapes_only:
            return fn(*args, **kwargs)
        mkey, akey = mkey or module_key(module), _args_key((args, kwargs))
        if mkey is None or akey is None:
            return fn(*args, **kwargs)
        key = (mkey, akey)
        if key not in self._seen:
            out = fn(*args, **kwargs)
            if not all(isinstance(v, (torch.Tensor, *_SIMPLE)) for v in torch.utils._pytree.tree_leaves(out)):
                return out  # an output that is not plain tensors and values (a cache object): always run
            self._seen[key] = out
            return out
        return torch.utils._pytree.tree_map(fresh_like, self._seen[key])


def fresh_like(value: Any) -> Any:
    """A new tensor of `value`'s shape, strides, dtype and device (and whether it needs a
    gradient), uninitialised; anything else as it is: a recorded output handed to a node's twin."""
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device,
                                   requires_grad=value.requires_grad)
    return value


@contextmanager
def repeated_modules_once(model: nn.Module) -> Iterator[None]:
    """Inside, an eager forward of `model` without autograd runs each repeated module (the
    outermost modules configured alike, two or more of them) once per input layout
    (`RepeatedOutputs`): for an eager pass that reads only shapes."""
    keys = {name: module_key(m) for name, m in model.named_modules() if name}
    counts: dict[tuple, int] = {}
    for key in keys.values():
        if key is not None:
            counts[key] = counts.get(key, 0) + 1
    chosen = {name for name, key in keys.items() if key is not None and counts[key] > 1}
    outermost = [n for n in chosen if not any(".".join(n.split(".")[:i]) in chosen for i in range(1, n.count(".") + 1))]
    memo, patched = RepeatedOutputs(), []
    for name in outermost:
        module = model.get_submodule(name)
        module.forward = _looked_up(memo, module, module.forward, keys[name])
        patched.append(module)
    try:
        yield
    finally:
        for module in patched:
            del module.forward


def _looked_up(memo: RepeatedOutputs, module: nn.Module, forward: Callable[..., Any], key: tuple) -> Callable[..., Any]:
    return lambda *args, **kwargs: memo.call(module, forward, args, kwargs, key)


class ShapeFailure(RuntimeError):
    """A node of a traced graph failed while its shapes were propagated: the node and the model's
    own error (torch's ShapeProp prints a traceback and raises a message holding the whole node)."""

    def __init__(self, node: fx.Node, cause: BaseException) -> None:
        where = innermost_module(node)
        super().__init__(f"{type(cause).__name__}: {_first_line(cause)} (at {node.name}"
                         f"{f' in {where}' if where else ''})")
        self.node, self.cause = node, cause


class RepeatAwareShapeProp(ShapeProp):
    """ShapeProp that runs a leaf module once per distinct (module configuration, input shapes)
    (`RepeatedOutputs`; shape propagation runs without autograd). A failing node raises
    `ShapeFailure`, torch's own traceback print silenced."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self._repeats = RepeatedOutputs(shapes_only=True)

    def run_node(self, n: fx.Node) -> Any:
        try:
            with redirect_stderr(io.StringIO()):
                return super().run_node(n)
        except RuntimeError as err:
            if isinstance(err.__cause__, ShapeFailure):
                raise err.__cause__ from None
            raise ShapeFailure(n, err.__cause__ or err) from err.__cause__

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        module = self.fetch_attr(target)
        if not all(t.device.type == "meta" for t in torch.utils._pytree.tree_leaves((args, kwargs))
                   if isinstance(t, torch.Tensor)):
            return super().call_module(target, args, kwargs)
        return self._repeats.call(module, lambda *a, **k: super(RepeatAwareShapeProp, self).call_module(target, a, k),
                                  args, kwargs)


def _metadata(val: Any) -> Any:
    if isinstance(val, torch.Tensor):
        return _extract_tensor_metadata(val)
    if isinstance(val, (list, tuple)):
        return type(val)(_metadata(v) for v in val) if not hasattr(val, "_fields") else None
    return None


def random_ops(gm: fx.GraphModule) -> list[tuple[str, str]]:
    """(operator, innermost module) of every node whose result depends on the random generator
    (torch's `nondeterministic_seeded` tag: rand, bernoulli, exponential_...), leaving out a dropout
    or attention dropout of probability 0, which draws nothing that matters."""
    found = []
    for node in gm.graph.nodes:
        op = node.target
        if node.op != "call_function" or not isinstance(op, torch._ops.OpOverload):
            continue
        if torch.Tag.nondeterministic_seeded not in op.tags:
            continue
        names = [a.name for a in op._schema.arguments]
        p_name = next((n for n in ("p", "dropout_p") if n in names), None)
        if p_name is not None:
            i = names.index(p_name)
            p = node.kwargs.get(p_name, node.args[i] if i < len(node.args) else op._schema.arguments[i].default_value)
            if p == 0:
                continue
        found.append((str(op.overloadpacket.__name__), innermost_module(node) or ""))
    return found


def retarget(gm: fx.GraphModule, device: torch.device) -> None:
    """Point every device an export trace baked into the graph (`arange(..., device=cpu)`: export
    traces on the CPU) at `device`, the one the graph will really run on; and let a `.to(device)`
    keep its value's dtype (`_device_only`)."""
    def fix(arg: Any) -> Any:
        return device if isinstance(arg, torch.device) and arg.type in ("meta", "cpu") and arg != device else arg

    changed = False
    for node in gm.graph.nodes:
        args, kwargs = fx.node.map_aggregate(node.args, fix), fx.node.map_aggregate(node.kwargs, fix)
        if _device_only(node):
            kwargs = {**kwargs, "dtype": None}
        if args != node.args or kwargs != node.kwargs:
            node.args, node.kwargs, changed = args, kwargs, True
    if changed:
        gm.recompile()


def _device_only(node: fx.Node) -> bool:
    """Export records `x.to(device)` as `aten.to.dtype_layout` with the dtype x had while tracing
    (`.to(dtype)` is `aten.to.dtype`). Baked in, it would cast back to fp32 a value a compute
    dtype made bf16 (FSDP2's bf16 parameters at zero >= 1: GPT-2's position embedding, then added
    to the token embedding, meets a bf16 LayerNorm, which CPU layer_norm refuses); the eager
    `.to(device)` keeps the value's dtype, and so does the node without it (the same at fp32)."""
    if node.op != "call_function" or node.target is not torch.ops.aten.to.dtype_layout or not node.args:
        return False
    val = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
    return node.kwargs.get("dtype") is not None and getattr(val, "dtype", None) == node.kwargs["dtype"]


def is_static(meta: Any) -> bool:
    """True when every size in a `tensor_meta` value is a plain integer. An export trace keeps a
    size that depends on the data as a symbol (how many tokens an MoE router sends to an expert):
    the graph computes it for any batch, but nothing may be sized from it ahead of time."""
    if isinstance(meta, TensorMetadata):
        return all(isinstance(d, int) for d in meta.shape)
    if isinstance(meta, (list, tuple)):
        return all(is_static(m) for m in meta)
    if isinstance(meta, dict):
        return all(is_static(m) for m in meta.values())
    return True


def meta_bytes(meta: Any) -> int:
    """Bytes of every tensor in a ShapeProp `tensor_meta` value (which may be nested); a tensor
    whose size depends on the data counts as 0 (it never crosses a stage boundary, see
    `build_cost_graph`)."""
    if isinstance(meta, TensorMetadata):
        if not is_static(meta):
            return 0
        numel = 1
        for d in meta.shape:
            numel *= int(d)
        return numel * torch.empty((), dtype=meta.dtype).element_size()
    if isinstance(meta, (list, tuple)):
        return sum(meta_bytes(m) for m in meta)
    if isinstance(meta, dict):
        return sum(meta_bytes(m) for m in meta.values())
    return 0


def _meta_shape(meta: Any) -> Any:
    if isinstance(meta, TensorMetadata):
        if not is_static(meta):
            return None
        return [list(map(int, meta.shape)), str(meta.dtype).replace("torch.", "")]
    if isinstance(meta, (list, tuple)):
        return [_meta_shape(m) for m in meta]
    if isinstance(meta, dict):
        return {k: _meta_shape(v) for k, v in meta.items()}
    return None


def canonical_param_names(module: nn.Module) -> tuple[dict[int, str], dict[str, str]]:
    """Map each parameter/buffer object to its first qualified name, and every alias to that name."""
    by_id: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, t in [
        *module.named_parameters(remove_duplicate=False),
        *module.named_buffers(remove_duplicate=False),
    ]:
        canon = by_id.setdefault(id(t), name)
        if canon != name:
            aliases[name] = canon
    return by_id, aliases


def _node_params(gm: fx.GraphModule, node: fx.Node, by_id: dict[int, str]) -> list[str]:
    """Canonical names of the parameters a compute node reads (its module's, or via get_attr inputs)."""
    found: list[str] = []
    if node.op == "call_module":
        sub = gm.get_submodule(node.target)
        found += [by_id[id(p)] for p in sub.parameters() if id(p) in by_id]
    for inp in node.all_input_nodes:
        if inp.op == "get_attr":
            obj = _fetch_attr(gm, inp.target)
            if isinstance(obj, nn.Parameter) and id(obj) in by_id:
                found.append(by_id[id(obj)])
    return list(dict.fromkeys(found))


def _fetch_attr(gm: nn.Module, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _node_target(node: fx.Node) -> str:
    t = node.target
    if isinstance(t, str):
        return t
    return getattr(t, "__qualname__", None) or getattr(t, "__name__", None) or str(t)


def innermost_module(node: fx.Node) -> str | None:
    """The module an op runs inside (the last entry of its recorded module stack), if any."""
    stack = [path for path, _ in (node.meta.get("nn_module_stack") or {}).values() if path]
    return stack[-1] if stack else None


def _leaf_of(node: fx.Node, leaves: set[str]) -> str | None:
    """The outermost user-named leaf module a node runs inside (export records the module stack)."""
    if node.op == "call_module" and node.target in leaves:
        return node.target
    for path, _ in (node.meta.get("nn_module_stack") or {}).values():
        if path in leaves:
            return path
    return None


def build_cost_graph(gm: fx.GraphModule, leaves: Iterable[str] = ()) -> nx.DiGraph:
    """The DAG of compute nodes, annotated with what tracing and shape propagation know. `leaf` names
    the leaf module a node belongs to: nodes of one leaf are never split across stages (an export
    trace is op by op, so a transformers decoder layer is kept whole this way)."""
    leaves = set(leaves)
    by_id, _ = canonical_param_names(gm)
    g = nx.DiGraph()
    derived = derived_nodes(gm)
    param_sizes: dict[str, int] = {}
    for p_name, p in gm.named_parameters():
        param_sizes[by_id.get(id(p), p_name)] = p.numel() * p.element_size()
    order = 0
    for node in gm.graph.nodes:
        if node.op not in COMPUTE_OPS:
            continue
        meta = node.meta.get("tensor_meta")
        params = _node_params(gm, node, by_id)
        g.add_node(
            node.name,
            op=node.op,
            target=_node_target(node),
            module=node.target if node.op == "call_module" else innermost_module(node),
            params=params,
            param_bytes=sum(param_sizes.get(p, 0) for p in params),
            shape=_meta_shape(meta),
            output_bytes=meta_bytes(meta),
            # a value sized by the data is contracted with its consumers like a tuple: never sent,
            # since a receiver allocates from shapes fixed at plan time
            single_tensor=isinstance(meta, TensorMetadata) and is_static(meta),
            reads_inputs=[i.name for i in node.all_input_nodes if i.op == "placeholder"],
            order=order,
            leaf=_leaf_of(node, leaves),
            # computed from the inputs alone: every stage reading it rebuilds it (graph/derived.py)
            derived=node.name in derived,
            # the block it computes in, the unit recomputation reruns (graph/recompute.py)
            block=block_of(node),
        )
        order += 1
        for inp in node.all_input_nodes:
            if inp.op in COMPUTE_OPS:
                g.add_edge(inp.name, node.name)
    for u, v in g.edges:
        g.edges[u, v]["bytes"] = sent_bytes(g.nodes[u])
    out = next(n for n in gm.graph.nodes if n.op == "output")
    g.graph["param_sizes"] = param_sizes
    g.graph["outputs"] = [n.name for n in out.all_input_nodes if n.op in COMPUTE_OPS]
    g.graph["inputs"] = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    return g


def trace_model(
    module: nn.Module,
    example_inputs: Any,
    leaf_modules: Iterable[str] = (),
    name: str | None = None,
    repeated: Repeated | None = None,
) -> TracedModel:
    """Trace with torch.fx (user leaves kept whole), fall back to torch.export, then propagate shapes.

    `example_inputs` is one tensor or a tuple of positional inputs; small real tensors are enough
    (shape propagation runs the model once on them). `repeated`: where the model's alike blocks
    are, so that its export is made from one at a depth of two and three (`stamp.py`).
    """
    leaves = _check_leaf_names(module, leaf_modules)
    args = _as_tuple(example_inputs)
    label = name or module.__class__.__name__
    method, out_spec = "fx", None
    try:
        gm = _fx_trace(module, leaves)
    except ConfigError:  # the model's wrapper refusing a setting (model.output): no tracer would do better
        raise
    except Exception as fx_error:  # noqa: BLE001 - any tracing failure means "try the next tracer"
        try:
            with _quiet_export():
                made = None if repeated is None else stamped_export(module, lambda m: _export_trace(m, args), repeated)
                gm, out_spec = made or _export_trace(module, args)
            method = "export"
        except ConfigError:
            raise
        except Exception as export_error:  # noqa: BLE001
            raise TraceError(label, fx_error, export_error, failure_site(module, fx_error)) from export_error
    if method == "fx":
        with torch.no_grad():
            RepeatAwareShapeProp(gm).propagate(*args)
    graph = build_cost_graph(gm, leaves)
    if graph.number_of_nodes() == 0:
        raise ConfigError("model", f"traced model {label!r} has no compute nodes to partition")
    _, aliases = canonical_param_names(gm)
    inputs = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    output = next(n.name for n in gm.graph.nodes if n.op == "output")
    return TracedModel(gm, graph, inputs, output, method, out_spec, aliases)
