"""Entry point: `python train.py scheduler=zbv pp=4 dp=2` (see README.md)."""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from launcher.app import run_safely
from launcher.config import register_configs
from launcher.overrides import precheck_argv
from launcher.sweep_names import register_resolvers

register_configs()
register_resolvers()


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    """Returns the run's `objective` for a sweeper (Optuna, ...); a failed job of a multirun returns
    what its sweeper takes for a failure (launcher/app.py: failed_value)."""
    hydra_cfg = HydraConfig.get()
    return run_safely(cfg, Path(hydra_cfg.runtime.output_dir), multirun=hydra_cfg.mode == RunMode.MULTIRUN,
                      sweeper=str(hydra_cfg.sweeper.get("_target_", "")))


if __name__ == "__main__":
    sys.argv[1:] = precheck_argv(sys.argv[1:])
    main()
