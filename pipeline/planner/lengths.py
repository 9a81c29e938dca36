"""The shapes of a plan's boundary values at each length a micro-batch may run at (`data.buckets`,
pipeline/data/lengths.py), found before any rank starts.

The plan is cut and priced at model.seq_len, the longest length: its memory budget holds for every
micro-batch. For each shorter length, the very graph the ranks cut into stages (traced at
model.seq_len) has its shapes propagated on the meta device from inputs of that length, and every
value crossing a stage boundary is read by name: `StagePlan.lengths[length][name]` is its shape
there. A rank then allocates each receive from the micro-batch's length alone, which it computes
from the data as every other rank does, so no shape travels and nothing in a step waits for the
host. Only a torch.fx graph, whose shapes follow its inputs', takes other lengths: one traced by
torch.export has every shape fixed (its views name model.seq_len) and is refused, as is a graph
that does not run at a length or whose boundary value changes dtype there, naming data.buckets.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from pipelaunch.models.spec import ModelSpec
from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.core.plan import Plan, dtype_name
from pipelaunch.pipeline.graph.trace import RepeatAwareShapeProp, TracedModel


def at_length(spec: ModelSpec, length: int) -> ModelSpec:
    """The model's spec with inputs (and per-token targets) of `length` tokens."""
    if len(spec.input_shape) != 1:
        raise ConfigError("data.buckets", f"model={spec.name} takes inputs of shape {tuple(spec.input_shape)} per "
                                          "sample, not a sequence of tokens: only a token model's micro-batches can "
                                          "run at their own lengths")
    target = (length,) if len(spec.target_shape) == 1 else spec.target_shape
    return replace(spec, input_shape=(length,), target_shape=target)


def with_length_shapes(plan: Plan, spec: ModelSpec, buckets: Sequence[int], micro_batch_size: int) -> Plan:
    """`plan` with each stage's `lengths`: per bucket, the shape of every boundary value at it."""
    longest = int(spec.input_shape[0])
    names = {n for s in plan.stages for n in s.values}
    traced = spec.trace(micro_batch_size)
    if traced.method != "fx":
        raise ConfigError("data.buckets", f"model={spec.name} is traced by torch.{traced.method}, which fixes every "
                                          f"shape of its graph at model.seq_len={longest}: its stages cannot run "
                                          "micro-batches of other lengths; set data.buckets=null (model=gpt and "
                                          "model=module traced by torch.fx take them)")
    shapes: dict[int, dict[str, list[int]]] = {}
    for length in buckets:
        if length == longest:
            shapes[length] = {n: list(shape) for s in plan.stages for n, (shape, _) in s.values.items()}
            continue
        try:
            with torch.no_grad():
                RepeatAwareShapeProp(traced.gm).propagate(*at_length(spec, length).meta_args(micro_batch_size))
        except ConfigError:
            raise
        except Exception as err:  # noqa: BLE001 - any failure: the graph does not run at this length
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ConfigError("data.buckets", f"model={spec.name}'s graph does not run at {length} tokens ({first}); "
                                              "list only lengths it takes, or set data.buckets=null") from None
        shapes[length] = _boundary_shapes(traced, plan, names, length, spec.name)
    stages = [replace(s, lengths={length: {n: shapes[length][n] for n in s.values} for length in shapes})
              for s in plan.stages]
    return replace(plan, stages=stages)


def _boundary_shapes(traced: TracedModel, plan: Plan, names: set[str], length: int, model: str) -> dict[str, list[int]]:
    metas = {n.name: n.meta.get("tensor_meta") for n in traced.gm.graph.nodes if n.name in names}
    dtypes = {n: dtype for s in plan.stages for n, (_, dtype) in s.values.items()}
    out = {}
    for name in sorted(names):
        meta = metas.get(name)
        if meta is None or not hasattr(meta, "shape"):
            raise ConfigError("data.buckets", f"model={model}'s graph at {length} tokens has no value {name!r}, which "
                                              "crosses a stage boundary at model.seq_len: its stages differ between "
                                              "lengths; set data.buckets=null (every micro-batch at model.seq_len)")
        if plan.meta.precision == "fp32" and dtype_name(meta.dtype) != dtypes[name]:
            raise ConfigError("data.buckets", f"model={model}'s boundary value {name!r} is {dtype_name(meta.dtype)} at "
                                              f"{length} tokens but {dtypes[name]} at model.seq_len; set "
                                              "data.buckets=null")
        out[name] = list(meta.shape)
    return out
