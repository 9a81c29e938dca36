"""A user's own mixture-of-experts layers under `model=module`: the modules its `ep_plan` names
hold their experts as one `nn.ModuleList`, and expert parallelism (`ep > 1`) splits that list.

The contract (transformers' `ep_dispatch_experts` one, which models/hf_moe.py hooks): a module the
plan names is called as `experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])` and
returns [T, H], each token's k picked experts' outputs weighted and summed; the router stays
outside it, in the model's own code (its softmax or sigmoid, its top-k, its own aux loss). Its
experts are the one `nn.ModuleList` it holds (experts alike in their parameters' shapes), and its
forward picks expert `e` as `self.<list>[e]` for `e < len(self.<list>)` (the positions, not a
count kept apart): the runtime calls that same forward with a rank's own experts in the list.

How: each named module's class is swapped for a subclass of it and `ListExperts` (`adopt`), as
models/hf_moe.py does for transformers' modules: outside ep its forward is the user's, in a trace
it is one call (a leaf of torch.fx, one opaque operator under torch.export). Under ep the list is
replaced by this rank's experts (`LocalExperts`, keyed by their global index, so every parameter
keeps its full-model name and a checkpoint holds each expert whole under it), and the user's
forward runs on the rows the rank receives, one expert per row at the row's weight (`compute`).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping

import torch
from torch import nn

from pipelaunch.models.hf_moe import HFExperts, mixed
from pipelaunch.pipeline.core.errors import ConfigError

#: the style an ep_plan entry names (transformers' own, for a module reached by token dispatch)
DISPATCH_STYLE = "ep_dispatch_experts"


class LocalExperts(nn.Module):
    """A rank's share of an experts list, each expert under its global index (`experts.5.w1`),
    indexed, iterated and counted by position as the `nn.ModuleList` it replaces."""

    def __init__(self, experts: Mapping[int, nn.Module]) -> None:
        super().__init__()
        for index, expert in experts.items():
            self.add_module(str(index), expert)

    def __getitem__(self, position: int) -> nn.Module:
        return list(self._modules.values())[position]

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self._modules.values())


class ListExperts(HFExperts):
    """Mixed into a user's experts module's class (`adopt`): `HFExperts`' forward (counting,
    packing, dispatch), its experts the `nn.ModuleList` child `list_name`."""

    list_name: str

    @property
    def local(self) -> int:
        return len(getattr(self, self.list_name))

    @local.setter
    def local(self, value: int) -> None:
        if value != self.local:
            raise AttributeError("a list of experts is cut by `keep`, not by setting `local`")

    def opaque_params(self) -> list[torch.Tensor]:
        return list(self.parameters())

    def expert_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return getattr(self, self.list_name).named_parameters(prefix=self.list_name)

    def keep(self, first: int, local: int) -> None:
        """Hold only experts `first` .. `first + local - 1` (a rank's share), under their indices."""
        experts = getattr(self, self.list_name)
        setattr(self, self.list_name, LocalExperts({first + i: experts[first + i] for i in range(local)}))
        self.first = first

    def whole_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        """Every expert's parameter shapes by full-model name (the rank's first expert's: alike)."""
        first = getattr(self, self.list_name)[0]
        return {f"{prefix}.{self.list_name}.{e}.{n}": tuple(p.shape) for e in range(self.total)
                for n, p in first.named_parameters()}

    def balanced(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, H] dealt evenly to the local experts, each called on its share (unweighted): what
        a shape-only pass computes (planning), a balanced routing's FLOPs and bytes."""
        n = x.shape[0]
        per = -(-n // self.local)
        padded = torch.cat([x, x.new_zeros(per * self.local - n, *x.shape[1:])])
        return torch.cat([expert(chunk) for expert, chunk in zip(self.local_experts(), padded.split(per), strict=True)])[:n]

    def local_experts(self) -> Iterator[nn.Module]:
        return iter(getattr(self, self.list_name))


def _pattern(key: str) -> re.Pattern:
    return re.compile(re.escape(key).replace(r"\*", r"[^.]+") + "$")


def _expert_list(name: str, module: nn.Module) -> str:
    """The one `nn.ModuleList` child of `module` its experts are (refused otherwise, naming why)."""
    lists = [n for n, m in module.named_children() if isinstance(m, nn.ModuleList)]
    if len(lists) != 1:
        found = f"holds {len(lists)} ({', '.join(lists)})" if lists else "holds none"
        raise ConfigError("model.ep_plan", f"{name} ({type(module).__name__}) is named there, and its experts need to "
                                           f"be one nn.ModuleList child of it; it {found}. Name the module whose "
                                           "forward(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) calls "
                                           "them (models/list_experts.py)")
    experts = getattr(module, lists[0])
    shapes = {tuple((n, tuple(p.shape)) for n, p in e.named_parameters()) for e in experts}
    if len(experts) < 2 or len(shapes) != 1 or not next(iter(shapes)):
        raise ConfigError("model.ep_plan", f"{name}.{lists[0]} holds {len(experts)} experts; ep splits two or more "
                                           "experts with parameters of one set of shapes (alike MLPs)")
    return lists[0]


def adopt(model: nn.Module, plan: Mapping[str, str], prefix: str = "") -> list[str]:
    """Each module of `model` an entry of `plan` ({module-name pattern, `*` one component:
    ep_dispatch_experts}) names made a `ListExperts` in place; returns their names (the trace
    keeps each one call). A pattern naming no module, or another style, is refused."""
    names = []
    for key, style in plan.items():
        if style != DISPATCH_STYLE:
            raise ConfigError("model.ep_plan", f"{key}: {style!r}; valid: {DISPATCH_STYLE} (the module its routed "
                                               "tokens are dispatched to)")
        pattern = _pattern(prefix + key)
        matched = [(n, m) for n, m in model.named_modules() if n and pattern.match(n)]
        if not matched:
            raise ConfigError("model.ep_plan", f"{key!r} names no module of the model; valid: its modules' qualified "
                                               "names, `*` for one component (layers.*.moe.experts)")
        for name, module in matched:
            if not isinstance(module, ListExperts):
                list_name = _expert_list(name.removeprefix(prefix), module)
                module.__class__ = mixed(type(module), ListExperts)
                module.list_name = list_name
                module.total = len(getattr(module, list_name))
                module.first, module.dispatch, module.top_k, module.counts = 0, None, None, None
                module.bias_update_rate = None
            names.append(name)
    return names
