"""The narrow record a rank runs from beside its Plan (`pipelaunch.pipeline.core.run_spec.RunSpec`),
built once here from the config, the plug-ins and the run directory.

Why not the whole config: on a rank the Plan alone says pp, dp, micro-batches, precision and
links, and the checkpoint root is decided once (here), so a rank reading a setting has one source.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from pipelaunch.pipeline.core.config import TrainConfig
from pipelaunch.pipeline.core.plugins import Plugins
from pipelaunch.pipeline.core.run_spec import CheckpointSpec, ProcessSpec, RunSpec


def checkpoint_root(cfg: TrainConfig, run_dir: Path | None) -> Path | None:
    """Where this run's checkpoints go: checkpoint.dir, else <run dir>/checkpoints (the one place
    it is decided: resume=auto looks there, the ranks save there)."""
    if cfg.checkpoint.dir:
        return Path(cfg.checkpoint.dir)
    return run_dir / "checkpoints" if run_dir is not None else None


def process_spec(cfg: TrainConfig) -> ProcessSpec:
    """A rank process's settings (what joining the process group reads)."""
    return ProcessSpec(str(cfg.device), cfg.threads, str(cfg.host_allocator), str(cfg.cpu_affinity), cfg.timeout_s)


def run_spec(cfg: TrainConfig, plugins: Plugins, run_dir: Path | None) -> RunSpec:
    """What every rank of this run reads besides the Plan."""
    root = checkpoint_root(cfg, run_dir)
    return RunSpec(
        plugins=plugins, seed=cfg.seed, steps=cfg.steps, warmup_steps=cfg.warmup_steps, batch_size=cfg.batch_size,
        log_every=cfg.log_every, clip_grad_norm=cfg.clip_grad_norm,
        eval=replace(cfg.eval),
        checkpoint=CheckpointSpec(cfg.checkpoint.every, cfg.checkpoint.keep, str(root) if root is not None else None),
        debug=replace(cfg.debug),
        process=process_spec(cfg), config=cfg.to_dict(), model_config=dict(cfg.model))
