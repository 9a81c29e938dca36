"""Every rank's stages against the unsplit module, on one micro-batch: the comparison itself (#25).

Why here: the launcher's split check (`launcher/split_check.py`) decides when to run it and what
to tell the user; this builds and compares. Every rank's stages are built exactly as each rank
builds them (`pipelaunch.pipeline.runtime.stage.build_stage_modules`, on the CPU, from copies of one trace);
beside them the module is built for real (its factory called normally, under the constructor seed
every build uses) and given the stages' initial parameters by name, and the tensors a checkpoint
supplies; every other buffer keeps what its constructor computed. Both run one micro-batch forward
and backward under one seed (dropout draws alike). Compared, in the order a difference arises: the
buffers the stages hold, the output, the loss, then every parameter gradient in backward order
(tied copies summed, as ranks sum them). `tests/hf_sweep.py` builds and compares with these too.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.utils import _pytree as pytree

from pipelaunch.models.spec import ModelSpec
from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.core.plan import Plan
from pipelaunch.pipeline.data.packing import Batch, split_batch
from pipelaunch.pipeline.graph.buffers import constructor_seed
from pipelaunch.pipeline.graph.initial_weights import InitialWeights
from pipelaunch.pipeline.graph.materialize import lookup
from pipelaunch.pipeline.graph.split import SplitModel, run_in_order, split_model
from pipelaunch.pipeline.runtime.stage import StageModule, build_stage_modules

#: relative difference (to the tensor's norm) above which two tensors differ, for fp32 models
TOLERANCE = 1e-4
CPU = torch.device("cpu")


@dataclass(frozen=True)
class Difference:
    """One tensor the stages compute otherwise than the unsplit module; `relative`: by how much."""

    what: str  # "buffer", "output", "loss", "gradient"
    name: str
    relative: float


@dataclass
class Outcome:
    """What the check compared and what differed (first first)."""

    stages: int
    compared: int
    differences: list[Difference]
    tolerance: float
    seconds: float = 0.0


def every_stage(spec: ModelSpec, plan: Plan, seed: int, traced=None,
                initial_weights: Path | None = None) -> tuple[SplitModel, list[StageModule]]:
    """Each rank's stage modules built as that rank builds them, on the CPU (from copies of one
    trace, `traced`, else a fresh one; their tensors read from the file `initial_weights`, else
    initialised by name), in stage order, and the split routing values between them."""
    traced = spec.trace(plan.micro_batch_size) if traced is None else traced
    initial = InitialWeights(initial_weights) if initial_weights is not None else None
    stages: dict[int, StageModule] = {}
    for rank in range(plan.pp):
        stages.update(build_stage_modules(spec, plan, rank, seed, CPU, traced=copy.deepcopy(traced), initial=initial))
    split = split_model(traced, plan.assignment, len(plan.stages))
    return split, [stages[i].train() for i in range(len(plan.stages))]


def stage_parameters(stages: Iterable[StageModule]) -> dict[str, list[torch.Tensor]]:
    """Every parameter of the stages by the full model's name, with each distinct copy holding it
    (a tied parameter has one per rank that reads it)."""
    held: dict[str, dict[int, torch.Tensor]] = {}
    for mod in stages:
        for name, p in mod.named_model_parameters():
            held.setdefault(name, {})[id(p)] = p
    return {name: list(copies.values()) for name, copies in held.items()}


def stage_buffers(stages: Iterable[StageModule]) -> dict[str, torch.Tensor]:
    return {name: b for mod in stages for name, b in mod.gm.named_buffers()}


def built_for_real(spec: ModelSpec) -> nn.Module:
    """The module as its factory makes it, on the CPU, under the seed every build of it runs under."""
    with constructor_seed(), torch.device("cpu"):
        return spec.build().train()


@torch.no_grad()
def give_stage_tensors(model: nn.Module, spec: ModelSpec, params: dict[str, list[torch.Tensor]],
                       buffers: dict[str, torch.Tensor]) -> None:
    """Into the unsplit `model`, by name: the stages' initial parameters, and the buffers a
    checkpoint supplies (`spec.load.checkpoint`); every other buffer stays as its constructor made it."""
    given = {n: ts[0] for n, ts in params.items()}
    if spec.load is not None and getattr(spec.load, "checkpoint", False):
        held = spec.load.keys()
        given.update({n: b for n, b in buffers.items() if n in held})
    for name, value in given.items():
        lookup(model, name).copy_(value)


def relative_differences(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per name, |got - ref| relative to |ref|, or to 1e-4 of the largest |ref| for a tensor that is
    zero in exact arithmetic (a key bias under softmax, whose reference gradient is rounding noise);
    a name missing on one side counts as infinitely different."""
    floor = 1e-4 * max((float(r.float().norm()) for r in ref.values()), default=0.0) + 1e-12
    out = {}
    for name in [*ref, *(n for n in got if n not in ref)]:
        if name not in got or name not in ref or got[name].shape != ref[name].shape:
            out[name] = float("inf")
            continue
        g, r = got[name].float(), ref[name].float()
        out[name] = float((g - r).norm()) / max(float(r.norm()), floor)
    return out


