"""The per-rank training loop: build this rank's stages, run the schedule each step, sync, step.

Everything here runs inside one rank with a process group already initialised.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from pipelaunch.models.moe import set_aux_loss_scale
from pipelaunch.models.spec import ModelSpec
from pipelaunch.pipeline.compute import ring_attention as cp_exchanges
from pipelaunch.pipeline.compute.context_parallel import ContextParallel, activate, active
from pipelaunch.pipeline.compute.host_allocator import huge_pages_active, release_free_memory
from pipelaunch.pipeline.compute.memory import TensorPeak, current_memory_bytes, peak_memory_bytes, reset_peak
from pipelaunch.pipeline.core.plan import Plan, dtype_of
from pipelaunch.pipeline.core.precision import PRECISIONS
from pipelaunch.pipeline.core.results import RankFacts, RankResult, TrainingHistory
from pipelaunch.pipeline.core.run_spec import RunSpec
from pipelaunch.pipeline.data.lengths import step_lengths
from pipelaunch.pipeline.data.packing import Batch, split_batch
from pipelaunch.pipeline.graph.init import name_seed
from pipelaunch.pipeline.graph.initial_weights import InitialWeights
from pipelaunch.pipeline.runtime import checkpoint
from pipelaunch.pipeline.runtime import heartbeat as hb
from pipelaunch.pipeline.runtime.comm import verify_posting_order
from pipelaunch.pipeline.runtime.context import RankContext
from pipelaunch.pipeline.runtime.dp import (
    ReplicatedGrads,
    SharedGrads,
    allreduce_gradients,
    verify_collective_order,
)
from pipelaunch.pipeline.runtime.executor import Executor, StageSlot
from pipelaunch.pipeline.runtime.experts import split_experts, stop_expert_log
from pipelaunch.pipeline.runtime.faults import fault_injection
from pipelaunch.pipeline.runtime.heartbeat import Heartbeat
from pipelaunch.pipeline.runtime.optim import build_optimizer, clip_gradients
from pipelaunch.pipeline.runtime.preempt import StopRequests, control_group
from pipelaunch.pipeline.runtime.progress import Progress
from pipelaunch.pipeline.runtime.router_stats import expert_load, moe_layers, reset_counts, worst_ratio
from pipelaunch.pipeline.runtime.sharding import ShardedStages, local
from pipelaunch.pipeline.runtime.stage import build_stage_modules
from pipelaunch.pipeline.runtime.tensor_parallel import (
    TensorParallel,
    sum_partial_gradients,
    vocab_parallel_loss,
)
from pipelaunch.pipeline.runtime.tracking import Tracker, make_tracker

#: steps after warm-up whose events price the run's own per-stage costs (bounded: every rank sends
#: them to rank 0 at the end)
COST_WINDOW_STEPS = 5


def build_slots(spec: ModelSpec, plan: Plan, ctx: RankContext, seed: int,
                initial_weights: str | None = None, tp: TensorParallel | None = None) -> dict[int, StageSlot]:
    """This rank's stages, each knowing the global rank of every stage it exchanges values with;
    their tensors read from `initial_weights` (a file of the constructor's own), else made by name."""
    initial = InitialWeights(initial_weights) if initial_weights is not None else None
    modules = build_stage_modules(spec, plan, ctx.pp_rank, seed, ctx.device, initial=initial, tp=tp)
    slots: dict[int, StageSlot] = {}
    for sp in plan.stages_of(ctx.pp_rank):
        neighbours = {p for p in sp.inputs.values() if p is not None} | {c for cs in sp.outputs.values() for c in cs}
        peer_of = {
            n: None if plan.stages[n].rank == ctx.pp_rank else ctx.global_rank(plan.stages[n].rank) for n in neighbours
        }
        slots[sp.index] = StageSlot(
            index=sp.index,
            module=modules[sp.index],
            inputs=dict(sp.inputs),
            outputs={k: list(v) for k, v in sp.outputs.items()},
            values={k: (tuple(shape), dtype_of(dtype)) for k, (shape, dtype) in sp.values.items()},
            loss_value=sp.loss_value,
            peer_of=peer_of,
            scatter=frozenset(sp.scatter),
            shapes_at={length: {k: tuple(shape) for k, shape in shapes.items()}
                       for length, shapes in sp.lengths.items()},
        )
    return slots


def _data_parallel(plan: Plan, ctx: RankContext, slots: dict[int, StageSlot]) -> ReplicatedGrads | ShardedStages:
    """What carries out the program's data-parallel actions: the replicas' all-reduces (zero=0),
    or FSDP2 over each stage (zero >= 1: the parameters become DTensors, before the optimizer is
    built over them)."""
    modules = {s: slot.module for s, slot in slots.items()}
    actions = plan.schedule.actions[ctx.pp_rank]
    if plan.meta.zero:
        assert ctx.mesh is not None  # under cp, sharded over the replicas and their cp ranks (torchtitan's dp x cp)
        # under 1 < ep < dp the experts are sharded over their expert replicas (docs/sharding.md)
        return ShardedStages(plan, modules, actions, ctx.mesh.grad_mesh if ctx.cp > 1 else ctx.mesh.shard_mesh,
                             ctx.mesh["expert_dp"] if 1 < ctx.ep < ctx.dp else None)
    return ReplicatedGrads(plan, modules, actions, ctx.grad_group, ctx.expert_grad_group if ctx.ep > 1 else None)


def _context_parallel(run: RunSpec, plan: Plan, ctx: RankContext, spec: ModelSpec) -> torch.Tensor | None:
    """Set (or clear: a job before may have set it) the rank's context parallelism, which the
    model's attention reads; returns the global positions of its columns of the data (cp > 1)."""
    activate(ContextParallel(ctx.cp_group, plan.cp_method) if ctx.cp > 1 else None)
    cp_exchanges.EXCHANGES[0] = [] if run.debug.record_p2p and ctx.cp > 1 else None
    return active().positions(spec.input_shape[-1], torch.device("cpu")) if ctx.cp > 1 else None


def _loss_fn(spec: ModelSpec, slots: dict[int, StageSlot], tp: TensorParallel | None) -> Callable:
    """The model's loss, or under tp the vocabulary-parallel cross-entropy where the last stage's
    output is logits split by vocabulary (the launcher allowed that only for `causal_lm_loss`)."""
    split = any(s.loss_value in (s.module.tensor_parallel.vocab_outputs if s.module.tensor_parallel else ())
                for s in slots.values() if s.loss_value is not None)
    return vocab_parallel_loss(tp) if split and tp is not None else spec.loss_fn


def replica_microbatches(
    tensor: torch.Tensor, dp_rank: int, dp: int, microbatches: int, device: torch.device,
    lengths: Sequence[int] | None = None,
) -> list[torch.Tensor]:
    """This replica's contiguous share of the global batch, cut into equal micro-batches; under
    data.buckets each cut to its length (`lengths`: its positions past that are padding)."""
    share = tensor.chunk(dp)[dp_rank].chunk(microbatches)
    if lengths is not None:
        share = [mb[:, :length].contiguous() for mb, length in zip(share, lengths, strict=True)]
    return [mb.to(device, non_blocking=True) for mb in share]


class Callback:
    """Observes a rank's training at fixed points; the methods do nothing unless overridden. The
    test suite records gradients, weights and outputs through one; a user could log or inspect."""

    def before_optimizer_step(self, trainer: RankTrainer, step: int) -> None:
        """Gradients are final (summed over micro-batches, replicas and tied copies), not yet applied."""

    def after_step(self, trainer: RankTrainer, step: int, outcome: StepOutcome) -> None:
        """The step is over (outputs hold the model's outputs per micro-batch when not training)."""

    def result(self, trainer: RankTrainer) -> dict:
        """Merged into what the rank returns once training ends (`RankResult.extras`)."""
        return {}


@dataclass
class StepOutcome:
    """What one training step of this rank produced."""

    loss: float
    elapsed_s: float  # the whole step: schedule, gradient sums, optimizer, loss all-reduce
    schedule_s: float  # the executor's part of it
    events: list[dict]
    outputs: dict
    lr: float | None = None  # the learning rate this step's update used
    grad_norm: float | None = None  # the global gradient norm before clipping (clip_grad_norm set)
    scored: int | None = None  # the global batch's scored items (tokens not ignored, or samples)
    padded: int | None = None  # the global batch's padding input positions (data that pads: data=chat)
    #: the input positions the global batch ran (data.buckets: its micro-batches' lengths; None:
    #: batch_size x model.seq_len)
    positions: int | None = None
    #: rank 0, a model with experts: tokens per expert per layer over the step (router_stats.py)
    expert_load: dict | None = None


class RankTrainer:
    """This rank's stages, executor and optimizer, built once; `step` runs one training step.
    train_rank loops over it, and bench/paired_runtimes.py interleaves it with torch's runtime."""

    def __init__(self, run: RunSpec, plan: Plan, ctx: RankContext, callbacks: Sequence[Callback] = (),
                 initial_weights: str | None = None) -> None:
        self.run, self.plan, self.ctx = run, plan, ctx
        plugins = run.plugins
        self.callbacks = list(callbacks)
        self.heartbeat = Heartbeat(ctx.rank)
        self.spec: ModelSpec = plugins.model.build()
        self.data = plugins.data.build()
        #: this rank's tp group (plan.tp > 1): its stages are its slices of the planned modules
        self.tp = TensorParallel(ctx.tp_group, ctx.tp, ctx.tp_rank) if plan.tp > 1 else None
        self.slots = build_slots(self.spec, plan, ctx, run.seed, initial_weights, self.tp)
        #: under ep > 1 (debug.record_p2p), the ep group's exchanges this rank made in its first step
        self.expert_log: list[str] | None = [] if run.debug.record_p2p and plan.ep > 1 else None
        if plan.ep > 1:  # each MoE layer keeps this rank's experts and exchanges the tokens
            for slot in self.slots.values():
                slot.module.expert_params, slot.module.whole_experts = split_experts(
                    [slot.module], ctx.ep_group, ctx.ep, ctx.ep_rank, self.expert_log)
        self.loss_fn = _loss_fn(self.spec, self.slots, self.tp)
        self.training = plan.schedule.training
        # a mixture of experts' auxiliary loss weighs in each micro-batch as the step's mean does
        set_aux_loss_scale(1.0 / (plan.dp * plan.microbatches))
        self.data_parallel = _data_parallel(plan, ctx, self.slots) if self.training and ctx.dp * ctx.cp > 1 else None
        #: under cp > 1, the global positions of this rank's share of every sequence (its columns of
        #: the data), and (debug.record_p2p) the cp group's exchanges this rank made in its first step
        self.cp_positions, self.cp_log = _context_parallel(run, plan, ctx, self.spec), None
        self.initial_weights = "constructor" if initial_weights is not None else "by_name"
        # the stream dropout draws from: set by (seed, rank), so a run repeats itself and DP
        # replicas draw different masks (a resume then restores the stream it saved); the tp ranks
        # of a pipeline rank share one (rank // tp: the numbering of tp=1), so a dropout outside
        # the split regions keeps their values equal, as f, g and the boundaries' scatter assume
        torch.manual_seed(name_seed(run.seed, f"train:rank{ctx.rank // ctx.tp}"))
        self.modules: list[nn.Module] = [s.module for s in self.slots.values()]
        #: the MoE layers of this rank's stages, when the model has experts (router statistics)
        self.moe = moe_layers(self.modules) if self.spec.meta.get("experts") else None
        named = {n: p for m in self.modules for n, p in m.named_model_parameters()}  # stages may share one
        self.params = list({id(p): p for p in named.values()}.values())
        self.norm_params, self.expert_norm = self._norm_params(named)
        self.shared = SharedGrads(plan, ctx, self.slots)
        # a stage of parameter-free ops (masks, position ids of an op-level trace) has nothing to update
        self.optimizer, self.lr_scheduler = (
            build_optimizer(plugins.optimizer, plugins.lr_scheduler, self.params) if self.training and self.params
            else (None, None))
        self.clip = run.clip_grad_norm
        self.record_p2p = run.debug.record_p2p
        # debug.record_p2p: the data-parallel collectives this rank issues in its first step
        self.collective_log: list[str] | None = None
        if self.record_p2p and self.data_parallel is not None:
            self.data_parallel.issued = []
        # debug.record_p2p: the tensor-parallel collectives this rank issues in its first step
        self.tp_log: list[str] | None = None
        if self.record_p2p and self.tp is not None:
            self.tp.log = []
        self.executor = Executor(
            plan.schedule, ctx.pp_rank, self.slots, self.loss_fn, ctx.device,
            loss_scale=float(plan.microbatches * plan.dp), autocast=PRECISIONS[plan.meta.precision],
            heartbeat=self.heartbeat, record_p2p=self.record_p2p, model_inputs=plan.model_inputs,
            collectives=self.data_parallel, tp=self.tp, overlap=plan.moe_overlap,
        )
        # what this rank's stages read of the data: the model inputs they take (a first stage's
        # input; the targets a model computing its own loss reads, on whichever stage reads them)
        # and, on the last stage, the targets its loss scores
        reads = {plan.data_of(n) for s in self.slots.values() for n, p in s.inputs.items() if p is None}
        self.needs_inputs = "input" in reads
        self.needs_targets = "target" in reads or any(s.is_last for s in self.slots.values())
        #: the batch's extra per-token fields a stage of this rank reads (packed documents' position ids)
        self.needs_fields = sorted(reads - {"input", "target"})
        self._eval: Executor | None = None
        #: the last batch drawn: its scored items (tokens not ignored, or samples; None: not drawn)
        self.scored: int | None = None
        #: data.buckets: the lengths a micro-batch may run at (pipeline/data/lengths.py); None: one
        self.buckets: tuple[int, ...] | None = getattr(self.data, "length_buckets", None)
        #: the last batch's micro-batch lengths, every replica's in order (None: model.seq_len)
        self.lengths: list[int] | None = None
        #: the largest `_tensor_bytes_held` at an optimizer step so far (RankFacts.state_bytes)
        self.state_bytes: int | None = None
        for m in self.modules:
            m.train(self.training)

    def _norm_params(self, named: dict[str, nn.Parameter]) -> tuple[list[nn.Parameter], tuple | None]:
        """What this rank adds to the global gradient norm: a tied parameter once, on the lowest
        pipeline rank holding it, and a parameter every tp rank holds whole on tp rank 0 only (a
        split one on each: its slice); under ep > 1 its experts apart, their squares summed over
        the ep group whose ranks hold the others."""
        tied, ctx = self.plan.shared_param_ranks(), self.ctx
        split = {n for m in self.modules for n in m.split_dims}
        experts = [named[n] for n in sorted({n for m in self.modules for n in m.expert_params})]
        counted = [p for n, p in named.items() if (n not in tied or tied[n][0] == ctx.pp_rank)
                   and (n in split or ctx.tp_rank == 0) and not any(p is e for e in experts)]
        return counted, ((experts, ctx.ep_group) if experts else None)

    def _microbatch_lengths(self, index: int, held_out: bool) -> tuple[np.ndarray | None, list[int] | None]:
        """Under data.buckets, the order of batch `index`'s samples (data.group_by_length) and every
        replica's micro-batch lengths, the same on every rank (a function of the step's samples):
        known before the step's first message."""
        if self.buckets is None:
            return None, None
        lengths = self.data.sample_lengths(index, self.run.batch_size, held_out=held_out)
        return step_lengths(lengths, self.buckets, self.ctx.dp, self.plan.microbatches,
                            bool(getattr(self.data, "group_by_length", False)))

    def _microbatches(self, draw: Callable[[int, int], Batch], index: int, held_out: bool = False
                      ) -> tuple[list | None, list | None, list[float] | None, dict[str, list], list[int] | None]:
        """This replica's micro-batches of batch `index` from `draw` (the data's `batch` or
        `val_batch`): inputs where a stage reads them (a first stage's rank), targets on a last
        stage's rank and where a stage reads them as a model input; other stages never touch the data.
        And per micro-batch the divisor of its mean loss: the global batch's scored items over its
        own, counted here on the CPU from the whole batch every rank draws alike (no collective,
        known before the first backward); `self.scored` keeps the global count for the metrics.
        Then the micro-batches of the extra fields (packed position ids) this rank's stages read.
        Last, under data.buckets, this replica's micro-batch lengths, which every rank needs (what
        each message holds) and computes alike, whether its stages read the data or not."""
        ctx, m = self.ctx, self.plan.microbatches
        order, self.lengths = self._microbatch_lengths(index, held_out)
        lengths = None if self.lengths is None else self.lengths[ctx.dp_rank * m:(ctx.dp_rank + 1) * m]
        if not (self.needs_inputs or self.needs_targets or self.needs_fields):
            self.scored = None
            return None, None, None, {}, lengths
        inputs, targets, fields = split_batch(draw(index, self.run.batch_size))
        if order is not None:  # data.group_by_length: the same samples, similar lengths together
            rows = torch.from_numpy(order)
            inputs, targets, fields = inputs[rows], targets[rows], {f: t[rows] for f, t in fields.items()}
        self.scored = self.spec.count_scored(targets)
        if self.cp_positions is not None:  # this rank's columns of every sequence (head-tail chunks)
            inputs, targets = inputs[:, self.cp_positions], targets[:, self.cp_positions]
            fields = {f: t[:, self.cp_positions] for f, t in fields.items()}
        counts = [self.spec.count_scored(t) for t in targets.chunk(ctx.dp)[ctx.dp_rank].chunk(m)]
        divisors = [self.scored / c if c else math.inf for c in counts]

        def cut(tensor: torch.Tensor) -> list[torch.Tensor]:
            return replica_microbatches(tensor, ctx.dp_rank, ctx.dp, m, ctx.device, lengths)

        in_mbs = cut(inputs) if self.needs_inputs else None
        tgt_mbs = cut(targets) if self.needs_targets else None
        field_mbs = {f: cut(fields[f]) for f in self.needs_fields}
        return in_mbs, tgt_mbs, divisors, field_mbs, lengths

    def evaluate(self, batches: int) -> float:
        """Mean loss over held-out global batches 0..batches-1 (the data's `val_batch`), forward
        only, through the plan's inference schedule on the same stages (collective)."""
        if self.plan.eval_schedule is None:  # the planner builds it only for runs with eval.every > 0
            raise RuntimeError("this plan has no evaluation program: it was planned with eval.every=0")
        if self._eval is None:
            self._eval = Executor(self.plan.eval_schedule, self.ctx.pp_rank, self.slots, self.loss_fn,
                                  self.ctx.device, loss_scale=float(self.plan.microbatches * self.plan.dp),
                                  record_timings=False, autocast=self.executor.autocast,
                                  record_p2p=self.record_p2p, model_inputs=self.plan.model_inputs, tp=self.tp)
        for m in self.modules:
            m.eval()
        self.heartbeat.phase(hb.EVALUATION)
        total = torch.zeros((), device=self.ctx.device)
        with torch.no_grad():
            for index in range(batches):
                total += self._eval.run_step(*self._microbatches(self.data.val_batch, index, held_out=True))[0]
        if self.ctx.tp_rank:
            total.zero_()
        dist.all_reduce(total)
        for m in self.modules:
            m.train(self.training)
        if self.data_parallel is not None:
            self.data_parallel.release()
        return float(total) / batches

    def step(self, step: int) -> StepOutcome:
        """One step on batch `step` of the data."""
        ctx = self.ctx
        in_mbs, tgt_mbs, divisors, field_mbs, lengths = self._microbatches(self.data.batch, step)
        scored, positions = self.scored, self._positions_run()
        padded = self.data.padded_tokens(step, self.run.batch_size) if hasattr(self.data, "padded_tokens") else None
        if padded is not None and positions is not None:  # the padding the buckets did not cut away
            padded -= self.run.batch_size * self.spec.tokens_per_sample - positions
        if self.moe is not None:
            reset_counts(self.moe)
        start = time.perf_counter()
        loss_sum, events, outputs = self.executor.run_step(in_mbs, tgt_mbs, divisors, field_mbs, lengths)
        if self.data_parallel is not None:  # every replica waits for what it started, whatever the loss
            self.data_parallel.finish()
            if self.data_parallel.issued is not None:  # one step's order is every step's: log the first
                self.collective_log, self.data_parallel.issued = self.data_parallel.issued, None
        if self.tp is not None and self.tp.log is not None:
            self.tp_log, self.tp.log = self.tp.log, None
        if self.expert_log is not None:  # likewise the ep group's exchanges
            stop_expert_log(self.modules)
        if cp_exchanges.EXCHANGES[0] is not None:  # and the cp group's
            self.cp_log, cp_exchanges.EXCHANGES[0] = cp_exchanges.EXCHANGES[0], None
        schedule_s = time.perf_counter() - start
        self.heartbeat.phase(hb.UPDATE)
        if ctx.tp_rank:  # the tp ranks of the last stage hold the same loss: counted once
            loss_sum.zero_()
        dist.all_reduce(loss_sum)  # only last-stage ranks hold a non-zero share
        lr = grad_norm = None
        # a NaN or inf loss leaves the weights as they were, for the report to look at
        trained = self.training and bool(torch.isfinite(loss_sum))
        if trained:
            self.shared.sum_across_stages()
            if self.plan.sequence_parallel:
                sum_partial_gradients(self.modules, self.tp)
            if self.data_parallel is not None:
                allreduce_gradients(self.data_parallel.replicated, ctx.grad_group)
            for callback in self.callbacks:
                callback.before_optimizer_step(self, step)
            if self.clip is not None:
                grad_norm = clip_gradients(self.params, self.norm_params, float(self.clip), ctx.pp_group, ctx.device,
                                           self.data_parallel.shard_group if self.data_parallel else None,
                                           ctx.tp_group, self.expert_norm)
            if self.optimizer is not None:
                lr = self.optimizer.param_groups[0]["lr"]
                self.optimizer.step()
                # what the rank holds between steps, its gradients still there (RankFacts.state_bytes)
                self.state_bytes = max(self.state_bytes or 0, _tensor_bytes_held(self))
                self.optimizer.zero_grad(set_to_none=True)
                self.lr_scheduler.step()
        # the step's tokens per expert, and after a trained step the routers' bias update (moe.bias_update_rate)
        load = expert_load(self.moe, ctx.grad_group, ctx.tp_rank == 0, ctx.device,  # over dp x cp
                           trained=self.modules if trained else None) if self.moe is not None else None
        if ctx.device.type == "cuda":  # the step is over: its time includes the device's work
            torch.cuda.current_stream(ctx.device).synchronize()
        return StepOutcome(float(loss_sum), time.perf_counter() - start, schedule_s, events, outputs, lr, grad_norm,
                           scored, padded, positions, load)

    def _positions_run(self) -> int | None:
        """The input positions the last batch drawn ran at its micro-batches' lengths (None: one length)."""
        if self.lengths is None:
            return None
        per = self.run.batch_size // len(self.lengths)
        return per * sum(self.lengths)

    def verify_p2p_order(self) -> None:
        """debug.record_p2p (collective): every pair of ranks posted complementary messages in the
        same order, in the training and the evaluation program, and the replicas of each pipeline
        rank issued the same data-parallel collectives in the same order (the tp ranks theirs, an
        ep group its all-to-alls, a cp group its ring or all-to-all exchanges); rank 0 raises if not."""
        logs = [getattr(e, "posting_log", None) for e in (self.executor, self._eval)]
        everyone: list = [None] * self.ctx.world_size
        ctx = self.ctx
        ep_group = tuple(dist.get_process_group_ranks(ctx.ep_group)) if ctx.ep > 1 else None
        cp_group = tuple(dist.get_process_group_ranks(ctx.cp_group)) if ctx.cp > 1 else None
        dist.all_gather_object(everyone, {"posted": logs, "dp": (ctx.pp_rank, self.collective_log),
                                          "tp": ((ctx.dp_rank, ctx.pp_rank), self.tp_log),
                                          "ep": (ep_group, self.expert_log), "cp": (cp_group, self.cp_log)})
        if ctx.rank == 0:
            for which in range(2):
                verify_posting_order([part["posted"][which] for part in everyone])
            verify_collective_order([part["dp"] for part in everyone])
            verify_collective_order([part["tp"] for part in everyone], "tensor-parallel",
                                    "the tp ranks of (replica, pipeline rank)")
            # what each exchange carries differs by rank (the rows routed): its order may not
            verify_collective_order([(group, [e.rsplit(" ", 1)[0] for e in log]) for group, log in
                                     (part["ep"] for part in everyone) if group is not None], "expert", "the ep group")
            # the cp group's exchanges (each names its own ring neighbours: the order is what NCCL matches)
            verify_collective_order([(group, [e.split(" to ")[0] for e in log or []]) for group, log in
                                     (part["cp"] for part in everyone) if group is not None], "context-parallel",
                                    "the cp group")

    def nonfinite_report(self, step: int, loss: float) -> str:
        """Where a NaN or inf first showed (collective): the first stage, in pipeline order, whose
        parameters or forward outputs held one this step, else the loss of the last stage."""
        mine = {s: {"params": any(not torch.isfinite(local(p)).all() for p in self.slots[s].module.parameters()),
                    "outputs": bool(self.executor.nonfinite[s])} for s in self.slots}
        everyone: list = [None] * self.ctx.world_size
        dist.all_gather_object(everyone, mine)
        stages = {s: v for part in everyone for s, v in part.items()}
        where = "the loss of the last stage (every stage's outputs were finite)"
        for s in sorted(stages):
            what = "parameters" if stages[s]["params"] else "outputs" if stages[s]["outputs"] else None
            if what:
                sp = self.plan.stages[s]
                blocks = ", ".join(sp.blocks[:4]) + (" ..." if len(sp.blocks) > 4 else "")
                where = f"the {what} of stage {s} (pipeline rank {sp.rank}: {blocks})"
                break
        return (f"the loss became {loss} at step {step}; it first appeared in {where}. Lower optimizer.lr, set "
                "clip_grad_norm, or check the data of this step")


@dataclass
class RunRecord:
    """What a rank's run has produced so far: the history metrics.json and checkpoints carry."""

    start_step: int = 0
    resumed_from: str | None = None
    losses: list[float] = field(default_factory=list)
    lrs: list[float | None] = field(default_factory=list)
    grad_norms: list[float | None] = field(default_factory=list)
    eval_losses: list[dict] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    #: per step: the global batch's scored items and padding positions (None: not counted)
    scored: list[int | None] = field(default_factory=list)
    padded: list[int | None] = field(default_factory=list)
    positions: list[int | None] = field(default_factory=list)
    #: rank 0, a model with experts: each step's router statistics
    expert_load: list[dict] = field(default_factory=list)
    busy: list[float] = field(default_factory=list)
    schedule_times: list[float] = field(default_factory=list)
    last_events: list[dict] = field(default_factory=list)
    # the events of the last few steps after warm-up: what the run's own per-stage costs are taken from
    window: deque = field(default_factory=lambda: deque(maxlen=COST_WINDOW_STEPS))
    checkpoints: list[str] = field(default_factory=list)
    #: the signal the ranks stopped for before the last step (runtime/preempt.py), if any
    stopped_by: str | None = None

    @classmethod
    def resumed(cls, resume_from: str | None, trainer: RankTrainer) -> RunRecord:
        """A fresh record, or the one a checkpoint carries (its weights and states loaded too)."""
        if not resume_from:
            return cls()
        meta = checkpoint.load(Path(resume_from), trainer.modules, trainer.optimizer, trainer.lr_scheduler,
                               trainer.ctx)
        return cls(meta["step"], resume_from, list(meta.get("losses", [])), list(meta.get("lrs", [])),
                   list(meta.get("grad_norms", [])), list(meta.get("eval_losses", [])),
                   expert_load=list(meta.get("expert_load", [])))

    def add(self, step: int, outcome: StepOutcome, warmup_steps: int) -> None:
        self.schedule_times.append(outcome.schedule_s)
        self.losses.append(outcome.loss)
        self.lrs.append(outcome.lr)
        self.grad_norms.append(outcome.grad_norm)
        self.step_times.append(outcome.elapsed_s)
        self.scored.append(outcome.scored)
        self.padded.append(outcome.padded)
        self.positions.append(outcome.positions)
        if outcome.expert_load is not None:
            self.expert_load.append(outcome.expert_load)
        self.busy.append(sum(e.get("busy_s", e["end_s"] - e["start_s"]) for e in outcome.events if e["kind"] != "A2A"))
        self.last_events = outcome.events
        if step >= self.start_step + warmup_steps:
            self.window.append((step, outcome.events))


def train_rank(run: RunSpec, plan: Plan, ctx: RankContext, run_dir: Path | None,
               callbacks: Sequence[Callback] = (), resume_from: str | None = None,
               initial_weights: str | None = None) -> RankResult:
    """Run steps up to `run.steps` (from `resume_from`, a checkpoint, when resuming); rank 0 reports progress,
    and its result carries what the launcher's report writes (`_finish`). `initial_weights`: the
    file of the constructor's own weights (RankJob), or None to initialise by name."""
    trainer = RankTrainer(run, plan, ctx, callbacks, initial_weights)
    at_start = _memory_before_model(trainer)
    # tokens for a language model, samples otherwise (`ModelSpec.tokens_per_sample`)
    tokens_per_step = run.batch_size * trainer.spec.tokens_per_sample
    record = RunRecord.resumed(resume_from, trainer)
    reset_peak(ctx.device)
    tensors = TensorPeak(ctx.device, lambda: _tensor_bytes_held(trainer), run.steps - record.start_step)
    tracker = make_tracker(run.plugins.tracker, run.config, run_dir) if ctx.rank == 0 else None
    progress = Progress(run.steps, tokens_per_step, run.log_every, record.start_step,
                        trainer.spec.throughput_unit) \
        if ctx.rank == 0 else None
    stops = StopRequests(run_dir, control_group(ctx.device), ctx.world_size)
    stops.install()
    try:
        restarted = _train_steps(trainer, record, tensors, tracker, progress, stops, tokens_per_step)
    finally:
        stops.restore()
    at_start = at_start if restarted is None else restarted
    if progress is not None:
        progress.close()
    if trainer.record_p2p:
        trainer.verify_p2p_order()
    trainer.heartbeat.phase(hb.FINISHED)
    return _finish(trainer, record, at_start, tokens_per_step, tracker, tensors)


def _train_steps(trainer: RankTrainer, record: RunRecord, tensors: TensorPeak, tracker: Tracker | None,
                 progress: Progress | None, stops: StopRequests, tokens_per_step: int) -> float | None:
    """The steps from the record's start up to `run.steps`, or up to the step every rank agreed to
    stop after (SIGTERM, SIGUSR1: runtime/preempt.py), checkpointed then; returns the resident
    memory measure restarted after the last step (None when the run stopped before it)."""
    run, ctx = trainer.run, trainer.ctx
    restarted = None
    for step in range(record.start_step, run.steps):
        trainer.heartbeat.phase(hb.STEP_START, step)
        fault_injection(run.debug, ctx.rank, step, trainer.heartbeat)
        with tensors.measure(step - record.start_step):
            outcome = trainer.step(step)
        if step - record.start_step + 1 == tensors.steps:
            restarted = _restart_resident_measure(trainer)
        for callback in trainer.callbacks:
            callback.after_step(trainer, step, outcome)
        if not math.isfinite(outcome.loss):
            # every rank gathered the same facts: whichever fails first, the report is the whole one
            raise FloatingPointError(trainer.nonfinite_report(step, outcome.loss))
        record.add(step, outcome, run.warmup_steps)
        if tracker is not None:
            values = {"loss": outcome.loss, "step_time_s": outcome.elapsed_s,
                      "tokens_per_s": (outcome.positions or tokens_per_step) / outcome.elapsed_s}
            values.update(_token_counts(trainer, outcome, tokens_per_step))
            values.update({k: v for k, v in (("lr", outcome.lr), ("grad_norm", outcome.grad_norm)) if v is not None})
            values.update(_expert_values(outcome.expert_load))
            tracker.log_step(step, values)
        if progress is not None:
            progress.update(step, outcome.loss, outcome.elapsed_s, **_token_counts(trainer, outcome, tokens_per_step),
                            tokens=outcome.positions,
                            expert_load=worst_ratio(outcome.expert_load) if outcome.expert_load else None)
        _maybe_evaluate(trainer, record, step, tracker)
        stopped = stops.agreed()
        stopping = stopped is not None and step + 1 < run.steps
        _maybe_checkpoint(trainer, record, step, now=stopping)
        if stopping:
            record.stopped_by = stopped.name
            if ctx.rank == 0:
                print(f"stopping after step {step + 1} of {run.steps} ({stopped.name})", flush=True)
            break
    return restarted


def _token_counts(trainer: RankTrainer, outcome: StepOutcome, tokens_per_step: int) -> dict[str, float]:
    """For a language model on data that ignores targets (fine-tuning: prompts, padding), what
    tokens_per_s alone hides: the scored tokens per second apart from the input tokens', and the
    share of the input that is padding; {} otherwise (every input token is scored)."""
    if not trainer.spec.takes_tokens or not getattr(trainer.data, "masks_targets", False) or not outcome.elapsed_s:
        return {}
    out = {}
    if outcome.scored is not None:
        out["scored_tokens_per_s"] = outcome.scored / outcome.elapsed_s
    if outcome.padded is not None:
        out["padding_share"] = outcome.padded / (outcome.positions or tokens_per_step)
    return out


def _memory_before_model(trainer: RankTrainer) -> float:
    """What the rank held before its model's tensors: measured once the stages exist (building them
    imports and traces, which costs the process tens of MB that no plan can shrink), minus them."""
    return current_memory_bytes(trainer.ctx.device) - _tensor_bytes_held(trainer)


def _restart_resident_measure(trainer: RankTrainer) -> float:
    """After the steps whose tensors were counted: the heap's free pages (the profiler's among them)
    go back to the kernel, and the resident measure starts again from what the rank holds apart
    from its tensors now (`_memory_before_model`, as before the first step)."""
    release_free_memory()
    at_start = _memory_before_model(trainer)
    reset_peak(trainer.ctx.device)
    return at_start


def _tensor_bytes_held(trainer: RankTrainer) -> int:
    """Bytes of the tensors the rank holds between steps: parameters, their gradients, buffers and
    optimizer state, each storage once."""
    tensors = [*trainer.params, *(p.grad for p in trainer.params if p.grad is not None),
               *(b for m in trainer.modules for b in m.buffers())]
    if trainer.optimizer is not None:
        tensors += [v for state in trainer.optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    tensors = [local(t) for t in tensors]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t.device.type != "meta"}
    return sum(storages.values())


def _maybe_evaluate(trainer: RankTrainer, record: RunRecord, step: int, tracker: Tracker | None) -> None:
    """The held-out loss every `eval.every` steps and after the last one (collective)."""
    run = trainer.run
    every, batches = run.eval.every, run.eval.batches
    if not every or not ((step + 1) % every == 0 or step + 1 == run.steps):
        return
    eval_loss = trainer.evaluate(batches)
    record.eval_losses.append({"step": step, "eval_loss": eval_loss})
    if tracker is not None:
        tracker.log_step(step, {"eval_loss": eval_loss})
    if trainer.ctx.rank == 0:
        print(f"step {step:>4}/{run.steps} | eval_loss {eval_loss:.4f} ({batches} held-out batches, "
              "after this step's update)", flush=True)


def _maybe_checkpoint(trainer: RankTrainer, record: RunRecord, step: int, now: bool = False) -> None:
    """A checkpoint every `checkpoint.every` steps, after the last one and `now` (a stop), under the
    root the launcher decided (collective); rank 0 prunes all but the newest `checkpoint.keep`."""
    run, plan = trainer.run, trainer.plan
    every, root = run.checkpoint.every, run.checkpoint.root
    due = bool(every) and ((step + 1) % every == 0 or step + 1 == run.steps)
    if root is None or not (due or now):
        return
    root = Path(root)
    meta = {"samples_seen": (step + 1) * run.batch_size, "batch_size": run.batch_size,
            "losses": record.losses, "lrs": record.lrs, "grad_norms": record.grad_norms,
            "eval_losses": record.eval_losses, "expert_load": record.expert_load, "model": plan.model, "model_config": run.model_config,
            "layout": {"pp": plan.pp, "dp": plan.dp, "schedule": plan.schedule.name,
                       "partition": plan.meta.partitioner}}
    trainer.heartbeat.phase(hb.CHECKPOINT)
    path = checkpoint.save(root, step + 1, trainer.modules, trainer.optimizer, trainer.lr_scheduler, trainer.ctx,
                           meta)
    record.checkpoints.append(str(path))
    if trainer.ctx.rank == 0:
        checkpoint.prune(root, run.checkpoint.keep)


def _rank_info(trainer: RankTrainer, record: RunRecord, at_start: float,
               tensors: TensorPeak) -> tuple[RankFacts, list[dict], list[dict]]:
    """This rank's facts for metrics.json (where it ran, its memory, its busy time), with its
    last step's events and those of the cost window (only a first replica's: dp_rank 0)."""
    ctx, plan, slots = trainer.ctx, trainer.plan, trainer.slots
    warm = trainer.run.warmup_steps
    median_step = _median_after_warmup(record.step_times, warm) if record.step_times else 0.0
    median_busy = _median_after_warmup(record.busy, warm) if record.busy else 0.0
    peak = peak_memory_bytes(ctx.device)
    devices = plan.meta.device_memory
    facts = RankFacts(
        rank=ctx.rank, pp_rank=ctx.pp_rank, dp_rank=ctx.dp_rank, tp_rank=ctx.tp_rank, stages=sorted(slots),
        blocks={s: plan.stages[s].blocks for s in sorted(slots)},
        peak_memory_bytes=peak, memory_at_start_bytes=at_start, peak_above_start_bytes=peak - at_start,
        peak_tensor_bytes=tensors.peak_bytes(),
        predicted_peak_bytes=float(devices[ctx.pp_rank].total) if devices else None,
        state_bytes=trainer.state_bytes,
        busy_s=median_busy, bubble=max(0.0, 1.0 - median_busy / median_step) if median_step else 0.0,
        device=str(ctx.device),
        cpu_cores=sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        huge_pages=huge_pages_active(), weights_read=list(getattr(trainer.spec.load, "read", [])),
        initial_weights=trainer.initial_weights)
    if ctx.dp_rank != 0 or ctx.tp_rank != 0:
        return facts, [], []
    return facts, record.last_events, [{**e, "step": s} for s, step_events in record.window for e in step_events]


def _finish(trainer: RankTrainer, record: RunRecord, at_start: float, tokens_per_step: int,
            tracker: Tracker | None, tensors: TensorPeak) -> RankResult:
    """Gather every rank's facts on rank 0; return this rank's result (losses, its facts, what the
    callbacks add; rank 0 also the run's history, every rank's last-step events on one clock, the
    cost events of the steps after warm-up and the step's time outside the schedule, from which
    the report (pipelaunch.pipeline.report, run by the launcher) predicts this run's step and
    writes metrics.json, the trace and the timeline)."""
    run, ctx = trainer.run, trainer.ctx
    facts, events, cost_events = _rank_info(trainer, record, at_start, tensors)
    gathered: list | None = [None] * ctx.world_size if ctx.rank == 0 else None
    dist.gather_object((facts, events, cost_events), gathered, dst=0)
    result = RankResult(record.losses, facts, stopped_by=record.stopped_by)
    for callback in trainer.callbacks:
        result.extras.update(callback.result(trainer))
    if ctx.rank != 0:
        return result
    warm = run.warmup_steps
    median_step = _median_after_warmup(record.step_times, warm) if record.step_times else 0.0
    result.history = TrainingHistory(
        losses=record.losses, lr=record.lrs, eval_loss=record.eval_losses, start_step=record.start_step,
        resumed_from=record.resumed_from, checkpoints=record.checkpoints, step_time_s=median_step,
        step_times_s=record.step_times, tokens_per_s=_input_tokens(record, tokens_per_step) / median_step
        if median_step else 0.0,
        throughput_unit=trainer.spec.throughput_unit, ranks=[f for f, _, _ in gathered],
        grad_norm=record.grad_norms if trainer.clip is not None else None, stopped_by=record.stopped_by,
        expert_load=record.expert_load or None)
    if hasattr(trainer.data, "blend_metrics"):  # data.blend: the realised shares, over every step trained
        result.history.data_blend = trainer.data.blend_metrics(0, len(record.losses) * trainer.run.batch_size)
    if getattr(trainer.data, "masks_targets", False) and trainer.spec.takes_tokens and median_step:
        scored = [n for n in record.scored if n is not None]
        padded = [n for n in record.padded if n is not None]
        if scored:
            result.history.scored_tokens_per_s = statistics.fmean(scored) / median_step
        if padded:
            run_positions = [n or tokens_per_step for n, p in zip(record.positions, record.padded, strict=True)
                             if p is not None]
            result.history.padding_share = sum(padded) / sum(run_positions)
    result.overhead_s = (_median_after_warmup(
        [t - s for t, s in zip(record.step_times, record.schedule_times, strict=True)], warm)
        if record.step_times else 0.0)
    result.events = _one_clock([e for _, rank_events, _ in gathered for e in rank_events])
    result.cost_events = [e for _, _, rank_costs in gathered for e in rank_costs]
    tracker.finish({"step_time_s": median_step, "tokens_per_s": result.history.tokens_per_s})
    return result


def _expert_values(load: dict | None) -> dict[str, float]:
    """The tracker's router statistics: each layer's min / mean / max tokens per expert, and the
    worst busiest-over-mean ratio."""
    if not load:
        return {}
    values = {f"experts/{layer}/{k}": v for layer, s in load.items() for k, v in s.items()}
    return values | {"experts/max_over_mean": worst_ratio(load)}


def _input_tokens(record: RunRecord, tokens_per_step: int) -> float:
    """The input tokens of a step: batch x model.seq_len, or under data.buckets the mean of what
    the steps ran at their micro-batches' lengths."""
    run = [n for n in record.positions if n is not None]
    return statistics.fmean(run) if run else tokens_per_step


def _median_after_warmup(values: list[float], warmup: int) -> float:
    """Median over the steps after warm-up (all steps when there are no more than that)."""
    return statistics.median(values[warmup:] if len(values) > warmup else values)


def _one_clock(events: list[dict]) -> list[dict]:
    """Every rank's last-step events, sorted, with time 0 at the first one's start."""
    events = sorted(events, key=lambda e: e["start_s"])
    t0 = events[0]["start_s"] if events else 0.0
    for e in events:
        e["start_s"], e["end_s"] = e["start_s"] - t0, e["end_s"] - t0
    return events
