"""Sequence parallelism over the tp ranks (Megatron's, Korthikanti et al. 2022): a second rewrite
of a stage graph the tensor-parallel rewrite (`tensor_parallel.py`) has placed `f` and `g` in.

Why: between a row-parallel projection's `g` and the next column-parallel projection's `f` every
tp rank computes the same norms, dropouts and residual adds on the same whole activations; their
saved tensors are tp copies of one another. Under sequence parallelism each rank keeps only its
1/tp of the positions there: `g` becomes a reduce-scatter along the sequence (the rank's positions
of the summed output), `f` an all-gather (the whole sequence for the split projections; a
reduce-scatter of the gradient backward), the vocabulary-parallel lookup's sum a reduce-scatter.
The bytes a block moves are Megatron's (an all-reduce is a reduce-scatter plus an all-gather); the
activations between the split regions, and the stage boundaries there, are 1/tp.

The pass walks the graph on meta tensors (each node run on its inputs' meta values; an inserted
collective by its shape rule) with every value's layout over the tp ranks: `replicated` (whole
and equal), `sequence` (this rank's positions along one dimension) or `split` (a projection's
slice, partial sums). A `sequence` value may only meet operations that act on each position alone
(elementwise ops, norms over the last dimension, replicated projections: `_positionwise`); any
other reader gets the whole value first (an all-gather; its gradient this rank's part), so an
unknown operation costs communication, never correctness. A replicated operand broadcast along
the sequence (a positional table) is cut to this rank's positions (its gradient all-gathered
back); one broadcast over the positions (a norm's weight, a bias) gets a partial gradient on each
rank, so those parameters are named in `partial` and their gradients summed over the tp ranks once
per step (as Megatron does for its sequence-parallel norms). A read of a sequence value's shape
gives the whole shape.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import fx, nn
from torch.func import functional_call

from pipelaunch.pipeline.core.errors import ConfigError

REPLICATED, SEQUENCE, SPLIT = "replicated", "sequence", "split"

#: a value's layout: (kind, the sequence dimension when kind is SEQUENCE)
Layout = tuple[str, int | None]


@dataclass
class SequenceCollectives:
    """Makes the modules the pass inserts, each called on one tensor: `scatter(what, dim)` (g under
    sequence parallelism: reduce-scatter, all-gather backward), `gather(what, dim)` (f: all-gather,
    reduce-scatter backward), `to_whole(what, dim)` (all-gather; the gradient's own part back),
    `to_part(what, dim)` (this rank's part; the gradient all-gathered back), `partial(what)` (the
    value as it is; its gradient summed over the tp ranks: Megatron's f on a broadcast activation)."""

    scatter: Callable[[str, int], nn.Module]
    gather: Callable[[str, int], nn.Module]
    to_whole: Callable[[str, int], nn.Module]
    to_part: Callable[[str, int], nn.Module]
    partial: Callable[[str], nn.Module]


class _Chunk(nn.Module):
    def __init__(self, tp: int, dim: int) -> None:
        super().__init__()
        self.tp, self.dim = tp, dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.chunk(self.tp, self.dim)[0].contiguous()


class _Repeat(nn.Module):
    def __init__(self, tp: int, dim: int) -> None:
        super().__init__()
        self.tp, self.dim = tp, dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x] * self.tp, self.dim)


def shape_only(tp: int) -> SequenceCollectives:
    """Stand-ins with the collectives' shapes and no communication (the launcher's check, the
    planner's profile: the local work at the local shapes)."""
    return SequenceCollectives(scatter=lambda what, dim: _Chunk(tp, dim), gather=lambda what, dim: _Repeat(tp, dim),
                               to_whole=lambda what, dim: _Repeat(tp, dim), to_part=lambda what, dim: _Chunk(tp, dim),
                               partial=lambda what: nn.Identity())


