"""`data=tokens`: a flat binary file of token ids, the format nanoGPT and Megatron-style
preprocessing write (`np.array(ids, dtype=np.uint16).tofile("train.bin")`), read with numpy.memmap.

Sample i of the run (the global sample index: step x batch_size + position in the batch) is the
window of seq_len + 1 tokens starting at an offset drawn from (seed, i) alone. So the global batch
of a step is the same whatever pp and dp are (a replica takes its contiguous share of it), and a
run resumed at step k reads exactly what it would have read.

Packed (`data.packing=documents`) the windows start at documents' starts, found by a scan of the
file for `eod_id` once and cached beside it (`cached_document_starts`: `train.bin.docs-eod<id>-
<size>-<mtime>.npy`), so a second start, or another rank, reads the cache instead of the file.
`data.blend` mixes several files by weight (data/blend.py); `data=indexed` reads Megatron's
`.bin` + `.idx` pair through the same windows (data/indexed.py).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.data.blend import Mixture
from pipelaunch.pipeline.data.packing import (
    Batch,
    Pieces,
    Windows,
    check_packing,
    document_starts,
    whole_documents,
)
from pipelaunch.pipeline.graph.init import name_seed

DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
#: directories already said to be read-only (the document index computed in memory): said once
_READ_ONLY: set[str] = set()


def cached_document_starts(path: str | Path, tokens: np.ndarray, eod_id: int) -> np.ndarray:
    """The first id of every document of token file `path` (`packing.document_starts`), scanned
    once and cached beside the file, keyed by the file's size and modification time (a changed
    file is scanned again) and by `eod_id`; written atomically (a temporary file renamed), so
    ranks starting together at worst each write the same file. In a read-only directory the
    starts are computed in memory, said once per process."""
    file = Path(path)
    stat = file.stat()
    stem = f"{file.name}.docs-eod{eod_id}-"
    cache = file.with_name(f"{stem}{stat.st_size}-{stat.st_mtime_ns}.npy")
    try:
        starts = np.load(cache, allow_pickle=False)
        if starts.ndim == 1 and starts.dtype == np.int64 and (len(starts) == 0 or 0 <= starts[-1] < len(tokens)):
            return starts
    except (OSError, ValueError, EOFError):
        pass  # no cache yet, or not one we wrote: scan
    starts = document_starts(tokens, eod_id)
    try:
        temporary = cache.with_name(f"{cache.name}.tmp{os.getpid()}")
        with temporary.open("wb") as f:
            np.save(f, starts)
        os.replace(temporary, cache)
        for stale in file.parent.glob(f"{stem}*.npy"):  # the caches of the file's earlier versions
            if stale != cache:
                stale.unlink(missing_ok=True)
    except OSError as err:
        if str(file.parent) not in _READ_ONLY:
            _READ_ONLY.add(str(file.parent))
            print(f"pipelaunch: cannot cache the document index of {file} beside it ({err.strerror}); computed "
                  "in memory, at every start", file=sys.stderr, flush=True)
    return starts


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

    path: str | None
    seq_len: int
    dtype: str = "uint16"
    val_path: str | None = None
    seed: int = 0
    kind: str = "tokens"
    #: `none`; `documents`: windows of the whole documents `eod_id` ends, padded; `stream`: windows
    #: cut from the stream, documents split at their edges (data/packing.py)
    packing: str = "none"
    eod_id: int | None = None
    #: several corpora mixed by weight (data/blend.py): [{path, weight, val_path?}, ...] or
    #: Megatron's flat [weight, path, weight, path, ...]; null: `path` alone
    blend: Any = None

    def __post_init__(self) -> None:
        self.packed = check_packing(self.packing, self.eod_id)
        self.document_end, self.whole = self.eod_id, self.packing == "documents"
        if not isinstance(self.seq_len, int) or isinstance(self.seq_len, bool) or self.seq_len < 1:
            raise ConfigError("model.seq_len", f"got {self.seq_len!r}: data={self.name} cuts windows of model.seq_len "
                                               "ids; set model.seq_len=<tokens per sample>, e.g. model.seq_len=64")
        #: the last training batch drawn, (step, batch size), and its windows' counts of the file's ids
        self._drawn: tuple[tuple[int, int] | None, np.ndarray | None] = (None, None)
        self.mixture: Mixture | None = None
        if self.blend is not None:
            self.mixture = Mixture.of(self)
            return
        if self.path is None:
            raise ConfigError("data.path", f"is not set: data={self.name} reads {self.what}; set data.path=<file>, "
                                           "or data.blend=[{path: <file>, weight: <w>}, ...] to mix several")
        for key, value in (("data.path", self.path), ("data.val_path", self.val_path)):
            if value is not None and not isinstance(value, str):
                raise ConfigError(key, f"got {value!r}: a path ({self.what})")
        self._train = self._open(self.path, "data.path")
        self._val = self._open(self.val_path, "data.val_path") if self.val_path else None
        #: packed: where a window may start in each file (documents' starts, long ones' pieces)
        self._chunks = {id(t): Pieces.of(self._document_starts(t, p), len(t), self.seq_len + 1)
                        for t, p in ((self._train, self.path), (self._val, self.val_path))
                        if t is not None and self.whole}

    #: the config option and what its files are, for messages
    name, what = "tokens", "a flat binary file of token ids"

    def single(self, path: str, val_path: str | None) -> TokenFile:
        """This source on one corpus of a blend: the same settings, `path` alone."""
        return type(self)(path=path, seq_len=self.seq_len, dtype=self.dtype, val_path=val_path, seed=self.seed,
                          kind=self.kind, packing=self.packing, eod_id=self.eod_id)

    def _document_starts(self, tokens: np.ndarray, path: str) -> np.ndarray:
        """The documents' first ids in `tokens` (the file at `path`): from the cache beside it."""
        assert self.eod_id is not None
        return cached_document_starts(path, tokens, self.eod_id)

    def _open(self, path: str, key: str) -> np.memmap:
        tokens = open_tokens(path, self.dtype, key)
        if len(tokens) < self.seq_len + 1:
            raise ConfigError(key, f"{path} holds {len(tokens)} tokens, fewer than one window of seq_len + 1 = "
                                   f"{self.seq_len + 1}")
        return tokens

    def check_vocabulary(self, model_vocab: int) -> None:
        """Refuse ids the model cannot embed (a full scan of each file: the launcher does it once,
        before any rank starts, and the ranks do not)."""
        if self.mixture is not None:
            return self.mixture.check_vocabulary(model_vocab)
        for tokens, path, key in ((self._train, self.path, "data.path"), (self._val, self.val_path, "data.val_path")):
            top = int(tokens.max()) if tokens is not None else -1
            if top >= model_vocab:
                raise ConfigError(key, f"{path} holds token id {top}, outside the model's vocabulary of {model_vocab} "
                                       "(model.vocab_size); was it tokenized for another model?")

    def blend_metrics(self, first: int, count: int) -> dict | None:
        """Under data.blend, what each corpus gave of global samples first .. first + count - 1
        (metrics.json's `data_blend`); None for one corpus."""
        return self.mixture.metrics(first, count) if self.mixture is not None else None

    def _windows(self, tokens: np.ndarray, samples: np.ndarray, salt: str) -> tuple[np.ndarray, np.ndarray]:
        """The windows of global samples `samples` of `tokens` and how many of each one's ids are
        the file's (packed: a document's start drawn, whole documents, padding after; else a drawn
        offset, all). Sample i's window depends on (seed, salt, i) alone."""
        window = self.seq_len + 1
        if self.whole:
            chunks = self._chunks[id(tokens)]
            made = [whole_documents(tokens, int(chunks[name_seed(self.seed, f"{salt}:{i}") % len(chunks)]), window,
                                    self.document_end) for i in samples.tolist()]
            return np.stack([r for r, _ in made]), np.array([n for _, n in made], dtype=np.int64)
        span = len(tokens) - window
        starts = [name_seed(self.seed, f"{salt}:{i}") % (span + 1) for i in samples.tolist()]
        rows = np.stack([np.asarray(tokens[s:s + window], dtype=np.int64) for s in starts])
        return rows, np.full(len(samples), window, dtype=np.int64)

    def windows(self, samples: np.ndarray, held_out: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """The windows of global samples `samples` (training, or `held_out`: from val_path, or the
        training file when there is none) and each one's count of the file's ids."""
        if self.mixture is not None:
            return self.mixture.windows(samples, held_out)
        if held_out:
            return self._windows(self._val if self._val is not None else self._train, samples, "val")
        return self._windows(self._train, samples, "tokens")

    def _draw(self, first: int, count: int, held_out: bool = False) -> tuple[torch.Tensor, np.ndarray]:
        rows, used = self.windows(np.arange(first, first + count, dtype=np.int64), held_out)
        return torch.from_numpy(rows), used

    def padded_tokens(self, step: int, batch_size: int) -> int | None:
        """Input positions of batch `step` that are padding (windows of whole documents end with it);
        None otherwise (a window is the file's ids throughout). The trainer asks right after drawing
        the batch: its windows' counts are kept, not drawn again."""
        if not self.whole:
            return None
        drawn, used = self._drawn
        if drawn != (step, batch_size):
            used = self._draw(step * batch_size, batch_size)[1]
        return self._padding(used, self.seq_len)

    def batch(self, step: int, batch_size: int) -> Batch:
        rows, used = self._draw(step * batch_size, batch_size)
        self._drawn = ((step, batch_size), used)
        return self._batch(rows)

    def val_batch(self, index: int, batch_size: int) -> Batch:
        """Held-out batch `index` (from val_path, or the training file when there is none)."""
        return self._batch(self._draw(index * batch_size, batch_size, held_out=True)[0])
