"""Document packing (`data.packing=documents`): windows of a token stream holding whole documents,
each attended to and positioned on its own.

The documents are the stream's runs ending with the end-of-document id (`data.eod_id`). A window
of seq_len + 1 ids starts where a document starts and holds whole documents while they fit; the
rest of it is padding (end-of-document ids, never scored). A document longer than a window is
split: it starts a window at its start and at every seq_len + 1 ids after (`document_chunks`), and
its last piece is packed like a document. Per window, a segment starts at the window's first
position and after each end-of-document id; each input position gets its position id within its
segment (0 at each segment's first token), and the target of a segment's last position (an
end-of-document id, whose next token starts another document, or padding) is IGNORE_INDEX: no
document predicts another. A sample is a function of (seed, global sample index) and the data
alone, as without packing: any (pp, dp), or a resumed run, packs the same global batch.

The position ids are the extra per-token field the model takes (`FIELDS`): the segments are where
they restart (transformers' packed-sequence rule, `masking_utils.find_packed_sequence_indices`),
so one tensor gives a model both its positions and its document mask.

`data.packing=stream` packs as Megatron-LM's `reset_position_ids`/`reset_attention_mask` do: a
window is cut from the stream wherever the unpacked one is (a drawn offset), so documents are split
at its edges and nothing is padded; within it, the same segments, positions and masked ends.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pipelaunch.pipeline.core import IGNORE_INDEX, POSITION_IDS
from pipelaunch.pipeline.core.errors import ConfigError

#: `data.packing`: none (windows attend across documents), documents (windows of whole documents,
#: padded), stream (windows cut from the stream, documents split at their edges; see above)
PACKINGS = ("none", "documents", "stream")
#: the extra per-token data fields packing gives the model (ModelSpec.data_args names them)
FIELDS = (POSITION_IDS,)

#: ids scanned for document ends at a time (a token file is read block by block, never held whole)
SCAN = 1 << 26
#: a batch as a data source returns it: (inputs, targets), or with packing (inputs, targets, fields)
Batch = tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]


def check_packing(packing: str | None, eod_id: int | None, vocab: int | None = None,
                  eod_key: str = "data.eod_id") -> bool:
    """Whether `packing` packs documents; a ConfigError naming the key for an unknown packing, or
    packing without an end-of-document id (the documents could not be told apart)."""
    packing = packing or "none"
    if packing not in PACKINGS:
        raise ConfigError("data.packing", f"got {packing!r}; valid: {', '.join(PACKINGS)} (documents: windows of whole "
                                          "documents, padded; stream: windows cut from the stream, documents split "
                                          "at their edges; both: positions and attention per document)")
    if packing == "none":
        return False
    if eod_id is None or isinstance(eod_id, bool) or not isinstance(eod_id, int) or eod_id < 0:
        raise ConfigError(eod_key, f"got {eod_id!r}: data.packing={packing} splits the token stream into documents "
                                   "at the end-of-document id; set data.eod_id=<the id ending each document> (the "
                                   "tokenizer's end-of-sequence id, e.g. 50256 for GPT-2's)")
    if vocab is not None and eod_id >= vocab:
        raise ConfigError(eod_key, f"{eod_id} is outside the tokenizer's {vocab} ids")
    return True


def pack_rows(rows: np.ndarray, eod_id: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(inputs, targets, {position_ids}) of windows `rows` [n, seq_len + 1] (module docstring)."""
    rows = np.asarray(rows, dtype=np.int64)
    inputs, targets = rows[:, :-1], rows[:, 1:].copy()
    ends = inputs == eod_id
    targets[ends] = IGNORE_INDEX  # a document's last token does not predict the next document
    return (torch.from_numpy(np.ascontiguousarray(inputs)), torch.from_numpy(targets),
            {POSITION_IDS: torch.from_numpy(positions(ends))})


def document_chunks(tokens: np.ndarray, eod_id: int, window: int) -> np.ndarray:
    """Where a packed window may start: every document's first id, and inside a document longer
    than `window` ids every `window`-th id after it (its pieces), in stream order."""
    return chunks_of(document_starts(tokens, eod_id), len(tokens), window)


def document_starts(tokens: np.ndarray, eod_id: int) -> np.ndarray:
    """Every document's first id in the stream (0 and after each `eod_id`): a scan of the whole
    stream, a block at a time (a memmap is never read whole). A token file caches it beside the
    file (tokens.py); an indexed corpus reads it from its index instead (indexed.py)."""
    ends = np.concatenate([np.flatnonzero(np.asarray(tokens[i:i + SCAN]) == eod_id) + i
                           for i in range(0, len(tokens), SCAN)] or [np.zeros(0, dtype=np.int64)])
    starts = np.concatenate([[0], ends + 1]).astype(np.int64)
    return starts[starts < len(tokens)]


