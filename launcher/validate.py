"""Check a resolved config and turn it into a Plan, before any rank exists.

Every error is a ConfigError naming the key and what would be valid, so a bad command line fails
in the launcher process in well under a second instead of inside eight ranks.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from pipelaunch.launcher.config import group_configs
from pipelaunch.launcher.initial_weights import choose
from pipelaunch.launcher.plugins import TARGET, build_plugins, search_options
from pipelaunch.launcher.run_spec import run_spec
from pipelaunch.launcher.tensor_parallel import check_tensor_parallel, check_tp_sizes
from pipelaunch.models.module import LOSSES
from pipelaunch.models.spec import ModelSpec, causal_lm_loss
from pipelaunch.pipeline.core.config import Objective, TrainConfig
from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.core.hardware import configured_hardware
from pipelaunch.pipeline.core.plan import Plan, dtype_of
from pipelaunch.pipeline.core.plugins import GroupOptions, Plugins
from pipelaunch.pipeline.core.run_spec import RunSpec
from pipelaunch.pipeline.data.lengths import step_lengths
from pipelaunch.pipeline.graph.init import uncovered_tensors
from pipelaunch.pipeline.planner import Planned, make_plan
from pipelaunch.pipeline.planner.lengths import with_length_shapes
from pipelaunch.pipeline.planner.predict.lengths import price_lengths
from pipelaunch.pipeline.planner.predict.prediction import Prediction
from pipelaunch.pipeline.planner.search.choose import SearchResult
from pipelaunch.pipeline.runtime.context import bound_to_one_gpu

#: the data-parallel sharding levels (`zero`; docs/sharding.md)
ZERO_LEVELS = (0, 1, 2, 3)


@dataclass
class Prepared:
    spec: ModelSpec
    plan: Plan
    #: what every rank reads beside the plan: seed, steps, the plug-ins built once here (what the
    #: planner read too), evaluation, the one checkpoint root, ...
    run: RunSpec
    prediction: Prediction | None = None
    #: plan=auto / scheduler=auto: every candidate planned and simulated on the profile
    search: SearchResult | None = None
    #: the checkpoint `resume` names (auto: the latest complete one), or None for a fresh start
    resume_from: str | None = None
    #: the model as the planner built it, on the meta device (its size decides check_split=auto)
    model: torch.nn.Module | None = None


def _integer(value, key: str, minimum: int = 1, maximum: int | None = None, what: str = "") -> int:
    """`value` if it is an integer in [minimum, maximum], else a ConfigError naming `key`."""
    if (not isinstance(value, int) or isinstance(value, bool) or value < minimum
            or (maximum is not None and value > maximum)):
        bound = f"from {minimum} to {maximum}" if maximum is not None else f">= {minimum}"
        raise ConfigError(key, f"must be an integer {bound}{what}, got {value!r}")
    return value


def _number(value, key: str, low: float, high: float | None = None, strict: bool = False, what: str = "") -> float:
    """`value` if it is a number >= low (> low when `strict`) and <= high, else a ConfigError."""
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
          and (value > low if strict else value >= low) and (high is None or value <= high))
    if not ok:
        bound = f"{'>' if strict else '>='} {low}" + (f" and <= {high}" if high is not None else "")
        raise ConfigError(key, f"got {value!r}; valid: a number {bound}{what}")
    return float(value)


def check_experts(cfg: TrainConfig) -> None:
    """What expert parallelism needs of the layout (the model's experts are checked with the model:
    `check_expert_model`): ep folds over the replicas. Under zero >= 1 with 1 < ep < dp the experts
    are sharded over their dp / ep expert replicas (docs/sharding.md "Experts")."""
    ep = cfg.ep
    if ep == 1:
        return
    if cfg.dp % ep:
        fits = [e for e in range(1, cfg.dp + 1) if cfg.dp % e == 0]
        raise ConfigError("ep", f"ep={ep} splits each layer's experts over {ep} replicas, and dp={cfg.dp} does not "
                                f"divide into groups of {ep}; valid: a divisor of dp ({', '.join(map(str, fits))})")


def check_expert_model(spec, ep: int) -> None:
    """ep > 1 on a model with experts that ep divides (`ModelSpec.meta["experts"]`: model=gpt's,
    or a transformers MoE's whose experts models/hf_moe.py hooks), and transformers' auxiliary
    loss only where it trains (`meta["output_router_logits"]`)."""
    if spec.meta.get("output_router_logits") and not spec.own_loss:
        raise ConfigError("model.config.output_router_logits",
                          f"true makes model={spec.name} compute transformers' load-balancing loss from every layer's "
                          "router logits, which transformers adds only to its own loss (given labels); model.loss="
                          "causal_lm scores the logits alone, so that loss would be computed and dropped. Set "
                          "model.loss=model (transformers' loss with its aux loss, exact under pp, dp and ep), or "
                          "model.config.output_router_logits=false")
    if ep == 1:
        return
    experts = spec.meta.get("experts")
    if not experts:
        unsplit = spec.meta.get("experts_unsplit")
        if unsplit:
            raise ConfigError("ep", f"ep={ep} splits a mixture of experts' routed experts, and model={spec.name}'s "
                                    f"are not of a kind it splits: {unsplit}; set ep=1")
        raise ConfigError("ep", f"ep={ep} splits a mixture of experts' routed experts, and model={spec.name} has none "
                                "(model=gpt: model.experts=8; model=hf: a transformers MoE such as model=hf_mixtral_tiny)"
                                "; set ep=1")
    if experts % ep:
        fits = [e for e in range(1, experts + 1) if experts % e == 0]
        raise ConfigError("ep", f"ep={ep} does not divide the model's {experts} routed experts (each rank holds "
                                f"experts / ep of every layer); valid: {', '.join(map(str, fits))}")


#: what context parallelism composes with so far (docs/long_sequences.md): the rest is refused
CP_METHODS = ("ring", "alltoall")


def check_context_parallel(cfg: TrainConfig, spec, data) -> None:  # noqa: ANN001 - the data plug-in
    """cp > 1 on a model that splits its positions (`meta["context_parallel"]`: model=gpt reads
    `cp`), with the method its heads allow, and only beside what it composes with yet."""
    if cfg.cp_method not in CP_METHODS:
        raise ConfigError("cp_method", f"got {cfg.cp_method!r}; valid: ring (keys and values round the cp ranks), "
                                       "alltoall (DeepSpeed-Ulysses: an all-to-all over heads)")
    cp = cfg.cp
    if cp == 1:
        return
    if spec.meta.get("context_parallel") != cp:
        raise ConfigError("cp", f"cp={cp} splits every sequence over {cp} ranks along its positions, and model="
                                f"{spec.name} does not run attention over a cp group; valid: model=gpt (and its "
                                "presets), model=hf (sdpa attention), model=module (a token model calling torch's "
                                "scaled_dot_product_attention), or cp=1")
    heads = spec.meta.get("heads")
    if cfg.cp_method == "alltoall" and heads and (heads // cfg.tp) % cp:
        raise ConfigError("cp_method", f"alltoall splits each tp rank's {heads // cfg.tp} of the {heads} heads "
                                       f"(model.heads over tp={cfg.tp}) over cp={cp} ranks, which does not divide "
                                       "them; valid: ring, or a cp dividing the heads a tp rank holds")
    others = [(key, value, valid) for key, value, valid in (
        ("dp_shard", cfg.dp_shard or cfg.dp, f"dp_shard={cfg.dp}"),) if value != int(valid.split("=")[1])]
    if cfg.ep > 1 and cfg.zero:  # the experts' own FSDP2 units span their expert replicas, not their cp ranks
        others.append(("zero", cfg.zero, "zero=0 (ep > 1 beside cp reduces the experts over expert_dp x cp)"))
    if spec.meta.get("experts") and spec.own_loss and spec.meta.get("router_aux_loss"):  # over one rank's tokens
        others.append(("model.loss", "model", "model.loss=causal_lm (the model's own loss would add its routers' "
                                              "auxiliary loss over one cp rank's tokens)"))
    if spec.meta.get("experts") and cfg.moe.capacity_factor is not None:  # capacity counts a rank's tokens
        others.append(("moe.capacity_factor", cfg.moe.capacity_factor, "moe.capacity_factor=null"))
    if getattr(data, "length_buckets", None) is not None:
        others.append(("data.buckets", "set", "data.buckets=null"))
    packing = str(getattr(cfg.data, "packing", None) or "none") if hasattr(cfg.data, "get") else "none"
    if packing not in ("none", "documents"):
        others.append(("data.packing", packing, "data.packing=none or documents"))
    dropout = spec.meta.get("dropout")
    if dropout:
        others.append(("model.dropout", dropout, "model.dropout=0"))
    if others:
        key, value, valid = others[0]
        raise ConfigError(key, f"{key}={value} with cp={cp} is not supported yet (context parallelism runs beside pp, "
                               f"dp and tp, on one sequence or packed documents); set {valid}, or cp=1")


def check_capacity(spec, capacity_factor: float | None) -> None:
    """moe.capacity_factor only where the model's experts drop by it (`meta["capacity_factor"]`:
    model=gpt's, which read it); transformers' MoE modules are dropless."""
    if capacity_factor is None or spec.meta.get("capacity_factor") == capacity_factor:
        return
    raise ConfigError("moe.capacity_factor", f"{capacity_factor} is set, but model={spec.name}'s experts do not "
                                             "drop tokens by a capacity (transformers' MoE modules are dropless; "
                                             "model=gpt with model.experts > 0 reads it); set moe.capacity_factor=null")


def check_bias_update(spec, rate: float | None) -> None:
    """moe.bias_update_rate (DeepSeek-V3's auxiliary-loss-free balancing): off (null or 0), or a
    number > 0 where the runtime moves the routers' correction bias by it (`meta["bias_update_rate"]`:
    model=gpt's sigmoid router, or transformers' DeepSeek-V3 gates, which read the key)."""
    if rate is None or (rate == 0 and not isinstance(rate, bool)):
        return
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not np.isfinite(rate) or rate < 0:
        raise ConfigError("moe.bias_update_rate", f"got {rate!r}; valid: null or 0 (off: the routers' bias stays as it "
                                                  "is), or a number > 0, what each expert's correction bias moves by "
                                                  "after every optimizer step (down for an expert above the mean load "
                                                  "over the step's global batch, up below it; DeepSeek-V3 trains with "
                                                  "0.001)")
    meta = spec.meta
    if meta.get("bias_update_rate") == rate:
        return
    if meta.get("router") is not None:  # model=gpt with experts
        why = (f"model.router={meta['router']} picks its experts without a correction bias" if meta["router"] != "sigmoid"
               else "the model does not pass moe.bias_update_rate to its layers (its config's bias_update_rate)")
    elif meta.get("hf_model_type") is not None and meta.get("experts"):
        why = (f"model={spec.name}'s gates ({meta['hf_model_type']}) pick their experts without a correction bias "
               "(DeepSeek-V3's gate.e_score_correction_bias)")
    else:
        why = f"model={spec.name} has no routers with a correction bias"
    raise ConfigError("moe.bias_update_rate", f"{rate} is set, but {why}. The rate moves the bias a router picks its "
                                              "experts by, as DeepSeek-V3's does: valid with model=gpt, "
                                              "model.experts > 0 and model.router=sigmoid, or with transformers' "
                                              "DeepSeek-V3 (model=hf_deepseek_v3_tiny); set "
                                              "moe.bias_update_rate=null (off) for this model")


def check_config(cfg: TrainConfig) -> None:
    """What the schema's types cannot say: ranges, and rules between keys. Types and enum values
    (`device`, `remat`, `mode`, `precision`, ...) Hydra checked at composition."""
    for key, low in (("threads", 0), ("timeout_s", 1), ("log_every", 1), ("seed", 0), ("pp", 1), ("dp", 1), ("tp", 1),
                     ("ep", 1), ("cp", 1),
                     ("microbatches", 1), ("batch_size", 1), ("steps", 1), ("warmup_steps", 0)):
        _integer(getattr(cfg, key), key, low)
    _number(cfg.link_bandwidth, "link_bandwidth", 0.0, strict=True, what=" (the simulator's link model)")
    if cfg.link_latency_s is not None:
        _number(cfg.link_latency_s, "link_latency_s", 0.0, strict=True, what=" (the simulator's link model; null: measured)")
    for key in ("tp_link_latency_s", "tp_link_bandwidth"):
        if getattr(cfg, key) is not None:
            _number(getattr(cfg, key), key, 0.0, strict=True, what=" or null (the pipeline link's)")
    if cfg.action_overhead_s is not None:
        _number(cfg.action_overhead_s, "action_overhead_s", 0.0, what=" (seconds per compute action; null: measured)")
    if cfg.sequence_parallel and cfg.tp == 1 and cfg.plan.devices is None:
        raise ConfigError("sequence_parallel", "sequence_parallel=true splits the positions between tensor-parallel "
                                               "regions over the tp ranks, and tp=1 has none; set tp > 1, or "
                                               "sequence_parallel=false")
    check_devices(cfg)
    check_zero(cfg)
    check_experts(cfg)
    batch, dp, m = cfg.batch_size, cfg.dp, cfg.microbatches
    if cfg.plan.devices is None and batch % (dp * m):  # plan.devices: each layout's own (search/layouts.py)
        raise ConfigError(
            "batch_size",
            f"{batch} is not divisible by dp x microbatches = {dp} x {m} = {dp * m}; each replica's "
            f"share must split into equal micro-batches (try batch_size={dp * m * max(1, batch // (dp * m))})",
        )
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device", "cuda was asked for but no CUDA device is available; use device=cpu or auto")
    check_gpus(cfg)
    check_memory(cfg)
    check_hardware(cfg)
    check_training_keys(cfg)
    check_objective(cfg)


def check_devices(cfg: TrainConfig) -> None:
    """`plan.devices` (the search chooses pp and dp with pp x dp == it) is a positive integer, and
    only plan=auto chooses a layout."""
    devices = cfg.plan.devices
    if devices is None:
        return
    _integer(devices, "plan.devices", 1, what=" (the ranks plan=auto lays out as pp x dp) or null")
    if not cfg.plan.search:
        raise ConfigError("plan.devices", f"plan.devices={devices} asks the search to choose pp and dp, and only "
                                          f"plan=auto searches; add plan=auto, or set pp and dp (pp x dp ranks) "
                                          "and leave plan.devices null")


def check_zero(cfg: TrainConfig) -> None:
    """zero is a level in 0..3, and above 0 needs replicas to shard over (under `plan.devices`,
    each layout's dp: search/layouts.py leaves out the layouts that cannot)."""
    if isinstance(cfg.zero, bool) or cfg.zero not in ZERO_LEVELS:
        raise ConfigError("zero", f"got {cfg.zero!r}; valid: 0 (replicas hold everything), 1 (optimizer states "
                                  "sharded over the dp replicas), 2 (gradients too), 3 (parameters too)")
    devices = cfg.plan.devices
    if devices is not None and isinstance(devices, int) and devices % cfg.tp:
        raise ConfigError("plan.devices", f"{devices} devices do not split into pipeline ranks of tp={cfg.tp} "
                                          f"devices each; valid: a multiple of {cfg.tp}")
    if cfg.zero and cfg.dp < 2 and devices is None:
        raise ConfigError("zero", f"zero={cfg.zero} shards a stage's states over its data-parallel replicas, and "
                                  f"dp={cfg.dp} has one; set dp >= 2 (e.g. dp=2 zero={cfg.zero}) or zero=0")
    shard = cfg.dp_shard
    if shard is not None:
        key, dp = ("dp", cfg.dp) if devices is None else ("plan.devices", devices)
        divisors = [d for d in range(2, dp + 1) if dp % d == 0]
        if isinstance(shard, bool) or not isinstance(shard, int) or shard not in divisors:
            raise ConfigError("dp_shard", f"got {shard!r} with {key}={dp}; valid: null (shard over all replicas) or "
                                          f"a divisor of {key} of at least 2: {divisors or 'none (dp < 2)'}")
        if not cfg.zero:
            raise ConfigError("dp_shard", f"dp_shard={shard} splits sharded states over groups of replicas, and "
                                          "zero=0 shards nothing; set zero=1, 2 or 3, or leave dp_shard null")
        if cfg.tp > 1:
            raise ConfigError("dp_shard", f"dp_shard={shard} with tp={cfg.tp}: hybrid sharding of tensor-parallel "
                                          "slices is not supported yet; leave dp_shard null (shard over all "
                                          "replicas) or set tp=1")
    bucket = cfg.dp_bucket_bytes
    if bucket is not None and (isinstance(bucket, bool) or not isinstance(bucket, (int, float)) or bucket < 0):
        raise ConfigError("dp_bucket_bytes", f"got {bucket!r}; valid: null (25e6 at zero=0, one collective per block "
                                             "above), 0 (one per block) or a positive number of bytes")
    if str(cfg.reshard) != "use" and cfg.zero != 3 and not (cfg.plan.zero and 3 in cfg.plan.zero):
        raise ConfigError("reshard", f"reshard={cfg.reshard} keeps a block's gathered parameters until the stage's "
                                     f"run of actions ends, and only zero=3 gathers parameters per block (zero={cfg.zero} "
                                     "holds them whole for the step or never shards them); set zero=3, or leave "
                                     "reshard=use")


def check_memory(cfg: TrainConfig) -> None:
    cap = cfg.memory.cap_bytes
    if cap is not None and cap <= 0:
        raise ConfigError("memory.cap_bytes", f"must be a positive number of bytes or null, got {cap!r}")
    _number(cfg.memory.reserve_bytes, "memory.reserve_bytes", 0.0,
            what=" (bytes a rank holds beyond the model's tensors)")


def check_hardware(cfg: TrainConfig) -> None:
    """A hardware file must read (every figure a number, named by file and key); it prices GPUs,
    so a run that trains here on the CPU is refused (it would report predictions for another
    device); and a tensor-parallel group stays inside one of its nodes."""
    hw = configured_hardware(cfg.hardware)
    if hw is None:
        return
    if cfg.mode == "train" and not on_cuda(cfg):
        raise ConfigError("hardware", f"hardware={hw.name} prices the plan for {hw.device_name} GPUs, but this run "
                                      "trains here on the CPU; plan for them with mode=plan, train on the GPUs with "
                                      "the same command there, or use hardware=local to plan for this machine")
    if cfg.tp > hw.devices_per_node:
        raise ConfigError("tp", f"tp={cfg.tp} spans more devices than a node of hardware={hw.name} has "
                                f"({hw.devices_per_node}): a tensor-parallel group stays inside a node (it "
                                f"communicates at every layer); use tp <= {hw.devices_per_node}")


def check_objective(cfg: TrainConfig) -> None:
    """The value the run returns to a sweeper must be one this run will produce."""
    objective, every = cfg.objective, cfg.eval.every
    if objective == Objective.eval_loss and not every:
        raise ConfigError("objective", f"objective=eval_loss is the last held-out loss, but eval.every={every} never "
                                       "evaluates; set eval.every=<steps> (it also evaluates after the last step, so "
                                       f"eval.every={cfg.steps} evaluates once at the end) or use objective=loss")
    if cfg.mode == "plan" and objective in (Objective.loss, Objective.eval_loss):
        raise ConfigError("objective", f"objective={objective} is a training loss, but mode=plan trains nothing; a "
                                       "dry run returns the planned step: use objective=step_time_s or tokens_per_s, "
                                       "or mode=train")


def on_cuda(cfg: TrainConfig) -> bool:
    """Whether the ranks of this run train on GPUs (device=cuda, or auto where CUDA is available)."""
    return cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())


def local_ranks(cfg: TrainConfig) -> int:
    """Ranks on this node: LOCAL_WORLD_SIZE for ranks torchrun or SLURM started (each validates
    the config), else the pp x dp ranks the launcher is about to spawn here."""
    from pipelaunch.launcher.joined import joined_rank_env

    if joined_rank_env():
        return int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("WORLD_SIZE") or 1)
    return cfg.world_size


