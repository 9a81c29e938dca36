"""Helpers of bench/compare_torch_pipelining.py: the peers our runtime is measured against.

Each measurement runs in fresh spawned processes (one per pipeline rank, or one for the
single-process baseline) so that thread pools, allocator state and imports never leak between
configurations. Rank 0 puts its per-step wall times on a queue; the parent takes the median.
"""

from __future__ import annotations

import socket
import statistics
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pipelaunch.launcher.spawn import environment  # noqa: E402
from pipelaunch.models.gpt import gpt  # noqa: E402
from pipelaunch.models.spec import ModelSpec, causal_lm_loss  # noqa: E402
from pipelaunch.pipeline.compute.host_allocator import rank_environment  # noqa: E402
from pipelaunch.pipeline.core.config import TrainConfig  # noqa: E402
from pipelaunch.pipeline.core.plan import Plan  # noqa: E402
from pipelaunch.pipeline.data.synthetic import SyntheticTokens  # noqa: E402
from pipelaunch.pipeline.runtime.rank import set_up_rank_process  # noqa: E402

#: our scheduler name -> the torch.distributed.pipelining class with the same schedule.
TORCH_SCHEDULES: dict[str, str] = {
    "1f1b": "Schedule1F1B",
    "gpipe": "ScheduleGPipe",
    "zbv": "ScheduleZBVZeroBubble",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
}


@dataclass
class BenchConfig:
    """The workload every configuration trains: gpt_bench on synthetic tokens, SGD."""

    vocab_size: int = 4096
    dim: int = 256
    layers: int = 8
    heads: int = 4
    seq_len: int = 128
    batch_size: int = 32
    microbatches: int = 8
    lr: float = 0.1
    seed: int = 0
    steps: int = 12
    warmup: int = 3
    #: our partitioner; torch gets the very same stage split
    partitioner: str = "uniform"
    #: which runs get our launcher's process setup (malloc retention, huge pages, one core per rank):
    #: "ours" (its defaults), "all" (torch ranks and the single process too), "none" (switched off)
    host_setup: str = "ours"

    @property
    def peers_get_host_setup(self) -> bool:
        return self.host_setup == "all"

    def spec(self) -> ModelSpec:
        return gpt(vocab_size=self.vocab_size, dim=self.dim, layers=self.layers, heads=self.heads,
                   seq_len=self.seq_len, name="gpt_bench")

    def data(self) -> SyntheticTokens:
        return SyntheticTokens(self.vocab_size, self.seq_len, seed=self.seed)

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len


@dataclass
class PipelineJob:
    """One torch.distributed.pipelining run: which schedule, and stage -> (rank, blocks)."""

    schedule: str  # our name, a key of TORCH_SCHEDULES
    placement: list[int]  # rank of each stage, as in our plan.json
    stage_blocks: list[list[str]]  # blocks of each stage, as in our plan.json
    bench: BenchConfig = field(default_factory=BenchConfig)


