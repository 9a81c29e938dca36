"""NCCL's point-to-point rules, proven on lowered programs without a process (pipeline/planner/passes/p2p_check.py).

Every schedule of the scheduler config group on every placement it supports, pp 2-8, with and without recompute,
training and evaluation programs; programs drawn by hypothesis over skip-connected stage graphs;
and hand-made programs that NCCL would mismatch or deadlock on, which the checker must refuse
with the ranks and actions named."""

from __future__ import annotations

import random
from collections.abc import Iterable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipelaunch.launcher.validate import prepare
from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.core.ir import Action, Kind, Schedule
from pipelaunch.pipeline.core.plan import Plan
from pipelaunch.pipeline.planner.passes.lowering import lower, sequential_edges
from pipelaunch.pipeline.planner.passes.p2p_check import P2POrderError, TensorSpec, check_p2p, check_plan
from pipelaunch.pipeline.planner.placement import placement_for
from pipelaunch.pipeline.planner.schedules import build_schedule
from pipelaunch.pipeline.planner.schedules.inference import Inference
from tests.harness import FAST, compose_cfg
from tests.schedules import build, schedules
from tests.test_graph_equivalence import MODELS


def edges_messages(edges: Iterable[tuple[int, int]]) -> dict[tuple[int, int], tuple[list[TensorSpec], list[TensorSpec]]]:
    """One float tensor per edge each way: for checking schedules without a model."""
    spec: list[TensorSpec] = [("x", (1,), "float32")]
    return {(p, c): (spec, spec) for p, c in edges}


def _every_schedule(pp: int):
    """(name, placement kind, m, remat, schedule) for every schedule of the scheduler group valid at pp."""
    for name, gen in schedules().items():
        for kind in [None, *sorted(gen.supported_placements)]:
            for m in sorted({pp, 2 * pp, 3 * pp + 1}):
                for remat in ("none", "stage") if gen.training else ("none",):
                    try:
                        placement = placement_for(gen, pp, kind)
                        schedule = build_schedule(gen, placement, m, remat)
                    except ConfigError:
                        continue
                    yield name, kind, m, remat, schedule


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
def test_every_schedule_lowers_to_a_program_nccl_runs(pp: int) -> None:
    seen = set()
    for name, kind, m, remat, schedule in _every_schedule(pp):
        edges = sequential_edges(schedule.num_stages)
        lowered = lower(schedule, edges)
        groups = check_p2p(lowered, edges_messages(edges))
        # every cross-rank edge carries one forward group per micro-batch, and a backward one when training
        crossing = sum(schedule.placement[p] != schedule.placement[c] for p, c in edges)
        per_mb = 2 if schedule.training else 1
        assert sum(len(g) for g in groups) == 2 * per_mb * crossing * m, (name, kind, m, remat)
        evaluation = lower(build_schedule(Inference(), schedule.placement, m), edges)
        check_p2p(evaluation, edges_messages(edges))
        seen.add(name)
    if pp == 8:
        assert seen == set(schedules())


@pytest.mark.parametrize("overrides", [
    [*FAST, "scheduler=zbv", "pp=2", "dp=2"],
    [*FAST, "scheduler=hanayo", "pp=2", "dp=2", "remat=stage"],
    [*FAST, "scheduler=interleaved_1f1b", "pp=4", "remat=stage"],
    [*MODELS["unet"], "partitioner=milp", "scheduler=zbv", "pp=2"],
    [*MODELS["gpt_tied"], "scheduler=zbv", "pp=2"],
])
def test_plans_the_launcher_builds_pass_the_check(overrides: list[str]) -> None:
    plan = prepare(compose_cfg(["microbatches=4", *overrides])).plan
    check_plan(plan)  # make_plan ran it already; again here on the plan as the ranks receive it
    assert any(a.peer is not None for acts in plan.schedule.actions for a in acts)


def test_the_evaluation_program_is_planned_only_for_runs_that_evaluate(tmp_path) -> None:
    base = [*FAST, "microbatches=4", "scheduler=zbv", "pp=2"]
    assert prepare(compose_cfg(base)).plan.eval_schedule is None
    plan = prepare(compose_cfg([*base, "eval.every=1"])).plan
    evaluation = plan.eval_schedule
    assert evaluation is not None and evaluation.lowered and not evaluation.training
    assert any(a.peer is not None for acts in evaluation.actions for a in acts)
    check_plan(plan)
    # plan.json keeps both programs, each rank's actions on one line, and reads back the same
    plan.write(tmp_path / "plan.json")
    back = Plan.read(tmp_path / "plan.json")
    assert back.schedule.actions == plan.schedule.actions and back.eval_schedule.actions == evaluation.actions
    lines = (tmp_path / "plan.json").read_text().splitlines()
    assert sum(line.strip().startswith('["') for line in lines) == 2 * plan.pp


