"""Before any rank starts: every rank's stages against the unsplit module, on one micro-batch (#25).

Why: a pipeline trains what its traced, cut and materialised stages compute, which is not always
what the module written by the user computes. Buffers a constructor computes and no initialiser
reproduces (on the meta device they have no value), a custom `autograd.Function` that tracing
follows into its forward and so loses its backward (a straight-through estimator), or any other
gap between a trace and eager code would train another model than the one written, silently.
So before spawning, the launcher runs the stages beside the module built for real on the first
micro-batch of the run's data (`pipelaunch.launcher.split_compare`) and refuses the first tensor that
differs, by name, with the likely cause and what to do. Here: when it runs (`check_split`), with
how many threads, and what the user reads.
"""

from __future__ import annotations

import torch
from torch import nn

from pipelaunch.launcher.plugins import build_plugin
from pipelaunch.launcher.split_compare import Outcome, ReferenceFailed, compare
from pipelaunch.models.spec import ModelSpec
from pipelaunch.pipeline.compute.threads import cpu_threads
from pipelaunch.pipeline.core.config import CheckSplit, TrainConfig
from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.core.plan import Plan
from pipelaunch.pipeline.data.packing import split_batch
from pipelaunch.pipeline.graph.initial_weights import model_bytes

#: check_split=auto checks a model whose parameters and buffers take at most this many bytes (the
#: check holds them about four times: the stages, the unsplit module, a gradient of each)
AUTO_LIMIT_BYTES = 1 << 30


def skip_reason(cfg: TrainConfig, model: nn.Module | None) -> str | None:
    """Why the check does not run for this config (None: it runs): turned off, or under `auto` a
    model too large to build on the CPU twice. Both are printed; nothing else skips it."""
    if cfg.check_split == CheckSplit.never:
        return "check_split=never"
    if cfg.check_split == CheckSplit.auto and model is not None and model_bytes(model) > AUTO_LIMIT_BYTES:
        return (f"the model's parameters and buffers take {model_bytes(model) / 2**30:.1f} GiB, above the "
                f"{AUTO_LIMIT_BYTES / 2**30:g} GiB check_split=auto builds on the CPU twice; check_split=always checks anyway")
    return None


CAUSES = {
    "buffer": ("the ranks would start this buffer from another value than the module's constructor computes (built on "
               "the meta device it has no value, and no initialiser or checkpoint gives it one)",
               "compute it in a reset_parameters() of its module, or train the module through model=module, whose "
               "ranks read the buffers its constructor computes by name (all but one derived from a parameter)"),
    "output": ("the traced forward computes something other than the module's own forward (code the trace fixed to "
               "one case, an operation tracing does not reproduce)",
               "keep the module that computes it whole (`model.leaf_modules=[...]`: a leaf module runs its own forward "
               "and backward, untraced, on one stage), or choose another model.granularity where the model has one"),
    "gradient": ("the forward agrees and the backward does not: typically a custom torch.autograd.Function (a "
                 "straight-through estimator), which tracing follows into its forward, so its own backward is lost",
                 "keep the module whose forward calls it whole (`model.leaf_modules=[...]`: a leaf module runs its own "
                 "forward and backward, untraced, on one stage), or choose another model.granularity where the model "
                 "has one"),
}


def refusal(outcome: Outcome) -> ConfigError:
    """One paragraph: the first tensor that differs, by how much, the likely cause and what to do."""
    first = outcome.differences[0]
    kind = "output" if first.what == "loss" else first.what
    cause, fix = CAUSES[kind]
    what = {"buffer": f"buffer {first.name}", "output": "the model's output", "loss": "the loss",
            "gradient": f"the gradient of {first.name}"}[first.what]
    where = ""
    if first.what in ("buffer", "gradient") and "." in first.name:
        where = f" ({first.name} belongs to module {first.name.rsplit('.', 1)[0]})"
    order = " (the first in backward order, nearest the loss)" if first.what == "gradient" else ""
    return ConfigError("model", (
        f"the {outcome.stages} stages the ranks would build compute another model than the unsplit module, on one "
        f"micro-batch of this run's data: {what}{order} differs by {first.relative:.2e} relative to its norm "
        f"(tolerance {outcome.tolerance:g}; {len(outcome.differences)} of the {outcome.compared} tensors compared "
        f"differ){where}. Likely cause: {cause}. What to do: {fix}; or, knowing the difference, turn this check "
        "off with check_split=never, and the run trains what the stages compute."))


def _first_columns(batch, length: int):  # noqa: ANN001, ANN202 - a data plug-in's Batch
    """The batch's first `length` positions: under cp the stages are traced at one rank's length,
    and with no cp group active they compute what the unsplit module computes on those (causal)."""
    inputs, targets, fields = split_batch(batch)
    cut = [inputs[:, :length].contiguous(), targets[:, :length].contiguous()]
    return (*cut, {f: t[:, :length].contiguous() for f, t in fields.items()}) if fields else tuple(cut)


def check_split(cfg: TrainConfig, spec: ModelSpec, plan: Plan, model: nn.Module | None, initial=None) -> str:
    """The check as `cfg.check_split` asks, on the first micro-batch of the run's own data; returns
    the line for the log; raises ConfigError naming the first tensor that differs, or when the
    unsplit module cannot be built or run here (a check that cannot compare is never a silent
    skip: the user turns it off). `model`: the planner's meta model; `initial`: where the ranks'
    weights come from (`launcher.initial_weights.Initial`)."""
    reason = skip_reason(cfg, model)
    if reason is not None:
        return f"check_split: skipped: {reason}"
    batch = build_plugin("data", cfg.data).build().batch(0, plan.micro_batch_size)
    if cfg.cp > 1:  # one cp rank's trace: its length of positions (the first, as cp=1 holds them)
        batch = _first_columns(batch, spec.input_shape[-1])
    threads = torch.get_num_threads()
    # a rank's share of the cores: on a tiny model more threads only wait for each other
    torch.set_num_threads(cpu_threads(cfg.threads, cfg.world_size))
    try:
        outcome = compare(spec, plan, batch, cfg.seed, initial_weights=getattr(initial, "path", None),
                          reference=getattr(initial, "model", None))
    except ReferenceFailed as err:
        raise ConfigError("check_split", f"{err}, so the stages the ranks would build cannot be checked against it "
                                         f"(check_split={cfg.check_split}). If it runs only elsewhere (a CUDA-only "
                                         "kernel), turn the check off with check_split=false (or never): the run "
                                         "then trains what the stages compute, unchecked") from None
    finally:
        torch.set_num_threads(threads)
    if outcome.differences:
        raise refusal(outcome)
    return (f"check_split: the {outcome.stages} stages match the unsplit module on one micro-batch ({outcome.compared} "
            f"tensors within {outcome.tolerance:g}) in {outcome.seconds:.2f} s")
