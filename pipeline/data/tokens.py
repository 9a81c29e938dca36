"""`data=tokens`: a flat binary file of token ids, the format nanoGPT and Megatron-style
preprocessing write (`np.array(ids, dtype=np.uint16).tofile("train.bin")`), read with numpy.memmap.

Sample i of the run (the global sample index: step x batch_size + position in the batch) is the
window of seq_len + 1 tokens starting at an offset drawn from (seed, i) alone. So the global batch
of a step is the same whatever pp and dp are (a replica takes its contiguous share of it), and a
run resumed at step k reads exactly what it would have read.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.data.packing import Batch, Windows, check_packing, document_chunks, whole_documents
from pipelaunch.pipeline.graph.init import name_seed

DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


def open_tokens(path: str | Path, dtype: str, key: str) -> np.memmap:
    """The file as a read-only array of token ids, or a ConfigError naming `key`."""
    if dtype not in DTYPES:
        raise ConfigError("data.dtype", f"got {dtype!r}; valid: {', '.join(DTYPES)} (the dtype the token file was written with)")
    file = Path(path)
    if not file.is_file():
        raise ConfigError(key, f"{str(path)!r} does not exist (a flat binary file of {dtype} token ids)")
    itemsize = np.dtype(DTYPES[dtype]).itemsize
    size = file.stat().st_size
    if size == 0 or size % itemsize:
        raise ConfigError(key, f"{path} holds {size} bytes, not a whole number of {dtype} token ids ({itemsize} bytes "
                               f"each): is data.dtype right?")
    return np.memmap(file, dtype=DTYPES[dtype], mode="r")


@dataclass
class TokenFile(Windows):
    """Random windows of a token file (see the module docstring); `val_path` for eval batches."""

    path: str
    seq_len: int
    dtype: str = "uint16"
    val_path: str | None = None
    seed: int = 0
    kind: str = "tokens"
    #: `none`; `documents`: windows of the whole documents `eod_id` ends, padded; `stream`: windows
    #: cut from the stream, documents split at their edges (data/packing.py)
    packing: str = "none"
    eod_id: int | None = None

    def __post_init__(self) -> None:
        self.packed = check_packing(self.packing, self.eod_id)
        self.document_end, self.whole = self.eod_id, self.packing == "documents"
        if not isinstance(self.seq_len, int) or isinstance(self.seq_len, bool) or self.seq_len < 1:
            raise ConfigError("model.seq_len", f"got {self.seq_len!r}: data=tokens cuts windows of model.seq_len ids; "
                                               "set model.seq_len=<tokens per sample>, e.g. model.seq_len=64")
        self._train = self._open(self.path, "data.path")
        self._val = self._open(self.val_path, "data.val_path") if self.val_path else None
        #: packed: where a window may start in each file (documents' starts, long ones' pieces)
        self._chunks = {id(t): document_chunks(t, self.eod_id, self.seq_len + 1)
                        for t in (self._train, self._val) if t is not None and self.whole}
        #: the last training batch drawn, (step, batch size), and its windows' counts of the file's ids
        self._drawn: tuple[tuple[int, int] | None, np.ndarray | None] = (None, None)

    def _open(self, path: str, key: str) -> np.memmap:
        tokens = open_tokens(path, self.dtype, key)
        if len(tokens) < self.seq_len + 1:
            raise ConfigError(key, f"{path} holds {len(tokens)} tokens, fewer than one window of seq_len + 1 = "
                                   f"{self.seq_len + 1}")
        return tokens

    def check_vocabulary(self, model_vocab: int) -> None:
        """Refuse ids the model cannot embed (a full scan of each file: the launcher does it once,
        before any rank starts, and the ranks do not)."""
        for tokens, path, key in ((self._train, self.path, "data.path"), (self._val, self.val_path, "data.val_path")):
            top = int(tokens.max()) if tokens is not None else -1
            if top >= model_vocab:
                raise ConfigError(key, f"{path} holds token id {top}, outside the model's vocabulary of {model_vocab} "
                                       "(model.vocab_size); was it tokenized for another model?")

    def _windows(self, tokens: np.memmap, first: int, count: int, salt: str) -> tuple[torch.Tensor, np.ndarray]:
        """Windows `first`.. of `tokens` and how many of each one's ids are the file's (packed:
        a document's start drawn, whole documents, padding after; else a drawn offset, all)."""
        window = self.seq_len + 1
        if self.whole:
            chunks = self._chunks[id(tokens)]
            made = [whole_documents(tokens, int(chunks[name_seed(self.seed, f"{salt}:{i}") % len(chunks)]), window,
                                    self.document_end) for i in range(first, first + count)]
            return torch.from_numpy(np.stack([r for r, _ in made])), np.array([n for _, n in made])
        span = len(tokens) - window
        starts = [name_seed(self.seed, f"{salt}:{i}") % (span + 1) for i in range(first, first + count)]
        rows = np.stack([np.asarray(tokens[s:s + window], dtype=np.int64) for s in starts])
        return torch.from_numpy(rows), np.full(count, window)

    def padded_tokens(self, step: int, batch_size: int) -> int | None:
        """Input positions of batch `step` that are padding (windows of whole documents end with it);
        None otherwise (a window is the file's ids throughout). The trainer asks right after drawing
        the batch: its windows' counts are kept, not drawn again."""
        if not self.whole:
            return None
        drawn, used = self._drawn
        if drawn != (step, batch_size):
            used = self._windows(self._train, step * batch_size, batch_size, "tokens")[1]
        return self._padding(used, self.seq_len)

    def batch(self, step: int, batch_size: int) -> Batch:
        rows, used = self._windows(self._train, step * batch_size, batch_size, "tokens")
        self._drawn = ((step, batch_size), used)
        return self._batch(rows)

    def val_batch(self, index: int, batch_size: int) -> Batch:
        """Held-out batch `index` (from val_path, or the training file when there is none)."""
        tokens = self._val if self._val is not None else self._train
        return self._batch(self._windows(tokens, index * batch_size, batch_size, "val")[0])
