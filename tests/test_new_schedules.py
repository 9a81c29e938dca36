"""The schedules of #26 (dualpipev, interleaved_zb, v_half, v_min, looped_bfs) and the zero-bubble orders at
scale: memory bounds and bubbles on the simulator (exact, no machine noise), the Zero Bubble paper's
published profiles, torch's orders on the same costs, and real gloo ranks against one process.

(Every schedule of the group also runs in tests/test_equivalence.py at pp 1, 2, 4 and dp 1, 2 with
m = 4 where valid, and through the NCCL posting-order checker in tests/test_p2p_order.py.)"""

from __future__ import annotations

import importlib.util
import math

import pytest

from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.core.ir import Kind, Schedule
from pipelaunch.pipeline.planner.placement import interleaved, v_shape
from pipelaunch.pipeline.planner.predict.simulate import CostModel, simulate, validate
from pipelaunch.pipeline.planner.schedules import build_schedule
from pipelaunch.pipeline.planner.schedules.base import ScheduleCosts
from pipelaunch.pipeline.planner.schedules.dualpipev import DualPipeV
from pipelaunch.pipeline.planner.schedules.interleaved import Interleaved1F1B
from pipelaunch.pipeline.planner.schedules.interleaved_zb import InterleavedZB
from pipelaunch.pipeline.planner.schedules.looped_bfs import LoopedBFS, breadth_first_order
from pipelaunch.pipeline.planner.schedules.one_f_one_b import OneFOneB
from pipelaunch.pipeline.planner.schedules.torch_orders import TorchSchedule
from pipelaunch.pipeline.planner.schedules.v_memory import VHalf, VMin
from pipelaunch.pipeline.planner.schedules.zbv import ZBV
from pipelaunch.pipeline.planner.schedules.zero_bubble import ZBH1, ZBH2
from tests.harness import FAST, ROOT, compose_cfg, run_jobs
from tests.test_graph_equivalence import MODELS, _assert_all_match_single_process


def _stage_microbatches(schedule: Schedule) -> float:
    """Peak activations of the busiest rank in stage-micro-batches: a (chunk, micro-batch) holds
    1/v of a stage's activations from its F until its W or B ends (v chunks per rank)."""
    v = schedule.num_stages // schedule.pp
    peaks = []
    for acts in schedule.actions:
        held = peak = 0
        for a in acts:
            held += 1 if a.kind is Kind.F else -1 if a.kind in (Kind.B, Kind.W) else 0
            peak = max(peak, held)
        peaks.append(peak / v)
    return max(peaks)


def _run(gen, placement: list[int], m: int, f: float = 1.0, i: float = 1.0, w: float = 1.0, hop: float = 0.0):
    """Build (on these costs) and simulate; the schedule and its result."""
    n = len(placement)
    costs = ScheduleCosts.of([f] * n, [i] * n, [w] * n,
                             hop=[hop if placement[s] != placement[s + 1] else 0.0 for s in range(n - 1)])
    schedule = build_schedule(gen, placement, m, costs=costs)
    validate(schedule)
    return schedule, simulate(schedule, CostModel([f] * n, [i] * n, [w] * n, latency_s=hop))


@pytest.mark.parametrize("pp", [2, 3, 4, 6, 8, 12, 16])
def test_v_half_and_v_min_hold_their_share_of_1f1b_memory(pp: int) -> None:
    for m in (pp, 2 * pp, 4 * pp):
        for gen, bound in ((VHalf(), math.ceil(pp / 2) + 1), (VMin(), math.ceil(pp / 3) + 1)):
            schedule, _ = _run(gen, v_shape(pp), m)
            assert _stage_microbatches(schedule) <= bound, (gen.name, pp, m)


