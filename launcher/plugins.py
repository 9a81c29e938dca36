"""Plug-ins built once, at the edge: each plug-in group's option becomes a typed object.

A plug-in option (`conf/<group>/*.yaml`, a user's own too) names a callable by `_target_` and
carries its arguments. Here, and nowhere below the launcher, that mapping is read: one mechanism
(`build_plugin`: drop the keys that are no arguments, let Hydra import the callable and build
what is nested in its arguments, name group and option in the error) turns each into a
`pipelaunch.pipeline.core.plugins.Plugin`, and `build_plugins` gathers a run's into one
`Plugins` record that the planner and, pickled, every rank build their objects from.

`scheduler=auto` is no schedule: its option says `search: true`, a setting of the search
(`Plugins.search_schedules`), and the planner compares the scheduler group's options instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import OmegaConf

from pipelaunch.pipeline.core.config import PluginConfig, TrainConfig
from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.core.plugins import GroupOptions, OptimizerSpec, Plugin, Plugins, Refused
from pipelaunch.pipeline.planner.search.space import build_generator

#: keys of an option that are not arguments of its callable (`name` only labels the option)
RESERVED = ("name",)
#: groups whose callable takes the option's `name` as an argument (a model's name is its spec's)
NAMED_BY_ARGUMENT = ("model", "data")
#: the key of a scheduler option that asks for a search over the group (`conf/scheduler/auto.yaml`)
SEARCH_KEY = "search"
TARGET = "_target_"

#: optimizer state tensors per parameter (the size of the parameter each), by torch.optim class
#: name; an optimizer class of one's own may say its own with a `states_per_param` attribute
STATES_PER_PARAM = {"Adam": 2, "AdamW": 2, "NAdam": 2, "RAdam": 2, "Adamax": 2, "Adadelta": 2, "Adagrad": 1,
                    "RMSprop": 1, "Rprop": 2, "ASGD": 2, "SGD": 0}
#: what an optimizer neither the table nor its class prices is priced at (AdamW's, the common worst case)
UNKNOWN_STATES = 2


def plain(cfg: Any) -> Any:
    """An option as plain data (an OmegaConf node resolved into dicts and lists)."""
    return OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else cfg


def option_name(cfg: PluginConfig) -> str:
    """How an option is shown: its `name` key, or its callable's name."""
    return str(cfg.get("name") or str(cfg.get(TARGET, "?")).rsplit(".", 1)[-1])


def build_plugin(group: str, cfg: PluginConfig, option: str | None = None) -> Plugin:
    """The one way a group's option becomes a Plugin: its callable imported, the arguments that
    are plug-ins themselves built (Hydra's rules: `_partial_`, `_recursive_`), nothing called
    yet. What Hydra refuses is a ConfigError naming the group and the option."""
    cfg = dict(plain(cfg) or {})
    option = option or option_name(cfg)
    target = cfg.get(TARGET)
    if not isinstance(target, str):
        raise ConfigError(group, f"needs a `{TARGET}` naming a callable (got {cfg!r}); see conf/{group}/")
    reserved = () if group in NAMED_BY_ARGUMENT else RESERVED
    body = {k: v for k, v in cfg.items() if k not in reserved}
    try:
        made = instantiate(body, _partial_=True, _convert_="all")
    except InstantiationException as exc:
        cause = exc.__cause__ or exc
        if isinstance(cause, ConfigError):
            raise cause from None
        raise ConfigError(f"{group}.{TARGET}" if _unimportable(cause) else group,
                          f"could not build {target} ({group}={option}): {' '.join(str(cause).split())}") from None
    except Exception as exc:  # noqa: BLE001 - OmegaConf refusing the option's values
        raise ConfigError(group, f"could not build {target} ({group}={option}): {' '.join(str(exc).split())}") from None
    return Plugin(group, option, made.func, dict(made.keywords), config=cfg, args=tuple(made.args), path=target)


