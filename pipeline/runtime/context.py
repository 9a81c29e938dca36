"""Where this rank sits: its global rank, its coordinates on every axis of the layout, its device
and its process groups.

The layout is one record (`pipeline/core/layout.py`): global rank = ((dp_rank * pp + pp_rank) * cp
+ cp_rank) * tp + tp_rank. The tp ranks of a pipeline rank are consecutive (one node's GPUs, where
tensor parallelism's per-layer collectives belong), then the pipeline ranks of a replica, then the
replicas; experts fold over the replicas. Every group comes from the one mesh (`runtime/mesh.py`)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from pipelaunch.pipeline.core.layout import Coordinates, Layout
from pipelaunch.pipeline.runtime.mesh import RankMesh


@dataclass
class RankContext:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    layout: Layout
    device: torch.device
    mesh: RankMesh | None = None
    _at: Coordinates | None = field(default=None, repr=False)

    @property
    def at(self) -> Coordinates:
        if self._at is None:
            self._at = self.layout.coordinates(self.rank)
        return self._at

    @property
    def pp(self) -> int:
        return self.layout.pp

    @property
    def dp(self) -> int:
        return self.layout.dp

    @property
    def tp(self) -> int:
        return self.layout.tp

    @property
    def ep(self) -> int:
        return self.layout.ep

    @property
    def cp(self) -> int:
        return self.layout.cp

    @property
    def cp_rank(self) -> int:
        return self.at.cp

    @property
    def tp_rank(self) -> int:
        return self.at.tp

    @property
    def pp_rank(self) -> int:
        return self.at.pp

    @property
    def dp_rank(self) -> int:
        return self.at.dp

    @property
    def ep_rank(self) -> int:
        return self.at.ep

    def global_rank(self, pp_rank: int, dp_rank: int | None = None, tp_rank: int | None = None,
                    cp_rank: int | None = None) -> int:
        """Global rank of a pipeline rank in this (or another) replica, at this (or another) tp
        and cp rank: a stage's counterpart in a neighbouring stage is the one at the same tp and
        cp rank."""
        return self.layout.rank(self.dp_rank if dp_rank is None else dp_rank, pp_rank,
                                self.at.cp if cp_rank is None else cp_rank,
                                self.tp_rank if tp_rank is None else tp_rank)

    def tp_dp_mesh(self) -> DeviceMesh:
        """This pipeline rank's tp ranks x replicas, tp first (a checkpoint's view of a parameter
        split by tp, then sharded over the replicas: Shard(d) over tp, then Shard(0) over dp)."""
        assert self.mesh is not None
        return self.mesh.tp_dp

    def _group(self, axis: str) -> dist.ProcessGroup | None:
        return self.mesh.group(axis) if self.mesh is not None else None

    @property
    def tp_group(self) -> dist.ProcessGroup | None:
        """The tp ranks of this pipeline rank (None when there is one)."""
        return self._group("tp")

    @property
    def pp_group(self) -> dist.ProcessGroup | None:
        """The pipeline ranks of this replica (None when there is one)."""
        return self._group("pp")

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        return self._group("dp")

    @property
    def cp_group(self) -> dist.ProcessGroup | None:
        """The ranks holding the other positions of this rank's sequences (None when cp = 1)."""
        return self._group("cp")

    @property
    def grad_group(self) -> dist.ProcessGroup | None:
        """Where gradients are summed: the replicas, and their cp ranks (`RankMesh.grad_mesh`)."""
        return self._group("grad") if self.cp > 1 else self.dp_group

    @property
    def ep_group(self) -> dist.ProcessGroup | None:
        """The replicas holding this rank's layers' other experts: the all-to-all group (ep > 1)."""
        return self._group("ep") if self.ep > 1 else None

    @property
    def expert_dp_group(self) -> dist.ProcessGroup | None:
        """The replicas holding the same experts as this rank: its experts' gradients reduce here."""
        return self._group("expert_dp") if self.ep > 1 else self.dp_group

    @property
    def expert_grad_group(self) -> dist.ProcessGroup | None:
        """Where this rank's experts' gradients are summed: the replicas holding the same experts,
        and under cp their cp ranks (each routed its own positions to them)."""
        return self._group("expert_grad") if self.ep > 1 and self.cp > 1 else self.expert_dp_group


def select_device(requested: str, local_rank: int) -> torch.device:
    """`auto` takes this rank's GPU when CUDA is available, else the CPU. Local rank r takes GPU r
    of the ones visible, and makes it current before anything else touches CUDA, so that this
    process opens a CUDA context on its own GPU only. There is no wrapping around: two ranks on one
    GPU end inside NCCL ("duplicate GPU"); the launcher refuses such a node before spawning
    (launcher/validate.py: check_gpus), and a rank started some other way is refused here."""
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("device=cuda was asked for but torch.cuda.is_available() is False")
    visible = torch.cuda.device_count()
    if bound_to_one_gpu(visible):
        local_rank = 0  # the scheduler gave this process its own GPU (SLURM --gpus-per-task=1)
    if local_rank >= visible:
        raise RuntimeError(
            f"local rank {local_rank} has no GPU of its own: {visible} visible "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); one GPU per rank, "
            "so start at most as many ranks per node as it has GPUs")
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    return device


def bound_to_one_gpu(visible: int) -> bool:
    """Did the scheduler bind this process to a GPU of its own? Then it sees exactly one, named
    alone in its CUDA_VISIBLE_DEVICES (SLURM's --gpus-per-task=1 with binding does so per task),
    and it runs on that one whatever its local rank. A node-wide CUDA_VISIBLE_DEVICES naming one
    GPU for several ranks looks the same from inside one process: only a rank started by
    torchrun or SLURM trusts it (the launcher knows its own spawned ranks share it)."""
    names = [n for n in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if n.strip()]
    return visible == 1 and len(names) == 1 and "LOCAL_RANK" in os.environ


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default


def make_mesh(ctx: RankContext) -> RankMesh:
    """The run's one mesh (collective)."""
    return RankMesh(ctx.layout, ctx.device)
