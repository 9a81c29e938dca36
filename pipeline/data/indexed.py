"""`data=indexed`: Megatron's indexed corpus, the `<prefix>.bin` + `<prefix>.idx` pair that
Megatron-LM's and NeMo's preprocessing write (megatron-core's `indexed_dataset`), `data.path` the
prefix without extension as Megatron's `--data-path`.

The `.bin` is the token stream: every sequence's ids back to back in the index's dtype. The
`.idx` (`read_index`): the magic `MMIDIDX\\x00\\x00`, version 1 (u64), the dtype's code (u8),
the counts of sequences and of document boundaries (u64 each), then per sequence its length
(int32) and its byte offset in the .bin (int64), then the documents' boundaries as sequence
indices (int64, from 0 to the sequence count), all little-endian. The index is read with numpy
memmaps: a start reads the documents' offsets (8 bytes a document) and never scans the tokens.

The windows are data=tokens' (tokens.py: the same draw from (seed, sample index), the same packing
modes); only the documents' starts come from the index instead of a scan for `eod_id`. Packing
still needs each document to end with `data.eod_id` in the stream (Megatron's
`preprocess_data.py --append-eod`), which is what tells a window's documents apart: a sample of
the documents' last ids is checked when the corpus is opened.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.data.tokens import TokenFile

MAGIC = b"MMIDIDX\x00\x00"
#: megatron-core's DType codes (indexed_dataset.DType); the float ones hold no token ids
CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}
FLOATS = {6: "float64", 7: "float32"}
#: magic, version, dtype code, sequence count, document count
HEADER = struct.Struct("<9sQBQQ")
#: documents whose last id is checked against data.eod_id when a packed corpus opens
CHECKED_ENDS = 1024


@dataclass(frozen=True)
class Index:
    """An `.idx` file read: the token dtype, per sequence its length and byte offset in the .bin,
    and the document boundaries (sequence indices, 0 .. len(lengths))."""

    dtype: type[np.integer]
    lengths: np.ndarray
    pointers: np.ndarray
    documents: np.ndarray

    @property
    def tokens(self) -> int:
        """How many ids the .bin holds by the index."""
        return int(self.lengths.sum(dtype=np.int64)) if len(self.lengths) else 0

    def document_starts(self) -> np.ndarray:
        """Each non-empty document's first id in the token stream (from the index alone)."""
        seqs = self.documents[:-1][np.diff(self.documents) > 0]
        return self.pointers[seqs] // np.dtype(self.dtype).itemsize


def _paths(prefix: str, key: str) -> tuple[Path, Path]:
    """The `.bin` and `.idx` of `prefix`; a ConfigError naming `key` when either is missing."""
    if prefix.endswith((".bin", ".idx")) and not Path(prefix + ".idx").is_file():
        raise ConfigError(key, f"{prefix!r} names a file, but {key} is the corpus's prefix without extension, as "
                               f"Megatron's --data-path: {key}={prefix[:-4]}")
    bin_path, idx_path = Path(prefix + ".bin"), Path(prefix + ".idx")
    for path, what in ((idx_path, "index"), (bin_path, "token file")):
        if not path.is_file():
            raise ConfigError(key, f"{str(path)!r} does not exist: data=indexed reads Megatron's <prefix>.bin (the "
                                   f"tokens) and <prefix>.idx (the index), {key} the prefix; its {what} is missing")
    return bin_path, idx_path


def read_index(prefix: str, key: str = "data.path") -> Index:
    """The index of corpus `prefix` (module docstring), memory-mapped; a ConfigError naming `key`
    for a missing pair, a file that is not such an index, or one that disagrees with its .bin."""
    bin_path, idx_path = _paths(prefix, key)
    size = idx_path.stat().st_size
    with idx_path.open("rb") as f:
        head = f.read(HEADER.size)
    if len(head) < HEADER.size or head[:9] != MAGIC:
        raise ConfigError(key, f"{idx_path} is not a Megatron index (it does not start with {MAGIC!r}); data=indexed "
                               "reads the .idx megatron-core's IndexedDatasetBuilder writes")
    _, version, code, sequences, boundaries = HEADER.unpack(head)
    if version != 1 or code not in CODES:
        what = f"version {version}" if version != 1 else (f"{FLOATS[code]} values, not token ids" if code in FLOATS
                                                          else f"an unknown dtype code {code}")
        raise ConfigError(key, f"{idx_path} holds {what}: data=indexed reads version 1 indices of integer token ids")
    if size < HEADER.size + sequences * 12 + boundaries * 8 or boundaries < 1:
        raise ConfigError(key, f"{idx_path} is cut short ({size} bytes for {sequences} sequences and {boundaries} "
                               "document boundaries): rewrite it")
    lengths = np.memmap(idx_path, np.int32, "r", HEADER.size, (sequences,)) if sequences else np.zeros(0, np.int32)
    pointers = (np.memmap(idx_path, np.int64, "r", HEADER.size + 4 * sequences, (sequences,)) if sequences
                else np.zeros(0, np.int64))
    documents = np.memmap(idx_path, np.int64, "r", HEADER.size + 12 * sequences, (boundaries,))
    index = Index(CODES[code], lengths, pointers, documents)
    expected = index.tokens * np.dtype(index.dtype).itemsize
    if bin_path.stat().st_size != expected:
        raise ConfigError(key, f"{bin_path} holds {bin_path.stat().st_size} bytes, but its index describes "
                               f"{index.tokens} {np.dtype(index.dtype).name} ids ({expected} bytes): a .bin and .idx "
                               "of different corpora?")
    return index


