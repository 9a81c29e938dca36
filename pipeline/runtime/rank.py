"""The entry point of every rank: join the process group, train, leave cleanly."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from pipelaunch.pipeline.compute.host_allocator import configure_host_allocator
from pipelaunch.pipeline.compute.threads import cpu_threads
from pipelaunch.pipeline.core.plan import Plan
from pipelaunch.pipeline.core.results import RankResult
from pipelaunch.pipeline.core.run_spec import ProcessSpec, RunSpec
from pipelaunch.pipeline.runtime.context import (
    RankContext,
    backend_for,
    env_int,
    make_mesh,
    select_device,
)
from pipelaunch.pipeline.runtime.cpu_affinity import bind_rank_to_cores
from pipelaunch.pipeline.runtime.flight_recorder import apply_nccl_environment
from pipelaunch.pipeline.runtime.trainer import train_rank


@dataclass
class RankJob:
    """Everything a rank needs, picklable: the run (`RunSpec`: seed, steps, plug-ins, evaluation,
    checkpoints, ...), the plan (which alone says pp, dp, micro-batches, precision and links) and
    where to write."""

    run: RunSpec
    plan: Plan
    run_dir: str | None
    #: observers of the rank's training (pipelaunch.pipeline.runtime.trainer.Callback), picklable
    callbacks: tuple = ()
    #: the checkpoint this run resumes from (checked by the launcher), or None for a fresh start
    resume_from: str | None = None
    #: the safetensors file of the model as its constructor built it (read by name), or None: each
    #: rank initialises its stages by (seed, name) (launcher/initial_weights.py says which and why)
    initial_weights: str | None = None


def rank_main(job: RankJob) -> RankResult:
    """Run one rank of one job: join the process group, train, leave it."""
    plan = job.plan
    rank, device = join_process_group(job.run.process, plan.world_size, job.run_dir,
                                      f"pp x dp x tp = {plan.pp} x {plan.dp} x {plan.tp}")
    try:
        result = run_job(job, rank, device)
    except Exception as err:
        if peer_gone(err):  # let the rank that failed first be the one the launcher sees fail
            time.sleep(PEER_GONE_GRACE_S)
        raise
    leave_process_group()
    if result.stopped_by == "SIGTERM":
        # torch elastic is tearing the job down (it passed the launcher's SIGTERM on): it collects
        # no result, and a spawned rank that returned one would wait for it to, until SIGKILL
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return result


#: how long a rank whose peer's connection broke waits before it raises. torch elastic reports the
#: first rank it sees exit with an error and ends the others, so without the wait a peer's "connection
#: reset" could be reported in place of the rank that raised or was killed (the cause)
PEER_GONE_GRACE_S = 2.0
#: what gloo's errors say when the rank at the other end of a connection has exited
PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")


def peer_gone(err: BaseException) -> bool:
    """Whether `err` is a communication failure because a peer process has gone."""
    return any(text in str(err) for text in PEER_GONE)


def set_up_rank_process(host_allocator: str, cpu_affinity: str, local_rank: int, local_world: int,
                        threads: int) -> None:
    """The process settings a rank gets before training: malloc tuning and core binding (huge
    pages come from the environment it was spawned with, host_allocator.rank_environment)."""
    configure_host_allocator(host_allocator)
    bind_rank_to_cores(cpu_affinity, local_rank, local_world, threads)


def join_process_group(process: ProcessSpec, ranks: int, run_dir: str | None, needs: str = "the run",
                       bind_cores: bool = True) -> tuple[int, torch.device]:
    """Take this rank's device, set up its process (threads, malloc, cores) and join the process
    group of WORLD_SIZE ranks, which must be the `ranks` the run needs (`needs` says why: "pp x dp
    = 2 x 2", or plan.devices when the plan chooses pp and dp); returns (global rank, device).
    `bind_cores=False`: the cores are bound later (`bind_local_cores`), after rank 0 has planned
    on all of the machine's cores."""
    rank, world = env_int("RANK", 0), env_int("WORLD_SIZE", 1)
    local_rank, local_world = env_int("LOCAL_RANK", 0), env_int("LOCAL_WORLD_SIZE", world)
    if world != ranks:
        raise RuntimeError(f"WORLD_SIZE={world} but {needs} = {ranks}; start {ranks} ranks")
    device = select_device(process.device, local_rank)
    threads = cpu_threads(process.threads, local_world)
    configure_host_allocator(process.host_allocator)
    if bind_cores:
        bind_local_cores(process)
    if device.type == "cpu":
        torch.set_num_threads(threads)
    backend = backend_for(device)
    if backend == "nccl" and run_dir:
        # the launcher puts these in the environment of the ranks it spawns; ranks torchrun or
        # SLURM started get them here, before the process group reads them (a user's own win)
        apply_nccl_environment(Path(run_dir) / "logs")
    dist.init_process_group(
        backend,
        rank=rank,
        world_size=world,
        # on NCCL too: the watchdog aborts an operation that runs longer, after the flight recorder dump
        timeout=timedelta(seconds=process.timeout_s),
        device_id=device if device.type == "cuda" else None,
    )
    # No try/finally around what follows: a rank that raises keeps its connections open until its
    # process exits, so torch elastic writes its error file before the peers fail on closed sockets
    # and the cause is on record (tearing the group down first let a peer's "connection closed"
    # win the race).
    return rank, device


def run_job(job: RankJob, rank: int, device: torch.device) -> RankResult:
    """Train one job in the process group this rank has joined."""
    world = dist.get_world_size()
    local_rank, local_world = env_int("LOCAL_RANK", 0), env_int("LOCAL_WORLD_SIZE", world)
    ctx = RankContext(rank, world, local_rank, local_world, job.plan.layout, device)
    ctx.mesh = make_mesh(ctx)
    run_dir = Path(job.run_dir) if job.run_dir else None
    return train_rank(job.run, job.plan, ctx, run_dir, job.callbacks, job.resume_from, job.initial_weights)


def leave_process_group() -> None:
    """Destroy the process group, so a sequential multirun can start the next job cleanly."""
    if dist.is_initialized():
        dist.destroy_process_group()


#: how long ranks started by torchrun or SLURM wait for rank 0's Plan: a cold plan=auto profiles
#: and searches for minutes, longer than `timeout_s` allows a collective of the step; a rank 0 that
#: fails while planning exits, and torchrun or SLURM then end the others, so the wait is not a hang
PLAN_WAIT_S = 3600


def broadcast_plan(plan: Plan | None) -> Plan:
    """Every rank gets rank 0's Plan (ranks started by torchrun or SLURM: only rank 0 plans, since a
    profiled Plan depends on timings and every rank must run the very same one), over a gloo group
    of its own that waits `PLAN_WAIT_S` (the default group's timeout is the step's)."""
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=PLAN_WAIT_S))
    holder: list = [plan]
    dist.broadcast_object_list(holder, src=0, group=group)
    dist.destroy_process_group(group)
    return holder[0]


def bind_local_cores(process: ProcessSpec) -> None:
    """`cpu_affinity` for a rank torchrun or SLURM started, once the Plan is there: bound before,
    rank 0 would plan on its own cores only (its probe's two processes sharing one core time out)."""
    local_world = env_int("LOCAL_WORLD_SIZE", env_int("WORLD_SIZE", 1))
    bind_rank_to_cores(process.cpu_affinity, env_int("LOCAL_RANK", 0), local_world,
                       cpu_threads(process.threads, local_world))