def check_gpus(cfg: TrainConfig) -> None:
    """One GPU per rank: a node with fewer visible GPUs than local ranks is refused here, before
    any process exists. Without this check, two ranks would share a GPU and NCCL would fail inside
    the first communicator ("duplicate GPU"). A dry run (mode=plan) starts no rank and may plan for
    a larger node than this one. Only counts devices: nothing here opens a CUDA context."""
    if cfg.mode != "train" or not on_cuda(cfg):
        return
    needed, visible = local_ranks(cfg), torch.cuda.device_count()
    if cfg.tp > 1 and (needed % cfg.tp or cfg.tp > max(visible, 1)):
        raise ConfigError("tp", f"tp={cfg.tp} runs each layer's collectives among {cfg.tp} consecutive ranks, which "
                                f"must share a node (NVLink), but this node has {needed} rank(s) and {visible} "
                                f"GPU(s); valid: a tp dividing the ranks per node and at most its GPUs (tp within a "
                                "node, pp and dp across nodes)")
    from pipelaunch.launcher.joined import joined_rank_env

    if needed <= visible or (joined_rank_env() and bound_to_one_gpu(visible)):
        return

    shown = os.environ.get("CUDA_VISIBLE_DEVICES")
    seen = f"{visible} {'is' if visible == 1 else 'are'} visible (torch.cuda.device_count(); CUDA_VISIBLE_DEVICES=" \
           f"{shown if shown is not None else '<unset>'})"
    fit = max(1, visible)
    if joined_rank_env():
        what = f"LOCAL_WORLD_SIZE={needed} ranks on this node need {needed} GPUs (one each), but {seen}"
        ways = (f"start at most {fit} processes per node (torchrun --nproc-per-node {fit}, or "
                f"hydra/launcher=submitit_slurm with hydra.launcher.tasks_per_node={fit}, the GPUs per node) on "
                f"more nodes, or train on the CPU (device=cpu)")
    else:
        auto = " (device=auto takes the GPUs when CUDA is available)" if cfg.device == "auto" else ""
        ranks = (f"plan.devices = {needed}" if cfg.plan.devices is not None else
                 f"pp x dp x tp = {cfg.pp} x {cfg.dp} x {cfg.tp} = {needed}" if cfg.tp > 1 else
                 f"pp x dp = {cfg.pp} x {cfg.dp} = {needed}")
        what = f"{ranks} ranks on this node need {needed} GPUs (one each){auto}, but {seen}"
        fewer = f"plan.devices <= {fit}" if cfg.plan.devices is not None else f"lower pp or dp so that pp x dp <= {fit}"
        ways = (f"start fewer ranks per node ({fewer}), train on the CPU "
                f"(device=cpu), or spread the ranks over several nodes with torchrun (--nproc-per-node {fit} on "
                f"each) or SLURM (hydra/launcher=submitit_slurm with hydra.launcher.tasks_per_node={fit}, the GPUs "
                "per node)")
    raise ConfigError("device", f"{what}; two ranks on one GPU fail inside NCCL. Ways out: {ways}.")