class WholeShape(nn.Module):
    """A sequence value's shape as if whole (what the model's code reads of it)."""

    def __init__(self, tp: int, dim: int) -> None:
        super().__init__()
        self.tp, self.dim = tp, dim

    def forward(self, x: torch.Tensor, *index: int):
        shape = list(x.shape)
        shape[self.dim] *= self.tp
        return torch.Size(shape) if not index else shape[index[0]]


def _traced_source(node: fx.Node) -> fx.Node:
    """The traced node whose output `node` carries: itself, or for a collective a rewrite put in
    (`_tp_*`, `_sp_*` modules) the node it reads."""
    while node.op == "call_module" and str(node.target).startswith(("_tp_", "_sp_")) and node.args \
            and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


_MATMULS = {torch.ops.aten.linear.default, torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
            torch.ops.aten.matmul.default, nn.functional.linear, torch.matmul}


def _is_matmul(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether `node` is a projection (an nn.Linear call, or a linear or matrix product)."""
    if node.op == "call_module":
        return isinstance(gm.get_submodule(str(node.target)), nn.Linear)
    return node.op == "call_function" and node.target in _MATMULS


@dataclass
class SequenceRewrite:
    """What the pass did to one graph: every node's layout, the inserted modules (name -> kind) and
    the node each belongs to (where the planner prices it), and the parameters whose gradients are
    partial per tp rank (summed over the tp ranks once per step)."""

    layouts: dict[str, Layout] = field(default_factory=dict)
    inserted: dict[str, str] = field(default_factory=dict)
    at: dict[str, str] = field(default_factory=dict)
    partial: set[str] = field(default_factory=set)
    #: inserted module -> the bytes of the whole value it moves (what the planner prices), and the
    #: traced node whose output that value is (its dtype under autocast prices it under bf16)
    bytes: dict[str, int] = field(default_factory=dict)
    moves: dict[str, str] = field(default_factory=dict)
    #: the inserted modules whose value is a projection's output (autocast's compute dtype, where
    #: the moved value lies inside a leaf block, whose inner dtypes the planner does not trace)
    matmul: set[str] = field(default_factory=set)
    #: the tp rewrite's `f`/`g` replaced by their sequence-parallel forms (old name -> new)
    replaced: dict[str, str] = field(default_factory=dict)
    #: a node whose readers now read another (a lookup's: its reduce-scatter) -> that node
    carried: dict[str, str] = field(default_factory=dict)


#: elementwise and per-position operations, by name (torch functions, Tensor methods, aten overload
#: packets): they act on each position alone, so a sequence value's part gives the part of the result
_ELEMENTWISE = {
    "add", "sub", "mul", "div", "truediv", "neg", "pow", "rsqrt", "sqrt", "exp", "tanh", "sigmoid", "relu", "gelu",
    "silu", "erf", "dropout", "native_dropout", "feature_dropout", "to", "_to_copy", "float", "half", "bfloat16",
    "type_as", "type", "contiguous", "clone", "alias", "detach", "square", "reciprocal", "where", "clamp",
    "masked_fill", "softplus", "mish", "hardtanh", "leaky_relu", "abs", "sign", "log", "expm1", "log1p", "addcmul",
}
#: per-position operations over the last dimension(s) only (the sequence must lie left of them)
_LAST_DIMS = {"layer_norm", "native_layer_norm", "rms_norm", "softmax", "_softmax", "log_softmax", "linear",
              "mean", "sum", "amax", "amin", "var", "std", "norm", "matmul", "mm", "addmm", "t_linear"}
_REDUCTIONS = {"mean", "sum", "amax", "amin", "var", "std", "norm", "softmax", "_softmax", "log_softmax"}
_POSITIONWISE_MODULES = (nn.LayerNorm, nn.RMSNorm, nn.Dropout, nn.GELU, nn.SiLU, nn.ReLU, nn.Tanh, nn.Identity,
                         nn.Linear, nn.Sigmoid, nn.Softplus)
_SHAPE_ATTRS = {"dtype", "device", "ndim", "is_cuda", "requires_grad", "is_floating_point"}


def _name(node: fx.Node) -> str:
    if node.op == "call_method":
        return str(node.target)
    target = node.target
    packet = getattr(target, "overloadpacket", None)
    if packet is not None:
        return packet.__name__
    return getattr(target, "__name__", str(target))


def _meta(value):
    return fx.node.map_aggregate(value, lambda v: v.to("meta") if isinstance(v, torch.Tensor) else
                                 (torch.device("meta") if isinstance(v, torch.device) else v))


class _Pass:
    def __init__(self, gm: fx.GraphModule, make: SequenceCollectives, tp: int, seq_len: int,
                 sharded: Mapping[str, object], prefix: str, out: SequenceRewrite, top: str | None = None) -> None:
        self.gm, self.graph, self.make, self.tp, self.seq_len = gm, gm.graph, make, tp, seq_len
        self.sharded, self.prefix, self.out = sharded, prefix, out
        #: inside a block: the outer graph's node calling it (where what is inserted here is priced)
        self.top = top
        self.val: dict[fx.Node, object] = {}
        self.lay: dict[fx.Node, Layout] = {}
        self.wholes: dict[fx.Node, fx.Node] = {}
        #: per sequence value that is not a tensor (a tuple): dimensions right of the sequence's
        self.rights: dict[fx.Node, int] = {}

    # ---- inserting -----------------------------------------------------------------------------
    def _add(self, kind: str, module: nn.Module, owner: fx.Node, value=None) -> str:
        """Insert `module` (what `kind` of collective, moving `value` whole) into the graph."""
        base = f"_sp_{kind}_{owner.name}"
        name, k = base, 1
        while hasattr(self.gm, name):
            name, k = f"{base}_{k}", k + 1
        self.gm.add_module(name, module)
        self.out.inserted[self.prefix + name] = kind
        self.out.at[self.prefix + name] = self.top or owner.name
        if isinstance(value, torch.Tensor):
            self.out.bytes[self.prefix + name] = value.numel() * value.element_size()
            source = _traced_source(owner)
            self.out.moves[self.prefix + name] = self.top or source.name
            if _is_matmul(self.gm, source):
                self.out.matmul.add(self.prefix + name)
        return name

    def _whole(self, node: fx.Node) -> fx.Node:
        """`node` (a sequence value) all-gathered, once however many read it."""
        if node not in self.wholes:
            _, dim = self.lay[node]
            value = torch.cat([self.val[node]] * self.tp, dim)
            with self.graph.inserting_after(node):
                whole = self.graph.call_module(self._add("to_whole", self.make.to_whole(node.name, dim), node, value),
                                               (node,))
            self.val[whole] = value
            self.lay[whole] = (REPLICATED, None)
            self.wholes[node] = whole
        return self.wholes[node]

    def _before(self, node: fx.Node, arg: fx.Node, kind: str, module: nn.Module, value, layout: Layout) -> fx.Node:
        with self.graph.inserting_before(node):
            new = self.graph.call_module(self._add(kind, module, arg, self.val[arg]), (arg,))
        self.val[new], self.lay[new] = value, layout
        node.replace_input_with(arg, new)
        return new

    # ---- the walk ------------------------------------------------------------------------------
    def run(self, inputs: Sequence[tuple[object, Layout]], keep: Callable[[str], bool]) -> Layout:
        given = iter(inputs)
        result: Layout = (REPLICATED, None)
        for node in list(self.graph.nodes):
            if node.op == "placeholder":
                value, layout = next(given, (None, (REPLICATED, None)))
                self.val[node], self.lay[node] = value, layout
            elif node.op == "get_attr":
                self.val[node] = _meta(fx.graph_module._get_attr(self.gm, str(node.target)))
                self.lay[node] = (SPLIT, None) if self.prefix + str(node.target) in self.sharded else (REPLICATED, None)
            elif node.op == "output":
                result = self._output(node, keep)
            else:
                self._step(node)
        self.graph.lint()
        self.gm.recompile()
        return result

    def _output(self, node: fx.Node, keep: Callable[[str], bool]) -> Layout:
        """Sequence values may leave only where `keep(key)` allows (a stage's boundary values, by
        name; a block's single output); the others leave whole."""
        outs = node.args[0]
        named = dict(outs) if isinstance(outs, dict) else dict(enumerate(outs)) if isinstance(outs, (tuple, list)) \
            else {0: outs}
        single = len(named) == 1 and not isinstance(outs, dict)
        for key, arg in named.items():
            if isinstance(arg, fx.Node) and self.lay[arg][0] == SEQUENCE and not (keep(str(key)) and
                                                                             (single or isinstance(outs, dict))):
                node.replace_input_with(arg, self._whole(arg))
        if not single:
            return (REPLICATED, None)
        arg = node.args[0]
        return self.lay[arg] if isinstance(arg, fx.Node) else (REPLICATED, None)

    def _step(self, node: fx.Node) -> None:
        tail = str(node.target).rsplit(".", 1)[-1] if node.op == "call_module" else ""
        if tail.startswith("_tp_reduce_"):
            self._reduce(node)
        elif tail.startswith("_tp_embedding_"):
            self._embedding(node)
        elif tail.startswith("_tp_copy_"):
            self._copy(node)
        elif node.op == "call_module" and self._inner(node) is not None:
            self._block(node)
        else:
            self._op(node)
        self.out.layouts[self.prefix + node.name] = self.lay[node]

    def _is_sequence_shaped(self, value) -> bool:
        return isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == self.seq_len \
            and self.seq_len % self.tp == 0

    def _part(self, value: torch.Tensor, dim: int) -> torch.Tensor:
        return value.chunk(self.tp, dim)[0].contiguous()

    def _reduce(self, node: fx.Node) -> None:
        """g: partial sums in; under sequence parallelism this rank's positions of their sum out."""
        (x,) = node.args
        value = self.val[x]
        if self.lay[x][0] == SPLIT and self._is_sequence_shaped(value):
            owner = str(node.target)
            node.target = self._add("scatter", self.make.scatter(self._what(owner), 1), node, value)
            self.out.replaced[self.prefix + owner] = self.prefix + str(node.target)
            self.gm.delete_submodule(owner)
            self.val[node], self.lay[node] = self._part(value, 1), (SEQUENCE, 1)
        else:
            self.val[node], self.lay[node] = value, (REPLICATED, None)

    def _embedding(self, node: fx.Node) -> None:
        """The vocabulary-parallel lookup: its rows summed over the tp ranks by a reduce-scatter."""
        ids, weight = (self.val[a] for a in node.args)
        value = torch.empty((*ids.shape, weight.shape[1]), dtype=weight.dtype, device="meta")
        module = self.gm.get_submodule(str(node.target))
        if not self._is_sequence_shaped(value) or not hasattr(module, "reduce_output"):
            self.val[node], self.lay[node] = value, (REPLICATED, None)
            return
        module.reduce_output = False
        users = list(node.users)
        with self.graph.inserting_after(node):
            scattered = self.graph.call_module(self._add("scatter", self.make.scatter(self._what(str(node.target)), 1),
                                                         node, value), (node,))
        self.out.replaced[self.prefix + str(node.target)] = self.prefix + str(scattered.target)
        for user in users:
            user.replace_input_with(node, scattered)
        self.out.carried[self.prefix + node.name] = self.prefix + scattered.name
        self.val[node], self.lay[node] = value, (SPLIT, None)
        self.val[scattered], self.lay[scattered] = self._part(value, 1), (SEQUENCE, 1)
        self.out.layouts[self.prefix + scattered.name] = (SEQUENCE, 1)

    def _copy(self, node: fx.Node) -> None:
        """f: a sequence value all-gathered for the split projections (reduce-scatter backward)."""
        (x,) = node.args
        kind, dim = self.lay[x]
        if kind == SEQUENCE:
            owner = str(node.target)
            self.val[node] = torch.cat([self.val[x]] * self.tp, dim)
            node.target = self._add("gather", self.make.gather(self._what(owner), dim), node, self.val[node])
            self.out.replaced[self.prefix + owner] = self.prefix + str(node.target)
            self.gm.delete_submodule(owner)
        else:
            self.val[node] = self.val[x]
        self.lay[node] = (REPLICATED, None)

    def _what(self, inserted: str) -> str:
        """The module a tp collective belongs to, as its log label names it (else its own name)."""
        label = getattr(self.gm.get_submodule(inserted), "label", None)
        return label.split(" ", 2)[-1] if isinstance(label, str) else inserted

    def _inner(self, node: fx.Node) -> fx.GraphModule | None:
        module = self.gm.get_submodule(str(node.target))
        inner = getattr(module.forward, "__self__", None)
        return inner if isinstance(inner, fx.GraphModule) and inner is not module else None

    def _block(self, node: fx.Node) -> None:
        """A block the tp rewrite traced inside: the pass runs through its graph, its arguments'
        layouts in; its output may stay a sequence value (the residual stream)."""
        inner = self._inner(node)
        placeholders = [n for n in inner.graph.nodes if n.op == "placeholder"]
        given = [*node.args, *(node.kwargs.get(p.name, p.args[0] if p.args else None)
                               for p in placeholders[len(node.args):])]
        args = [(self.val[a], self.lay[a]) if isinstance(a, fx.Node) else (a, (REPLICATED, None)) for a in given]
        sub = _Pass(inner, self.make, self.tp, self.seq_len, self.sharded, f"{self.prefix}{node.target}.", self.out,
                    self.top or node.name)
        layout = sub.run(args, keep=lambda key: True)
        # the block's forward is the recompiled graph's (a bound method holds the old code)
        self.gm.get_submodule(str(node.target)).forward = inner.forward
        output = next(n for n in inner.graph.nodes if n.op == "output").args[0]
        self.val[node] = fx.node.map_aggregate(output, lambda n: sub.val[n] if isinstance(n, fx.Node) else n)
        self.lay[node] = layout

    def _right(self, node: fx.Node) -> int:
        """How many dimensions lie right of a sequence value's sequence dimension (broadcasting
        aligns values from the right, so per-position ops keep it)."""
        value, (_, dim) = self.val[node], self.lay[node]
        return self.rights[node] if not isinstance(value, torch.Tensor) else value.dim() - 1 - dim

    def _op(self, node: fx.Node) -> None:
        kinds = {self.lay[a][0] for a in node.all_input_nodes}
        if SEQUENCE in kinds and self._shape_read(node):
            return
        if SEQUENCE in kinds:
            seq = [a for a in node.all_input_nodes if self.lay[a][0] == SEQUENCE]
            rights = {self._right(a) for a in seq}
            if SPLIT in kinds or len(rights) > 1 or not self._positionwise(node, seq[0], next(iter(rights))):
                for a in seq:
                    node.replace_input_with(a, self._whole(a))
            else:
                self._cut_replicated(node, seq[0])
        value = self._run(node)
        self.val[node] = value
        kinds = {self.lay[a][0] for a in node.all_input_nodes}
        if SEQUENCE in kinds:
            source = next(a for a in node.all_input_nodes if self.lay[a][0] == SEQUENCE)
            right = self._right(source)
            if isinstance(value, torch.Tensor) and isinstance(self.val[source], torch.Tensor):
                right -= max(0, self.val[source].dim() - value.dim())  # trailing dimensions reduced away
            if isinstance(value, torch.Tensor):
                self.lay[node] = (SEQUENCE, value.dim() - 1 - right)
            else:  # a tuple of per-position results (a norm's output, mean and rstd)
                self.lay[node], self.rights[node] = (SEQUENCE, None), right
        elif SPLIT in kinds:
            self.lay[node] = (SPLIT, None)
        else:
            self.lay[node] = (REPLICATED, None)

    def _shape_read(self, node: fx.Node) -> bool:
        """`x.shape`, `x.size(...)`, `x.dtype` of a sequence value: the whole value's, no communication."""
        x = node.args[0] if node.args else None
        if not isinstance(x, fx.Node) or self.lay.get(x, (None, None))[0] != SEQUENCE:
            return False
        if node.op == "call_function" and node.target is getattr and node.args[1] in _SHAPE_ATTRS:
            self.val[node], self.lay[node] = getattr(self.val[x], node.args[1]), (REPLICATED, None)
            return True
        shape = (node.op == "call_function" and node.target is getattr and node.args[1] == "shape") or \
            (node.op == "call_method" and node.target == "size")
        if not shape:
            return False
        dim = self.lay[x][1]
        name = self._add("shape", WholeShape(self.tp, dim), node)
        self.out.inserted.pop(self.prefix + name)  # no communication
        index = tuple(node.args[1:]) if node.op == "call_method" else ()
        node.op, node.target, node.args, node.kwargs = "call_module", name, (x, *index), {}
        whole = list(self.val[x].shape)
        whole[dim] *= self.tp
        self.val[node] = torch.Size(whole) if not index else whole[index[0]]
        self.lay[node] = (REPLICATED, None)
        return True

    def _positionwise(self, node: fx.Node, seq: fx.Node, right: int) -> bool:
        """Whether `node` acts on each position alone, given its sequence input's sequence
        dimension `right` places from the last."""
        if node.op == "call_module":
            module = self.gm.get_submodule(str(node.target))
            if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
                return len(module.normalized_shape) <= right
            if isinstance(module, nn.Linear):
                return right >= 1
            return isinstance(module, _POSITIONWISE_MODULES)
        if node.op == "call_function" and node.target is operator.getitem:
            return not isinstance(self.val[node.args[0]], torch.Tensor)  # a tuple's element, not a slice
        name = _name(node)
        if name in _ELEMENTWISE:
            return True
        if name not in _LAST_DIMS or right < 1 or node.args[0] is not seq:
            return False  # the sequence value must be the operand acted on, its positions left of what is
        if name in ("layer_norm", "native_layer_norm", "rms_norm"):
            shape = node.args[1] if len(node.args) > 1 else node.kwargs.get("normalized_shape")
            return isinstance(shape, (list, tuple, torch.Size)) and len(shape) <= right
        if name in _REDUCTIONS:
            dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
            flat = dims if isinstance(dims, (list, tuple)) else [dims]
            rank = self.val[seq].dim()
            return dims is not None and all(isinstance(d, int) and d % rank > rank - 1 - right for d in flat)
        return True  # linear, matmul: the sequence value's last dimension contracted

    def _cut_replicated(self, node: fx.Node, seq: fx.Node) -> None:
        """The replicated operands of a per-position op on a sequence value: an elementwise op's
        cut to this rank's positions where they extend along the sequence (broadcasting aligns
        them from the right); otherwise (a norm's weight, a projection's) their gradient is partial."""
        right = self._right(seq)
        broadcasts = node.op != "call_module" and _name(node) in _ELEMENTWISE
        for arg in list(node.all_input_nodes):
            if self.lay[arg][0] != REPLICATED or not isinstance(self.val[arg], torch.Tensor):
                continue
            value = self.val[arg]
            at = value.dim() - 1 - right
            if broadcasts and 0 <= at < value.dim() and value.shape[at] == self.seq_len:
                self._before(node, arg, "to_part", self.make.to_part(arg.name, at), self._part(value, at),
                             (SEQUENCE, at))
            elif value.requires_grad or value.is_floating_point():
                self._partial(node, arg)
        if node.op == "call_module":  # a norm's or projection's own parameters
            module = self.gm.get_submodule(str(node.target))
            self.out.partial.update(f"{self.prefix}{node.target}.{n}" for n, _ in module.named_parameters())

    def _partial(self, node: fx.Node, arg: fx.Node) -> None:
        """A replicated operand broadcast over the positions: a parameter's gradient is summed over
        the tp ranks once per step; an activation's by Megatron's f here."""
        if arg.op == "get_attr" and isinstance(_param(self.gm, str(arg.target)), nn.Parameter):
            self.out.partial.add(self.prefix + str(arg.target))
        elif arg.op != "get_attr":
            self._before(node, arg, "partial", self.make.partial(arg.name), self.val[arg], (REPLICATED, None))

    def _run(self, node: fx.Node):
        args = fx.node.map_arg(node.args, lambda n: self.val[n])
        kwargs = fx.node.map_arg(node.kwargs, lambda n: self.val[n])
        args, kwargs = _meta(args), _meta(kwargs)
        try:
            if node.op == "call_function":
                return node.target(*args, **kwargs)
            if node.op == "call_method":
                self_, *rest = args
                return getattr(self_, node.target)(*rest, **kwargs)
            module = self.gm.get_submodule(str(node.target))
            tensors = {n: _meta(t) for n, t in [*module.named_parameters(), *module.named_buffers()]}
            return functional_call(module, tensors, tuple(args), kwargs)
        except Exception as err:  # noqa: BLE001 - whatever the op raised on meta
            raise ConfigError("sequence_parallel", f"{self.prefix}{node.name} ({node.format_node()[:200]}) cannot be "
                                                   f"followed on meta tensors to place sequence parallelism: "
                                                   f"{type(err).__name__}: {str(err)[:200]}; use "
                                                   "sequence_parallel=false") from err


def _param(gm: nn.Module, target: str):
    owner, _, attr = target.rpartition(".")
    module = gm.get_submodule(owner) if owner else gm
    return getattr(module, attr)


def sequence_parallel(gm: fx.GraphModule, make: SequenceCollectives, tp: int, seq_len: int,
                      sharded: Mapping[str, object], inputs: Sequence[tuple[torch.Tensor | None, Layout]],
                      keep: Callable[[str], bool]) -> SequenceRewrite:
    """Rewrite a stage graph (already rewritten by `tensor_parallel.parallelize`) in place for
    sequence parallelism. `inputs`: each placeholder's meta value and layout, in order; `keep(name)`:
    whether the stage's output `name` may leave as a sequence value (a stage boundary: yes; the
    value the loss scores: whole). Returns every node's layout, what was inserted and the parameters whose
    gradients are partial per tp rank."""
    out = SequenceRewrite()
    _Pass(gm, make, tp, seq_len, sharded, "", out).run(inputs, keep)
    return out


@dataclass(frozen=True)
class SequenceSetup:
    """What the sequence-parallel pass needs of a whole model: tp, the sequence length and the
    model's meta arguments (one micro-batch's)."""

    tp: int
    seq_len: int
    args: tuple[torch.Tensor, ...]


def sequence_setup(enabled: bool, spec, micro_batch_size: int, tp: int) -> SequenceSetup | None:
    """Under `sequence_parallel=true` and tp > 1, what the pass needs; refused, naming the key,
    where the model's input has no sequence dimension tp divides."""
    if not enabled or tp == 1:
        return None
    args = tuple(spec.meta_args(micro_batch_size))
    first = args[0]
    if first.dim() < 2 or first.shape[1] % tp:
        raise ConfigError("sequence_parallel", f"sequence parallelism cuts dimension 1 of the model's input (the "
                                               f"positions) over tp={tp} ranks, but model={spec.name}'s input has "
                                               f"shape {list(first.shape)}; valid: a sequence length tp divides "
                                               "(model.seq_len), or sequence_parallel=false")
    return SequenceSetup(tp, int(first.shape[1]), args)
