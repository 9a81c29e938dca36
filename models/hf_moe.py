"""transformers' mixture-of-experts layers under `model=hf`: their routed-experts modules kept as
one call each in the traced graph, so expert parallelism (`ep > 1`) can hook them as it hooks
`model=gpt`'s (`pipeline/runtime/experts.py`).

Which modules: those transformers' own expert-parallel plan dispatches tokens to
(`base_model_ep_plan`, style `ep_dispatch_experts`, e.g. `layers.*.mlp.experts`): experts modules
of the `@use_experts_implementation` kind, every parameter stacked along a leading dimension of
`num_experts`, called as `experts(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])`
and returning the weighted sum of each token's k expert outputs [T, H]. Mixtral, Qwen2-MoE,
Qwen3-MoE, OLMoE, DeepSeek-V3 and most MoE families of transformers 5 hold their experts so.
The router stays outside the experts module, in the exported graph: each model routes as it
does (softmax top-k, DeepSeek-V3's sigmoid, bias-corrected group-limited top-k, ...).

How: each such module's class is swapped, in place, for a subclass of it and `HFExperts`
(`adopt`): parameters, names and transformers' `isinstance` checks are unchanged, and outside
expert parallelism its forward is transformers' own. Under torch.export it is one call of an
opaque operator (`pipelaunch::hf_experts`, its parameters as arguments: the stamp of repeated
layers renames them with the layer), which `as_modules` turns back into a `call_module` of the
module itself once the graph is made (`ModelSpec.trace`). A stage then runs transformers' expert
code eagerly; a pass on meta or fake tensors (planning) computes a balanced load (`balanced`).

Under expert parallelism the runtime keeps `local = num_experts / ep` consecutive experts of each
module (`first`, `local`: transformers' `num_experts` follows `local`, so its code indexes the
rank's experts by local id) and sets `dispatch`: the model's (token, expert) rows, each carrying
its routing weight as one more column, are carried to the ranks holding their experts, where
transformers' own forward runs on them (`compute`: one expert per row, the row's own weight, so
its activation and its weighting are what one process computes), and each weighted row comes
back to be summed per token, in slot order, as transformers' `grouped_mm` sums them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import fx, nn

#: transformers' expert-parallel style for an experts module reached by token dispatch
DISPATCH_STYLE = "ep_dispatch_experts"
#: whether a forward is being exported (the module is then one opaque call)
_EXPORTING = [False]


def shapes_only(x: torch.Tensor) -> bool:
    """A pass that reads shapes alone (meta tensors, or fake ones under export or autocast's dtype
    pass): which expert a token picks is unknown."""
    from torch._subclasses.fake_tensor import is_fake

    return x.is_meta or is_fake(x)


@torch.library.custom_op("pipelaunch::hf_experts", mutates_args=())
def _opaque(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
            params: list[torch.Tensor]) -> torch.Tensor:
    """Stands for an experts module's call in an exported graph; never run (`as_modules`)."""
    raise RuntimeError("pipelaunch::hf_experts stands for an experts module in an exported graph and is "
                       "replaced by a call of the module (models/hf_moe.as_modules)")


@_opaque.register_fake
def _(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
      params: list[torch.Tensor]) -> torch.Tensor:
    return torch.empty_like(hidden)


