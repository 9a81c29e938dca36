"""What the equivalence tests compare, recorded inside each rank by a trainer callback: the
gradients of step 0 before the optimizer applies them, the final weights, (forward-only
schedules) the model's outputs of step 0, and which of the modules a rank never needs it imported."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from pipelaunch.pipeline.runtime.executor import StageSlot
from pipelaunch.pipeline.runtime.rank import RankJob, join_process_group, leave_process_group, run_job
from pipelaunch.pipeline.runtime.trainer import Callback, StepOutcome


def stage_state(slots: dict[int, StageSlot], what: str, tp=None, ep_group=None) -> dict[str, torch.Tensor]:
    """Parameters or gradients of this rank's stages, keyed by their name in the full model (a
    sharded one gathered whole: collective over the replicas, every one calls it in one order; a
    tensor-parallel slice gathered over the tp ranks, likewise; a share of the experts over the
    ep group, a list's experts from their owners)."""
    out, whole = {}, {}
    for slot in slots.values():
        dims = slot.module.split_dims
        for name, p in slot.module.named_model_parameters():
            t = p.grad if what == "grad" else p
            if isinstance(t, DTensor):
                t = t.full_tensor()
            if t is not None and name in dims and tp is not None:
                parts = [torch.empty_like(t) for _ in range(tp.size)]
                dist.all_gather(parts, t.detach().contiguous(), group=tp.group)
                t = torch.cat(parts, dim=dims[name])
            if name in slot.module.whole_experts and ep_group is not None:
                whole[name] = (t if t is not None else torch.zeros_like(p)).detach().cpu().clone()
                continue
            if name in slot.module.expert_params and ep_group is not None:
                t = t if t is not None else torch.zeros_like(p)
                parts = [torch.empty_like(t) for _ in range(dist.get_world_size(ep_group))]
                dist.all_gather(parts, t.detach().contiguous(), group=ep_group)
                t = torch.cat(parts)
            if t is not None:
                out[name] = t.detach().cpu().clone()
    if any(slot.module.whole_experts for slot in slots.values()) and ep_group is not None:
        # a list's experts, each whole on its owner under its own name: every owner's
        held = [None] * dist.get_world_size(ep_group)
        dist.all_gather_object(held, whole, group=ep_group)
        for part in held:
            out.update(part)
    return out


#: what a rank never uses: drawing (the launcher draws the timeline) and the MILP solvers (the planner)
UNNEEDED = ("matplotlib", "matplotlib.pyplot", "scipy.optimize")


class CaptureState(Callback):
    def __init__(self) -> None:
        self.state: dict = {}

    def before_optimizer_step(self, trainer, step: int) -> None:
        if step == 0:
            self.state["grads_step0"] = stage_state(trainer.slots, "grad", trainer.tp, trainer.ctx.ep_group)

    def after_step(self, trainer, step: int, outcome: StepOutcome) -> None:
        if step == 0 and outcome.outputs:
            self.state["outputs"] = torch.cat([outcome.outputs[mb].cpu() for mb in sorted(outcome.outputs)])

    def result(self, trainer) -> dict:
        self.state["params_final"] = stage_state(trainer.slots, "param", trainer.tp, trainer.ctx.ep_group)
        out = {"state": self.state, "unneeded_imports": [m for m in UNNEEDED if m in sys.modules],
               # the data-parallel collectives the rank issued in its first step (debug.record_p2p)
               "collective_log": list(trainer.collective_log or []),
               # the tensor-parallel collectives it issued in its first step (debug.record_p2p)
               "tp_log": list(trainer.tp_log or []),
               # the ep group's exchanges it made in its first step (debug.record_p2p, ep > 1)
               "expert_log": list(trainer.expert_log or []),
               # the cp group's exchanges it made in its first step (debug.record_p2p, cp > 1)
               "cp_log": list(trainer.cp_log or []),
               # what it posted to each peer in its first step: (op, label, shape, dtype) (debug.record_p2p)
               "posting_log": dict(getattr(trainer.executor, "posting_log", None) or {}),
               "program": [str(a) for a in trainer.executor.actions]}
        if "outputs" in self.state:
            out["outputs"] = self.state["outputs"]
        return out


def rank_main_many(jobs: list[RankJob]) -> list[dict]:
    """Run several jobs of the same world size in one process group, one after the other, so the
    suite checks many configurations without paying for a spawn each."""
    first = jobs[0].plan
    rank, device = join_process_group(jobs[0].run.process, first.world_size, jobs[0].run_dir)
    results = []
    for job in jobs:
        world = job.plan.world_size
        if world != first.world_size:
            raise RuntimeError(f"jobs of one spawn must have one world size, got {world}")
        results.append(run_job(job, rank, device))
    leave_process_group()
    return results