def chunks_of(starts: np.ndarray, length: int, window: int) -> np.ndarray:
    """`document_chunks` from the documents' first ids `starts` (ascending, from 0) in a stream of
    `length` ids: each document's start and, in one longer than `window`, every `window`-th id after."""
    starts = np.asarray(starts, dtype=np.int64)
    lengths = np.append(starts[1:], length) - starts
    pieces = 1 + (lengths - 1) // window
    first = np.repeat(np.cumsum(pieces) - pieces, pieces)
    return np.repeat(starts, pieces) + (np.arange(int(pieces.sum())) - first) * window


@dataclass(frozen=True)
class Pieces:
    """`chunks_of(starts, length, window)` without materialising it: entry k is the k-th window
    start in stream order, found by a binary search over the documents' first piece numbers. A
    corpus of n documents costs O(n) to index, whatever its tokens per window (the array would
    hold tokens / window entries: 38 million for 5 billion ids in windows of 129)."""

    starts: np.ndarray
    #: per document, the number of its first piece (pieces of the documents before it)
    first: np.ndarray
    total: int
    window: int

    @classmethod
    def of(cls, starts: np.ndarray, length: int, window: int) -> Pieces:
        starts = np.asarray(starts, dtype=np.int64)
        pieces = 1 + (np.append(starts[1:], length) - starts - 1) // window
        return cls(starts, np.cumsum(pieces) - pieces, int(pieces.sum()), window)

    def __len__(self) -> int:
        return self.total

    def __getitem__(self, k: int) -> int:
        d = int(np.searchsorted(self.first, k, side="right")) - 1
        return int(self.starts[d] + (k - self.first[d]) * self.window)


def whole_documents(tokens: np.ndarray, start: int, window: int, eod_id: int) -> tuple[np.ndarray, int]:
    """The window of `window` ids from `start` (a `document_chunks` entry) holding whole documents
    only: cut after the last end-of-document id in it and padded with `eod_id`; a piece of a long
    document with no end in it is kept whole. Returns (the ids, how many are the stream's)."""
    row = np.full(window, eod_id, dtype=np.int64)
    taken = np.asarray(tokens[start:start + window], dtype=np.int64)
    ends = np.flatnonzero(taken == eod_id)
    used = len(taken) if len(ends) == 0 or len(taken) < window and ends[-1] == len(taken) - 1 else int(ends[-1]) + 1
    row[:used] = taken[:used]
    return row, used


def greedy_windows(tokens: np.ndarray, eod_id: int, window: int) -> tuple[np.ndarray, np.ndarray]:
    """The stream cut in order into windows of whole documents (`whole_documents`), each starting
    where the last one's ids ended: (windows [n, window], the stream's ids in each)."""
    chunks = document_chunks(tokens, eod_id, window)
    rows, used, i = [], [], 0
    while i < len(chunks):
        row, n = whole_documents(tokens, int(chunks[i]), window, eod_id)
        rows.append(row)
        used.append(n)
        i = int(np.searchsorted(chunks, chunks[i] + n))
    return np.stack(rows), np.asarray(used, dtype=np.int64)


def positions(ends: np.ndarray) -> np.ndarray:
    """Per position, its offset from its segment's start: segments start at 0 and after each `ends`."""
    n, t = ends.shape
    index = np.broadcast_to(np.arange(t, dtype=np.int64), (n, t))
    starts = np.zeros((n, t), dtype=bool)
    starts[:, 0] = True
    starts[:, 1:] = ends[:, :-1]
    return index - np.maximum.accumulate(np.where(starts, index, 0), axis=1)


def split_batch(batch: Batch) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(inputs, targets, extra fields) of what a data source returns (fields {} without packing)."""
    if len(batch) == 3:
        return batch[0], batch[1], dict(batch[2])
    return batch[0], batch[1], {}


class Windows:
    """What a source of windows of seq_len + 1 token ids gives per batch, packed or not: a source
    sets `packed` and `document_end` (the id ending each document) when it is built."""

    packed: bool = False
    document_end: int | None = None
    #: packed into windows of whole documents (`data.packing=documents`), not cut from the stream
    whole: bool = False

    @property
    def fields(self) -> tuple[str, ...]:
        """The per-token fields a batch gives beside inputs and targets (packing: position ids)."""
        return FIELDS if self.packed else ()

    @property
    def masks_targets(self) -> bool:
        """Packed targets hold IGNORE_INDEX (at document ends): the loss must weigh scored tokens."""
        return self.packed

    def _padding(self, used: np.ndarray, seq_len: int) -> int:
        """Input positions of windows holding `used` stream ids each that are padding."""
        return int((seq_len - np.minimum(used, seq_len)).sum())

    def _batch(self, rows: torch.Tensor) -> Batch:
        if self.packed:
            assert self.document_end is not None
            return pack_rows(rows.numpy(), self.document_end)
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
