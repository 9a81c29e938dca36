"""Check a resolved config and turn it into a Plan, before any rank exists.

Every error is a ConfigError naming the key and what would be valid, so a bad command line fails
in the launcher process in well under a second instead of inside eight ranks.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate

from launcher.search import TracedModels, instantiate_scheduler, micro_batch_size, search, search_space
from models.spec import ModelSpec
from pipeline.core.errors import ConfigError
from pipeline.core.plan import Plan, dtype_name, dtype_of
from pipeline.graph.init import uncovered_tensors
from pipeline.graph.trace import TracedModel
from pipeline.planner import build_plan, needs_profile, plugin
from pipeline.planner.fit import fit_budget
from pipeline.planner.memory import optimizer_states
from pipeline.planner.predict import Prediction, optimizer_seconds_per_byte, predict
from pipeline.planner.schedules import REMAT_CHOICES
from pipeline.planner.schedules.auto import AutoSchedule
from pipeline.planner.schedules.base import ScheduleGenerator
from pipeline.planner.search import Candidate, SearchResult
from pipeline.runtime.context import available_cores, bound_to_one_gpu, cpu_threads
from pipeline.runtime.cpu_affinity import CPU_AFFINITY_CHOICES
from pipeline.runtime.host_allocator import HOST_ALLOCATOR_CHOICES

DEVICES = ("auto", "cpu", "cuda")
MODES = ("train", "plan")
#: what a run returns to a Hydra sweeper (`objective`) -> the direction to optimise it in
OBJECTIVES = {"tokens_per_s": "maximize", "step_time_s": "minimize", "loss": "minimize", "eval_loss": "minimize"}


@dataclass
class Prepared:
    spec: ModelSpec
    generator: ScheduleGenerator
    plan: Plan
    prediction: Prediction | None = None
    #: plan=auto / scheduler=auto: every candidate planned and simulated on the profile
    search: SearchResult | None = None
    #: the checkpoint `resume` names (auto: the latest complete one), or None for a fresh start
    resume_from: str | None = None


def _integer(value, key: str, minimum: int = 1, maximum: int | None = None, what: str = "") -> int:
    """`value` if it is an integer in [minimum, maximum], else a ConfigError naming `key`."""
    if (not isinstance(value, int) or isinstance(value, bool) or value < minimum
            or (maximum is not None and value > maximum)):
        bound = f"from {minimum} to {maximum}" if maximum is not None else f">= {minimum}"
        raise ConfigError(key, f"must be an integer {bound}{what}, got {value!r}")
    return value


def _positive(cfg: dict, key: str, minimum: int = 1) -> int:
    return _integer(cfg.get(key), key, minimum)


def _build(cfg: dict, key: str):
    try:
        return instantiate(cfg[key])
    except InstantiationException as exc:
        cause = exc.__cause__ or exc
        if isinstance(cause, ConfigError):
            raise cause from None
        raise ConfigError(key, f"could not build {cfg[key].get('_target_')}: {cause}") from exc
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - OmegaConf or the target refusing its arguments
        raise ConfigError(key, f"could not build {cfg[key].get('_target_')}: {' '.join(str(exc).split())}") from exc


def missing_values(value, prefix: str = "") -> list[str]:
    """Keys still holding `???` (a value the chosen option requires and nobody gave)."""
    if isinstance(value, dict):
        return [m for k, v in value.items() for m in missing_values(v, f"{prefix}{k}.")]
    return [prefix.rstrip(".")] if value == "???" else []


def memory_cap(cfg: dict) -> float | None:
    """The per-device budget in bytes (memory.cap_bytes), or None for no budget."""
    cap = (cfg.get("memory") or {}).get("cap_bytes")
    if cap is None:
        return None
    if not isinstance(cap, (int, float)) or cap <= 0:
        raise ConfigError("memory.cap_bytes", f"must be a positive number of bytes or null, got {cap!r}")
    return float(cap)


def reserve_bytes(cfg: dict) -> float:
    """What a device holds beyond the model's tensors once it trains (memory.reserve_bytes)."""
    return _number((cfg.get("memory") or {}).get("reserve_bytes", 0.0), "memory.reserve_bytes", 0.0,
                   what=" (bytes a rank holds beyond the model's tensors)")


#: keys the launcher itself adds to the resolved config
LAUNCHER_KEYS = {"resume_from", "scheduler_chosen", "plan_chosen", "plan_search"}