@pytest.mark.parametrize("pp", [4, 8, 16, 32])
def test_v_half_and_v_min_idle_no_more_than_the_papers_rates_and_less_than_1f1b(pp: int) -> None:
    """At F = I = W, in the paper's metric (1 - a rank's work over the longest rank's span), V-Half's
    bubble is at most p/(2m) and V-Min's at most 2p/(3m), the rates "Pipeline Parallelism with
    Controllable Memory" gives for them, and both idle less than 1F1B (a stage is two V chunks)."""
    for m in (pp, 2 * pp, 4 * pp):
        _, ref = _run(OneFOneB(), list(range(pp)), m, 2.0, 2.0, 2.0)
        for gen, rate in ((VHalf(), pp / (2 * m)), (VMin(), 2 * pp / (3 * m))):
            _, res = _run(gen, v_shape(pp), m)
            assert max(res.internal_bubble) <= rate, (gen.name, pp, m, max(res.internal_bubble))
            assert res.mean_bubble < ref.mean_bubble, (gen.name, pp, m)


@pytest.mark.parametrize(("pp", "m"), [(2, 4), (4, 8), (4, 12), (8, 16)])
@pytest.mark.parametrize("costs", [(1.0, 1.0, 1.0), (1.0, 1.2, 0.7)])
def test_interleaved_zb_beats_interleaved_1f1b_in_its_memory(pp: int, m: int, costs: tuple) -> None:
    plain_s, plain = _run(Interleaved1F1B(), interleaved(pp, 2), m, *costs)
    zb_s, zb = _run(InterleavedZB(), interleaved(pp, 2), m, *costs)
    assert zb.makespan_s <= plain.makespan_s * (1 + 1e-9)
    assert _stage_microbatches(zb_s) <= _stage_microbatches(plain_s)
    if costs == (1.0, 1.0, 1.0):
        assert zb.makespan_s < plain.makespan_s  # the drain's input gradients run back to back


def test_dualpipev_pairs_run_back_to_back_and_needs_2p_micro_batches() -> None:
    schedule, res = _run(DualPipeV(), v_shape(4), 16)
    pairs = schedule.meta["overlapped"]
    assert pairs
    compute = [[str(a) for a in acts] for acts in schedule.compute_only()]
    for pair in pairs:
        f, b = pair.split("+")
        rank = next(r for r, acts in enumerate(compute) if f in acts)
        assert compute[rank][compute[rank].index(f) + 1] == b, pair  # no W slipped between them
    _, ref = _run(OneFOneB(), list(range(4)), 16, 2.0, 2.0, 2.0)
    assert res.mean_bubble < ref.mean_bubble
    with pytest.raises(ConfigError, match="microbatches >= 8"):
        build_schedule(DualPipeV(), v_shape(4), 6)


