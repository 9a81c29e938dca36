"""What a rank reads of the run beside its Plan: one narrow, typed record built by the launcher.

The Plan alone says pp, dp, micro-batches, the micro-batch size, precision and the links; the
`RunSpec` says what the Plan does not: how long to train and from which seed, the plug-ins to
build (model, data, optimizer, LR schedule, tracker), evaluation, checkpoints (one root, decided
once by the launcher) and the rank process's settings. A rank never reads the whole config, so
no setting has two sources on a rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipelaunch.pipeline.core.config import DebugConfig, EvalConfig
from pipelaunch.pipeline.core.plugins import Plugins


@dataclass(frozen=True)
class CheckpointSpec:
    #: save every this many steps and after the last one; 0 = never
    every: int
    #: complete checkpoints kept (the oldest are deleted); 0 = keep all
    keep: int
    #: where step_<N>/ directories go (checkpoint.dir, else <run dir>/checkpoints); None = nowhere
    root: str | None


@dataclass(frozen=True)
class ProcessSpec:
    """A rank process's settings: its device kind, threads, allocator, cores and collective timeout."""

    device: str
    threads: int
    host_allocator: str
    cpu_affinity: str
    timeout_s: int


@dataclass(frozen=True)
class RunSpec:
    """Everything a rank needs of the run but the Plan (module docstring); the launcher builds it
    (`pipelaunch.launcher.run_spec`), so no default is stated twice."""

    plugins: Plugins
    seed: int
    steps: int
    #: steps excluded from timing
    warmup_steps: int
    #: the global batch (sequences per optimizer step)
    batch_size: int
    log_every: int
    clip_grad_norm: float | None
    eval: EvalConfig
    checkpoint: CheckpointSpec
    #: fault injection and P2P-order recording (`debug.*`), for testing failure handling
    debug: DebugConfig
    process: ProcessSpec
    #: the run's config as plain data: metrics.json's `config`, the tracker's run config
    config: dict[str, Any]
    #: the model option as written, recorded in each checkpoint (export rebuilds the model from it)
    model_config: dict[str, Any]