def _unimportable(cause: BaseException) -> bool:
    return isinstance(cause, ImportError | AttributeError) or "Error locating target" in str(cause)


def is_search(scheduler_cfg: PluginConfig) -> bool:
    """Whether the scheduler option is `scheduler=auto`: a search over the group, no schedule."""
    return bool(plain(scheduler_cfg).get(SEARCH_KEY) is True and TARGET not in scheduler_cfg)


def schedule_option(cfg: PluginConfig, option: str | None = None) -> Plugin:
    """A scheduler option, checked to build a ScheduleGenerator (`search.space.build_generator`)."""
    if is_search(cfg):
        raise ConfigError(
            "scheduler",
            "scheduler=auto is a search the launcher runs over the scheduler group's options "
            "(plan=auto with only the schedule varying), not a schedule: build a concrete one by its "
            "option name instead, e.g. scheduler=1f1b",
        )
    plugin = build_plugin("scheduler", cfg, option)
    build_generator(plugin)
    return plugin


def optimizer_spec(cfg: PluginConfig) -> OptimizerSpec:
    """The optimizer option, with the state tensors it keeps per parameter decided here, from its
    class and options (`momentum`, `centered`, `amsgrad`), once."""
    factory = build_plugin("optimizer", cfg)
    return OptimizerSpec(factory, states_per_param(factory))


def states_per_param(factory: Plugin) -> int:
    """State tensors per parameter for this optimizer: its class's `states_per_param` when it says,
    else torch.optim's by class name, with the options that add one."""
    declared = factory.attribute("states_per_param", None)
    if isinstance(declared, int):
        return declared
    name = getattr(factory.fn, "__name__", "")
    states = STATES_PER_PARAM.get(name, UNKNOWN_STATES)
    options = factory.kwargs
    momentum = float(options.get("momentum") or 0.0)
    if name == "SGD" and momentum:
        states = 1
    elif name == "RMSprop":
        states += int(bool(momentum)) + int(bool(options.get("centered")))
    elif name in ("Adam", "AdamW") and options.get("amsgrad"):
        states += 1
    return states


def build_plugins(cfg: TrainConfig) -> Plugins:
    """Every plug-in of this run, built once; nothing is called yet but the scheduler (to check it
    builds a generator)."""
    searching = is_search(cfg.scheduler)
    return Plugins(
        model=build_plugin("model", cfg.model), data=build_plugin("data", cfg.data),
        scheduler=None if searching else schedule_option(cfg.scheduler),
        partitioner=build_plugin("partitioner", cfg.partitioner),
        placement=build_plugin("placement", cfg.placement), optimizer=optimizer_spec(cfg.optimizer),
        lr_scheduler=build_plugin("lr_scheduler", cfg.lr_scheduler) if cfg.lr_scheduler else None,
        tracker=build_plugin("logger", cfg.logger), search_schedules=searching)


def group_plugins(group: str, options: Mapping[str, PluginConfig]) -> dict[str, Plugin]:
    """Each option of a group (name -> its YAML) built, but `scheduler=auto` (a search, no
    schedule); an option that cannot be built is kept, refusing to build with its error, so that
    a search reports it like any candidate that fails."""
    out = {}
    for name, cfg in options.items():
        if group == "scheduler" and is_search(cfg):
            continue
        try:
            out[name] = build_plugin(group, cfg, name)
        except ConfigError as err:
            out[name] = Plugin(group, name, Refused(group, name, str(err).split(": ", 1)[-1]), {}, dict(cfg),
                               path=str(cfg.get(TARGET)))
    return out


def search_options(cfg: TrainConfig, read) -> GroupOptions:
    """The scheduler and partitioner options a search compares, `read(group)` giving each group's
    options as YAML (`launcher.config.group_configs`); none when nothing searches."""
    if not (cfg.plan.search or is_search(cfg.scheduler)):
        return GroupOptions()
    return GroupOptions(group_plugins("scheduler", read("scheduler")), group_plugins("partitioner", read("partitioner")))
