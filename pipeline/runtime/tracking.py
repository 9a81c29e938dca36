"""Experiment tracking on global rank 0: the console line per step, and wandb when asked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.core.config import TrainConfig


class Tracker:
    """`logger=console` prints; `logger=wandb` also logs to a wandb run (offline by default)."""

    def __init__(self, cfg: TrainConfig, run_dir: Path | None) -> None:
        self.run: Any = None
        logger_cfg = cfg.logger
        if logger_cfg.get("name") == "wandb":
            import wandb

            self.run = wandb.init(
                project=logger_cfg.get("project", "pipelaunch"),
                mode=logger_cfg.get("mode", "offline"),
                group=logger_cfg.get("group"),
                tags=list(logger_cfg.get("tags") or []),
                config=cfg.to_dict(),
                dir=str(run_dir) if run_dir else None,
                reinit="finish_previous",  # a sequential multirun starts a new run per job
            )

    def log_step(self, step: int, values: dict[str, float]) -> None:
        if self.run is not None:
            self.run.log(values, step=step)

    def finish(self, summary: dict[str, Any] | None = None) -> None:
        if self.run is not None:
            if summary:
                self.run.summary.update(summary)
            self.run.finish()
            self.run = None