def free_port() -> int:
    """A TCP port that was free a moment ago (for the gloo rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _median_step(times: list[float], warmup: int) -> float:
    timed = times[warmup:] if len(times) > warmup else times
    return statistics.median(timed)


def workload_overrides(cfg: BenchConfig) -> list[str]:
    """train.py overrides for this workload (everything but the schedule)."""
    return [
        "model=gpt_bench", f"model.vocab_size={cfg.vocab_size}", f"model.dim={cfg.dim}", f"model.layers={cfg.layers}",
        f"model.heads={cfg.heads}", f"model.seq_len={cfg.seq_len}",
        "data=synthetic", f"batch_size={cfg.batch_size}", f"microbatches={cfg.microbatches}",
        "pp=2", "dp=1", "threads=1", "optimizer=sgd", f"optimizer.lr={cfg.lr}", f"seed={cfg.seed}",
        f"partitioner={cfg.partitioner}",
    ]


def compose_our_run(schedule: str, cfg: BenchConfig) -> tuple[TrainConfig, Plan]:
    """The typed config and the Plan `train.py ... scheduler=<schedule>` would run (Hydra
    compose + our planner, profile included)."""
    from pipelaunch.launcher.overrides import compose_checked
    from pipelaunch.launcher.validate import prepare

    typed = compose_checked([*workload_overrides(cfg), f"scheduler={schedule}"])
    return typed, prepare(typed).plan


class TorchRank:
    """One rank's torch.distributed.pipelining stages, schedule and optimizer; `step` times one
    training step as our trainer does (schedule, SGD step, zero_grad, scalar loss all-reduce)."""

    def __init__(self, job: PipelineJob, rank: int) -> None:
        import torch.distributed.pipelining as tpp

        self.bench = cfg = job.bench
        spec = cfg.spec()
        num_stages = len(job.placement)
        mine = [i for i, r in enumerate(job.placement) if r == rank]
        full = spec.build_full(cfg.seed)  # the same weights as ours (the constructor's own); stages take its blocks
        modules = [nn.Sequential(OrderedDict((n, getattr(full, n)) for n in job.stage_blocks[i])) for i in mine]
        stages = [tpp.PipelineStage(m, i, num_stages, torch.device("cpu")) for m, i in zip(modules, mine, strict=True)]
        cls = getattr(tpp, TORCH_SCHEDULES[job.schedule])
        self.schedule = cls(stages[0] if len(stages) == 1 else stages, n_microbatches=cfg.microbatches,
                            loss_fn=causal_lm_loss)
        self.optimizer = torch.optim.SGD([p for m in modules for p in m.parameters()], lr=cfg.lr)
        self.has_first, self.has_last = 0 in mine, num_stages - 1 in mine
        self.data = cfg.data()

    def step(self, step: int) -> tuple[float, float]:
        """(seconds, loss) of one step on batch `step`."""
        inputs, targets = self.data.batch(step, self.bench.batch_size)
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.has_first else ()
        start = time.perf_counter()
        self.schedule.step(*args, target=targets if self.has_last else None, losses=losses, return_outputs=False)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        loss = torch.stack([x.detach() for x in losses]).mean() if losses else torch.zeros(())
        dist.all_reduce(loss)  # as our trainer does: aligns the ranks at the step boundary
        return time.perf_counter() - start, float(loss)


def _torch_rank(rank: int, job: PipelineJob, port: int, out: mp.SimpleQueue) -> None:
    """One rank of a torch.distributed.pipelining run; rank 0 reports step times."""
    world = max(job.placement) + 1
    if job.bench.peers_get_host_setup:
        apply_host_setup(rank, world, threads=1)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        runtime = TorchRank(job, rank)
        times, loss = [], 0.0
        for step in range(job.bench.steps):
            seconds, loss = runtime.step(step)
            times.append(seconds)
        if rank == 0:
            out.put({"step_times_s": times, "final_loss": loss})
    finally:
        dist.destroy_process_group()


def apply_host_setup(local_rank: int, local_world: int, threads: int) -> None:
    """Our launcher's defaults for a rank process; spawn it with `rank_environment(True)` for the
    huge pages."""
    set_up_rank_process("retain", "auto", local_rank, local_world, threads)


def run_torch_pipeline(job: PipelineJob) -> dict:
    """Spawn one process per rank, train, return rank 0's step times and the median."""
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    world = max(job.placement) + 1
    with environment(rank_environment(job.bench.peers_get_host_setup)):
        mp.start_processes(_torch_rank, args=(job, free_port(), out), nprocs=world, join=True,
                           start_method="spawn")
    result = out.get()
    result["step_time_s"] = _median_step(result["step_times_s"], job.bench.warmup)
    return result


def _single_process(threads: int, cfg: BenchConfig, out: mp.SimpleQueue) -> None:
    """Plain gradient accumulation over the micro-batches, then one SGD step."""
    if cfg.peers_get_host_setup:
        apply_host_setup(0, 1, threads)
    torch.set_num_threads(threads)
    model: nn.Module = cfg.spec().build_full(cfg.seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    data = cfg.data()
    times: list[float] = []
    loss_sum = torch.zeros(())
    for step in range(cfg.steps):
        inputs, targets = data.batch(step, cfg.batch_size)
        start = time.perf_counter()
        loss_sum = torch.zeros(())
        for x, t in zip(inputs.chunk(cfg.microbatches), targets.chunk(cfg.microbatches), strict=True):
            loss = causal_lm_loss(model(x), t) / cfg.microbatches
            loss.backward()
            loss_sum += loss.detach()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    out.put({"step_times_s": times, "final_loss": float(loss_sum)})


def run_single_process(threads: int, cfg: BenchConfig) -> dict:
    """The single-process baseline in a fresh process with `threads` intra-op threads."""
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    proc = ctx.Process(target=_single_process, args=(threads, cfg, out))
    with environment(rank_environment(cfg.peers_get_host_setup)):
        proc.start()
    result = out.get()
    proc.join()
    if proc.exitcode:
        raise RuntimeError(f"single-process run exited with {proc.exitcode}")
    result["step_time_s"] = _median_step(result["step_times_s"], cfg.warmup)
    return result