def check_scalars(cfg: dict) -> None:
    from dataclasses import fields

    missing = missing_values(cfg)
    if missing:
        group = missing[0].split(".")[0]
        option = (cfg.get(group) or {}).get("name") or (cfg.get(group) or {}).get("_target_", "")
        raise ConfigError(missing[0], f"is required by {group}={option} and was not given; set "
                                      f"{missing[0]}=<value> on the command line")

    from launcher.config import TrainConfig

    known = {f.name for f in fields(TrainConfig)} | LAUNCHER_KEYS
    unknown = sorted(set(cfg) - known)
    if unknown:
        raise ConfigError(unknown[0], f"is not a setting of train.py (a typo?); top-level keys are "
                                      f"{', '.join(sorted(known - LAUNCHER_KEYS))}")
    for key, low in (("threads", 0), ("timeout_s", 1), ("log_every", 1), ("seed", 0)):
        _positive(cfg, key, low)
    for key in ("link_latency_s", "link_bandwidth"):
        _number(cfg.get(key), key, 0.0, strict=True, what=" (the simulator's link model)")
    _positive(cfg, "pp")
    dp = _positive(cfg, "dp")
    m, batch = _positive(cfg, "microbatches"), _positive(cfg, "batch_size")
    _positive(cfg, "steps")
    _positive(cfg, "warmup_steps", 0)
    if batch % (dp * m):
        raise ConfigError(
            "batch_size",
            f"{batch} is not divisible by dp x microbatches = {dp} x {m} = {dp * m}; each replica's "
            f"share must split into equal micro-batches (try batch_size={dp * m * max(1, batch // (dp * m))})",
        )
    if cfg.get("device") not in DEVICES:
        raise ConfigError("device", f"got {cfg.get('device')!r}; valid: {', '.join(DEVICES)}")
    if cfg["device"] == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device", "cuda was asked for but no CUDA device is available; use device=cpu or auto")
    check_gpus(cfg)
    if cfg.get("remat") not in REMAT_CHOICES:
        raise ConfigError("remat", f"got {cfg.get('remat')!r}; valid: {', '.join(REMAT_CHOICES)}")
    if cfg.get("mode") not in MODES:
        raise ConfigError("mode", f"got {cfg.get('mode')!r}; valid: {', '.join(MODES)}")
    if cfg.get("host_allocator", "retain") not in HOST_ALLOCATOR_CHOICES:
        raise ConfigError("host_allocator", f"got {cfg.get('host_allocator')!r}; valid: "
                                            f"{', '.join(HOST_ALLOCATOR_CHOICES)} (retain keeps freed host memory "
                                            "for reuse, system leaves malloc as it is)")
    if cfg.get("cpu_affinity", "auto") not in CPU_AFFINITY_CHOICES:
        raise ConfigError("cpu_affinity", f"got {cfg.get('cpu_affinity')!r}; valid: "
                                          f"{', '.join(CPU_AFFINITY_CHOICES)} (auto binds each local rank to "
                                          "its own cores when there are enough, none leaves it to the OS)")
    if not isinstance(cfg.get("huge_pages", True), bool):
        raise ConfigError("huge_pages", f"got {cfg.get('huge_pages')!r}; valid: true or false")
    check_training_keys(cfg)
    check_objective(cfg)


def check_objective(cfg: dict) -> None:
    """The value the run returns to a sweeper must be one this run will produce."""
    objective = cfg.get("objective", "tokens_per_s")
    if objective not in OBJECTIVES:
        raise ConfigError("objective", f"got {objective!r}; valid: tokens_per_s (maximised), step_time_s, loss, "
                                       "eval_loss (minimised)")
    every = (cfg.get("eval") or {}).get("every", 0)
    if objective == "eval_loss" and not every:
        raise ConfigError("objective", f"objective=eval_loss is the last held-out loss, but eval.every={every} never "
                                       "evaluates; set eval.every=<steps> (it also evaluates after the last step, so "
                                       f"eval.every={cfg['steps']} evaluates once at the end) or use objective=loss")
    if cfg.get("mode") == "plan" and objective in ("loss", "eval_loss"):
        raise ConfigError("objective", f"objective={objective} is a training loss, but mode=plan trains nothing; a "
                                       "dry run returns the planned step: use objective=step_time_s or tokens_per_s, "
                                       "or mode=train")


def on_cuda(cfg: dict) -> bool:
    """Whether the ranks of this run train on GPUs (device=cuda, or auto where CUDA is available)."""
    return cfg["device"] == "cuda" or (cfg["device"] == "auto" and torch.cuda.is_available())


