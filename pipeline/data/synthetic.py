"""Seeded synthetic token sequences with learnable structure, so the loss visibly falls."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipelaunch.pipeline.graph.init import name_seed


@dataclass
class SyntheticTokens:
    """Sequences from a fixed random Markov chain: each next token is `succ[prev]` with
    probability `structure`, otherwise uniform. Global batch of step k depends on (seed, k) only."""

    vocab_size: int
    seq_len: int
    seed: int = 0
    kind: str = "tokens"  # what the model must take (checked before spawning)
    structure: float = 0.75

    def __post_init__(self) -> None:
        gen = torch.Generator().manual_seed(name_seed(self.seed, "synthetic:successor"))
        self._successor = torch.randperm(self.vocab_size, generator=gen)

    def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._draw(f"synthetic:step{step}", batch_size)

    def val_batch(self, index: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Held-out batch `index`: drawn like the training batches, from another stream."""
        return self._draw(f"synthetic:val{index}", batch_size)

    def _draw(self, stream: str, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(name_seed(self.seed, stream))
        seq = torch.empty(batch_size, self.seq_len + 1, dtype=torch.long)
        seq[:, 0] = torch.randint(self.vocab_size, (batch_size,), generator=gen)
        noise = torch.randint(self.vocab_size, (batch_size, self.seq_len), generator=gen)
        follow = torch.rand(batch_size, self.seq_len, generator=gen) < self.structure
        for t in range(self.seq_len):
            seq[:, t + 1] = torch.where(follow[:, t], self._successor[seq[:, t]], noise[:, t])
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
