"""torch.distributed.pipelining's schedules lowered into our IR (pipeline/planner/schedules/torch_orders.py):
every class's order, re-read from torch, equals ours action for action, validates, simulates, passes NCCL's
posting rules, and one of them trains on real ranks exactly like one process."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch.distributed.pipelining.schedules as ts

from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.core.ir import Kind
from pipelaunch.pipeline.planner.passes.lowering import lower, sequential_edges
from pipelaunch.pipeline.planner.passes.p2p_check import check_p2p
from pipelaunch.pipeline.planner.placement import interleaved, linear, placement_for, v_shape
from pipelaunch.pipeline.planner.predict.simulate import CostModel, simulate, validate
from pipelaunch.pipeline.planner.schedules import build_schedule
from pipelaunch.pipeline.planner.schedules.one_f_one_b import OneFOneB
from pipelaunch.pipeline.planner.schedules.torch_orders import SHAPES, TorchSchedule
from tests.harness import FAST, assert_state_close, compose_cfg, merge_state, run_jobs
from tests.reference import reference_run

CASES = [(name, pp, m) for name in SHAPES for pp in (2, 4) for m in (pp, 2 * pp)]


def torch_lists(name: str, pp: int, m: int) -> tuple[dict[int, list[str]], dict[int, int], int]:
    """torch's own per-rank compute lists, built by its unmodified constructor over stand-in stages
    (OVERLAP_F_B spelled as its two sub-actions, forward first), its stage -> rank map, and the
    number of OVERLAP_F_B actions."""
    cls = ts.get_schedule_class(name)
    per_rank = 1 if issubclass(cls, ts.PipelineScheduleSingle) else 2
    stages = [SimpleNamespace(num_stages=pp * per_rank, group_size=pp, group_rank=0, submod=None)
              for _ in range(per_rank)]
    sched = cls(stages[0], m) if per_rank == 1 else cls(stages, m)
    lists, overlaps = {}, 0
    for rank, acts in sched.pipeline_order.items():
        out = []
        for a in acts:
            if a is None:
                continue
            if a.computation_type is ts.OVERLAP_F_B:
                overlaps += 1
                subs = sorted(a.sub_actions, key=lambda s: s.computation_type is not ts.FORWARD)
                out += [str(s) for s in subs]
            elif a.computation_type in (ts.FORWARD, ts.FULL_BACKWARD, ts.BACKWARD_INPUT, ts.BACKWARD_WEIGHT):
                out.append(str(a))
        lists[rank] = out
    mapping = dict(getattr(sched, "stage_index_to_group_rank", None) or enumerate(range(pp)))
    return lists, mapping, overlaps


def _torch_accepts(name: str, pp: int, m: int) -> bool:
    try:
        torch_lists(name, pp, m)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize(("name", "pp", "m"), [c for c in CASES if _torch_accepts(*c)])
def test_each_torch_order_equals_torchs_own_list_and_simulates(name: str, pp: int, m: int) -> None:
    gen = TorchSchedule(schedule=name)
    placement = placement_for(gen, pp)
    sched = build_schedule(gen, placement, m)
    validate(sched)
    result = simulate(sched, CostModel.uniform(sched.num_stages))
    assert 0 < result.makespan_s and max(result.peak_activation_microbatches) >= 1
    lists, mapping, overlaps = torch_lists(name, pp, m)
    assert mapping == dict(enumerate(placement)), "torch's stage -> rank map is our placement"
    ours = {r: [a.torch_name for a in acts] for r, acts in enumerate(sched.actions)}
    if name == "1F1B":
        # torch's runtime runs its own loop (warm-up, then B/F, micro-batches in order), which is our 1F1B;
        # torch 2.13's picture of it numbers the last rank's forwards from 1: same kinds, mb + 1
        assert sched.actions == OneFOneB().compute_actions(linear(pp), m)
        last = pp - 1
        assert all(lists[r] == ours[r] for r in range(last))
        drawn = [a.torch_name if a.kind is not Kind.F else f"{a.stage}F{a.mb + 1}" for a in sched.actions[last]]
        assert lists[last] in (ours[last], drawn)
    else:
        assert lists == ours
    assert len(gen.overlapped(placement, m)) == overlaps
    assert (overlaps > 0) == (name == "DualPipeV")
    for fwd, bwd in gen.overlapped(placement, m):  # each pair adjacent in its rank's program, forward first
        program = sched.actions[placement[fwd.stage]]
        at = program.index(fwd)
        assert program[at + 1] == bwd and bwd.kind in (Kind.B, Kind.I) and placement[bwd.stage] == placement[fwd.stage]
    edges = sequential_edges(sched.num_stages)
    spec = [("x", (1,), "float32")]
    check_p2p(lower(sched, edges), {e: (spec, spec) for e in edges})


def test_the_placement_follows_the_class() -> None:
    assert placement_for(TorchSchedule(schedule="gpipe"), 4) == linear(4)
    assert placement_for(TorchSchedule(schedule="Interleaved1F1B", stages_per_rank=3), 4) == interleaved(4, 3)
    assert placement_for(TorchSchedule(schedule="DualPipeV"), 4) == v_shape(4)
    three = TorchSchedule(schedule="InterleavedZeroBubble", stages_per_rank=3)
    assert build_schedule(three, interleaved(2, 3), 4).num_stages == 6
    assert TorchSchedule(schedule="zbvzerobubble").split_backward and not TorchSchedule(schedule="LoopedBFS").split_backward


def test_torchs_requirements_are_config_errors_naming_microbatches() -> None:
    with pytest.raises(ValueError, match="at least as many microbatches as stages"):
        torch_lists("DualPipeV", 4, 4)
    with pytest.raises(ConfigError, match=r"microbatches.*DualPipeV.*at least as many microbatches") as err:
        TorchSchedule(schedule="DualPipeV").check(4, 4, v_shape(4))
    assert err.value.key == "microbatches"
    with pytest.raises(ConfigError, match=r"multiple of the number of rounds") as err:
        TorchSchedule(schedule="Interleaved1F1B").check(4, 9, interleaved(4, 2))
    assert err.value.key == "microbatches"
    with pytest.raises(ConfigError) as err:
        TorchSchedule(schedule="1F1B").check(4, 3, linear(4))
    assert err.value.key == "microbatches"


def test_bad_names_counts_and_placements_are_refused_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r"scheduler.schedule.*'ZB'.*GPipe, 1F1B, Interleaved1F1B, LoopedBFS, "
                                          r"InterleavedZeroBubble, ZBVZeroBubble, DualPipeV"):
        TorchSchedule(schedule="ZB")
    with pytest.raises(ConfigError, match=r"scheduler.stages_per_rank.*exactly 2"):
        TorchSchedule(schedule="ZBVZeroBubble", stages_per_rank=3)
    with pytest.raises(ConfigError, match=r"scheduler.stages_per_rank.*exactly 1"):
        TorchSchedule(schedule="GPipe", stages_per_rank=2)
    with pytest.raises(ConfigError, match="scheduler.stages_per_rank"):
        TorchSchedule(schedule="LoopedBFS", stages_per_rank=0)
    with pytest.raises(ConfigError, match=r"placement.*\[0, 1, 1, 0\]"):
        TorchSchedule().check(2, 4, interleaved(2, 2))


@pytest.mark.timeout(300)
def test_dualpipev_trains_on_real_ranks_like_one_process(tmp_path) -> None:
    cfg = compose_cfg([*FAST, "scheduler=torch", "scheduler.schedule=DualPipeV", "pp=2", "microbatches=4"])
    (ranks,) = run_jobs([cfg], tmp_path / "logs")
    ref = reference_run(cfg)
    assert ranks[0].losses == pytest.approx(ref["losses"], rel=1e-5)
    assert_state_close(merge_state(ranks, "grads_step0"), ref["grads_step0"], "DualPipeV pp=2 grads")
    assert_state_close(merge_state(ranks, "params_final"), ref["params_final"], "DualPipeV pp=2 weights")