def local_ranks(cfg: dict) -> int:
    """Ranks on this node: LOCAL_WORLD_SIZE for ranks torchrun or SLURM started (each validates
    the config), else the pp x dp ranks the launcher is about to spawn here."""
    from launcher.joined import joined_rank_env

    if joined_rank_env():
        return int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("WORLD_SIZE") or 1)
    return cfg["pp"] * cfg["dp"]


def check_gpus(cfg: dict) -> None:
    """One GPU per rank: a node with fewer visible GPUs than local ranks is refused here, before
    any process exists. Without this check, two ranks would share a GPU and NCCL would fail inside
    the first communicator ("duplicate GPU"). A dry run (mode=plan) starts no rank and may plan for
    a larger node than this one. Only counts devices: nothing here opens a CUDA context."""
    if cfg.get("mode") != "train" or not on_cuda(cfg):
        return
    needed, visible = local_ranks(cfg), torch.cuda.device_count()
    from launcher.joined import joined_rank_env

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
        auto = " (device=auto takes the GPUs when CUDA is available)" if cfg["device"] == "auto" else ""
        what = (f"pp x dp = {cfg['pp']} x {cfg['dp']} = {needed} ranks on this node need {needed} GPUs (one each){auto}, "
                f"but {seen}")
        ways = (f"start fewer ranks per node (lower pp or dp so that pp x dp <= {fit}), train on the CPU "
                f"(device=cpu), or spread the ranks over several nodes with torchrun (--nproc-per-node {fit} on "
                f"each) or SLURM (hydra/launcher=submitit_slurm with hydra.launcher.tasks_per_node={fit}, the GPUs "
                "per node)")
    raise ConfigError("device", f"{what}; two ranks on one GPU fail inside NCCL. Ways out: {ways}.")


def _number(value, key: str, low: float, high: float | None = None, strict: bool = False, what: str = "") -> float:
    """`value` if it is a number >= low (> low when `strict`) and <= high, else a ConfigError."""
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
          and (value > low if strict else value >= low) and (high is None or value <= high))
    if not ok:
        bound = f"{'>' if strict else '>='} {low}" + (f" and <= {high}" if high is not None else "")
        raise ConfigError(key, f"got {value!r}; valid: a number {bound}{what}")
    return float(value)


def check_training_keys(cfg: dict) -> None:
    """LR schedule, clipping, precision, evaluation, checkpoints, resume and fault injection."""
    from pipeline.core.precision import PRECISIONS

    lr = cfg.get("lr_scheduler") or {}
    if lr:
        _integer(lr.get("warmup_steps", 0), "lr_scheduler.warmup_steps", 0)
        _number(lr.get("min_lr_ratio", 0.0), "lr_scheduler.min_lr_ratio", 0.0, 1.0, what=" (a fraction of optimizer.lr)")
        _integer(lr.get("total_steps", cfg["steps"]), "lr_scheduler.total_steps", 1, what=" (default: steps)")
    if cfg.get("clip_grad_norm") is not None:
        _number(cfg["clip_grad_norm"], "clip_grad_norm", 0.0, strict=True, what=" or null (no clipping)")
    if cfg.get("precision", "fp32") not in PRECISIONS:
        raise ConfigError("precision", f"got {cfg.get('precision')!r}; valid: {', '.join(PRECISIONS)}")
    for group, keys in (("eval", {"every": 0, "batches": 1}), ("checkpoint", {"every": 0, "keep": 0})):
        for key, low in keys.items():
            _integer((cfg.get(group) or {}).get(key, low), f"{group}.{key}", low)
    debug = cfg.get("debug") or {}
    world, last = cfg["pp"] * cfg["dp"] - 1, cfg["steps"] - 1
    for key, high in (("kill_rank", world), ("kill_step", last), ("hang_rank", world), ("hang_step", last)):
        if debug.get(key) is not None:
            _integer(debug[key], f"debug.{key}", 0, high, " or null")


