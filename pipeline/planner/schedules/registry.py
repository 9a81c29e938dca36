"""A thin in-code view of the schedule generators, for `scheduler=auto` and for tests.

Hydra's `conf/scheduler/*.yaml` stays the way to choose (and to add) a schedule; this only lists
the built-in classes so that code can iterate over them.
"""

from __future__ import annotations

from pipeline.core.errors import ConfigError
from pipeline.planner.placement import from_kind
from pipeline.planner.schedules.base import ScheduleGenerator
from pipeline.planner.schedules.gpipe import GPipe
from pipeline.planner.schedules.hanayo import Hanayo
from pipeline.planner.schedules.inference import Inference
from pipeline.planner.schedules.interleaved import Interleaved1F1B
from pipeline.planner.schedules.one_f_one_b import OneFOneB
from pipeline.planner.schedules.zbv import ZBV
from pipeline.planner.schedules.zero_bubble import ZBH1, ZBH2

GENERATORS: dict[str, type[ScheduleGenerator]] = {
    cls.name: cls for cls in (GPipe, OneFOneB, Interleaved1F1B, Hanayo, ZBH1, ZBH2, ZBV, Inference)
}


def placement_for(generator: ScheduleGenerator, pp: int, kind: str | None = None) -> list[int]:
    """The placement a generator runs on: `kind`, or its default when None/"auto"."""
    if kind in (None, "auto"):
        kind = generator.default_placement
    return from_kind(kind, pp, generator.stages_per_rank())


def valid_generators(pp: int, microbatches: int, placement_kind: str | None = None) -> list[ScheduleGenerator]:
    """Default-configured instances of every registered generator whose `check` passes.

    With `placement_kind` None (or "auto") each generator is checked on its own default placement.
    """
    out: list[ScheduleGenerator] = []
    for cls in GENERATORS.values():
        gen = cls()
        if placement_kind not in (None, "auto") and placement_kind not in gen.supported_placements:
            continue
        try:
            placement = placement_for(gen, pp, placement_kind)
            gen.check(pp, microbatches, placement)
        except ConfigError:
            continue
        out.append(gen)
    return out
