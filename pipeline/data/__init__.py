"""Datasets: each returns the same global batch for a given step on every rank."""

from __future__ import annotations

from typing import Protocol

import torch


class BatchSource(Protocol):
    """Anything that yields the global batch of a step, deterministically from (seed, step)."""

    def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def val_batch(self, index: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Held-out batch `index` (evaluation): never one of the training batches."""
        ...
