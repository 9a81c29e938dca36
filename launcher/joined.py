"""Is this process a rank someone else started (torchrun, SLURM through submitit)? Light on
purpose: the launcher asks before it knows whether it will train at all."""

from __future__ import annotations

import os


def export_submitit_env() -> bool:
    """Under hydra-submitit-launcher with several tasks, each task is one rank: export
    RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT/LOCAL_RANK from the SLURM (or local) job environment."""
    if "SUBMITIT_EXECUTOR" not in os.environ or "RANK" in os.environ:
        return False
    import submitit

    if submitit.JobEnvironment().num_tasks <= 1:
        return False
    from submitit.helpers import TorchDistributedEnvironment

    TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
    return True


def joined_rank_env() -> bool:
    """True when torchrun (or SLURM via submitit's export) already started this process as a rank."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))
