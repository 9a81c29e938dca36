"""Weight initialisation that depends only on the seed and each parameter's name.

Why: every rank materialises only its own stages, yet a pipeline run must start from exactly the
weights a single-process run starts from. Seeding each submodule's `reset_parameters` from
(seed, fully-qualified module name) makes the result independent of which rank builds what.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn


def name_seed(seed: int, name: str) -> int:
    """A stable 63-bit seed from (seed, name); Python's hash() is salted per process, so not that."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@torch.no_grad()
def init_by_name(module: nn.Module, seed: int, prefix: str = "") -> nn.Module:
    """Re-initialise every submodule that owns parameters, seeded by its qualified name.

    `prefix` is the module's own qualified name inside the full model, so that a stage holding
    `blocks.3` initialises it exactly as the full model would.
    """
    for name, sub in module.named_modules():
        reset = getattr(sub, "reset_parameters", None)
        if reset is None or not any(True for _ in sub.parameters(recurse=False)):
            continue
        qualified = ".".join(p for p in (prefix, name) if p)
        gen_state = torch.random.get_rng_state()
        try:
            torch.manual_seed(name_seed(seed, qualified))
            reset()
        finally:
            torch.random.set_rng_state(gen_state)
    return module
