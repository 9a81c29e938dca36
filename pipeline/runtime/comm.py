"""Point-to-point transfers between pipeline ranks, with tags that make every message unique.

Receives are posted ahead of time (a small look-ahead window over the rank's program) so that a
transfer overlaps the compute before it; sends are asynchronous and awaited at the end of a step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from pipeline.ir import Action, Kind


def message_tag(action: Action, num_microbatches: int) -> int:
    """Same tag on both ends: a RECV_F of stage s matches the SEND_F of stage s-1, and so on."""
    if action.kind in (Kind.SEND_F, Kind.RECV_B):
        boundary, direction = action.stage, 0 if action.kind is Kind.SEND_F else 1
    else:  # RECV_F of stage s receives from boundary s-1; SEND_B of stage s sends to boundary s-1
        boundary, direction = action.stage - 1, 0 if action.kind is Kind.RECV_F else 1
    return (boundary * num_microbatches + action.mb) * 2 + direction


@dataclass
class PendingRecv:
    work: dist.Work | None
    tensor: torch.Tensor


class P2P:
    """Sends and receives for one rank's program, addressed by global rank."""

    def __init__(self, num_microbatches: int, lookahead: int = 2) -> None:
        self.num_microbatches = num_microbatches
        self.lookahead = lookahead
        self._recvs: dict[Action, PendingRecv] = {}
        self._sends: list[tuple[dist.Work, torch.Tensor]] = []

    def post_recv(self, action: Action, peer: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        if action in self._recvs:
            return
        buf = torch.empty(shape, dtype=dtype, device=device)
        work = dist.irecv(buf, src=peer, tag=message_tag(action, self.num_microbatches))
        self._recvs[action] = PendingRecv(work, buf)

    def take_recv(self, action: Action) -> torch.Tensor:
        pending = self._recvs.pop(action)
        if pending.work is not None:
            pending.work.wait()
        return pending.tensor

    def send(self, action: Action, peer: int, tensor: torch.Tensor) -> None:
        tensor = tensor.detach().contiguous()
        work = dist.isend(tensor, dst=peer, tag=message_tag(action, self.num_microbatches))
        self._sends.append((work, tensor))

    def wait_sends(self) -> None:
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()

    def has_pending(self) -> bool:
        return bool(self._recvs)