def check_training_keys(cfg: TrainConfig) -> None:
    """LR schedule, clipping, evaluation, checkpoints and fault injection."""
    lr = cfg.lr_scheduler or {}
    if lr:
        _integer(lr.get("warmup_steps", 0), "lr_scheduler.warmup_steps", 0)
        _number(lr.get("min_lr_ratio", 0.0), "lr_scheduler.min_lr_ratio", 0.0, 1.0, what=" (a fraction of optimizer.lr)")
        _integer(lr.get("total_steps", cfg.steps), "lr_scheduler.total_steps", 1, what=" (default: steps)")
    if cfg.clip_grad_norm is not None:
        _number(cfg.clip_grad_norm, "clip_grad_norm", 0.0, strict=True, what=" or null (no clipping)")
    for key, low in (("eval.every", 0), ("eval.batches", 1), ("checkpoint.every", 0), ("checkpoint.keep", 0)):
        group, name = key.split(".")
        _integer(getattr(getattr(cfg, group), name), key, low)
    world, last = cfg.world_size - 1, cfg.steps - 1
    for key, high in (("kill_rank", world), ("kill_step", last), ("hang_rank", world), ("hang_step", last)):
        if getattr(cfg.debug, key) is not None:
            _integer(getattr(cfg.debug, key), f"debug.{key}", 0, high, " or null")


