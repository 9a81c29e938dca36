"""Variable-length micro-batches (`data.buckets`): each micro-batch runs at the shortest of a few
lengths that holds its longest example, not at model.seq_len.

Why a few lengths and not every length: each length's shapes of the values crossing stage
boundaries are traced once, before any rank starts (`planner/lengths.py`), so every rank knows
what each message of a step holds from the data alone, with no shape message and no host
synchronisation inside the step (Megatron's `variable_seq_lengths` sends shapes first and waits
for them). A few lengths also keep the CUDA caching allocator reusing its blocks. The memory
budget is priced at model.seq_len, the longest length: it holds for every micro-batch.

A micro-batch's length is a function of the global batch's samples, which are a function of
(seed, step): every rank of every replica computes the same lengths for a step (`step_lengths`)
from the data's per-sample lengths, without drawing the batch, before the step's first message.
`data.group_by_length` first orders the global batch's samples so that each micro-batch holds
similar lengths (`grouped_order`): less padding, the same loss (token-weighted over the global batch).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pipelaunch.pipeline.core.errors import ConfigError


def check_buckets(buckets: Sequence[int] | None, seq_len: int) -> tuple[int, ...] | None:
    """The lengths micro-batches may run at, ascending and ending with `seq_len` (model.seq_len is
    always one); None without buckets. A ConfigError naming data.buckets for anything else."""
    if buckets is None:
        return None
    if isinstance(buckets, (str, int)) or not all(isinstance(b, int) and not isinstance(b, bool) for b in buckets):
        raise ConfigError("data.buckets", f"got {buckets!r}; valid: a list of lengths in tokens, e.g. "
                                          f"data.buckets=[{max(1, seq_len // 4)},{max(1, seq_len // 2)}] (model.seq_len="
                                          f"{seq_len} is always the last), or null for one length")
    wrong = [b for b in buckets if not 1 <= b <= seq_len]
    if wrong:
        raise ConfigError("data.buckets", f"{wrong} outside 1..model.seq_len={seq_len}: a micro-batch runs at the "
                                          "shortest listed length holding its longest example, model.seq_len at most")
    return tuple(sorted({*buckets, seq_len}))


def grouped_order(sample_lengths: np.ndarray, replicas: int, microbatches: int) -> np.ndarray:
    """`data.group_by_length`: an order of the global batch's samples in which each micro-batch
    holds samples of similar lengths, micro-batch j of every replica the next similar ones (no
    replica gets all the long ones). The same set of samples: the loss, token-weighted over the
    global batch, is unchanged. A stable sort: ties keep their order, the same on every rank."""
    parts = replicas * microbatches
    ranked = np.argsort(np.asarray(sample_lengths), kind="stable").reshape(parts, -1)  # g: the g-th shortest
    return np.concatenate([ranked[j * replicas + r] for r in range(replicas) for j in range(microbatches)])


def microbatch_lengths(sample_lengths: np.ndarray, buckets: Sequence[int], parts: int) -> list[int]:
    """The length of each of the global batch's `parts` equal, contiguous micro-batches (replica by
    replica, as the runtime cuts it): the shortest bucket holding its longest sample."""
    longest = np.asarray(sample_lengths).reshape(parts, -1).max(axis=1)
    edges = np.asarray(buckets)
    return [int(edges[i]) for i in np.searchsorted(edges, longest, side="left")]


def step_lengths(sample_lengths: np.ndarray, buckets: Sequence[int], replicas: int, microbatches: int,
                 grouped: bool) -> tuple[np.ndarray | None, list[int]]:
    """A step's sample order (None: as drawn; `grouped`: `grouped_order`) and each of its
    micro-batches' length, every replica's in order."""
    order = grouped_order(sample_lengths, replicas, microbatches) if grouped else None
    ordered = sample_lengths if order is None else np.asarray(sample_lengths)[order]
    return order, microbatch_lengths(ordered, buckets, replicas * microbatches)
