"""The parallel layout as one record: how many ranks on each axis, where each rank sits, and which
ranks form each group.

Why one record: every rank must agree, without a message, on its own coordinates and on the
ranks of each group it joins (a P2P neighbour, its replicas, its tensor-parallel peers, the ranks
holding the same experts), and the planner's candidates are priced on the same layout the ranks
build. torchtitan's `ParallelDims` holds this for a trainer; here it is plain data beside the
Plan, and `pipeline/runtime/mesh.py` builds the one DeviceMesh from it.

The axes, outermost first (a rank's global index is mixed-radix in this order):

- `dp`: data-parallel replicas (under hybrid sharding, `dp_shard` consecutive ones share their
  shards and the groups of them replicate);
- `pp`: pipeline ranks of a replica;
- `cp`: context-parallel ranks (the sequence split over them; 1 until it lands);
- `tp`: tensor-parallel ranks, innermost, so a node's GPUs hold them.

Expert parallelism folds over the replicas (`ep` divides `dp`): the ep ranks holding different
experts of a layer are `ep` consecutive replicas (at the same pp, cp and tp coordinates), and the
`dp / ep` ranks holding the same experts are the "expert replicas", over which the experts'
gradients are reduced (every other parameter's over all dp replicas). Why over the replicas and
not over tp as well (Megatron's parallel folding can use tp's ranks too): an expert layer's
tokens are the replica's, split by no tp rank, so the all-to-alls run between replicas, and the
tp ranks of one pipeline rank stay lockstep copies as the tp rewrite needs.
"""

from __future__ import annotations

from dataclasses import dataclass

#: the axes in global-rank order, outermost first
AXES = ("dp", "pp", "cp", "tp")


@dataclass(frozen=True)
class Coordinates:
    """Where one rank sits on every axis (and in its expert group)."""

    dp: int
    pp: int
    cp: int
    tp: int
    #: its place among the `ep` replicas sharing a layer's experts, and which group of them
    ep: int = 0
    expert_replica: int = 0


@dataclass(frozen=True)
class Layout:
    """pp x dp x cp x tp ranks, ep folded over dp; `dp_shard`: the replicas a sharded tensor spans
    (None: all of them)."""

    pp: int = 1
    dp: int = 1
    tp: int = 1
    cp: int = 1
    ep: int = 1
    dp_shard: int | None = None

    def __post_init__(self) -> None:
        for axis in ("pp", "dp", "tp", "cp", "ep"):
            if getattr(self, axis) < 1:
                raise ValueError(f"layout: {axis}={getattr(self, axis)} must be at least 1")
        if self.dp % self.ep:
            raise ValueError(f"layout: ep={self.ep} must divide dp={self.dp} (experts fold over the replicas)")

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    @property
    def sizes(self) -> tuple[int, ...]:
        """Each axis's size, in `AXES` order."""
        return self.dp, self.pp, self.cp, self.tp

    def rank(self, dp: int = 0, pp: int = 0, cp: int = 0, tp: int = 0) -> int:
        """The global rank at these coordinates."""
        return ((dp * self.pp + pp) * self.cp + cp) * self.tp + tp

    def coordinates(self, rank: int) -> Coordinates:
        """Where `rank` sits."""
        if not 0 <= rank < self.world:
            raise ValueError(f"layout: rank {rank} is outside 0..{self.world - 1}")
        rest, tp = divmod(rank, self.tp)
        rest, cp = divmod(rest, self.cp)
        dp, pp = divmod(rest, self.pp)
        return Coordinates(dp, pp, cp, tp, ep=dp % self.ep, expert_replica=dp // self.ep)

    def along(self, rank: int, axis: str) -> list[int]:
        """The ranks that differ from `rank` on `axis` alone, in that axis's order (its group)."""
        at = self.coordinates(rank)
        here = {"dp": at.dp, "pp": at.pp, "cp": at.cp, "tp": at.tp}
        return [self.rank(**{**here, axis: i}) for i in range(getattr(self, axis))]

    def expert_group(self, rank: int) -> list[int]:
        """The `ep` ranks holding the different experts of `rank`'s layers (its all-to-all group)."""
        at = self.coordinates(rank)
        return [self.rank(at.expert_replica * self.ep + e, at.pp, at.cp, at.tp) for e in range(self.ep)]

    def expert_replicas(self, rank: int) -> list[int]:
        """The `dp / ep` ranks holding the same experts as `rank` (their gradients reduced together)."""
        at = self.coordinates(rank)
        return [self.rank(r * self.ep + at.ep, at.pp, at.cp, at.tp) for r in range(self.dp // self.ep)]

    def groups(self, axis: str) -> list[list[int]]:
        """Every group along `axis` ("dp", "pp", "cp", "tp", "ep" or "expert_dp"), each once, in the
        order every rank creates them (torch.distributed's new_group is collective)."""
        seen, out = set(), []
        for rank in range(self.world):
            group = (self.expert_group(rank) if axis == "ep" else self.expert_replicas(rank) if axis == "expert_dp"
                     else self.along(rank, axis))
            if group[0] not in seen:
                seen.add(group[0])
                out.append(group)
        return out