def _zb_profiles():
    spec = importlib.util.spec_from_file_location("zb_profiles", ROOT / "bench" / "_zb_profiles.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.PROFILES


def _paper_bubble(gen, profile, chunks: int) -> float:
    """The Zero Bubble paper's metric on its own profile: the largest idle share of a rank's span."""
    p = profile.p
    placement = v_shape(p) if chunks == 2 else list(range(p))
    _, res = _run(gen, placement, profile.m, profile.f / chunks, profile.i / chunks, profile.w / chunks, profile.hop)
    return max(res.internal_bubble)


def test_zero_bubble_orders_against_the_papers_published_rates() -> None:
    """1F1B and ZB-H1 reproduce the published rates; ZB-H2 equals them on the 1.5B-parameter 8-stage
    settings; ZB-V comes within half a point of the published 7.0% at p=16, m=48 with 1.61 ms hops."""
    profiles = _zb_profiles()
    for name in ("zb-iclr-8-24-18", "zb-iclr-8-32-18", "zb-iclr-8-64-18", "zb-iclr-16-48-11"):
        profile = profiles[name]
        for label, gen in (("1F1B", OneFOneB()), ("ZB-H1", ZBH1())):
            assert _paper_bubble(gen, profile, 1) == pytest.approx(profile.published[label], abs=5e-4), (name, label)
        if name.startswith("zb-iclr-8-"):
            assert _paper_bubble(ZBH2(), profile, 1) == pytest.approx(profile.published["ZB-H2"], abs=5e-4), name
    arxiv = profiles["zb-arxiv-16-48"]
    assert _paper_bubble(ZBV(), arxiv, 2) <= arxiv.published["ZB-V"] + 0.005


def test_zb_h2_reaches_the_published_zb_h2_rates() -> None:
    """The tight warm-up (each rank's forwards end before its first input gradient arrives) makes
    ours equal the published ZB-H2 where the filling warm-up was 0.7-1.5 points over. At p=32,
    m=256 with 0.46 ms hops, where 2p - 1 micro-batches clip rank 0's warm-up, the tapered one keeps
    it within half a point; the 2p of the paper's ZB-2p (`in_flight`) brings it below."""
    profiles = _zb_profiles()
    for name in ("zb-iclr-8-32-29", "zb-iclr-32-96-10"):
        profile = profiles[name]
        assert _paper_bubble(ZBH2(), profile, 1) == pytest.approx(profile.published["ZB-H2"], abs=5e-4), name
    clipped = profiles["zb-iclr-32-256-10"]
    assert _paper_bubble(ZBH2(), clipped, 1) <= clipped.published["ZB-H2"] + 0.005
    assert _paper_bubble(ZBH2(in_flight=2 * clipped.p), clipped, 1) <= clipped.published["ZB-H2"] + 5e-4
    with pytest.raises(ConfigError, match=r"scheduler.in_flight.*>= pp = 4"):
        build_schedule(ZBH2(in_flight=3), list(range(4)), 8)


@pytest.mark.parametrize(("ours", "theirs"), [(ZBV, "ZBVZeroBubble"), (InterleavedZB, "InterleavedZeroBubble"),
                                             (DualPipeV, "DualPipeV")])
def test_our_orders_beat_torchs_on_uneven_costs(ours, theirs: str) -> None:
    """p=16, m=64, F:I:W = 1:1:0.5 and a hop of 5% of F, on the simulator: our order of each family
    takes no longer a step than torch's (dualpipev is DualPipeV's own order: the same step), and a
    schedule of ours holding no more activations than torch's takes a shorter one (interleaved_zb
    spends interleaved 1F1B's memory; zbv undercuts torch's interleaved zero bubble in less)."""
    pp, m, costs = 16, 64, (1.0, 1.0, 0.5, 0.05)
    placement = interleaved(pp, 2) if theirs == "InterleavedZeroBubble" else v_shape(pp)
    _, ours_r = _run(ours(), placement, m, *costs)
    theirs_s, theirs_r = _run(TorchSchedule(schedule=theirs), placement, m, *costs)
    assert ours_r.makespan_s <= theirs_r.makespan_s * (1 + 1e-9)
    within = [res.makespan_s for s, res in (_run(ZBV(), v_shape(pp), m, *costs), _run(ours(), placement, m, *costs))
              if _stage_microbatches(s) <= _stage_microbatches(theirs_s)]
    assert within and min(within) < theirs_r.makespan_s


@pytest.mark.parametrize("m", [8, 16])
def test_fusing_backwards_prices_the_links_the_order_was_chosen_on(m: int) -> None:
    """p=4, F:I:W = 1:1.2:0.7, a hop of 10% of F: fusing an I with its W looked free on free links
    and lengthened zbv's step past torch's ZBVZeroBubble (26.5 against 26.3 at m=8); priced with the
    hops, zbv's step is torch's or shorter."""
    costs = (1.0, 1.2, 0.7, 0.1)
    _, ours = _run(ZBV(), v_shape(4), m, *costs)
    _, theirs = _run(TorchSchedule(schedule="ZBVZeroBubble"), v_shape(4), m, *costs)
    assert ours.makespan_s <= theirs.makespan_s * (1 + 1e-9)


NEW = ("dualpipev", "interleaved_zb", "v_half", "v_min", "looped_bfs")


@pytest.mark.timeout(600)
def test_new_schedules_train_like_one_process_with_skips_remat_and_dp(tmp_path) -> None:
    """DualPipeV at pp=4 (m = 2p: tests/test_equivalence.py's m = 4 is too few there) with and
    without recomputation; and at pp=2, every new schedule on unet's long skip connections. (The
    others at pp=4, and all of them with dp=2 and remat=stage, run in tests/test_equivalence.py.)"""
    four = [
        ("dualpipev pp=4", compose_cfg([*FAST, "scheduler=dualpipev", "pp=4", "microbatches=8", "batch_size=32"])),
        ("dualpipev pp=4 remat=stage", compose_cfg([*FAST, "scheduler=dualpipev", "pp=4", "microbatches=8",
                                                    "batch_size=32", "remat=stage"])),
    ]
    _assert_all_match_single_process(four, run_jobs([cfg for _, cfg in four], tmp_path / "logs4"))
    skips = [(f"unet {s}", compose_cfg([*MODELS["unet"], f"scheduler={s}", "pp=2"])) for s in NEW]
    _assert_all_match_single_process(skips, run_jobs([cfg for _, cfg in skips], tmp_path / "logs2"))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_new_schedules_at_pp_8_train_like_one_process(tmp_path) -> None:
    cases = [(f"{s} pp=8", compose_cfg([*FAST, f"scheduler={s}", "pp=8", "microbatches=16", "batch_size=32",
                                        "model.layers=8"])) for s in NEW]
    _assert_all_match_single_process(cases, run_jobs([cfg for _, cfg in cases], tmp_path / "logs"))


@pytest.mark.parametrize(("pp", "v", "m"), [(2, 2, 3), (4, 2, 8), (4, 4, 5), (8, 2, 16)])
def test_looped_bfs_starts_from_torchs_order_and_never_takes_longer(pp: int, v: int, m: int) -> None:
    """Breadth-first's order with full backwards is torch's ScheduleLoopedBFS action for action; with
    the backward split and the W placed on the costs, ours takes no longer a step at no more memory,
    and a shorter one where W is cheaper than I and links are slow."""
    theirs = TorchSchedule(schedule="LoopedBFS", stages_per_rank=v)
    placement = interleaved(pp, v)
    assert breadth_first_order(pp, v, m) == [list(acts) for acts in theirs.compute_actions(placement, m)]
    for costs in ((1.0, 1.0, 1.0, 0.0), (1.0, 1.0, 0.5, 0.1), (1.0, 1.2, 0.7, 0.05)):
        ours_s, ours_r = _run(LoopedBFS(stages_per_rank=v), placement, m, *costs)
        theirs_s, theirs_r = _run(TorchSchedule(schedule="LoopedBFS", stages_per_rank=v), placement, m, *costs)
        assert ours_r.makespan_s <= theirs_r.makespan_s * (1 + 1e-9), costs
        assert _stage_microbatches(ours_s) <= _stage_microbatches(theirs_s)
        if costs[2] < costs[1] and costs[3] > 0 and pp > 2:
            assert ours_r.makespan_s < theirs_r.makespan_s, costs


@pytest.mark.parametrize(("pp", "m"), [(1, 3), (2, 4), (3, 2), (4, 5), (4, 13), (8, 16)])
def test_the_zb_v_order_with_its_own_w_is_torchs_zbv(pp: int, m: int) -> None:
    """One of zbv's candidates is the ZB-V order with the W where the paper puts them: written from
    the paper's pattern here, it equals torch's ZBVZeroBubble action for action, so zbv never takes a
    longer step than torch's on the same costs."""
    from pipelaunch.pipeline.planner.schedules.orders import zero_bubble_v

    theirs = TorchSchedule(schedule="ZBVZeroBubble").compute_actions(v_shape(pp), m)
    assert zero_bubble_v(pp, m, weights=True) == [list(acts) for acts in theirs]
