"""Plug-ins as the launcher built them: typed, picklable objects the planner and the ranks call.

Every plug-in group (`model`, `data`, `scheduler`, `partitioner`, `placement`, `optimizer`,
`lr_scheduler`, `logger`) is an open mapping in the config: a YAML option naming a callable and
that callable's arguments. The launcher turns each into one of these, once, at the edge
(`pipelaunch.launcher.plugins`), so that nothing below it reads how an option names its callable:
the planner builds a schedule generator from a `Plugin` once, the memory model asks the `OptimizerSpec` how
many state tensors it keeps per parameter, a rank builds its optimizer, data and tracker from
them. They are plain data (a callable importable by name, plain arguments), so a `RankJob`
carrying them pickles to a spawned rank.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from pipelaunch.pipeline.core.errors import ConfigError


@dataclass(frozen=True)
class Plugin:
    """One option of a plug-in group: its callable and that callable's own arguments (plug-ins
    nested in them already built). `config` is the option as the user wrote it, kept only to be
    reported (plan.json's search records it); nothing builds from it."""

    group: str
    #: how the option is shown: its `name` key, else its callable's name
    option: str
    fn: Callable[..., Any]
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    config: Mapping[str, Any] = field(default_factory=dict)
    #: leading positional arguments the option gives its callable (rare; most take keywords)
    args: tuple[Any, ...] = ()
    #: the callable's import path as the option names it (`torch.optim.AdamW`), for messages
    path: str = ""

    def __post_init__(self) -> None:
        if not self.path:
            fn = self.fn
            name = getattr(fn, "__qualname__", type(fn).__name__)
            object.__setattr__(self, "path", f"{getattr(fn, '__module__', '?')}.{name}")

    def __call__(self, *args: Any, **more: Any) -> Any:
        """The callable with the option's arguments (and `more`, which win)."""
        return self.fn(*self.args, *args, **{**self.kwargs, **more})

    def build(self, *args: Any, **more: Any) -> Any:
        """`self(*args, **more)`, what the callable refuses a ConfigError naming group and option."""
        try:
            return self(*args, **more)
        except ConfigError:
            raise
        except Exception as err:  # noqa: BLE001 - whatever the callable refuses is the option's error
            raise ConfigError(f"{self.group} ({self.option})",
                              f"could not build {self.path}: {' '.join(str(err).split())}") from err

    def attribute(self, name: str, default: Any) -> Any:
        """A class-level declaration of the callable (`training`, `needs_profile`, ...)."""
        return getattr(self.fn, name, default)

    def with_settings(self, option: str, **settings: Any) -> Plugin:
        """The same callable with some arguments changed (a search's variant), shown as `option`."""
        return replace(self, option=option, kwargs={**self.kwargs, **settings},
                       config={**self.config, **settings})

    def same_as(self, other: Plugin) -> bool:
        """Whether both build the same thing: one callable, equal arguments."""
        return self.fn is other.fn and self.args == other.args and dict(self.kwargs) == dict(other.kwargs)


@dataclass(frozen=True)
class Refused:
    """The callable of an option that could not be imported: building it raises why. A search
    over a group's options keeps such an option and reports its error, as for any candidate."""

    group: str
    option: str
    reason: str

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise ConfigError(f"{self.group} ({self.option})", self.reason)


@dataclass(frozen=True)
class OptimizerSpec:
    """The optimizer of a run: `factory(params)` builds it (a `torch.optim` class with the
    option's arguments), and `states_per_param` is how many tensors of a parameter's size it
    keeps per parameter (what the memory model prices), decided once where the option is read."""

    factory: Plugin
    states_per_param: int

    def __call__(self, params: Any, **more: Any) -> Any:
        return self.factory(params, **more)

    @property
    def chooses_implementation(self) -> bool:
        """Whether the option itself picks torch's `foreach` or `fused` implementation."""
        return any(k in self.factory.kwargs for k in ("foreach", "fused"))


@dataclass(frozen=True)
class Plugins:
    """Every plug-in of one run, built by the launcher: what the planner and each rank build
    their objects from. `model()` is the ModelSpec, `data()` the batch source, `scheduler()` the
    schedule generator (a frozen value), `tracker(run_config, run_dir)` rank 0's tracker; `lr_scheduler` is
    None for a constant learning rate. `search_schedules`: `scheduler=auto` (no generator: the
    planner searches the scheduler group's options)."""

    model: Plugin
    data: Plugin
    scheduler: Plugin | None
    partitioner: Plugin
    placement: Plugin
    optimizer: OptimizerSpec
    lr_scheduler: Plugin | None
    tracker: Plugin
    search_schedules: bool = False


@dataclass(frozen=True)
class GroupOptions:
    """Every option of the `scheduler` and `partitioner` config groups (name -> the option built),
    as the launcher found them on this run's search path: what a search compares."""

    scheduler: Mapping[str, Plugin] = field(default_factory=dict)
    partitioner: Mapping[str, Plugin] = field(default_factory=dict)
