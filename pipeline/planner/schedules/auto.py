"""`scheduler=auto`: simulate every valid training schedule on the cost model, keep the fastest.

Why: which schedule wins depends on the stage costs, the link and the micro-batch count (ZBV's
zero bubble needs m >= 2p, interleaving pays in messages); simulating is cheap and says so in
numbers. `choose` returns the winner and a table the caller can print or log.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from pipeline.core.errors import ConfigError
from pipeline.core.ir import Action
from pipeline.planner.placement import classify
from pipeline.planner.schedules.base import ScheduleGenerator


@dataclass
class AutoSchedule(ScheduleGenerator):
    """Picks a concrete schedule by simulation; `chosen` holds the last pick."""

    name: ClassVar[str] = "auto"
    supported_placements: ClassVar[tuple[str, ...]] = ("linear", "interleaved", "v", "explicit")

    chosen: ScheduleGenerator | None = field(default=None, repr=False)

    def choose(
        self,
        pp: int,
        microbatches: int,
        cost_model: object,
        placement_kind: str | None = None,
    ) -> tuple[ScheduleGenerator, list[dict]]:
        """Simulate each valid training schedule; return (fastest, table sorted by makespan).

        `cost_model` is a `pipeline.planner.simulate.CostModel`; it is re-split to each candidate's stage
        count (`CostModel.resplit`), so one profile compares 1F1B (p stages) with ZBV (2p stages).
        Ties on makespan go to the lower peak activation memory. (The launcher's `scheduler=auto`
        is `plan=auto` with only the schedule varying, `pipeline.planner.search`, which
        re-partitions the measured profile per candidate instead.)
        """
        from pipeline.planner.schedules import build_schedule
        from pipeline.planner.schedules.registry import placement_for, valid_generators
        from pipeline.planner.simulate import CostModel, simulate

        assert isinstance(cost_model, CostModel)

        def candidates():
            for gen in valid_generators(pp, microbatches, placement_kind):
                if gen.training:
                    placement = placement_for(gen, pp, placement_kind)
                    schedule = build_schedule(gen, placement, microbatches)
                    yield gen, classify(placement), simulate(schedule, cost_model.resplit(len(placement)))

        winner, _, rows = pick_fastest(candidates(), pp, microbatches, placement_kind)
        self.chosen = winner
        return winner, rows

    def check(self, pp: int, microbatches: int, placement: list[int]) -> None:
        from pipeline.planner.schedules.registry import valid_generators

        kind = classify(placement) if pp > 1 else "linear"
        if not [g for g in valid_generators(pp, microbatches, kind) if g.training]:
            raise ConfigError("scheduler", f"no training schedule fits pp={pp}, microbatches={microbatches} "
                                           f"on a {kind} placement {placement}")

    def compute_actions(self, placement: list[int], microbatches: int) -> list[list[Action]]:
        """Without a profile: choose on unit costs among schedules for this placement, then delegate."""
        from pipeline.planner.simulate import CostModel

        pp = max(placement) + 1
        kind = classify(placement) if pp > 1 else "linear"
        gen, _ = self.choose(pp, microbatches, CostModel.uniform(len(placement)), kind)
        return gen.compute_actions(placement, microbatches)


def pick_fastest(candidates, pp: int, microbatches: int, placement_kind: str | None = None):
    """Rank simulated candidates `(generator, placement label, SimResult or payload with .result)`:
    return (fastest generator, its payload, rows sorted by makespan with the winner marked).
    Ties on makespan go to the lower peak activation memory."""
    rows: list[dict] = []
    best = None
    for gen, label, payload in candidates:
        result = getattr(payload, "result", payload)
        row = {
            "name": gen.name,
            "placement": label,
            "makespan_s": result.makespan_s,
            "bubble": result.mean_bubble,
            "peak_activation_bytes": max(result.peak_activation_bytes),
        }
        rows.append(row)
        key = (row["makespan_s"], row["peak_activation_bytes"], len(rows))
        if best is None or key < best[0]:
            best = (key, gen, payload)
    if best is None:
        raise ConfigError(
            "scheduler",
            f"no schedule can run pp={pp}, microbatches={microbatches}"
            + (f" on a {placement_kind} placement" if placement_kind else ""),
        )
    rows.sort(key=lambda r: (r["makespan_s"], r["peak_activation_bytes"]))
    for row in rows:
        row["chosen"] = row["name"] == best[1].name
    return best[1], best[2], rows
