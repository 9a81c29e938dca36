"""The typed schema of the primary config, registered in Hydra's ConfigStore.

Top-level numbers (`pp`, `dp`, ...) are plain int keys, not config groups: Hydra cannot select a
group option by a number on the command line. Group contents stay open (`Any`) because each
option carries its own fields and `_target_`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


@dataclass
class EvalConfig:
    #: a forward-only pass over held-out batches every this many steps (and after the last); 0 = never
    every: int = 0
    #: held-out batches per evaluation (each a full global batch of `batch_size` sequences)
    batches: int = 2


@dataclass
class CheckpointConfig:
    #: save every this many steps and at the end of the run; 0 = no checkpoints
    every: int = 0
    #: complete checkpoints kept (the oldest are deleted); 0 = keep all
    keep: int = 3
    #: where step_<N>/ directories go; null = <run dir>/checkpoints
    dir: Any = None


@dataclass
class DebugConfig:
    """Fault injection, for testing the launcher's failure handling (never set in real runs)."""

    #: this global rank kills itself with SIGKILL at the start of step `kill_step`
    kill_rank: Any = None
    kill_step: Any = None
    #: this global rank stops answering (sleeps for good) at the start of step `hang_step`
    hang_rank: Any = None
    hang_step: Any = None
    #: log each rank's P2P posting order (first training step and first evaluation) and check, at
    #: the end, that every pair's k-th messages complement each other, as NCCL needs (tags are 0)
    record_p2p: bool = False


@dataclass
class TrainConfig:
    model: Any = MISSING
    data: Any = MISSING
    scheduler: Any = MISSING
    partitioner: Any = MISSING
    placement: Any = MISSING
    optimizer: Any = MISSING
    logger: Any = MISSING
    memory: Any = MISSING
    lr_scheduler: Any = MISSING
    #: manual (the scheduler, partitioner, microbatches and remat given) | auto (searched jointly)
    plan: Any = MISSING
    #: pipeline-parallel degree: ranks per pipeline.
    pp: int = 2
    #: data-parallel degree: number of pipeline replicas.
    dp: int = 1
    #: micro-batches per step in each replica.
    microbatches: int = 4
    #: the global batch (sequences per optimizer step), the same whatever pp and dp are.
    batch_size: int = 16
    steps: int = 10
    #: steps excluded from timing (the first ones pay for allocation and warm caches).
    warmup_steps: int = 2
    seed: int = 0
    #: auto | cpu | cuda
    device: str = "auto"
    #: none | full (keep only stage inputs in the forward, recompute in the backward) | auto (under
    #: memory=budget: recompute only on the stages that would not fit otherwise)
    remat: str = "none"
    #: train | plan (dry run: plan, simulate, draw; no ranks)
    mode: str = "train"
    #: what the run returns to a Hydra sweeper (Optuna, Nevergrad, Ax), in metrics.json's unit:
    #: tokens_per_s (maximised) | step_time_s | loss (final training loss) | eval_loss (last
    #: held-out loss; needs eval.every > 0), the last three minimised. A dry run (mode=plan)
    #: returns the planned step_time_s or tokens_per_s; a failed job in a multirun returns what its
    #: sweeper counts as a failed trial (None for Optuna, NaN otherwise: launcher/app.py failed_value)
    objective: str = "tokens_per_s"
    #: profile and simulate the plan before training even when nothing else needs it, so that the
    #: run reports the predicted step and per-device peak beside the measured ones
    predict: bool = False
    #: print a line every this many steps on rank 0.
    log_every: int = 1
    #: seconds any collective or P2P wait may take before the job fails.
    timeout_s: int = 120
    #: CPU threads per rank; 0 = cores / local ranks, at least 1.
    threads: int = 0
    #: retain (keep freed host memory for reuse: no page faults on every new activation) | system
    host_allocator: str = "retain"
    #: back rank heaps with transparent huge pages (glibc tunable, set for the ranks the launcher spawns)
    huge_pages: bool = True
    #: auto (bind each local rank to its own `threads` cores when they cover all ranks) | none
    cpu_affinity: str = "auto"
    #: clip gradients to this global norm (over every parameter of the model, tied ones once); null = off
    clip_grad_norm: Any = None
    #: fp32 | bf16 (autocast for compute; weights, gradients and optimizer state stay fp32)
    precision: str = "fp32"
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    #: none | auto (the latest complete checkpoint under checkpoint.dir) | a step_<N> directory
    resume: str = "none"
    debug: DebugConfig = field(default_factory=DebugConfig)
    #: link model for the simulator's predictions (seconds per message, bytes per second).
    link_latency_s: float = 5e-5
    link_bandwidth: float = 1e9


def group_configs(group: str) -> dict[str, dict]:
    """Every option of a config group as a plain dict, found on this run's own search path (the
    project's conf/ and any `hydra.searchpath` entry, so a user's package counts); outside a
    Hydra app, the project's own `conf/<group>/` options. Why: `scheduler=auto` and `plan=auto` compare
    every schedule the user could have chosen by name, not a list kept in code."""
    from hydra._internal.config_repository import ConfigRepository
    from hydra._internal.config_search_path_impl import ConfigSearchPathImpl
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.object_type import ObjectType
    from omegaconf import OmegaConf

    if not HydraConfig.initialized():  # composed outside the app (a test, a notebook): the project's own
        return {path.stem: OmegaConf.to_container(OmegaConf.load(path), resolve=False)
                for path in sorted((CONF_DIR / group).glob("*.yaml"))}
    search_path = ConfigSearchPathImpl()
    for source in HydraConfig.get().runtime.config_sources:
        search_path.append(source.provider, f"{source.schema}://{source.path}")
    repo = ConfigRepository(config_search_path=search_path)
    out = {}
    for option in repo.get_group_options(group, results_filter=ObjectType.CONFIG):
        loaded = repo.load_config(f"{group}/{option}")
        if loaded is not None:
            out[option] = OmegaConf.to_container(loaded.config, resolve=False)
    return out


def register_configs() -> None:
    ConfigStore.instance().store(name="train_schema", node=TrainConfig)