def prepare(cfg: dict, profile: bool | None = None, device: torch.device | None = None) -> Prepared:
    """Validate `cfg` (a resolved plain dict) and build the Plan.

    The model is built and traced on the meta device (no weights). With a profile (always for
    scheduler=auto, mode=plan, a memory budget, cost-aware schedules and partitioners that read
    costs), every node is measured on this machine one leaf module at a time (cached) and the plan
    is simulated; auto keeps the fastest candidate schedule. The profile is taken on the device the
    run trains on: `device` when this process is a rank (its own GPU), else the CPU, or for a GPU
    run a child process on cuda:0 (launcher/search.py: TracedModels). Nothing else here touches a
    GPU."""
    check_scalars(cfg)
    spec = _build(cfg, "model")
    generator = _build(cfg, "scheduler")
    check_optimizer(cfg)
    data_vocab = (cfg.get("data") or {}).get("vocab_size")
    model_vocab = spec.meta.get("vocab_size")
    data_kind = (cfg.get("data") or {}).get("kind", "tokens")
    model_kind = "tokens" if spec.input_dtype == torch.long else "images"
    if data_kind != model_kind:
        raise ConfigError("data", f"model={spec.name} takes {model_kind} but the data gives {data_kind}; use "
                                  f"data={'synthetic, text, tokens or hf' if model_kind == 'tokens' else 'images'}")
    if data_vocab is not None and model_vocab is not None and data_vocab > model_vocab:
        raise ConfigError("data.vocab_size", f"{data_vocab} exceeds model.vocab_size={model_vocab}")
    for group in ("partitioner", "placement"):
        plugin(cfg[group], group)  # an unknown _target_ is a config error now, not in a rank
    data = _build(cfg, "data")  # missing files, a wrong dtype, a short corpus: refused here, not in a rank
    if model_vocab is not None and hasattr(data, "check_vocabulary"):
        data.check_vocabulary(model_vocab)  # ids the model cannot embed

    auto = isinstance(generator, AutoSchedule)
    searching = bool((cfg.get("plan") or {}).get("search"))
    link = (cfg.get("link_latency_s", 5e-5), cfg.get("link_bandwidth", 1e9))
    cap = memory_cap(cfg)
    if profile is None:
        profile = bool(auto or searching or cfg["mode"] == "plan" or cfg.get("predict")
                       or needs_profile(cfg["partitioner"]) or getattr(generator, "cost_aware", False)
                       or cap is not None)
    mbs = micro_batch_size(cfg, cfg["microbatches"])
    models = TracedModels(spec, cfg, profile, cuda=on_cuda(cfg), device=device)
    traced = models.get(mbs)
    resume_from = resume_checkpoint(cfg, models.model)
    uncovered = uncovered_tensors(models.model, spec.init)
    if uncovered:
        warnings.warn(f"model {spec.name}: no initialiser writes {', '.join(uncovered[:8])}"
                      f"{' ...' if len(uncovered) > 8 else ''}; they start from pipeline.graph.init.fallback_fill "
                      "(give their module a reset_parameters() to choose)", stacklevel=2)
    states = optimizer_states(cfg["optimizer"])
    reserve = reserve_bytes(cfg)
    timing = {"rank_slots": rank_slots(cfg), "optimizer_s_per_byte": optimizer_seconds_per_byte(
        cfg["optimizer"], cpu_threads(cfg.get("threads", 0), cfg["pp"] * cfg["dp"])) if profile else 0.0}

    def build(gen: ScheduleGenerator, traced: TracedModel, c: Candidate | None = None) -> Plan:
        plan = build_plan(
            traced, gen, model_name=spec.name, pp=cfg["pp"], dp=cfg["dp"],
            microbatches=c.microbatches if c else cfg["microbatches"], batch_size=cfg["batch_size"],
            placement_cfg=dict(cfg["placement"]), partitioner_cfg=dict(c.partitioner_cfg if c else cfg["partitioner"]),
            memory_cap=cap, remat=c.remat if c else cfg["remat"], bandwidth=link[1], profiled=profile,
            optimizer_states=states, reserve_bytes=reserve,
        )
        plan.meta.update(timing)
        return plan

    if (auto or searching) and not profile:
        # validation only (joined ranks check the config; rank 0 then plans with a profile): any
        # candidate that builds shows the config can be planned
        cands, _ = search_space(cfg, traced.graph, auto and not searching)
        errors = []
        for c in cands:
            try:
                gen = instantiate_scheduler(c.scheduler, dict(c.scheduler_cfg))
                plan = with_precision(build(gen, models.get(micro_batch_size(cfg, c.microbatches)), c),
                                      traced, spec, mbs, cfg)
                return Prepared(spec, gen, plan, resume_from=resume_from)
            except ConfigError as err:
                errors.append(err)
        raise errors[0] if errors else ConfigError("scheduler", "scheduler=auto has no candidate schedules")
    if auto or searching:
        cands, given = search_space(cfg, traced.graph, auto and not searching)
        result = search(cfg, models, build, cands, given, link)
        win = result.winner
        prediction = win.prediction
        win_mbs = micro_batch_size(cfg, win.candidate.microbatches)
        with_precision(prediction.plan, models.get(win_mbs), spec, win_mbs, cfg)
        generator = instantiate_scheduler(win.candidate.scheduler, dict(win.candidate.scheduler_cfg))
        return Prepared(spec, generator, prediction.plan, prediction, result, resume_from)
    plan = with_precision(build(generator, traced), traced, spec, mbs, cfg)
    prediction = fit_budget(plan, predict(plan, *link), traced.graph, cap, *link) if profile else None
    return Prepared(spec, generator, plan, prediction, resume_from=resume_from)


