"""From a meta-device model to real tensors: all of them (the reference) or one rank's stages only.

Why not `module.to_empty()`: it gives every holder of a tied tensor its own new tensor (the tie
breaks), and on an fx stage module it replaces the tensors a `get_attr` copied without touching the
full model the initialisers walk. Here each selected meta tensor gets exactly one real tensor, put
into every module that holds it (in the full model and in any stage module cut from it), so ties
survive and `pipelaunch.pipeline.graph.init.init_by_name` sees the real tensors under their full-model names.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

import torch
from torch import nn

from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.graph.init import init_by_name


def _holders(modules: Iterable[nn.Module]) -> Iterable[tuple[dict, str, torch.Tensor]]:
    seen: set[int] = set()
    for mod in modules:
        for sub in mod.modules():
            if id(sub) in seen:
                continue
            seen.add(id(sub))
            for store in (sub._parameters, sub._buffers):
                for name, t in store.items():
                    if t is not None:
                        yield store, name, t


def lookup(root: nn.Module, name: str) -> torch.Tensor:
    """The parameter or buffer at a fully-qualified name."""
    owner, _, attr = name.rpartition(".")
    mod = root.get_submodule(owner) if owner else root
    t = mod._parameters.get(attr, mod._buffers.get(attr))
    if t is None:
        raise KeyError(f"the model has no parameter or buffer named {name!r}")
    return t


def _held_by(root: nn.Module, name: str) -> torch.Tensor:
    """`lookup`, for a meta tensor a stage module holds: one the full model lacks is a tensor the
    module keeps as a plain attribute (fx made it a stage buffer), which nothing can give a value."""
    try:
        return lookup(root, name)
    except KeyError:
        raise ConfigError("model", f"{name} is a tensor the module keeps as a plain attribute, not a parameter or "
                                   "buffer: built on the meta device it has no value and nothing can give it one; "
                                   f"register it with register_buffer({name.rsplit('.', 1)[-1]!r}, ..., "
                                   "persistent=False)") from None


def to_meta_parameters(root: nn.Module) -> list[str]:
    """Put every parameter of `root` that is not on the meta device there (ties kept), and return
    their names: a model built under `torch.device("meta")` whose constructor still made some
    parameter for real (a factory the device context does not reach) then has every weight
    materialised, initialised and loaded by name like the rest, instead of keeping a value no
    initialiser chose."""
    moved: dict[int, nn.Parameter] = {}
    names = []
    for mod_name, mod in root.named_modules(remove_duplicate=False):
        for attr, p in list(mod._parameters.items()):
            if p is None or p.device.type == "meta":
                continue
            if id(p) not in moved:
                moved[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
                names.append(f"{mod_name}.{attr}" if mod_name else attr)
            mod._parameters[attr] = moved[id(p)]
    return names


@torch.no_grad()
def materialize(
    root: nn.Module,
    seed: int,
    device: torch.device,
    family_init=None,
    names: Collection[str] | None = None,
    also: Iterable[nn.Module] = (),
    load=None,
    initial=None,
    whole_init=None,
) -> list[str]:
    """Replace the meta tensors of `root` at the fully-qualified `names` (all when None) by real
    ones, give them their initial values, and move them to `device`. Modules in `also` (stage
    modules cut from `root`, whose tensors sit at the same qualified names) get the very same
    tensors. The initial values: with `initial` (`pipeline.graph.initial_weights.InitialWeights`),
    the constructor's own, read by name; else initialised by name (`init_by_name`, with
    `family_init` per module and `whole_init` model-wide). Returns the names that got the fallback
    initialisation. With `load` (pretrained weights, e.g. `pipelaunch.models.hf.SafetensorsDir`; or
    the constructor's buffers when initialising by name), the tensors it holds are then read by
    name, each under any of its names (tied), and only those: a tensor it lacks keeps its initial
    value."""
    wanted = None if names is None else {id(_held_by(root, n)) for n in names}
    fresh: dict[int, torch.Tensor] = {}
    for store, name, t in list(_holders([root])):
        if t.device.type != "meta" or (wanted is not None and id(t) not in wanted):
            continue
        new = fresh.get(id(t))
        if new is None:
            new = torch.empty_like(t, device="cpu")
            if isinstance(t, nn.Parameter):
                new = nn.Parameter(new, requires_grad=t.requires_grad)
            fresh[id(t)] = new
        store[name] = new
    made = {id(t): t for t in fresh.values()}  # the new real tensors, by their own identity
    constants = []
    for module in also:
        for path, sub in module.named_modules(remove_duplicate=False):
            for store in (sub._parameters, sub._buffers):
                for attr, t in list(store.items()):
                    if t is not None and t.device.type == "meta":
                        store[attr] = _held_by(root, f"{path}.{attr}" if path else attr)
                    elif t is not None and id(t) not in made:
                        constants.append((store, attr, t))  # a value the trace baked in (export's lifted constants)
    names_of: dict[int, list[str]] = {}
    for name, t in [*root.named_parameters(remove_duplicate=False), *root.named_buffers(remove_duplicate=False)]:
        if id(t) in made:
            names_of.setdefault(id(t), []).append(name)
    aliases = {ns[0]: ns[1:] for ns in names_of.values()}
    wanted_tensors = [(ns[0], made[i]) for i, ns in names_of.items()]
    if initial is not None:
        lacking = initial.load(wanted_tensors, aliases)
        if lacking:
            raise ConfigError("model", f"the model built for real lacks {len(lacking)} tensor(s) the model built on the "
                                       f"meta device holds ({', '.join(lacking[:6])}): its constructor builds another "
                                       "structure on the meta device; build the same modules whatever the device, or "
                                       "set init.weights=by_name")
        fell_back: list[str] = []
    else:
        fell_back = init_by_name(root, seed, family_init, whole_init)  # on the CPU generator, whatever the device
    if load is not None and made and (initial is None or getattr(load, "checkpoint", False)):
        missing = set(load.load(wanted_tensors, aliases))
        fell_back = [n for n in fell_back if n in missing]
    if device.type != "cpu":
        for t in made.values():
            t.data = t.data.to(device)
    for store, attr, t in constants:
        store[attr] = t.to(device)
    return fell_back