@st.composite
def programs(draw) -> tuple[Schedule, list[tuple[int, int]]]:
    """A stage graph with skip edges, a placement, and compute programs drawn as the per-rank
    projections of a random order of all actions that respects their dependencies."""
    pp = draw(st.integers(2, 4))
    num_stages = pp * draw(st.integers(1, 2))
    m = draw(st.integers(1, 4))
    placement = [draw(st.integers(0, pp - 1)) for _ in range(num_stages)]
    for r in range(pp):  # every rank holds a stage
        if r not in placement:
            placement[draw(st.integers(0, num_stages - 1))] = r
    if len(set(placement)) < pp:
        placement = [s % pp for s in range(num_stages)]
    skips = draw(st.lists(st.tuples(st.integers(0, num_stages - 1), st.integers(0, num_stages - 1)), max_size=3))
    edges = sorted(set(sequential_edges(num_stages)) | {(a, b) for a, b in skips if a + 1 < b})
    split = draw(st.booleans())
    rng = random.Random(draw(st.integers(0, 2**16)))
    # dependencies: F(s) after F(s-1); backward(s) after backward(s+1) and F(s); W after I
    done: set[tuple[str, int, int]] = set()
    todo = [("F", s, mb) for s in range(num_stages) for mb in range(m)]
    todo += [(k, s, mb) for s in range(num_stages) for mb in range(m) for k in (("I", "W") if split else ("B",))]
    order = []
    while todo:
        ready = [a for a in todo if _ready(a, done, num_stages)]
        pick = rng.choice(ready)
        todo.remove(pick)
        done.add((pick[0] if pick[0] != "I" else "B", pick[1], pick[2]))
        if pick[0] == "I":
            done.add(("I", pick[1], pick[2]))
        order.append(pick)
    actions: list[list[Action]] = [[] for _ in range(pp)]
    for kind, s, mb in order:
        actions[placement[s]].append(Action(s, Kind(kind), mb))
    return Schedule("drawn", num_stages, m, placement, actions), edges


def _ready(action: tuple[str, int, int], done: set[tuple[str, int, int]], num_stages: int) -> bool:
    kind, s, mb = action
    if kind == "F":
        return s == 0 or ("F", s - 1, mb) in done
    if kind == "W":
        return ("I", s, mb) in done
    return ("F", s, mb) in done and (s + 1 == num_stages or ("B", s + 1, mb) in done)


@settings(max_examples=60, deadline=None)
@given(programs())
def test_any_valid_compute_order_lowers_to_a_program_nccl_runs(drawn) -> None:
    schedule, edges = drawn
    check_p2p(lower(schedule, edges), edges_messages(edges))


def _lowered_1f1b() -> Schedule:
    gen = build("1f1b")
    return lower(build_schedule(gen, placement_for(gen, 2), 4))


def test_two_ranks_posting_a_pair_s_messages_in_different_orders_is_refused() -> None:
    schedule = _lowered_1f1b()
    acts = schedule.actions[1]
    recvs = [i for i, a in enumerate(acts) if a.kind is Kind.RECV_F]
    i, j = recvs[1], recvs[2]  # both posted before either forward reads them: only the order differs
    acts[i], acts[j] = acts[j], acts[i]
    with pytest.raises(P2POrderError) as err:
        check_p2p(schedule, edges_messages(sequential_edges(2)))
    text = str(err.value)
    assert "ranks 0 and 1" in text and "P2P group #" in text and "1RECV_F2<0" in text and "0SEND_F1>1" in text


def test_receiving_before_sending_on_both_ends_is_refused() -> None:
    """What the runtime used to do (receives posted ahead of sends): both ranks wait to receive."""
    sched = Schedule("hand-made", 2, 1, [0, 1], [
        [Action(0, Kind.F, 0), Action(0, Kind.RECV_B, 0, 1), Action(0, Kind.SEND_F, 0, 1), Action(0, Kind.B, 0)],
        [Action(1, Kind.RECV_F, 0, 0), Action(1, Kind.F, 0), Action(1, Kind.B, 0), Action(1, Kind.SEND_B, 0, 0)],
    ], lowered=True)
    with pytest.raises(P2POrderError, match=r"disagree on their P2P group #0.*0RECV_B0<1.*1RECV_F0<0"):
        check_p2p(sched, edges_messages(sequential_edges(2)))


