"""The one DeviceMesh of a run, built from its layout record (`pipeline/core/layout.py`), and every
process group a rank uses, handed out by axis name.

Why one: each group is a communicator every rank must create in the same order, and three places
used to build meshes of their own, in three axis orders (dp-pp-tp for the groups, pp-tp-dp for a
checkpoint's view of a tp-split parameter, replicate-shard-pp for hybrid sharding, which left tp
out). Here the world mesh has the layout's axes in global-rank order, the data-parallel axis cut
into the pair the run needs (hybrid sharding's replicate x shard, or expert parallelism's expert
replicas x experts), and each group is a slice or a flattening of it.
"""

from __future__ import annotations

from functools import cached_property

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from pipelaunch.pipeline.core.layout import Layout


class RankMesh:
    """The world's DeviceMesh over `layout` and its groups. Collective: every rank builds it, in
    the same order, and asks for the same groups in the same order (`cached_property`: a group is
    made the first time any rank asks, which rank code does at the same point on every rank)."""

    def __init__(self, layout: Layout, device: torch.device) -> None:
        self.layout = layout
        outer, inner = self._dp_split(layout)
        self.dp_names = outer[0], inner[0]
        self.mesh: DeviceMesh = init_device_mesh(
            device.type, (outer[1], inner[1], layout.pp, layout.cp, layout.tp),
            mesh_dim_names=(outer[0], inner[0], "pp", "cp", "tp"))

    @staticmethod
    def _dp_split(layout: Layout) -> tuple[tuple[str, int], tuple[str, int]]:
        """The data-parallel axis as two: (expert replicas, experts) under expert parallelism,
        else (replicate, shard) groups of hybrid sharding (shard = dp without it)."""
        if layout.ep > 1:
            if layout.dp_shard not in (None, layout.dp):
                raise ValueError("expert parallelism with hybrid sharding (dp_shard < dp) is not supported")
            return ("expert_dp", layout.dp // layout.ep), ("ep", layout.ep)
        shard = layout.dp_shard or layout.dp
        return ("dp_replicate", layout.dp // shard), ("dp_shard", shard)

    def __getitem__(self, axis: str) -> DeviceMesh:
        """The 1-D mesh along `axis`: pp, cp, tp, dp (all the replicas), grad (the replicas x cp),
        and ep / expert_dp / expert_grad (expert_dp x cp) under expert parallelism, dp_replicate /
        dp_shard otherwise."""
        if axis == "dp":
            return self.dp_mesh
        if axis == "grad":
            return self.grad_mesh
        if axis == "expert_grad":
            return self.expert_grad_mesh
        return self.mesh[axis]

    @cached_property
    def dp_mesh(self) -> DeviceMesh:
        """All the replicas, one axis (the two data-parallel axes flattened)."""
        outer, inner = self.dp_names
        if self.mesh[outer].size() == 1:
            return self.mesh[inner]
        if self.mesh[inner].size() == 1:
            return self.mesh[outer]
        return self.mesh[outer, inner]._flatten("dp")

    @cached_property
    def grad_mesh(self) -> DeviceMesh:
        """What the gradients are summed over: the replicas, and under cp their cp ranks too (each
        computed its share of the same sequences' gradients)."""
        if self.layout.cp == 1:
            return self.dp_mesh
        outer, inner = self.dp_names
        axes = [a for a in (outer, inner) if self.mesh[a].size() > 1] + ["cp"]
        return self.mesh["cp"] if axes == ["cp"] else self.mesh[tuple(axes)]._flatten("dp_cp")

    @cached_property
    def expert_grad_mesh(self) -> DeviceMesh:
        """What an experts parameter's gradients are summed over under ep > 1: its expert
        replicas, and under cp their cp ranks too."""
        if self.layout.cp == 1:
            return self.mesh["expert_dp"]
        if self.mesh["expert_dp"].size() == 1:
            return self.mesh["cp"]
        return self.mesh["expert_dp", "cp"]._flatten("expert_dp_cp")

    @cached_property
    def shard_mesh(self) -> DeviceMesh:
        """What FSDP2 shards over: the replicas (1-D), or replicate x shard (2-D, hybrid sharding)."""
        if self.layout.ep == 1 and self.layout.dp_shard not in (None, self.layout.dp):
            return self.mesh["dp_replicate", "dp_shard"]
        return self.dp_mesh

    @cached_property
    def tp_dp(self) -> DeviceMesh:
        """This pipeline rank's tp ranks x replicas, tp first: a checkpoint's view of a parameter
        split by tp and sharded over the replicas (Shard(d) over tp, then Shard(0) over dp). Built
        from the world's rank grid in that order (a DeviceMesh slices its dimensions in its own
        order only)."""
        layout = self.layout
        grid = torch.arange(layout.world).view(layout.dp, layout.pp, layout.cp, layout.tp).permute(1, 2, 3, 0)
        mesh = DeviceMesh(self.mesh.device_type, grid, mesh_dim_names=("pp", "cp", "tp", "dp"))
        return mesh["tp", "dp"]

    @cached_property
    def ep_expert_dp(self) -> DeviceMesh:
        """This rank's ep ranks x expert replicas, ep first: a checkpoint's view of an experts
        parameter sharded over its expert replicas (zero >= 1, 1 < ep < dp: Shard(0) over ep, each
        rank's experts, then Shard(0) over expert_dp, FSDP2's shard of them). Made from the two
        axes' existing groups, so no collective: only the ranks whose stages hold experts ask."""
        layout = self.layout
        grid = torch.arange(layout.world).view(layout.dp // layout.ep, layout.ep, layout.pp, layout.cp, layout.tp)
        at = layout.coordinates(dist.get_rank())
        ranks = grid[:, :, at.pp, at.cp, at.tp].T.contiguous()  # [ep, expert_dp]
        return DeviceMesh.from_group([self.mesh["ep"].get_group(), self.mesh["expert_dp"].get_group()],
                                     self.mesh.device_type, ranks, mesh_dim_names=("ep", "expert_dp"))

    def group(self, axis: str) -> dist.ProcessGroup | None:
        """The process group along `axis`, None where the axis has one rank."""
        mesh = self[axis]
        return mesh.get_group() if mesh.size() > 1 else None
