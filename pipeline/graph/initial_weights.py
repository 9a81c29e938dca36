"""The weights a run starts from: the model as its author builds it, written once, read by name.

Why: a pipeline run must start from exactly the weights `torch.manual_seed(seed); factory()` gives
in the user's own script, whatever the layout, or the first losses a user compares with their own
script differ and pp=2 trains another model than pp=1. No initialiser re-run per rank can promise
that: a constructor may draw into several layers in one call (timm's `named_apply`), rescale
tensors by name after initialising them (nanoGPT's `c_proj`), or compute buffers; the only faithful
source is the constructor itself, run for real. So the model is built once per node on the CPU,
under the run's seed, its tensors are written to one safetensors file, and each rank reads only its
own stages' tensors from it by name (`safe_open` maps the file: no rank reads the whole model).

`InitialWeights` is a `ModelSpec.load`-style reader (`keys`, `load`) over that file; `built_as_written`
is the one way the model is built for it, shared by the launcher, the split check and the tests'
single-process reference.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch import nn

#: the file's metadata key holding {canonical name: [the other names of that tensor]} (ties)
ALIASES_KEY = "pipelaunch.aliases"


def model_bytes(model: nn.Module) -> int:
    """Bytes of a (meta) model's distinct parameters and buffers."""
    sizes = {id(t): t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]}
    return sum(sizes.values())


def built_as_written(build: Callable[[], nn.Module], seed: int) -> nn.Module:
    """`torch.manual_seed(seed); build()` on the CPU, as a user's own script does it; the caller's
    global generator is left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.device("cpu"):
            return build()


def distinct_tensors(model: nn.Module) -> dict[str, list[str]]:
    """Every distinct parameter and buffer, by its first name, with its other names (tied)."""
    names: dict[int, list[str]] = {}
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(t), []).append(name)
    return {ns[0]: ns[1:] for ns in names.values()}


@torch.no_grad()
def load_into(model: nn.Module, load) -> list[str]:
    """Read every tensor `load` (the `ModelSpec.load` protocol) holds into the real `model`, under
    any of its tied names; returns the names it lacks."""
    lookup = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    aliases = distinct_tensors(model)
    return load.load([(name, lookup[name].data) for name in aliases], aliases)


@torch.no_grad()
def write_initial_weights(model: nn.Module, path: Path) -> int:
    """Write every distinct tensor of `model` (a real one) to the safetensors file `path`, ties as
    aliases in its metadata, atomically (a reader never sees half a file); returns the bytes written."""
    from safetensors.torch import save_file

    lookup = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    aliases = distinct_tensors(model)
    tensors, storages = {}, set()
    for name in aliases:
        t = lookup[name].detach()
        if t.device.type == "meta":
            raise ValueError(f"{name} is on the meta device: the model was not built for real")
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        # safetensors stores each tensor alone: a view of another's storage is written as a copy
        t = t.contiguous() if key not in storages else t.clone()
        storages.add(key)
        tensors[name] = t
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    save_file(tensors, str(partial), metadata={ALIASES_KEY: json.dumps({k: v for k, v in aliases.items() if v})})
    partial.replace(path)
    return sum(t.numel() * t.element_size() for t in tensors.values())


class InitialWeights:
    """Reads a rank's tensors by name from the file `write_initial_weights` wrote: the `ModelSpec.load`
    protocol (`keys`, `load`), so `pipeline.graph.materialize` treats it like any checkpoint."""

    #: not a checkpoint the split check copies into its reference: the reference is the same build
    checkpoint = False

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._index: dict[str, str] | None = None

    def index(self) -> dict[str, str]:
        """Every name the file answers to (a tied alias too) -> the key it is stored under."""
        if self._index is None:
            from safetensors import safe_open

            with safe_open(str(self.path), "pt", device="cpu") as f:
                keys = list(f.keys())
                aliases = json.loads((f.metadata() or {}).get(ALIASES_KEY, "{}"))
            self._index = {k: k for k in keys} | {a: k for k, names in aliases.items() for a in names}
        return self._index

    def keys(self) -> set[str]:
        return set(self.index())

    @torch.no_grad()
    def load(self, tensors: Iterable[tuple[str, torch.Tensor]], aliases: dict[str, list[str]]) -> list[str]:
        """Copy the constructor's value into each (name, real tensor), found under the name or a tied
        alias; returns the names the file lacks or holds with another shape."""
        from safetensors import safe_open

        index, missing = self.index(), []
        with safe_open(str(self.path), "pt", device="cpu") as f:
            for name, t in tensors:
                key = next((index[k] for k in (name, *aliases.get(name, ())) if k in index), None)
                value = None if key is None else f.get_tensor(key)
                if value is None or value.shape != t.shape:
                    missing.append(name)
                    continue
                t.copy_(value)
        return missing
