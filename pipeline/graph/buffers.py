"""Buffers as a module's own constructor computes them, for a model built on the meta device.

Why: built on the meta device, a constructor's buffers have shapes and no values (a rotary
embedding's `inv_freq`, a causal mask, DiT's sin-cos position table), and no initialiser computes
them again (`reset_parameters` is about parameters), so each would start from the fallback (zeros,
or random) and every rank would train another model than the one written, without a word. Here the
constructor runs once more with every parameter moved to the meta device as it is registered (no
parameter memory, no initialisation cost) and its buffers computed for real on the CPU, under a
fixed seed, so a buffer drawn at random is the same on every rank. A rank then reads its stages'
buffers by name, as it reads weights from a checkpoint (`ModelSpec.load`, `materialize(load=...)`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

#: the global seed a constructor runs under whenever the pipeline builds a model (every rank the same)
CONSTRUCTOR_SEED = 0


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """While open, each parameter a module registers is moved to the meta device on registration;
    buffers and other tensors stay where the constructor made them (accelerate's
    `init_empty_weights(include_buffers=False)` does the same)."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


@contextmanager
def constructor_seed() -> Iterator[None]:
    """The global CPU generator at CONSTRUCTOR_SEED, restored afterwards."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(CONSTRUCTOR_SEED)
        yield


class ConstructorBuffers:
    """The buffers `make()` computes for real, read by name: the `ModelSpec.load` protocol (`keys`,
    `load`). Built once per process, on first use (a rank asks only when its stages hold a buffer).
    A buffer the constructor derives from a parameter stays on meta there and is not offered."""

    #: not a checkpoint: the split check compares these with the constructor's own, never copies them
    checkpoint = False

    def __init__(self, make: Callable[[], nn.Module]) -> None:
        self.make = make
        self._values: dict[str, torch.Tensor] | None = None

    def values(self) -> dict[str, torch.Tensor]:
        """Every buffer of the module (under each of its names) that its constructor computed."""
        if self._values is None:
            with constructor_seed(), torch.device("cpu"), parameters_on_meta():
                module = self.make()
            self._values = {n: b for n, b in module.named_buffers(remove_duplicate=False) if b.device.type != "meta"}
        return self._values

    def keys(self) -> set[str]:
        return set(self.values())

    def load(self, tensors: Iterable[tuple[str, torch.Tensor]], aliases: dict[str, list[str]]) -> list[str]:
        """Copy the constructor's value into each (name, real tensor) it has one for, under the name
        or a tied alias; returns the names it has none for (left to the initialisers)."""
        values, missing = self.values(), []
        for name, t in tensors:
            key = next((k for k in (name, *aliases.get(name, ())) if k in values), None)
            if key is None or values[key].shape != t.shape:
                missing.append(name)
                continue
            with torch.no_grad():
                t.copy_(values[key])
        return missing
