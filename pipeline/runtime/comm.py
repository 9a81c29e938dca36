"""Point-to-point transfers between pipeline ranks, posted the way NCCL needs them.

Every SEND/RECV action of the lowered program is one `batch_isend_irecv` group with one peer,
and its peer posts the complementary group at the same place in their shared order
(`pipeline.planner.lowering`). Tags are always 0: NCCL ignores them, and with tag 0 gloo matches a pair's
messages in posting order as NCCL does, so a CPU run exercises the very semantics a GPU run has.
Receives are waited for only when the compute that reads them runs; sent tensors are kept alive
until their transfer completes and released as soon as it has (checked at every action, without
blocking), not held to the end of the step.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

#: one entry of a posting-order log: ("send" | "recv", message label, shape, dtype)
LogEntry = tuple[str, str, tuple[int, ...], str]


@dataclass
class Pending:
    """A posted receive group: its works, its buffers, and where in the program it was posted."""

    works: list[dist.Work]
    buffers: list[torch.Tensor]
    position: int


class P2P:
    """Sends and receives for one rank's program, addressed by global rank.

    With `record`, every tensor posted is logged per peer, so that the ranks' logs can be
    compared pair by pair (`verify_posting_order`): what NCCL needs, shown on gloo."""

    def __init__(self, device: torch.device, record: bool = False) -> None:
        self.device = device
        self._posted: dict[Hashable, Pending] = {}
        self._sends: list[tuple[list[dist.Work], list[torch.Tensor]]] = []
        self.log: dict[int, list[LogEntry]] | None = {} if record else None

    def _record(self, peer: int, op: str, label: str, tensors: Sequence[torch.Tensor]) -> None:
        if self.log is not None:
            entries = self.log.setdefault(peer, [])
            for i, t in enumerate(tensors):
                entries.append((op, f"{label}#{i}", tuple(t.shape), str(t.dtype)))

    def post_recv(self, key: Hashable, label: str, peer: int, shapes: Sequence[tuple[tuple[int, ...], torch.dtype]],
                  position: int) -> None:
        """Post one group of receives from `peer` (nothing when it carries no tensor)."""
        buffers = [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in shapes]
        works = _batch([dist.P2POp(dist.irecv, b, peer) for b in buffers])
        self._record(peer, "recv", label, buffers)
        self._posted[key] = Pending(works, buffers, position)

    def pending_position(self, key: Hashable) -> int | None:
        pending = self._posted.get(key)
        return None if pending is None else pending.position

    def wait_recv(self, key: Hashable) -> list[torch.Tensor]:
        """Wait for one posted group and return its tensors (on a GPU the wait only orders the
        current stream after the transfer; the host goes on)."""
        pending = self._posted.pop(key)
        for work in pending.works:
            work.wait()
        return pending.buffers

    def send(self, label: str, peer: int, tensors: Sequence[torch.Tensor]) -> None:
        """Post one group of sends to `peer`."""
        tensors = [t.detach().contiguous() for t in tensors]
        self._record(peer, "send", label, tensors)
        self._sends.append((_batch([dist.P2POp(dist.isend, t, peer) for t in tensors]), tensors))

    def release_completed(self) -> None:
        """Drop the sent tensors whose transfer has completed (a query, never a wait)."""
        if self._sends:
            self._sends = [s for s in self._sends if not all(w.is_completed() for w in s[0])]

    def wait_sends(self) -> None:
        for works, _ in self._sends:
            for work in works:
                work.wait()
        self._sends.clear()


def _batch(ops: list[dist.P2POp]) -> list[dist.Work]:
    return dist.batch_isend_irecv(ops) if ops else []


def verify_posting_order(logs: Sequence[dict[int, list[LogEntry]] | None]) -> None:
    """`logs[rank]`: that rank's posting-order log by peer rank. Raise RuntimeError at the first
    pair whose k-th tensors do not complement each other (a send of one end is a receive of the
    other, same message, shape and dtype), as NCCL would have matched them."""
    for a, mine in enumerate(logs):
        for b, ours in sorted((mine or {}).items()):
            if b < a:
                continue
            theirs = (logs[b] or {}).get(a, [])
            for k in range(max(len(ours), len(theirs))):
                x = ours[k] if k < len(ours) else None
                y = theirs[k] if k < len(theirs) else None
                if x and y and x[0] != y[0] and x[1:] == y[1:]:
                    continue
                raise RuntimeError(f"ranks {a} and {b} posted their tensor #{k} with each other out of order: "
                                   f"rank {a} posted {x or 'nothing'}, rank {b} posted {y or 'nothing'}; NCCL "
                                   "would have matched these two (it ignores tags)")
