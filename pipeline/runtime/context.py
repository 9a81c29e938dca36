"""Where this rank sits: its global rank, its (dp, pp, tp) coordinates, device and process groups.

The layout: global rank = (dp_rank * pp + pp_rank) * tp + tp_rank. The tp ranks of a pipeline
rank are consecutive (one node's GPUs, where tensor parallelism's per-layer collectives belong),
then the pipeline ranks of a replica, then the replicas."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass
class RankContext:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    pp: int
    dp: int
    device: torch.device
    mesh: DeviceMesh | None = None
    tp: int = 1
    _tp_dp: DeviceMesh | None = field(default=None, repr=False)

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def pp_rank(self) -> int:
        return (self.rank // self.tp) % self.pp

    @property
    def dp_rank(self) -> int:
        return self.rank // (self.tp * self.pp)

    def global_rank(self, pp_rank: int, dp_rank: int | None = None, tp_rank: int | None = None) -> int:
        """Global rank of a pipeline rank in this (or another) replica, at this (or another) tp
        rank: a stage's counterpart in a neighbouring stage is the one at the same tp rank."""
        dp_rank = self.dp_rank if dp_rank is None else dp_rank
        return (dp_rank * self.pp + pp_rank) * self.tp + (self.tp_rank if tp_rank is None else tp_rank)

    def tp_dp_mesh(self) -> DeviceMesh:
        """This pipeline rank's tp ranks x replicas, tp first (a checkpoint's view of a parameter
        split by tp, then sharded over the replicas: Shard(d) over tp, then Shard(0) over dp).
        Collective the first time: every rank builds the world's (pp, tp, dp) mesh."""
        if self._tp_dp is None:
            ranks = torch.arange(self.world_size).view(self.dp, self.pp, self.tp).permute(1, 2, 0)
            self._tp_dp = DeviceMesh(self.device.type, ranks, mesh_dim_names=("pp", "tp", "dp"))["tp", "dp"]
        return self._tp_dp

    @property
    def tp_group(self) -> dist.ProcessGroup | None:
        """The tp ranks of this pipeline rank (None when there is one)."""
        return self.mesh["tp"].get_group() if self.mesh is not None and self.tp > 1 else None

    @property
    def pp_group(self) -> dist.ProcessGroup | None:
        """The pipeline ranks of this replica (None when there is one)."""
        return self.mesh["pp"].get_group() if self.mesh is not None and self.pp > 1 else None

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        return self.mesh["dp"].get_group() if self.mesh is not None and self.dp > 1 else None


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


def make_mesh(ctx: RankContext) -> DeviceMesh:
    return init_device_mesh(ctx.device.type, (ctx.dp, ctx.pp, ctx.tp), mesh_dim_names=("dp", "pp", "tp"))
