"""The command: `pipelaunch scheduler=zbv pp=4 dp=2` from the user's own project directory (also
`python -m pipelaunch ...`, and `python train.py ...` in a checkout).

Why a project directory matters: a researcher's factory (`models.vit.ViT`), their config groups
(`conf/model/mynet.yaml`) and their outputs live in their repository, not in ours. So the command
puts the directory it runs in first on the import path, adds its `conf/` (when there is one) to
Hydra's search path, and Hydra writes `outputs/` there, as it writes into any working directory.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from pipelaunch.launcher.config import CONF_DIR

SEARCHPATH = "hydra.searchpath="


def project_argv(argv: list[str], cwd: Path) -> list[str]:
    """`argv` with the project's `conf/` (under `cwd`) first on Hydra's search path, merged into a
    `hydra.searchpath=[...]` the command line already gives; unchanged without a `conf/` there."""
    conf = (cwd / "conf").resolve()
    if not conf.is_dir() or conf == CONF_DIR.resolve():
        return list(argv)
    entry = f"file://{conf}"
    out, merged = [], False
    for arg in argv:
        if arg.startswith(SEARCHPATH) and arg[len(SEARCHPATH):].startswith("["):
            inner = arg[len(SEARCHPATH) + 1:-1].strip()
            arg = f"{SEARCHPATH}[{entry}{',' + inner if inner else ''}]"
            merged = True
        out.append(arg)
    return out if merged else [*out, f"{SEARCHPATH}[{entry}]"]


def on_import_path(directory: Path) -> None:
    """The user's project importable first (their `models` package before any other of that name)."""
    path = str(directory.resolve())
    if path not in sys.path:
        sys.path.insert(0, path)
    # ranks are spawned processes: they import the factory by name too
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (path, os.environ.get("PYTHONPATH")) if p)


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="train")
def train(cfg: DictConfig) -> float | None:
    """Returns the run's `objective` for a sweeper (Optuna, ...); a failed job of a multirun returns
    what its sweeper takes for a failure (launcher/app.py: failed_value)."""
    from pipelaunch.launcher.app import (
        run_safely,  # the launcher and planner: not in a rank that imports this
    )

    hydra_cfg = HydraConfig.get()
    return run_safely(cfg, Path(hydra_cfg.runtime.output_dir), multirun=hydra_cfg.mode == RunMode.MULTIRUN,
                      sweeper=str(hydra_cfg.sweeper.get("_target_", "")))


def main() -> None:
    """The installed `pipelaunch` command."""
    from pipelaunch.launcher.config import register_configs
    from pipelaunch.launcher.overrides import precheck_argv
    from pipelaunch.launcher.sweep_names import register_resolvers

    register_configs()
    register_resolvers()
    cwd = Path.cwd()
    on_import_path(cwd)
    sys.argv[1:] = precheck_argv(project_argv(sys.argv[1:], cwd))
    train()