def check_trains_here(cfg: TrainConfig, spec: ModelSpec, plugins: Plugins) -> None:
    """Refuse (on `model`) training on this machine's CPU a model whose weights, gradients and
    optimizer states alone exceed the host memory available, before any rank is spawned. Why: the
    ranks would build it and be killed by the kernel mid-build with no message (a preset such as
    model=llama3_70b holds 70B parameters). What every layout holds at the least: the whole model
    once, however pp, tp and zero split it, against the memory planning a profile is checked on."""
    from pipelaunch.pipeline.planner.measure.host_memory import GIB, available_bytes

    available = available_bytes()
    if cfg.mode != "train" or on_cuda(cfg) or available is None:
        return
    params = list(spec.build_meta().parameters())
    states = plugins.optimizer.states_per_param
    need = (2 + states) * float(sum(p.numel() * p.element_size() for p in params))
    if need > available:
        count = sum(p.numel() for p in params)
        raise ConfigError("model", f"model={spec.name} holds {count / 1e9:.2f}B parameters: training it here takes at "
                                   f"least {need / GIB:.1f} GiB for its weights, gradients and {states} optimizer "
                                   f"state(s) per parameter, more than the {available / GIB:.1f} GiB this machine has "
                                   "available; plan it for the GPUs it will train on with mode=plan hardware=<gpu> "
                                   "(h100_sxm, a100_80gb, h200, b200 or your own conf/hardware file: priced on meta, "
                                   f"nothing allocated), e.g. python train.py mode=plan model={spec.name} "
                                   "hardware=h100_sxm plan=auto plan.devices=64")


