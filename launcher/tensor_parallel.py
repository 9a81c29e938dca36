"""What tensor parallelism (tp > 1) needs of a model, checked before any rank exists: sizes tp
divides, the model traced at one tp rank's shapes and cut by the plan, each stage's graph
rewritten with stand-ins for the collectives (the rewrite refuses a split weight it cannot place
collectives around), and vocabulary-split logits scored only by the cross-entropy that computes
on the shards."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from torch import nn

from pipelaunch.models.spec import ModelSpec, causal_lm_loss
from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.core.plan import Plan
from pipelaunch.pipeline.graph.sequence_parallel import shape_only
from pipelaunch.pipeline.graph.tensor_parallel import (
    SHAPE_ONLY,
    check_local_reshapes,
    local_split,
    parallelize,
    shard_meta,
)
from pipelaunch.pipeline.graph.trace import TracedModel
from pipelaunch.pipeline.runtime.tensor_parallel import apply_sequence_parallel

#: the traces planning made: (micro-batch size, tp, the modules tp splits) -> the model traced at
#: those shapes, or None (`Planned.traces`)
Traces = Callable[[int, int, Mapping[str, str]], "TracedModel | None"]


def check_tp_sizes(spec: ModelSpec, tp: int) -> None:
    """tp divides every size the model's plan splits (heads, key/value heads, the MLP width, the
    vocabulary: `ModelSpec.meta["tp_divides"]`), named by its config key."""
    if tp == 1:
        return
    for key, size in spec.meta.get("tp_divides", {}).items():
        if size % tp:
            fits = [t for t in range(2, size + 1) if size % t == 0][:4]
            raise ConfigError("tp", f"tp={tp} does not divide {key}={size}: each tp rank holds {key} / tp of "
                                    f"it; valid: a tp dividing every one of {', '.join(spec.meta['tp_divides'])} "
                                    f"(here {', '.join(map(str, fits))} ... divide {size}), or tp=1")


def check_tensor_parallel(spec: ModelSpec, plan: Plan, traces: Traces | None = None) -> None:
    """Refuse, before spawning, a tensor-parallel plan the ranks could not run exactly: a module
    whose code bakes a full size in, a split weight read other than by a projection or a lookup,
    or split logits no vocabulary-parallel loss scores, or a reshape that narrows each head
    instead of keeping the rank's heads (`check_local_reshapes`). (A stage boundary inside a split region is
    fine: the plan's values have one tp rank's shapes, and each rank sends its own slice.)
    `traces`: the traces planning made (`Planned.traces`). An export trace of the model at the
    plan's shapes that planning made is read, not made again (the same `spec.trace` of the same
    model gives the same graph; an 80-layer export takes ~10 s); an fx trace is made afresh, as
    cheap to make and with leaf modules the rewrite below changes in place."""
    if plan.tp == 1:
        return
    size = plan.micro_batch_size

    def trace(model: nn.Module, tp: int) -> TracedModel:
        made = traces(size, tp, plan.tp_modules) if traces is not None else None
        return made if made is not None and made.method == "export" else spec.trace(size, model)

    split, sharded = local_split(spec.build_meta(), lambda m: trace(m, plan.tp), plan.assignment,
                                 len(plan.stages), plan.tp_modules, plan.tp)
    local = spec.build_meta()
    shard_meta(local, plan.tp_modules, plan.tp)
    check_local_reshapes(spec.build_meta(), local, spec.meta_args(size), plan.tp,
                         lambda m: trace(m, plan.tp if m is local else 1))
    for stage in plan.stages:
        rewritten = parallelize(split.stages[stage.index], sharded, plan.tp_modules, SHAPE_ONLY)
        if plan.sequence_parallel:  # the pass on meta, as each rank will run it (it refuses what it cannot follow)
            apply_sequence_parallel(split.stages[stage.index], spec, plan, stage.index, sharded, shape_only(plan.tp),
                                    plan.tp)
        if stage.loss_value in rewritten.vocab_outputs and not spec.own_loss and spec.loss_fn is not causal_lm_loss:
            raise ConfigError("model.tp_plan", f"the last stage's output is split by vocabulary over the tp ranks, and "
                                               f"model={spec.name}'s loss is not the next-token cross-entropy "
                                               "(causal_lm), the one computed on the shards; plan its head as "
                                               "replicate, or use model.loss=causal_lm")