def test_a_cycle_of_waits_across_three_ranks_is_a_deadlock_even_when_every_pair_agrees() -> None:
    """Each pair posts the same order, but rank 0 sends to 2 first, 2 receives from 1 first and
    1 receives from 0 first: one stream per rank, each waiting on the next. gloo would run it."""
    edges = [(0, 1), (1, 2), (0, 2)]
    sched = Schedule("hand-made", 3, 1, [0, 1, 2], [
        [Action(0, Kind.F, 0), Action(0, Kind.SEND_F, 0, 2), Action(0, Kind.SEND_F, 0, 1)],
        [Action(1, Kind.RECV_F, 0, 0), Action(1, Kind.F, 0), Action(1, Kind.SEND_F, 0, 2)],
        [Action(2, Kind.RECV_F, 0, 1), Action(2, Kind.RECV_F, 0, 0), Action(2, Kind.F, 0)],
    ], training=False, lowered=True)
    with pytest.raises(P2POrderError) as err:
        check_p2p(sched, edges_messages(edges))
    text = str(err.value)
    assert "deadlock under NCCL" in text
    assert "rank 0: P2P stream at 0SEND_F0>2" in text and "rank 2 posts as its 2RECV_F0<0" in text
    # the same messages in the order the lowering gives run
    compute = Schedule("hand-made", 3, 1, [0, 1, 2], [[Action(s, Kind.F, 0)] for s in range(3)], training=False)
    check_p2p(lower(compute, edges), edges_messages(edges))


def test_a_receive_after_the_compute_that_reads_it_and_an_action_without_a_peer_are_refused() -> None:
    late = Schedule("hand-made", 2, 1, [0, 1], [
        [Action(0, Kind.F, 0), Action(0, Kind.SEND_F, 0, 1)],
        [Action(1, Kind.F, 0), Action(1, Kind.RECV_F, 0, 0)],
    ], training=False, lowered=True)
    with pytest.raises(P2POrderError, match=r"1F0 \(action #0\) runs before 1RECV_F0<0"):
        check_p2p(late, edges_messages(sequential_edges(2)))
    legacy = Schedule("hand-made", 2, 1, [0, 1], [
        [Action(0, Kind.F, 0), Action(0, Kind.SEND_F, 0)],
        [Action(1, Kind.RECV_F, 0), Action(1, Kind.F, 0)],
    ], training=False, lowered=True)
    with pytest.raises(P2POrderError, match="names no peer stage"):
        check_p2p(legacy, edges_messages(sequential_edges(2)))


def test_actions_with_a_peer_round_trip_through_text() -> None:
    for text in ("2SEND_F0>3", "3RECV_B11<4", "0F1"):
        assert str(Action.parse(text)) == text
    assert Action.parse("2SEND_F0>3").torch_name == "2SEND_F0"


def test_lowering_posts_messages_in_one_causal_order() -> None:
    """The exact programs the lowering gives (as before it was made linear per rank): a send right
    after its producer, a receive as early as the causal order allows, a skip edge (0 -> 2) with no
    gradient, and on the V placement the neighbours on one rank exchanging nothing."""
    from pipelaunch.pipeline.planner.placement import linear, v_shape
    from pipelaunch.pipeline.planner.schedules.one_f_one_b import OneFOneB
    from pipelaunch.pipeline.planner.schedules.zbv import ZBV

    skip = lower(build_schedule(OneFOneB(), linear(3), 3), [(0, 1), (1, 2), (0, 2)], grad_edges=[(0, 1), (1, 2)])
    assert [" ".join(map(str, acts)) for acts in skip.actions] == [
        "0F0 0SEND_F0>1 0SEND_F0>2 0F1 0SEND_F1>1 0SEND_F1>2 0F2 0SEND_F2>1 0SEND_F2>2 0RECV_B0<1 0RECV_B1<1 "
        "0RECV_B2<1 0B0 0B1 0B2",
        "1RECV_F0<0 1RECV_F1<0 1F0 1SEND_F0>2 1RECV_F2<0 1F1 1SEND_F1>2 1RECV_B0<2 1B0 1SEND_B0>0 1F2 1SEND_F2>2 "
        "1RECV_B1<2 1B1 1SEND_B1>0 1RECV_B2<2 1B2 1SEND_B2>0",
        "2RECV_F0<0 2RECV_F1<0 2RECV_F0<1 2RECV_F2<0 2RECV_F1<1 2F0 2B0 2SEND_B0>1 2RECV_F2<1 2F1 2B1 2SEND_B1>1 "
        "2F2 2B2 2SEND_B2>1",
    ]
    v = lower(build_schedule(ZBV(), v_shape(2), 2), [(0, 1), (1, 2), (2, 3), (0, 3)])
    assert [" ".join(map(str, acts)) for acts in v.actions] == [
        "0F0 0SEND_F0>1 0F1 0SEND_F1>1 3RECV_F0<2 3F0 3I0 3SEND_B0>2 3RECV_F1<2 0RECV_B0<1 3W0 3F1 0I0 3I1 "
        "3SEND_B1>2 0RECV_B1<1 0W0 3W1 0B1",
        "1RECV_F0<0 1RECV_F1<0 1F0 2F0 2SEND_F0>3 2RECV_B0<3 1F1 2F1 2SEND_F1>3 2I0 1I0 1SEND_B0>0 2RECV_B1<3 2W0 "
        "1W0 2I1 1I1 1SEND_B1>0 2W1 1W1",
    ]