class HFExperts:
    """Mixed into a transformers experts module's class (`adopt`). `total`: the module's experts
    in the whole model; `first`, `local`: this rank's share (all of them without ep); `dispatch`:
    under ep, how rows reach the ranks holding their experts (the runtime's `Dispatch`, called as
    `dispatch(self, rows, global expert ids)` and calling back `compute`); `top_k`: the experts
    a token picks (read from the traced call); `counts`: tokens per expert since the trainer last
    read them (router statistics); `bias_update_rate`: what the gate's correction bias moves by
    after each step (`balance_by_bias`; None: it stays)."""

    total: int
    first: int
    dispatch: Callable | None
    top_k: int | None
    counts: torch.Tensor | None
    bias_update_rate: float | None

    @property
    def local(self) -> int:
        return self.num_experts

    @local.setter
    def local(self, value: int) -> None:
        self.num_experts = value

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        if _EXPORTING[0]:
            return torch.ops.pipelaunch.hf_experts(hidden_states, top_k_index, top_k_weights, self.opaque_params())
        t, k = top_k_index.shape
        self.top_k = k
        if shapes_only(hidden_states):  # a balanced load, its FLOPs and bytes
            rows = self.balanced(hidden_states.repeat_interleave(k, dim=0))
            return (rows.view(t, k, -1) * top_k_weights.reshape(t, k, 1)).sum(dim=1).to(hidden_states.dtype)
        if torch._C._current_graph_task_id() == -1:  # not a rerun inside the backward (remat)
            with torch.no_grad():
                counts = torch.bincount(top_k_index.reshape(-1), minlength=self.total)
            self.counts = counts if self.counts is None else self.counts + counts
        if self.dispatch is None:
            return super().forward(hidden_states, top_k_index, top_k_weights)
        packed = torch.promote_types(hidden_states.dtype, top_k_weights.dtype)
        self._packing = (hidden_states.shape[-1], hidden_states.dtype, top_k_weights.dtype)
        rows = torch.cat([hidden_states.repeat_interleave(k, dim=0).to(packed),
                          top_k_weights.reshape(-1, 1).to(packed)], dim=1)
        out = self.dispatch(self, rows, top_k_index.reshape(-1))
        return out.view(t, k, -1).sum(dim=1).to(hidden_states.dtype)

    def opaque_params(self) -> list[torch.Tensor]:
        """What an exported call reads (`as_modules` finds the module by them)."""
        return list(self._parameters.values())

    def expert_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """The routed experts' parameters (relative names): transformers' stacked ones."""
        return self.named_parameters(recurse=False)

    def keep(self, first: int, local: int) -> None:
        """Hold only experts `first` .. `first + local - 1` (a rank's share): every stacked
        parameter cut along the experts."""
        for name, whole in list(self.named_parameters(recurse=False)):
            setattr(self, name, nn.Parameter(whole.data[first:first + local].clone(), requires_grad=whole.requires_grad))
        self.first, self.local = first, local

    def whole_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        """Each expert parameter's shape in the whole model, by full-model name."""
        return {f"{prefix}.{n}": (self.total, *p.shape[1:]) for n, p in self.named_parameters(recurse=False)}

    def compute(self, rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """The rows `forward` packed (a token, its routing weight last), each through this rank's
        expert `index` [N] (local ids) by transformers' own forward, top-1 at the row's weight:
        each row's weighted expert output [N, H]."""
        width, hidden_dtype, weight_dtype = self._packing
        x, w = rows[:, :width].to(hidden_dtype), rows[:, width:].to(weight_dtype)
        if rows.shape[0] == 0:  # none here: still connected, so the exchanges' backward runs on every rank
            return super().forward(x.sum(dim=0, keepdim=True), index.new_zeros((1, 1)), w.new_ones((1, 1)))[:0]
        return super().forward(x, index.reshape(-1, 1), w)

    def balanced(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, H] spread evenly over the local experts, one batched product each way, unweighted:
        what a shape-only pass computes (planning), a balanced routing's FLOPs and bytes."""
        n, h = x.shape
        per = -(-n // self.local)
        padded = torch.cat([x, x.new_zeros(per * self.local - n, h)]).view(self.local, per, h)
        proj = self._batched(padded, "gate_up_proj" if self.has_gate else "up_proj")
        proj = self._apply_gate(proj) if self.has_gate else self.act_fn(proj)
        out = self._batched(proj, "down_proj")
        if self.has_post_expert_norm:
            out = self.post_expert_norm(out)
        return out.reshape(-1, out.shape[-1])[:n]

    def _batched(self, x: torch.Tensor, name: str) -> torch.Tensor:
        weight = getattr(self, name)
        out = torch.bmm(x, weight if self.is_transposed else weight.transpose(1, 2))
        return out + getattr(self, f"{name}_bias").unsqueeze(1) if self.has_bias else out


_SUBCLASSES: dict[tuple[type, type], type] = {}


def mixed(cls: type, mixin: type = HFExperts) -> type:
    """`cls` with `mixin` before it (one class per pair, named as `cls`): what `adopt` swaps an
    experts module's class for, in place."""
    if (cls, mixin) not in _SUBCLASSES:
        _SUBCLASSES[cls, mixin] = type(cls.__name__, (mixin, cls), {"__module__": cls.__module__,
                                                                     "__doc__": cls.__doc__})
    return _SUBCLASSES[cls, mixin]


def _patterns(model: nn.Module) -> list[re.Pattern]:
    """The modules transformers' expert-parallel plans dispatch tokens to, as name patterns."""
    found = []
    for m in model.modules():
        config = getattr(m, "config", None)
        for sub in (config, *(getattr(config, k, None) for k in getattr(config, "sub_configs", None) or ())):
            plan = getattr(sub, "base_model_ep_plan", None) or {}
            found += [p for p, style in plan.items() if style == DISPATCH_STYLE]
    return [re.compile(r"(^|.*\.)" + re.escape(p).replace(r"\*", r"\d+") + "$") for p in dict.fromkeys(found)]


def supported(module: nn.Module) -> bool:
    """An experts module `HFExperts` can run: transformers' `@use_experts_implementation` kind,
    every parameter stacked along its `num_experts` experts."""
    n = getattr(module, "num_experts", None)
    params = list(module.named_parameters(recurse=False))
    return (hasattr(module, "_is_expert_parallel") and hasattr(module, "has_gate") and isinstance(n, int) and n > 0
            and bool(params) and all(p.dim() >= 2 and p.shape[0] == n for _, p in params))


def experts_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(name, module) of each experts module of `model` its ep plan dispatches to and `supported`."""
    patterns = _patterns(model)
    if not patterns:
        return
    for name, module in model.named_modules():
        if any(p.match(name) for p in patterns) and supported(module):
            yield name, module


#: where transformers' DeepSeek-V3 family keeps the correction bias its gate picks experts by,
#: beside the experts module (`mlp.gate.e_score_correction_bias` next to `mlp.experts`)
CORRECTION_BIAS = "gate.e_score_correction_bias"


def correction_bias_name(experts_name: str) -> str:
    """The name of the correction bias the gate beside the experts module `experts_name` picks by."""
    return f"{experts_name.rsplit('.', 1)[0]}.{CORRECTION_BIAS}" if "." in experts_name else CORRECTION_BIAS


def balance_by_bias(model: nn.Module, rate: float | None) -> None:
    """Each experts module of `model` whose gate has a correction bias gets `bias_update_rate`
    (DeepSeek-V3's auxiliary-loss-free balancing: models/moe.py `move_bias`, applied after each
    step by the runtime)."""
    buffers = {n for n, _ in model.named_buffers()}
    for name, module in model.named_modules():
        if isinstance(module, HFExperts):
            module.bias_update_rate = (rate or None) if correction_bias_name(name) in buffers else None


def adopt(model: nn.Module) -> list[int]:
    """Each experts module of `model` (`experts_modules`) made an `HFExperts` in place; returns
    their expert counts, in model order."""
    totals = []
    for _, module in experts_modules(model):
        if not isinstance(module, HFExperts):
            module.__class__ = mixed(type(module))
            module.total, module.first, module.dispatch, module.top_k, module.counts = \
                module.num_experts, 0, None, None, None
            module.bias_update_rate = None
        totals.append(module.total)
    return totals


@contextmanager
def opaque() -> Iterator[None]:
    """Inside, an exported `HFExperts` forward is one `pipelaunch::hf_experts` call."""
    before = _EXPORTING[0]
    _EXPORTING[0] = True
    try:
        yield
    finally:
        _EXPORTING[0] = before


def _owner(model: nn.Module, target: str) -> str | None:
    """The path of the deepest `HFExperts` module of `model` holding the parameter `target` (its
    own, or an expert's of a list: models/list_experts.py)."""
    parts = target.split(".")[:-1]
    for end in range(len(parts), 0, -1):
        path = ".".join(parts[:end])
        try:
            if isinstance(model.get_submodule(path), HFExperts):
                return path
        except AttributeError:
            continue
    return None


def as_modules(gm: fx.GraphModule, model: nn.Module) -> dict[str, str]:
    """Each `pipelaunch::hf_experts` call of `gm` (a trace of `model`) turned into a `call_module`
    of the experts module whose parameters it reads (the module of `model` itself, put in `gm` at
    its path), on its three inputs; the parameters' own reads dropped. Returns {node: module path}."""
    turned = {}
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.pipelaunch.hf_experts.default:
            continue
        params = list(node.args[3])
        paths = {_owner(model, str(p.target)) if p.op == "get_attr" else None for p in params}
        if len(paths) != 1 or None in paths:
            raise RuntimeError(f"{node.name}: an experts call reads other values than one module's parameters")
        path = paths.pop()
        module = model.get_submodule(path)
        owner, _, attr = path.rpartition(".")
        setattr(gm.get_submodule(owner) if owner else gm, attr, module)
        index = node.args[1]
        value = index.meta.get("val") if isinstance(index, fx.Node) else None
        if value is not None:
            module.top_k = int(value.shape[-1])
        node.op, node.target, node.args, node.kwargs = "call_module", path, tuple(node.args[:3]), {}
        for p in params:
            if not p.users:
                gm.graph.erase_node(p)
        turned[node.name] = path
    if turned:
        gm.graph.lint()
        gm.recompile()
    return turned
