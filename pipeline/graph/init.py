"""Initial weights that depend only on the seed and each tensor's fully-qualified name.

Why: for a model too large to build once on a node's CPU (`init.weights=by_name`, or above
`init.max_bytes`), each rank initialises only its own stages' tensors, yet every layout must start
from the same weights. (Every other model starts from its constructor's own values, built once and
read by name: `pipeline.graph.initial_weights`.)

The rule, applied to a model whose tensors are partly real and partly on the meta device (a rank
holds its stages' tensors for real; the single-process reference holds all of them):

1. every module with a `reset_parameters()` runs it;
2. then the model family's own initialiser: transformers' per-module `_init_weights` (called on
   every module, children before parents as `nn.Module.apply` does; it may write a descendant's
   tensors, as GPT-2 rescales its `c_proj` weights from the attention module), or torchtitan's
   convention, a model-wide `init_weights()` called once on the model;
3. every real tensor that neither wrote (a bare `nn.Parameter` in a module without
   `reset_parameters`, a buffer no initialiser knows) is filled by `fallback_fill`, seeded by
   (seed, "fallback:" + its name): floating tensors of 2+ dimensions from N(0, 0.02²) (the
   transformer convention), 1-D floating tensors named `weight`, `scale`, `gain` or `gamma` with
   ones (a norm's gain), everything else with zeros.

Every random draw into a named tensor (`uniform_`, `normal_`, ... whatever initialiser makes it)
is seeded by (seed, that tensor's name, how many draws it had before) and leaves the generator as
it found it, so its value never depends on which other tensors are real in this process: an
initialiser that walks the whole model in one call (timm's `named_apply`) gives each tensor the
same value under every split. Draws into unnamed temporaries (`orthogonal_`'s) follow the
generator seeded by (seed, the module's name) for `reset_parameters`, (seed, "family:" + name) for
the per-module initialiser, (seed, "whole") for the model-wide one.
Modules whose tensors are all on the meta device are skipped, so a rank pays only for its own
stages. Initialisers run on the CPU generator whatever the device, so a tensor's value does not
depend on where it lives. What this rule cannot keep is what a constructor does outside these
methods (nanoGPT rescales its `c_proj` weights in `__init__`): those tensors get their method's
distribution, not the constructor's.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

#: 1-D floating tensors with these (last) names start at one: the gain of a norm.
GAIN_NAMES = ("weight", "scale", "gamma", "gain")
FALLBACK_STD = 0.02


def seed_host(seed: int) -> None:
    """`torch.manual_seed(seed)` for the draws made here: the CPU generator, and CUDA's where CUDA
    is initialised. Why not torch.manual_seed itself: with CUDA not (yet) initialised it queues a
    lazy seed with a captured stack trace (`torch.cuda._lazy_call`), 3-6 ms a call inside a deep
    stack; naming hundreds of parameters took 2.5 s of a small model's 4.7 s plan."""
    torch.random.default_generator.manual_seed(seed)
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(seed)


def name_seed(seed: int, name: str) -> int:
    """A stable 63-bit seed from (seed, name); Python's hash() is salted per process, so not that."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def storage_key(t: torch.Tensor) -> int:
    """Identity of a tensor's storage: shared by its views and `.data`, distinct per meta tensor too."""
    return t.untyped_storage()._cdata


#: the in-place random fills an initialiser draws with (aten overload packets)
RANDOM_FILLS = frozenset(getattr(torch.ops.aten, op) for op in (
    "uniform_", "normal_", "bernoulli_", "random_", "exponential_", "cauchy_", "log_normal_", "geometric_"))


class _WriteLog(TorchDispatchMode):
    """Records the storages every in-place op writes while initialisers run; with `names` (storage
    key -> tensor name) and `seed`, seeds each random fill of a named real tensor by (seed, name,
    its count of earlier draws)."""

    def __init__(self, names: dict[int, str] | None = None, seed: int = 0) -> None:
        super().__init__()
        self.written: set[int] = set()
        self.names, self.seed = names or {}, seed
        self.draws: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                t = args[i] if i < len(args) else kwargs.get(arg.name)
                if isinstance(t, torch.Tensor):
                    self.written.add(storage_key(t))
        target = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if (func.overloadpacket in RANDOM_FILLS and target is not None and _is_real(target)
                and kwargs.get("generator") is None):
            name = self.names.get(storage_key(target))
            if name is not None:  # drawn apart: the generator's own sequence goes on as if it had not been
                count = self.draws.get(name, 0)
                self.draws[name] = count + 1
                state = torch.get_rng_state()
                seed_host(name_seed(self.seed, f"draw:{name}:{count}"))
                try:
                    return func(*args, **kwargs)
                finally:
                    torch.set_rng_state(state)
        return func(*args, **kwargs)