def tolerance_for(model: nn.Module) -> float:
    """TOLERANCE, or for a model holding half-precision parameters a few of their rounding steps."""
    eps = max((torch.finfo(p.dtype).eps for p in model.parameters() if p.is_floating_point()), default=0.0)
    return max(TOLERANCE, 8 * eps)


def _forward_backward(run, spec: ModelSpec, batch: Batch,
                      seed: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Output leaves and loss of one forward (under `seed`: dropout draws alike) and its backward;
    the model is given what the data gives it (`spec.model_args`: the targets too, for a model
    computing its own loss; packed documents' position ids)."""
    x, y, fields = split_batch(batch)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        out = run(*spec.model_args(x, y, fields))
        loss = spec.loss_fn(out, y)
    loss.backward()
    leaves = [t.detach() for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    return leaves, loss.detach()


class ReferenceFailed(RuntimeError):
    """The unsplit module itself could not be built or run on the CPU here (e.g. a CUDA-only kernel)."""


def _line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:300] if text else ''}"


def _run_reference(spec: ModelSpec, params: dict[str, list[torch.Tensor]], buffers: dict[str, torch.Tensor],
                   batch: Batch, seed: int,
                   reference: nn.Module | None = None) -> tuple[nn.Module, dict, list, torch.Tensor]:
    """The unsplit module (`reference`: the one the ranks' initial weights were written from, else
    built here and given the stages' initial tensors), its buffers before the step, its output and
    loss after one step."""
    if reference is None:
        try:
            reference = built_for_real(spec)
        except Exception as err:  # noqa: BLE001 - whatever keeps the module itself from being built here
            raise ReferenceFailed(f"the unsplit module cannot be built on the CPU here ({_line(err)})") from err
        give_stage_tensors(reference, spec, params, buffers)
    reference.train()
    before = {n: b.clone() for n, b in reference.named_buffers(remove_duplicate=False) if n in buffers}
    try:
        out, loss = _forward_backward(reference, spec, batch, seed)
    except Exception as err:  # noqa: BLE001 - whatever keeps the module itself from running here
        raise ReferenceFailed(f"the unsplit module cannot run on the CPU here ({_line(err)})") from err
    return reference, before, out, loss


def _gradients(params: dict[str, list[torch.Tensor]], reference: nn.Module) -> tuple[dict, dict]:
    """(stages', reference's) gradient per parameter name, tied copies summed, in backward order."""
    grads = {n: sum((p.grad if p.grad is not None else torch.zeros_like(p)) for p in ts) for n, ts in params.items()}
    ref_params = dict(reference.named_parameters())
    ref_grads = {n: ref_params[n].grad if ref_params[n].grad is not None else torch.zeros_like(ref_params[n])
                 for n in reversed(list(ref_params)) if n in grads}  # backward order: nearest the loss first
    return grads, ref_grads


def compare(spec: ModelSpec, plan: Plan, batch: Batch, seed: int, traced=None,
            initial_weights: Path | None = None, reference: nn.Module | None = None) -> Outcome:
    """The check itself (see the module docstring), on one micro-batch `batch`. With
    `initial_weights` (the file the ranks read) the stages read it and `reference` is the module it
    was written from. Raises ConfigError when the stages cannot be built or run, ReferenceFailed
    when the unsplit module cannot."""
    start = time.perf_counter()
    try:
        split, stages = every_stage(spec, plan, seed, traced, initial_weights)
    except ConfigError:
        raise
    except Exception as err:  # noqa: BLE001 - a rank would fail the same way
        raise ConfigError("model", f"the ranks' stages cannot be built ({_line(err)})") from err
    params, held = stage_parameters(stages), stage_buffers(stages)
    buffers = {n: b.clone() for n, b in held.items()}
    reference, ref_buffers, ref_out, ref_loss = _run_reference(spec, params, buffers, batch, seed, reference)
    buffers = {n: b for n, b in buffers.items() if n in ref_buffers}  # not the constants an export trace lifted
    try:
        out, loss = _forward_backward(lambda *v: run_in_order(split, *v, stages=stages), spec, batch, seed)
    except Exception as err:  # noqa: BLE001 - a rank would fail the same way
        raise ConfigError("model", f"the stages the ranks would build fail on one micro-batch where the unsplit "
                                   f"module runs ({_line(err)})") from err
    grads, ref_grads = _gradients(params, reference)
    tolerance, found = tolerance_for(reference), []
    for what, got, ref in (("buffer", buffers, ref_buffers),
                           ("output", dict(enumerate(out)), dict(enumerate(ref_out))),
                           ("loss", {"loss": loss}, {"loss": ref_loss}),
                           ("gradient", grads, ref_grads)):
        rels = relative_differences(got, ref)
        found += [Difference(what, str(n), r) for n, r in rels.items() if not r <= tolerance]
    compared = len(ref_buffers) + len(ref_out) + 1 + len(ref_grads)
    return Outcome(len(stages), compared, found, tolerance, time.perf_counter() - start)

