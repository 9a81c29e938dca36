"""Point-to-point transfers between pipeline ranks, with tags that make every message unique.

A message carries one named value of one micro-batch along one stage-graph edge, in one
direction; its tag is derived from (edge id, micro-batch, direction), computed identically on
both ends from the Plan. Receives are posted ahead of time (a look-ahead window over the rank's
program) so transfers overlap compute; sends are asynchronous and awaited at the end of a step.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch
import torch.distributed as dist

FORWARD, BACKWARD = 0, 1


def message_tag(edge_id: int, mb: int, direction: int, num_microbatches: int) -> int:
    return (edge_id * num_microbatches + mb) * 2 + direction


@dataclass
class RecvSpec:
    """One tensor to receive: under which key it is handed back, from whom, what it looks like."""

    key: Hashable
    peer: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    tag: int


class P2P:
    """Sends and receives for one rank's program, addressed by global rank."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._posted: dict[Hashable, list[tuple[Hashable, dist.Work, torch.Tensor]]] = {}
        self._sends: list[tuple[dist.Work, torch.Tensor]] = []

    def post(self, group_key: Hashable, specs: list[RecvSpec]) -> None:
        """Post the receives of one RECV action (all its tensors) unless already posted."""
        if group_key in self._posted:
            return
        posted = []
        for spec in specs:
            buf = torch.empty(spec.shape, dtype=spec.dtype, device=self.device)
            posted.append((spec.key, dist.irecv(buf, src=spec.peer, tag=spec.tag), buf))
        self._posted[group_key] = posted

    def take(self, group_key: Hashable) -> dict[Hashable, torch.Tensor]:
        """Wait for the receives of one RECV action and return its tensors by key."""
        out = {}
        for key, work, buf in self._posted.pop(group_key):
            work.wait()
            out[key] = buf
        return out

    def send(self, tensor: torch.Tensor, peer: int, tag: int) -> None:
        tensor = tensor.detach().contiguous()
        self._sends.append((dist.isend(tensor, dst=peer, tag=tag), tensor))

    def wait_sends(self) -> None:
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()
