"""Point-to-point transfers between pipeline ranks, posted the way NCCL needs them.

Every SEND/RECV action of the lowered program is one `batch_isend_irecv` group with one peer,
and its peer posts the complementary group at the same place in their shared order
(`pipelaunch.pipeline.planner.passes.lowering`). Tags are always 0: NCCL ignores them, and with tag 0 gloo matches a pair's
messages in posting order as NCCL does, so a CPU run exercises the very semantics a GPU run has.
Receives are waited for only when the compute that reads them runs; sent tensors are kept alive
until their transfer completes and released as soon as it has, not held to the end of the step.
On a GPU a send's work reports its completion (`is_completed`, checked at every action, without
blocking). gloo's never does before `wait()`, so on the CPU a rank would hold every tensor it sent
until the step's end: 64 activations of 128 KiB on a middle rank of gpt_bench at 32 micro-batches,
8 MiB that no plan priced. There the sends to a peer are waited for once a receive from that
peer completes that the peer posted after them in the pair's order: the peer had posted the
matching receives before it, so the transfers need nothing more from its program and the wait
cannot deadlock.
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
    #: the peer's global rank, and the group's index in the pair's posting order
    peer: int = -1
    index: int = 0


@dataclass
class Sent:
    """A posted send group: its works, the tensors it keeps alive, its peer and pair index."""

    works: list[dist.Work]
    tensors: list[torch.Tensor]
    peer: int
    index: int


class P2P:
    """Sends and receives for one rank's program, addressed by global rank.

    With `record`, every tensor posted is logged per peer, so that the ranks' logs can be
    compared pair by pair (`verify_posting_order`): what NCCL needs, shown on gloo."""

    def __init__(self, device: torch.device, record: bool = False) -> None:
        self.device = device
        self._posted: dict[Hashable, Pending] = {}
        self._sends: list[Sent] = []
        #: per peer, how many groups this rank has posted with it (the pair's posting order)
        self._pair_count: dict[int, int] = {}
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
        self._posted[key] = Pending(works, buffers, position, peer, self._next_index(peer, works))

    def _next_index(self, peer: int, works: list[dist.Work]) -> int:
        """The pair index of a group just posted with `peer` (a group with no tensor posts nothing)."""
        index = self._pair_count.get(peer, 0)
        if works:
            self._pair_count[peer] = index + 1
        return index

    def pending_position(self, key: Hashable) -> int | None:
        pending = self._posted.get(key)
        return None if pending is None else pending.position

    def wait_recv(self, key: Hashable) -> list[torch.Tensor]:
        """Wait for one posted group and return its tensors (on a GPU the wait only orders the
        current stream after the transfer; the host goes on)."""
        pending = self._posted.pop(key)
        for work in pending.works:
            work.wait()
        if self.device.type == "cpu" and pending.works:
            self._release_sent_before(pending.peer, pending.index)
        return pending.buffers

    def _release_sent_before(self, peer: int, index: int) -> None:
        """Wait for, and drop, the sends to `peer` posted before pair index `index` (see the module
        docstring: the peer posted their receives before the group just received)."""
        kept = []
        for sent in self._sends:
            if sent.peer == peer and sent.index < index:
                for work in sent.works:
                    work.wait()
            else:
                kept.append(sent)
        self._sends = kept

    def send(self, label: str, peer: int, tensors: Sequence[torch.Tensor]) -> None:
        """Post one group of sends to `peer`."""
        tensors = [t.detach().contiguous() for t in tensors]
        self._record(peer, "send", label, tensors)
        works = _batch([dist.P2POp(dist.isend, t, peer) for t in tensors])
        self._sends.append(Sent(works, tensors, peer, self._next_index(peer, works)))

    def release_completed(self) -> None:
        """Drop the sent tensors whose transfer has completed (a query, never a wait). On the CPU
        nothing to do: gloo's works never report it, `wait_recv` releases them instead."""
        if self._sends and self.device.type != "cpu":
            self._sends = [s for s in self._sends if not all(w.is_completed() for w in s.works)]

    def wait_sends(self) -> None:
        for sent in self._sends:
            for work in sent.works:
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