def rank_slots(cfg: dict) -> float | None:
    """On CPU, how many ranks' worth of cores this machine has when its local ranks need more
    (pp x dp ranks of `threads` threads on fewer cores take turns); None when each has its own."""
    if on_cuda(cfg):
        return None
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or cfg["pp"] * cfg["dp"])
    threads = cpu_threads(cfg.get("threads", 0), local)
    cores = available_cores()
    return cores / threads if local * threads > cores else None


def with_precision(plan: Plan, traced, spec: ModelSpec, mbs: int, cfg: dict) -> Plan:
    """Under precision=bf16, every value crossing a stage boundary gets the dtype autocast gives it
    on the run's device type (what the sender produces, so what the receiver allocates)."""
    from pipeline.core.precision import PRECISIONS
    from pipeline.planner.autocast import autocast_dtypes

    dtype = PRECISIONS[cfg.get("precision", "fp32")]
    if dtype is None:
        return plan
    # on the run's device type (its autocast policy), without touching a GPU: fake tensors only
    dtypes = autocast_dtypes(traced, spec.meta_input(mbs), torch.device("cuda" if on_cuda(cfg) else "cpu"), dtype)
    for stage in plan.stages:
        for name, (shape, old) in list(stage.values.items()):
            stage.values[name] = [shape, dtype_name(dtypes.get(name, dtype_of(old)))]
    plan.meta["precision"] = cfg["precision"]
    return plan


def check_optimizer(cfg: dict) -> None:
    """Build the optimizer over a dummy parameter: a bad learning rate or argument fails here,
    naming the key, and not in every rank after spawning."""
    opt = cfg.get("optimizer") or {}
    for key, value in opt.items():
        if key in ("lr", "momentum", "weight_decay", "eps", "dampening"):
            _number(value, f"optimizer.{key}", 0.0)
    if opt.get("lr") == 0:
        raise ConfigError("optimizer.lr", "got 0: nothing would train; valid: a positive number")
    try:
        instantiate(opt)([torch.nn.Parameter(torch.zeros(1))])
    except InstantiationException as exc:
        cause = exc.__cause__ or exc
        raise ConfigError("optimizer", f"could not build {opt.get('_target_')}: {cause}") from None
    except (ValueError, TypeError) as exc:
        raise ConfigError("optimizer", f"{opt.get('_target_')} refused its arguments: {exc}") from None


def resume_checkpoint(cfg: dict, model: torch.nn.Module) -> str | None:
    """The checkpoint to resume from, checked against this (meta-device) model, every parameter
    by name and shape, and this run (batch size, steps left), before any rank exists."""
    from pipeline.runtime import checkpoint

    root = (cfg.get("checkpoint") or {}).get("dir")
    resume = cfg.get("resume", "none")
    if resume == "auto" and not root:
        raise ConfigError("resume", "resume=auto needs checkpoint.dir (the launcher sets <run dir>/checkpoints)")
    path = checkpoint.resolve_resume(resume, Path(root) if root else Path("."))
    if path is None:
        return None
    meta = checkpoint.read_meta(path)
    stored = checkpoint.stored_tensors(path)
    mismatched = []
    for name, p in model.named_parameters():
        got = stored.get(f"model/{name}")
        if got is None or got[0] != tuple(p.shape):
            mismatched.append(f"{name} {tuple(p.shape)} (checkpoint: {got[0] if got else 'missing'})")
    if mismatched:
        raise ConfigError("resume", f"{path} was written for another model: {', '.join(mismatched[:4])}"
                                    f"{' ...' if len(mismatched) > 4 else ''}; resume with the model that wrote it")
    if meta.get("batch_size") != cfg["batch_size"]:
        raise ConfigError("batch_size", f"{cfg['batch_size']} differs from the {meta.get('batch_size')} of checkpoint "
                                        f"{path}; resume with batch_size={meta.get('batch_size')} so the data "
                                        "position (global sample index) carries over")
    if meta["step"] >= cfg["steps"]:
        raise ConfigError("steps", f"checkpoint {path} is at step {meta['step']}; steps={cfg['steps']} leaves nothing "
                                   f"to run (set steps > {meta['step']})")
    return str(path)
