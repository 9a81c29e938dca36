"""Plain single-process training on the same data: the yardstick every pipeline must match.

Gradient accumulation over exactly the micro-batches the pipeline sees (dp replicas x
micro-batches each), each loss divided by their count, then torch's own `clip_grad_norm_` when
clipping is on, one optimizer step and one LR-schedule step; under precision=bf16 the forward and
the loss run under autocast, as each pipeline stage does. A mixture of experts whose layers move
their router's bias (`moe.bias_update_rate`) moves it after each optimizer step by the step's own
counts (`update_bias`), as the model's author would.
"""

from __future__ import annotations

import torch
from hydra.utils import instantiate

from pipelaunch.launcher.plugins import build_plugins
from pipelaunch.models.hf_moe import HFExperts, correction_bias_name
from pipelaunch.models.moe import MoE, move_bias, set_aux_loss_scale
from pipelaunch.models.spec import ModelSpec
from pipelaunch.pipeline.core.precision import PRECISIONS
from pipelaunch.pipeline.runtime.optim import build_optimizer


def reference_run(cfg: dict, capture_state: bool = True) -> dict:
    spec: ModelSpec = instantiate(cfg.model)
    data = instantiate(cfg.data)
    model = spec.build_full(cfg.seed)
    plugins = build_plugins(cfg)
    optimizer, lr_scheduler = build_optimizer(plugins.optimizer, plugins.lr_scheduler, list(model.parameters()))
    autocast = PRECISIONS[str(cfg.precision)]
    clip = cfg.clip_grad_norm
    dp, m, batch = cfg.dp, cfg.microbatches, cfg.batch_size
    set_aux_loss_scale(1.0 / (dp * m))  # a mixture of experts' auxiliary loss: each micro-batch's share
    # (layer, its correction bias): model=gpt's sigmoid routers, transformers' DeepSeek-V3 gates
    balanced = [(layer, layer.router.expert_bias if isinstance(layer, MoE) else model.get_buffer(correction_bias_name(name)))
                for name, layer in model.named_modules()
                if isinstance(layer, (MoE, HFExperts)) and layer.bias_update_rate]
    losses: list[float] = []
    out: dict = {}
    for step in range(cfg.steps):
        inputs, targets = data.batch(step, batch)
        total = 0.0
        for layer, _ in balanced:  # count the step's tokens per expert alone (not evaluation's)
            layer.counts = None
        for x_share, y_share in zip(inputs.chunk(dp), targets.chunk(dp), strict=True):
            for x, y in zip(x_share.chunk(m), y_share.chunk(m), strict=True):
                with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
                    loss = spec.loss_fn(model(x), y) / (dp * m)
                loss.backward()
                total += float(loss.detach())
        losses.append(total)
        if capture_state and step == 0:
            out["grads_step0"] = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), float(clip))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        lr_scheduler.step()
        for layer, bias in balanced:  # DeepSeek-V3's bias update on the step's whole batch
            move_bias(bias, layer.counts, layer.bias_update_rate)
        every = cfg.eval.every
        if every and ((step + 1) % every == 0 or step + 1 == cfg.steps):
            out.setdefault("eval_losses", []).append(
                {"step": step, "eval_loss": reference_eval(cfg, spec, model, data, autocast)})
    out["losses"] = losses
    if capture_state:
        out["params_final"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        out["buffers_final"] = {n: b.detach().clone() for n, b in model.named_buffers()}
    return out


@torch.no_grad()
def reference_eval(cfg: dict, spec: ModelSpec, model: torch.nn.Module, data, autocast: torch.dtype | None) -> float:
    """Mean loss over the held-out batches, each the mean of its micro-batches' losses."""
    dp, m, batch = cfg.dp, cfg.microbatches, cfg.batch_size
    batches = cfg.eval.batches
    model.eval()
    total = 0.0
    for index in range(batches):
        inputs, targets = data.val_batch(index, batch)
        for x, y in zip(inputs.chunk(dp * m), targets.chunk(dp * m), strict=True):
            with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
                total += float(spec.loss_fn(model(x), y)) / (dp * m)
    model.train()
    return total / batches


@torch.no_grad()
def reference_forward(cfg: dict, inputs: torch.Tensor) -> torch.Tensor:
    spec: ModelSpec = instantiate(cfg.model)
    return spec.build_full(cfg.seed)(inputs)


def train_by_hand(cfg, model: torch.nn.Module, step_loss, probe=None) -> dict:
    """A user's own loop: `step_loss(model, step)` (the loss of batch `step`, written by the test)
    backward, the run's optimizer and schedule; losses, step 0's gradients and the final weights.
    `probe(model)`, before step 0, may read what it wants (its gradients are then cleared)."""
    plugins = build_plugins(cfg)
    optimizer, lr_scheduler = build_optimizer(plugins.optimizer, plugins.lr_scheduler, list(model.parameters()))
    probed = probe(model) if probe is not None else None
    optimizer.zero_grad(set_to_none=True)
    losses, grads = [], {}
    for step in range(cfg.steps):
        loss = step_loss(model, step)
        loss.backward()
        losses.append(float(loss.detach()))
        if step == 0:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        lr_scheduler.step()
    return {"losses": losses, "grads": grads, "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "probed": probed}

