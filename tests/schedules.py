"""Every schedule the tests know: the options of the `scheduler` config group, as the launcher reads
them (`pipelaunch.launcher.config.group_configs`), never a list kept in code. A schedule added by a YAML in
`conf/scheduler/` is simulated, lowered and run for equivalence like the built-ins."""

from __future__ import annotations

from hydra.utils import instantiate

from pipelaunch.launcher.config import group_configs
from pipelaunch.launcher.plugins import is_search
from pipelaunch.pipeline.planner.schedules.base import ScheduleGenerator


def scheduler_options() -> dict[str, dict]:
    """Each option of the scheduler group that is a schedule (all but `auto`, the search over
    the others), as its YAML."""
    out = {}
    for name, cfg in group_configs("scheduler").items():
        if not is_search(cfg):
            out[name] = cfg
    return out


def build(name: str) -> ScheduleGenerator:
    """The generator the option's YAML builds (a frozen value: costs are arguments of each call)."""
    cfg = scheduler_options()[name]
    gen = instantiate({k: v for k, v in cfg.items() if k != "name"})
    assert isinstance(gen, ScheduleGenerator), f"scheduler={name}: {cfg['_target_']} is not a ScheduleGenerator"
    return gen


def schedules() -> dict[str, ScheduleGenerator]:
    """Option name -> a fresh generator, for every schedule of the group (forward-only ones too)."""
    return {name: build(name) for name in scheduler_options()}


def training_schedules() -> dict[str, ScheduleGenerator]:
    """Option name -> a fresh generator, for the schedules that train (run a backward)."""
    return {name: gen for name, gen in schedules().items() if gen.training}