def _is_real(t: torch.Tensor | None) -> bool:
    return t is not None and t.device.type != "meta"


def _direct(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(n, t) for n, t in [*module._parameters.items(), *module._buffers.items()] if t is not None]


@contextmanager
def _seeded(seed: int, name: str) -> Iterator[None]:
    with torch.random.fork_rng(devices=[]):
        seed_host(name_seed(seed, name))
        yield


@contextmanager
def _completed(module: nn.Module) -> Iterator[None]:
    """Give a module whose own tensors are partly real temporary CPU copies of the meta ones, so
    its initialiser draws in the same order as on a fully real module; put the meta ones back."""
    own = _direct(module)
    swapped = []
    if any(_is_real(t) for _, t in own):
        for name, t in own:
            if not _is_real(t):
                store = module._parameters if name in module._parameters else module._buffers
                swapped.append((store, name, t))
                store[name] = torch.empty_like(t, device="cpu")
    try:
        yield
    finally:
        for store, name, t in swapped:
            store[name] = t


def _post_order(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    for name, child in module.named_children():
        yield from _post_order(child, f"{prefix}.{name}" if prefix else name)
    yield prefix, module


def _has_real(module: nn.Module) -> bool:
    return any(_is_real(t) for t in [*module.parameters(), *module.buffers()])


def fallback_fill(t: torch.Tensor, name: str, seed: int) -> None:
    """The documented value of a tensor that no initialiser writes (see the module docstring)."""
    if t.is_floating_point() and t.dim() >= 2:
        gen = torch.Generator().manual_seed(name_seed(seed, f"fallback:{name}"))
        t.copy_(torch.randn(t.shape, generator=gen, dtype=torch.float32) * FALLBACK_STD)
    elif t.is_floating_point() and name.rsplit(".", 1)[-1] in GAIN_NAMES:
        t.fill_(1.0)
    else:
        t.zero_()


@torch.no_grad()
def init_by_name(root: nn.Module, seed: int, family_init=None, whole_init=None) -> list[str]:
    """Initialise every real tensor of `root` by the rule above; returns the names that got the
    fallback. `root` is the whole model (tensors outside this process's stages on the meta device);
    `family_init(root, module)` a per-module initialiser, `whole_init(root)` a model-wide one."""
    modules = list(root.named_modules())
    names = {storage_key(t): n for n, t in [*root.named_parameters(remove_duplicate=False),
                                            *root.named_buffers(remove_duplicate=False)] if _is_real(t)}
    log = _WriteLog(names, seed)
    with log:
        for name, sub in modules:
            reset = getattr(sub, "reset_parameters", None)
            if callable(reset) and any(_is_real(t) for _, t in _direct(sub)):
                with _completed(sub), _seeded(seed, name):
                    reset()
        if family_init is not None:
            for name, sub in _post_order(root):
                if _has_real(sub):
                    with _completed(sub), _seeded(seed, f"family:{name}"):
                        family_init(root, sub)
        if whole_init is not None and _has_real(root):
            with _seeded(seed, "whole"):
                whole_init(root)
    fell_back = []
    seen: set[int] = set()
    for name, t in [*root.named_parameters(), *root.named_buffers()]:
        if _is_real(t) and id(t) not in seen:
            seen.add(id(t))
            if storage_key(t) not in log.written:
                fallback_fill(t, name, seed)
                fell_back.append(name)
    return fell_back


def uncovered_tensors(meta_model: nn.Module, family_init=None, whole_init=None) -> list[str]:
    """Names of the tensors no initialiser writes, found on the meta model without materialising
    anything (the launcher warns about them: they get `fallback_fill`)."""
    log = _WriteLog()
    with torch.no_grad(), log:
        for sub in meta_model.modules():
            reset = getattr(sub, "reset_parameters", None)
            if callable(reset) and _direct(sub):
                reset()  # meta tensors draw nothing: no seeding needed to see what is written
        if family_init is not None:
            for _, sub in _post_order(meta_model):
                family_init(meta_model, sub)
        if whole_init is not None:
            whole_init(meta_model)
    seen: set[int] = set()
    out = []
    for name, t in [*meta_model.named_parameters(), *meta_model.named_buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            if storage_key(t) not in log.written:
                out.append(name)
    return out
