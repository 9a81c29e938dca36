"""Experiment tracking on global rank 0: the `logger` config group's plug-ins.

Each option of `conf/logger/` names a `Tracker` subclass (a user's own too), which the launcher
imports (`Plugins.tracker`): it is built on rank 0 with the run's config as plain data, the run
directory and the option's other keys, then told each step's
values and, at the end, the run's summary. The console line per step is the progress display's
(`pipelaunch.pipeline.runtime.progress`), whatever the logger.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipelaunch.pipeline.core.plugins import Plugin


class Tracker:
    """`logger=console`: nothing beyond the progress line. The interface every logger keeps."""

    def __init__(self, run_config: dict, run_dir: Path | None) -> None:
        self.run_config, self.run_dir = run_config, run_dir

    def log_step(self, step: int, values: dict[str, float]) -> None:
        """The values of one step (loss, lr, tokens/s, eval_loss)."""

    def finish(self, summary: dict[str, Any] | None = None) -> None:
        """The run's summary (median step time, tokens/s); the last call."""


class WandbTracker(Tracker):
    """`logger=wandb`: a wandb run, offline by default (`wandb sync` uploads it later)."""

    def __init__(self, run_config: dict, run_dir: Path | None, project: str = "pipelaunch", mode: str = "offline",
                 group: str | None = None, tags: Sequence[str] = ()) -> None:
        import wandb

        super().__init__(run_config, run_dir)
        self.run: Any = wandb.init(
            project=project, mode=mode, group=group, tags=list(tags), config=run_config,
            dir=str(run_dir) if run_dir else None,
            reinit="finish_previous",  # a sequential multirun starts a new run per job
        )

    def log_step(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def finish(self, summary: dict[str, Any] | None = None) -> None:
        if self.run is not None:
            if summary:
                self.run.summary.update(summary)
            self.run.finish()
            self.run = None


def make_tracker(logger: Plugin, run_config: dict, run_dir: Path | None) -> Tracker:
    """The `logger` option's tracker for this run: its class, called with the run's config as plain
    data, the run directory and the option's other keys (its `name` only labels the option)."""
    return logger.build(run_config, run_dir)