def group_options(cfg: TrainConfig) -> GroupOptions:
    """The scheduler and partitioner options a search compares (on this run's search path), built."""
    return search_options(cfg, group_configs)


def prepare(cfg: TrainConfig, profile: bool | None = None, device: torch.device | None = None,
            options: GroupOptions | None = None, run_dir: Path | None = None) -> Prepared:
    """Validate `cfg` and plan the run (`pipelaunch.pipeline.planner.make_plan`).

    The model is built and traced on the meta device (no weights). With a profile (always for
    scheduler=auto, mode=plan, a memory budget, cost-aware schedules and partitioners that read
    costs), every node is measured on this machine one leaf module at a time (cached) and the plan
    is simulated. The profile is taken on the device the run trains on: `device` when this process
    is a rank (its own GPU), else the CPU, or for a GPU run a child process on cuda:0
    (pipeline/planner/measure/traced.py). Nothing else here touches a GPU. `options`: the group options a
    search compares (default: read from this run's search path)."""
    check_config(cfg)
    plugins = build_plugins(cfg)  # every callable imported now: a config error here, not in a rank
    spec = plugins.model.build()
    check_trains_here(cfg, spec, plugins)
    check_optimizer(cfg, plugins)
    data = check_data(cfg, spec, plugins)
    check_tp_sizes(spec, cfg.tp)
    check_expert_model(spec, cfg.ep)
    check_context_parallel(cfg, spec, data)
    check_capacity(spec, cfg.moe.capacity_factor)
    check_bias_update(spec, cfg.moe.bias_update_rate)
    planned = make_plan(cfg, spec, plugins, options if options is not None else group_options(cfg),
                        profile=profile, device=device, cuda=on_cuda(cfg))
    if planned.plan.cp != cfg.cp:  # a search over cp (plan.cp) chose another: the model at its cp
        spec = plugins.model.with_settings(plugins.model.option, context_parallel=planned.plan.cp).build()
    check_output(cfg, spec, planned.plan)
    check_scored_microbatches(cfg, spec, data, planned.plan)
    planned = _variable_lengths(cfg, spec, data, planned)
    check_tensor_parallel(spec, planned.plan, planned.traces)
    run = run_spec(cfg, plugins, run_dir)
    resume_from = resume_checkpoint(cfg, planned.model, Path(run.checkpoint.root) if run.checkpoint.root else None)
    if choose(cfg, spec, planned.model)[0] != "constructor":  # the constructor's own values need no initialiser
        _warn_uncovered(spec, planned)
    return Prepared(spec, planned.plan, run, planned.prediction, planned.search, resume_from, planned.model)