@dataclass
class IndexedCorpus(TokenFile):
    """data=tokens' windows of a Megatron indexed corpus (module docstring): `path` (and each
    blend corpus, and `val_path`) the prefix; the dtype is the index's."""

    dtype: str | None = None

    name, what = "indexed", "a Megatron indexed corpus (<prefix>.bin + <prefix>.idx)"

    def _open(self, path: str, key: str) -> np.ndarray:
        index = read_index(path, key)
        if self.dtype is not None and np.dtype(self.dtype) != np.dtype(index.dtype):
            raise ConfigError("data.dtype", f"is {self.dtype}, but {path}.idx says its ids are "
                                            f"{np.dtype(index.dtype).name}; leave data.dtype=null (the index's)")
        if index.tokens < self.seq_len + 1:
            raise ConfigError(key, f"{path} holds {index.tokens} tokens, fewer than one window of seq_len + 1 = "
                                   f"{self.seq_len + 1}")
        tokens = np.memmap(path + ".bin", dtype=index.dtype, mode="r")
        if not hasattr(self, "_indexes"):
            self._indexes: dict[int, Index] = {}
        self._indexes[id(tokens)] = index
        return tokens

    def _document_starts(self, tokens: np.ndarray, path: str) -> np.ndarray:
        """The documents' starts from the index; a sample of their last ids must be data.eod_id."""
        starts = self._indexes[id(tokens)].document_starts()
        ends = np.append(starts[1:], len(tokens)) - 1
        checked = ends[np.unique(np.linspace(0, len(ends) - 1, min(len(ends), CHECKED_ENDS)).astype(np.int64))]
        found = np.asarray(tokens[checked])
        wrong = np.flatnonzero(found != self.eod_id)
        if len(wrong):
            raise ConfigError("data.eod_id", f"is {self.eod_id}, but {len(wrong)} of {len(checked)} documents checked "
                                             f"in {path} do not end with it (one ends with {int(found[wrong[0]])}): "
                                             f"data.packing={self.packing} tells a window's documents apart by the id "
                                             "ending each, as Megatron's preprocess_data.py --append-eod writes it; "
                                             "set data.eod_id to that id, or data.packing=none")
        return starts


class IndexedWriter:
    """Writes a Megatron indexed corpus, one sequence per document (as Megatron's
    preprocess_data.py does without sentence splitting): `add(ids, lengths)` streams documents to
    `<prefix>.bin`, `close()` writes `<prefix>.idx`; both appear complete or not at all."""

    def __init__(self, prefix: str | Path, dtype: str) -> None:
        self.prefix, self.dtype = str(prefix), np.dtype(dtype)
        code = {np.dtype(v): k for k, v in CODES.items()}.get(self.dtype)
        if code is None:
            raise ConfigError("--dtype", f"{dtype} is not a dtype Megatron's index holds ids in")
        self.code = code
        self._bin = open(self.prefix + ".bin.partial", "wb")  # noqa: SIM115 (closed by close())
        self._lengths: list[np.ndarray] = []

    def add(self, ids: np.ndarray, lengths: np.ndarray) -> None:
        """Documents of `lengths` ids each, their ids `ids` back to back."""
        np.asarray(ids).astype(self.dtype).tofile(self._bin)
        self._lengths.append(np.asarray(lengths, dtype=np.int32))

    def close(self) -> None:
        self._bin.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int32)
        pointers = np.concatenate([[0], np.cumsum(lengths.astype(np.int64) * self.dtype.itemsize)[:-1]])
        pointers = pointers[:len(lengths)].astype(np.int64)
        with open(self.prefix + ".idx.partial", "wb") as f:
            f.write(HEADER.pack(MAGIC, 1, self.code, len(lengths), len(lengths) + 1))
            for array in (lengths, pointers, np.arange(len(lengths) + 1, dtype=np.int64)):
                f.write(np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<")).tobytes())
        os.replace(self.prefix + ".bin.partial", self.prefix + ".bin")
        os.replace(self.prefix + ".idx.partial", self.prefix + ".idx")
