"""`scheduler=auto`: the option that asks the launcher to search the schedules.

Why a class at all: `conf/scheduler/auto.yaml` names it as its `_target_`, so that `scheduler=auto`
is an option of the group like any other, and the launcher recognises it as "search the schedules":
`plan=auto` with only the schedule varying (`pipelaunch.pipeline.planner.search.choose`), over every training option
of the scheduler config group on the run's search path, a user's own too. It is no schedule itself:
building one from it is refused, naming what to do instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, NoReturn

from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.core.ir import Action
from pipelaunch.pipeline.planner.schedules.base import ScheduleCosts, ScheduleGenerator


@dataclass(frozen=True)
class AutoSchedule(ScheduleGenerator):
    """Marks `scheduler=auto`; the launcher's plan search picks the concrete schedule."""

    name: ClassVar[str] = "auto"
    supported_placements: ClassVar[tuple[str, ...]] = ("linear", "interleaved", "v", "explicit")

    def check(self, pp: int, microbatches: int, placement: list[int]) -> None:
        self._refuse()

    def compute_actions(self, placement: list[int], microbatches: int, costs: ScheduleCosts | None = None,
                        *, first_order: bool = False) -> list[list[Action]]:
        self._refuse()

    @staticmethod
    def _refuse() -> NoReturn:
        raise ConfigError(
            "scheduler",
            "scheduler=auto is a search the launcher runs over the scheduler group's options "
            "(plan=auto with only the schedule varying), not a schedule: build a concrete one by its "
            "option name instead, e.g. scheduler=1f1b",
        )
