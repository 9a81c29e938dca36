"""DualPipe's overlapped pairs (moe.overlap): the baton that fixes the order in which the two
sides issue their exchanges (runtime/overlap.py), and the simulator's price of a pair."""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import pytest

from pipelaunch.launcher.validate import prepare
from pipelaunch.pipeline.core.ir import overlapped_pairs
from pipelaunch.pipeline.planner.predict.simulate import simulate
from pipelaunch.pipeline.runtime.overlap import Pair
from tests.harness import compose_cfg
from tests.test_moe import MOE, SIGMOID


def test_the_two_sides_take_turns_at_each_exchange_in_a_fixed_order() -> None:
    """Forward first; each side hands over right after it issues an exchange; a finished side no
    longer takes turns. Run many times: always the same order (what every ep rank must issue)."""
    def side(pair: Pair, log: list[str], name: str, exchanges: int) -> None:
        for k in range(exchanges):
            log.append(f"{name}{k}")
            pair.hand_over()
        log.append(f"{name} done")

    for _ in range(50):
        log: list[str] = []
        pair = Pair()
        pair.run(partial(side, pair, log, "F", 3), partial(side, pair, log, "B", 1), torch_device())
        assert log == ["F0", "B0", "F1", "B done", "F2", "F done"]


def test_an_error_on_either_side_stops_both_and_is_raised() -> None:
    pair = Pair()

    def forward() -> None:
        pair.hand_over()
        raise RuntimeError("the forward failed")

    with pytest.raises(RuntimeError, match="the forward failed"):
        pair.run(forward, lambda: pair.hand_over(), torch_device())


def torch_device():
    import torch

    return torch.device("cpu")


def test_a_pair_costs_both_computes_and_what_neither_hides() -> None:
    """On DualPipeV's plan at ep=2: with no exchange time a pair costs its two actions back to
    back, started once both may (the runtime waits for both actions' messages first: the step is
    never shorter than without overlap); with exchanges, the step is shorter, each pair's two
    actions share one span, and a pair never costs less than its longer side."""
    plan = prepare(compose_cfg([*MOE, *SIGMOID, "pp=2", "dp=2", "ep=2", "scheduler=dualpipev", "microbatches=8",
                                "batch_size=32", "mode=plan"])).prediction
    cost, schedule = plan.cost, plan.plan.schedule
    n = len(cost.forward_s)
    assert cost.overlap_exchange_s is not None and all(x > 0 for x in cost.overlap_exchange_s)
    alone = simulate(schedule, replace(cost, overlap_exchange_s=None))
    free = simulate(schedule, replace(cost, overlap_exchange_s=[0.0] * n))
    assert free.makespan_s >= alone.makespan_s - 1e-12
    # exchanges half of every forward and backward: each hides behind the other side's compute
    halves = [f / 2 for f in cost.forward_s]
    slow = replace(cost, overlap_exchange_s=halves)
    overlapped, sequential = simulate(schedule, slow), simulate(schedule, replace(slow, overlap_exchange_s=None))
    assert overlapped.makespan_s < sequential.makespan_s
    events = {(e["rank"], e["action"]): e for e in overlapped.events}
    for rank in range(2):
        acts = schedule.actions[rank]
        for pos in overlapped_pairs(acts):
            f, b = events[(rank, str(acts[pos]))], events[(rank, str(acts[pos + 1]))]
            assert (f["start_s"], f["end_s"]) == (b["start_s"], b["end_s"])
            span = f["end_s"] - f["start_s"]
            fs, bs = cost.forward_s[acts[pos].stage], cost.backward_s[acts[pos + 1].stage]
            assert max(fs, bs) - 1e-12 <= span <= fs + bs + 1e-12
            free_f = next(e for e in free.events if (e["rank"], e["action"]) == (rank, str(acts[pos])))
            assert free_f["end_s"] - free_f["start_s"] == pytest.approx(fs + bs)