#: the first steps a data.buckets run's prediction is simulated on, each on its own lengths
PRICED_STEPS = 16


def _variable_lengths(cfg: TrainConfig, spec: ModelSpec, data: object, planned: Planned) -> Planned:
    """Under data.buckets, the plan with its boundary values' shapes at every bucket
    (planner/lengths.py) and its predicted step on the run's first steps' own micro-batch lengths
    (planner/predict/lengths.py), recorded beside the step at model.seq_len."""
    buckets = getattr(data, "length_buckets", None)
    if buckets is None:  # (a model not reading tokens is refused by planner/lengths.at_length, naming data.buckets)
        return planned
    plan = planned.plan
    plan = with_length_shapes(plan, spec, buckets, cfg.batch_size // (plan.dp * plan.microbatches))
    planned = replace(planned, plan=plan)
    if planned.prediction is None or plan.meta.prediction is None or not plan.schedule.training:
        return planned
    grouped = bool(getattr(data, "group_by_length", False))
    lengths = [step_lengths(data.sample_lengths(step, cfg.batch_size), buckets, plan.dp, plan.microbatches, grouped)[1]
               for step in range(min(cfg.steps, PRICED_STEPS))]
    priced = price_lengths(planned.prediction, lengths, int(spec.input_shape[0]))
    step = replace(plan.meta.prediction, variable_lengths=priced)
    return replace(planned, plan=replace(plan, meta=replace(plan.meta, prediction=step)))


def check_data(cfg: TrainConfig, spec: ModelSpec, plugins: Plugins) -> object:
    """The data must give what the model takes, with ids it can embed; missing files, a wrong
    dtype or a short corpus are refused here, not in a rank. For `model=module` (its input set
    by hand) each disagreement names the model key to set and its value. Returns the data built."""
    data_vocab, model_vocab = cfg.data.get("vocab_size"), spec.meta.get("vocab_size")
    data_kind = cfg.data.get("kind", "tokens")
    model_kind = "tokens" if spec.takes_tokens else "images"
    adapter = "input" in cfg.model  # model=module: input, target and loss are the user's
    if data_kind != model_kind:
        if adapter:
            want, gives = ("int64", "token ids") if data_kind == "tokens" else ("float32", "float tensors")
            raise ConfigError("model.input.dtype", f"is {str(spec.input_dtype).removeprefix('torch.')} but the data "
                                                   f"gives {gives}; set model.input.dtype={want}")
        raise ConfigError("data", f"model={spec.name} takes {model_kind} but the data gives {data_kind}; use "
                                  f"data={'synthetic, text, tokens or hf' if model_kind == 'tokens' else 'images'}")
    if data_kind == "tokens":
        _check_token_windows(cfg, spec, adapter)
    if data_vocab is not None and model_vocab is not None and data_vocab > model_vocab:
        raise ConfigError("data.vocab_size", f"{data_vocab} exceeds model.vocab_size={model_vocab}")
    data = plugins.data.build()
    if model_vocab is not None and hasattr(data, "check_vocabulary"):
        data.check_vocabulary(model_vocab)  # ids the model cannot embed
    check_data_fields(cfg, spec, tuple(getattr(data, "fields", ())))
    if getattr(data, "length_buckets", None) is not None and cfg.tp > 1:
        raise ConfigError("tp", f"tp={cfg.tp} with micro-batches of their own lengths (data.buckets) is not supported "
                                "yet; use tp=1, or data.buckets=null")
    if getattr(data, "masks_targets", False):
        check_masked_loss(cfg, spec)
    return data


def check_data_fields(cfg: TrainConfig, spec: ModelSpec, fields: tuple[str, ...]) -> None:
    """The extra per-token fields the data gives (packed documents' position ids) and those the
    model takes must agree: packing for a model that cannot take the position ids (its documents
    would attend to each other) is refused, naming the key, as is an attention implementation of
    transformers that ignores them on this device."""
    taken = tuple(a for a in spec.data_args if a not in ("input", "target"))
    if fields and not taken:
        raise ConfigError("data.packing", f"packs documents, but model={spec.name} takes no position ids or document "
                                          "mask (its documents would attend to each other); use data.packing=none, "
                                          "or a model that takes them: model=gpt, model=hf, or model=module with "
                                          "model.position_ids_arg naming its forward's argument")
    missing = [f for f in taken if f not in fields]
    if missing:
        raise ConfigError("data.packing", f"model={spec.name} takes {', '.join(missing)} (packed documents), but the "
                                          f"data gives none; set data.packing=documents (data=tokens or data=hf)")
    if not fields:
        return
    impl = spec.meta.get("attn_implementation")
    if impl is not None:
        from pipelaunch.models.hf import PACKED_ATTENTION

        device = "cuda" if on_cuda(cfg) else "cpu"
        if device not in PACKED_ATTENTION.get(impl, ()):
            valid = ", ".join(k for k, devices in PACKED_ATTENTION.items() if device in devices)
            raise ConfigError("model.config.attn_implementation",
                              f"{impl} does not keep packed documents apart from position ids alone on {device} "
                              f"(transformers' packed path); valid here: {valid}")


def check_masked_loss(cfg: TrainConfig, spec: ModelSpec) -> None:
    """Data whose targets hold IGNORE_INDEX (data=chat: prompts, padding) needs a loss that is a
    mean over the scored tokens, so the runtime can weigh each micro-batch by its scored tokens'
    share of the global batch's: causal_lm, or transformers' own loss on the data's targets. A loss
    whose count of scored items is unknown (a model's own loss elsewhere, a callable) is refused."""
    if spec.masked_refusal is not None:
        raise ConfigError("model.labels" if "model.labels" in spec.masked_refusal else "model.loss",
                          spec.masked_refusal)
    if spec.token_weighted:
        return
    what = ("the model computes its own loss, which cannot be told the global batch's scored tokens nor be known "
            "to leave -100 targets out" if spec.own_loss else
            "this loss is not known to be a mean over the targets that are not -100")
    raise ConfigError("model.loss", f"data={cfg.data.get('_target_', '').rsplit('.', 1)[-1] or 'chat'} scores only "
                                    f"the responses (targets -100 on prompts and padding), but {what}; set "
                                    "model.loss=causal_lm (pipelaunch scores the logits, token-weighted over the "
                                    "global batch)")


def check_scored_microbatches(cfg: TrainConfig, spec: ModelSpec, data: object, plan: Plan) -> None:
    """On data that ignores targets, every micro-batch of every step must score a token: a
    transformers loss on none is 0/0 (NaN), and a micro-batch that trains nothing is a sign of
    examples cut to nothing. Counted from the data's per-sample scores, without building batches."""
    if not plan.schedule.training or not hasattr(data, "scored_per_sample"):
        return
    parts, per = plan.dp * plan.microbatches, cfg.batch_size // (plan.dp * plan.microbatches)
    chunk = max(1, (1 << 22) // cfg.batch_size)  # steps counted at once: a few million samples
    empty = np.zeros((0, 2), dtype=np.int64)
    for start in range(0, cfg.steps, chunk):
        steps = min(chunk, cfg.steps - start)
        counts = np.asarray(data.scored_per_sample(start * cfg.batch_size, steps * cfg.batch_size))
        if getattr(data, "group_by_length", False):  # each step's samples in the order its micro-batches take
            counts = np.concatenate([
                counts.reshape(steps, -1)[i][step_lengths(data.sample_lengths(start + i, cfg.batch_size),
                                                          data.length_buckets, plan.dp, plan.microbatches, True)[0]]
                for i in range(steps)])
        empty = np.argwhere(counts.reshape(steps, parts, per).sum(axis=2) == 0)
        if len(empty):
            empty[:, 0] += start
            break
    if not len(empty):
        return
    step, part = (int(v) for v in empty[0])
    first = step * cfg.batch_size + part * per
    why, fix = (("its examples' responses were cut away (data.truncate=true: prompts as long as the window)",
                 "a longer model.seq_len") if cfg.data.get("truncate") else
                ("its examples' responses are empty", "check data.response_key and data.add_eos"))
    raise ConfigError("microbatches", f"micro-batch {part % plan.microbatches} of replica {part // plan.microbatches} "
                                      f"at step {step} (samples {first}..{first + per - 1} of the run) holds no scored "
                                      f"token, every target -100: {why}. Use fewer micro-batches (microbatches="
                                      f"{plan.microbatches} now, {per} example(s) each) or a larger batch_size, or "
                                      f"{fix}")


def _check_token_windows(cfg: TrainConfig, spec: ModelSpec, adapter: bool) -> None:
    """Token data gives (seq_len,) ids in and the next (seq_len,) ids as targets: the window must
    be set and equal the model's input, and the loss must score a token per position."""
    data_len, model_len = cfg.data.get("seq_len"), cfg.model.get("seq_len")
    # (under cp a rank's model input is 1/cp of the window: the window is the whole sequence)
    sample = spec.input_shape[0] * int(spec.meta.get("context_parallel", 1)) if len(spec.input_shape) == 1 else None
    if "seq_len" in cfg.data and data_len is None:
        raise ConfigError("model.seq_len", f"is unset, and the data cuts windows of model.seq_len tokens; set "
                                           f"model.seq_len={sample if sample is not None else '<tokens per sample>'}")
    if data_len is None or sample is None:
        return
    if model_len is not None and data_len != model_len:
        raise ConfigError("data.seq_len", f"{data_len} differs from model.seq_len={model_len}; set "
                                          f"data.seq_len={model_len} or leave it out (it follows model.seq_len)")
    if sample != data_len:
        key = "model.input.shape" if adapter else "model.seq_len"
        raise ConfigError(key, f"the model takes {sample} tokens per sample but the data gives windows of {data_len} "
                               f"(model.seq_len); set 'model.input.shape=[{data_len}]' or leave model.input.shape "
                               f"out (it follows model.seq_len)" if adapter else
                               f"the model takes {sample} tokens per sample but the data gives {data_len}; set "
                               f"model.seq_len={sample}")
    if adapter and (spec.target_shape != spec.input_shape or spec.target_dtype != torch.long):
        loss = cfg.model.get("loss")
        if isinstance(loss, str) and loss not in ("causal_lm", "model"):
            raise ConfigError("model.loss", f"{loss} scores {'one label per sample' if loss == 'cross_entropy' else 'float targets'}, "
                                            f"but token data gives the next token id at each of the {data_len} positions; "
                                            "set model.loss=causal_lm")
        raise ConfigError("model.target", f"shape {list(spec.target_shape)} {str(spec.target_dtype).removeprefix('torch.')} "
                                          f"but token data gives the next token id at each of the {data_len} positions; "
                                          f"set 'model.target.shape=[{data_len}]' model.target.dtype=int64 (or model.target=null)")


def check_output(cfg: TrainConfig, spec: ModelSpec, plan: Plan) -> None:
    """The loss must score what the model returns against what the data gives, on the traced
    output's shape (the last stage's, per micro-batch) and the targets', on the meta device: a
    model returning one position where the targets have one per position (nanoGPT's forward
    without targets) is refused here, naming both shapes and the fix, and not on the last rank.
    A model computing its own loss must return it: a scalar."""
    last = next(s for s in plan.stages if s.loss_value is not None)
    if last.loss_value not in last.values:
        return
    shape, dtype = last.values[last.loss_value]
    if spec.own_loss:
        if shape or not dtype_of(dtype).is_floating_point:
            raise ConfigError("model.output", f"with model.loss=model the output must be the model's own loss, a "
                                              f"scalar, but it is a {dtype} tensor {shape}; set model.output to the "
                                              "loss's field or position in what the model returns (nanoGPT's "
                                              "(logits, loss): model.output=1)")
        return
    mbs = plan.micro_batch_size
    target = [mbs, *spec.target_shape]
    loss = cfg.model.get("loss")
    name = next((k for k, f in LOSSES.items() if f is spec.loss_fn), None) or (
        loss.get(TARGET) if isinstance(loss, Mapping) else None) or "the loss"
    problem = None
    if spec.loss_fn is causal_lm_loss and shape[:-1] != target:
        problem = "it needs the output's shape but its last dimension (the logits) to equal the targets'"
    else:
        try:
            spec.loss_fn(torch.empty(shape, dtype=dtype_of(dtype), device="meta"),
                         torch.empty(target, dtype=spec.target_dtype, device="meta"))
        except Exception as err:  # noqa: BLE001 - whatever the loss refuses, a rank would refuse too
            problem = " ".join(str(err).split())[:300]
    if problem is None:
        return
    where = f"the model's output {shape} (a micro-batch of {mbs}) against the data's targets {target}"
    if len(shape) == 3 and len(target) == 2 and shape[1] == 1 < target[1]:
        problem = (f"the output holds 1 position where the targets have {target[1]} (a forward that, given no "
                   "targets, returns the last position's logits only, as nanoGPT's does)")
    raise ConfigError("model.loss", f"{name} cannot score {where}: {problem}. If the model computes its own loss "
                                    "from the targets, let it: model.loss=model (its forward gets the targets by "
                                    "keyword, model.targets_arg; model.output picks the loss, by default its `loss` "
                                    "field or a tuple's last element); else make the forward return every position "
                                    "(model.output picks which part of its output is scored)")


def _warn_uncovered(spec: ModelSpec, planned: Planned) -> None:
    uncovered = uncovered_tensors(planned.model, spec.init, spec.init_weights) if planned.model is not None else []
    if uncovered and spec.load is not None:  # read by name: a checkpoint's, or the constructor's buffers
        held = spec.load.keys()
        uncovered = [n for n in uncovered if n not in held]
    if uncovered:
        warnings.warn(f"model {spec.name}: no initialiser writes {', '.join(uncovered[:8])}"
                      f"{' ...' if len(uncovered) > 8 else ''}; they start from pipelaunch.pipeline.graph.init.fallback_fill "
                      "(give their module a reset_parameters() to choose)", stacklevel=3)


def check_optimizer(cfg: TrainConfig, plugins: Plugins) -> None:
    """Build the optimizer over a dummy parameter: a bad learning rate or argument fails here,
    naming the key, and not in every rank after spawning."""
    opt = cfg.optimizer
    for key, value in opt.items():
        if key in ("lr", "momentum", "weight_decay", "eps", "dampening"):
            _number(value, f"optimizer.{key}", 0.0)
    if opt.get("lr") == 0:
        raise ConfigError("optimizer.lr", "got 0: nothing would train; valid: a positive number")
    try:
        plugins.optimizer([torch.nn.Parameter(torch.zeros(1))])
    except (ValueError, TypeError) as exc:
        raise ConfigError("optimizer", f"{opt.get(TARGET)} refused its arguments: {exc}") from None


def resume_checkpoint(cfg: TrainConfig, model: torch.nn.Module | None, root: Path | None) -> str | None:
    """The checkpoint to resume from, checked against this (meta-device) model, every parameter
    by name and shape, and this run (batch size, steps left), before any rank exists."""
    from pipelaunch.pipeline.planner.measure.experts import whole_shapes
    from pipelaunch.pipeline.runtime import checkpoint

    if cfg.resume == "auto" and root is None:
        raise ConfigError("resume", "resume=auto needs checkpoint.dir (the launcher sets <run dir>/checkpoints)")
    path = checkpoint.resolve_resume(cfg.resume, root if root is not None else Path("."))
    if path is None:
        return None
    meta = checkpoint.read_meta(path)
    stored = checkpoint.stored_tensors(path)
    mismatched = []
    for name, shape in whole_shapes(model).items():  # the planner's model may hold one ep rank's experts
        got = stored.get(f"model/{name}")
        if got is None or got[0] != shape:
            mismatched.append(f"{name} {shape} (checkpoint: {got[0] if got else 'missing'})")
    if mismatched:
        raise ConfigError("resume", f"{path} was written for another model: {', '.join(mismatched[:4])}"
                                    f"{' ...' if len(mismatched) > 4 else ''}; resume with the model that wrote it")
    if meta.get("batch_size") != cfg.batch_size:
        raise ConfigError("batch_size", f"{cfg.batch_size} differs from the {meta.get('batch_size')} of checkpoint "
                                        f"{path}; resume with batch_size={meta.get('batch_size')} so the data "
                                        "position (global sample index) carries over")
    if meta["step"] >= cfg.steps:
        raise ConfigError("steps", f"checkpoint {path} is at step {meta['step']}; steps={cfg.steps} leaves nothing "
                                   f"to run (set steps > {meta['step']})")
    return str(path)
