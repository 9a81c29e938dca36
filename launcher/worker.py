"""The entry point of every rank: join the process group, train, leave cleanly."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from pipeline.plan import Plan
from pipeline.runtime.context import RankContext, backend_for, cpu_threads, env_int, make_mesh, select_device
from pipeline.runtime.trainer import train_rank


@dataclass
class RankJob:
    """Everything a rank needs, picklable: the resolved config, the plan and where to write."""

    cfg: dict
    plan: Plan
    run_dir: str | None
    capture_state: bool = False


def rank_main(job: RankJob) -> dict:
    """Run one rank; the process group is always destroyed, so a multirun can start the next job."""
    rank, world = env_int("RANK", 0), env_int("WORLD_SIZE", 1)
    local_rank, local_world = env_int("LOCAL_RANK", 0), env_int("LOCAL_WORLD_SIZE", world)
    cfg, plan = job.cfg, job.plan
    if world != plan.pp * plan.dp:
        raise RuntimeError(f"WORLD_SIZE={world} but pp x dp = {plan.pp} x {plan.dp} = {plan.pp * plan.dp}")
    device = select_device(cfg["device"], local_rank)
    if device.type == "cpu":
        torch.set_num_threads(cpu_threads(cfg.get("threads", 0), local_world))
    dist.init_process_group(
        backend_for(device), rank=rank, world_size=world, timeout=timedelta(seconds=cfg.get("timeout_s", 120)),
        device_id=device if device.type == "cuda" else None,
    )
    try:
        ctx = RankContext(rank, world, local_rank, local_world, plan.pp, plan.dp, device)
        ctx.mesh = make_mesh(ctx)
        run_dir = Path(job.run_dir) if job.run_dir else None
        return train_rank(cfg, plan, ctx, run_dir, capture_state=job.capture_state)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def joined_rank_env() -> bool:
    """True when torchrun (or SLURM via submitit's export) already started this process as a rank."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))
