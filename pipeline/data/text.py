"""Byte-level language modelling over text files on disk.

The default corpus is the Python standard library's own `.py` sources, so real text exists on
every machine without a download.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.graph.init import name_seed


def stdlib_sources() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.glob("*.py") if p.is_file())


@dataclass
class TextBytes:
    """Random windows of `seq_len + 1` bytes from the concatenated corpus; vocabulary is 256."""

    seq_len: int
    paths: list[str] | None = None
    max_bytes: int = 8_000_000
    seed: int = 0
    kind: str = "tokens"  # what the model must take (checked before spawning)
    vocab_size: int = 256

    def __post_init__(self) -> None:
        if self.vocab_size < 256:
            raise ConfigError("model.vocab_size", f"data=text is byte-level and needs vocab_size >= 256, got {self.vocab_size}")
        files = [Path(p) for p in self.paths] if self.paths else stdlib_sources()
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise ConfigError("data.paths", f"{', '.join(missing)} does not exist (text files, or directories whose "
                                            "*.py files are read; null reads the Python standard library)")
        chunks, total = [], 0
        for path in files:
            files_in = sorted(path.rglob("*.py")) if path.is_dir() else [path]
            for f in files_in:
                data = f.read_bytes()[: self.max_bytes - total]
                chunks.append(data)
                total += len(data)
                if total >= self.max_bytes:
                    break
            if total >= self.max_bytes:
                break
        if total <= self.seq_len + 1:
            raise ConfigError("data.paths", f"the corpus {files[:3]}... holds {total} bytes, fewer than one sequence")
        self._corpus = torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)

    @property
    def num_bytes(self) -> int:
        return int(self._corpus.numel())

    def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._draw(f"text:step{step}", batch_size)

    def val_batch(self, index: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Held-out batch `index`: drawn like the training batches, from another stream."""
        return self._draw(f"text:val{index}", batch_size)

    def _draw(self, stream: str, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(name_seed(self.seed, stream))
        starts = torch.randint(self.num_bytes - self.seq_len - 1, (batch_size,), generator=gen)
        window = starts[:, None] + torch.arange(self.seq_len + 1)
        seq = self._corpus[window].long()
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
