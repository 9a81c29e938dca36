"""The typed schema (`pipelaunch.pipeline.core.config.TrainConfig`) registered in Hydra's ConfigStore, the
composed config turned into that typed object, and the options of a config group.

Top-level numbers (`pp`, `dp`, ...) are plain int keys, not config groups: Hydra cannot select a
group option by a number on the command line.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from pipelaunch.pipeline.core.config import TrainConfig
from pipelaunch.pipeline.core.errors import ConfigError

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


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


def typed_config(cfg: DictConfig) -> TrainConfig:
    """The composed config as the one typed object every later step reads, interpolations
    resolved (ranks cannot resolve `${hydra:...}`). A value the chosen option requires and nobody
    gave (`???`) is refused here, naming it."""
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        group = missing[0].split(".")[0]
        option = OmegaConf.select(cfg, f"{group}.name", default=None) or OmegaConf.select(
            cfg, f"{group}._target_", default="")
        raise ConfigError(missing[0], f"is required by {group}={option} and was not given; set "
                                      f"{missing[0]}=<value> on the command line")
    known = {f.name for f in fields(TrainConfig)}
    unknown = sorted(set(cfg.keys()) - known)
    if unknown:
        raise ConfigError(unknown[0], f"is not a setting of train.py (a typo?); top-level keys are "
                                      f"{', '.join(sorted(known))}")
    return OmegaConf.to_object(cfg)
