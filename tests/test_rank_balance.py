"""Stage boundaries re-balanced for the busiest rank when a rank holds several stages."""

from __future__ import annotations

from pipelaunch.pipeline.planner.partition.rank_balance import _score, rank_balanced_starts


def test_v_placement_balances_ranks_not_stages() -> None:
    costs = [1.0] * 12
    placement = [0, 1, 1, 0]  # V: rank 0 holds the first and the last stage
    start = [0, 2, 4, 10]  # rank 0: 2 + 2 = 4, rank 1: 2 + 6 = 8
    best = rank_balanced_starts(costs, start, placement)
    assert _score(costs, best, placement)[0] == 6.0
    assert best[0] == 0 and all(a < b for a, b in zip(best, best[1:], strict=False))


def test_one_stage_per_rank_keeps_an_already_balanced_split() -> None:
    costs = [3.0, 1.0, 1.0, 1.0]
    assert rank_balanced_starts(costs, [0, 1], [0, 1]) == [0, 1]
