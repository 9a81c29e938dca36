"""Document packing (`data.packing=documents`): windows of a token stream holding several documents,
each document attended to and positioned on its own.

A window of seq_len + 1 ids is cut from the stream of documents, each ending with the
end-of-document id (`data.eod_id`), as the data cuts windows without packing; a document may start
or end outside the window (a long one is split over several windows), and what the window holds of
it is trained on as a document of its own. Per window, a segment starts at the window's first
position and after each end-of-document id; each input position gets its position id within its
segment (0 at each segment's first token), and the target of a segment's last position (an
end-of-document id, whose next token starts another document) is IGNORE_INDEX: no document
predicts another. So every sample is a function of its window alone, the window of (seed, global
sample index) as before: any (pp, dp), or a resumed run, packs the same global batch.

The position ids are the extra per-token field the model takes (`FIELDS`): the segments are where
they restart (transformers' packed-sequence rule, `masking_utils.find_packed_sequence_indices`),
so one tensor gives a model both its positions and its document mask.
"""

from __future__ import annotations

import numpy as np
import torch

from pipelaunch.pipeline.core import IGNORE_INDEX, POSITION_IDS
from pipelaunch.pipeline.core.errors import ConfigError

#: `data.packing`: none (windows attend across documents, as before), documents (see above)
PACKINGS = ("none", "documents")
#: the extra per-token data fields packing gives the model (ModelSpec.data_args names them)
FIELDS = (POSITION_IDS,)

#: a batch as a data source returns it: (inputs, targets), or with packing (inputs, targets, fields)
Batch = tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]


def check_packing(packing: str | None, eod_id: int | None, vocab: int | None = None,
                  eod_key: str = "data.eod_id") -> bool:
    """Whether `packing` packs documents; a ConfigError naming the key for an unknown packing, or
    packing without an end-of-document id (the documents could not be told apart)."""
    packing = packing or "none"
    if packing not in PACKINGS:
        raise ConfigError("data.packing", f"got {packing!r}; valid: {', '.join(PACKINGS)} (documents: windows packed "
                                          "from whole documents, positions and attention per document)")
    if packing == "none":
        return False
    if eod_id is None or isinstance(eod_id, bool) or not isinstance(eod_id, int) or eod_id < 0:
        raise ConfigError(eod_key, f"got {eod_id!r}: data.packing=documents splits the token stream into documents "
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

    @property
    def fields(self) -> tuple[str, ...]:
        """The per-token fields a batch gives beside inputs and targets (packing: position ids)."""
        return FIELDS if self.packed else ()

    @property
    def masks_targets(self) -> bool:
        """Packed targets hold IGNORE_INDEX (at document ends): the loss must weigh scored tokens."""
        return self.packed

    def _batch(self, rows: torch.Tensor) -> Batch:
        if self.packed:
            assert self.document_end is not None
            return pack_rows(rows.numpy(), self.document_end)
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
