"""What `python train.py` does once Hydra has composed the config."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from launcher.config import group_configs
from launcher.diagnose import where_ranks_were
from launcher.joined import export_submitit_env, joined_rank_env
from launcher.validate import Prepared, prepare
from pipeline.errors import ConfigError, RankFailed
from pipeline.report.tables import format_choice, format_prediction, stage_table
from pipeline.report.timeline import draw_timeline
from pipeline.runtime.heartbeat import HEARTBEAT_DIR
from pipeline.runtime.host_allocator import rank_environment
from pipeline.runtime.memory import peak_memory_bytes
from pipeline.runtime.progress import launcher_terminal


def resolve(cfg: DictConfig) -> dict:
    """A plain dict with every interpolation resolved: spawned ranks cannot resolve ${hydra:...}."""
    return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)


def run(cfg: DictConfig, run_dir: Path) -> dict:
    """Validate, plan, then spawn ranks (or join as one); returns rank 0's metrics."""
    resolved = resolve(cfg)
    if str(resolved["scheduler"].get("_target_", "")).endswith("AutoSchedule"):
        resolved["scheduler"]["candidates"] = {
            name: option for name, option in group_configs("scheduler").items()
            if not str(option.get("_target_", "")).endswith("AutoSchedule")}
        resolved["scheduler"]["_recursive_"] = False  # the candidates are built one by one, by the planner
    ckpt = resolved.setdefault("checkpoint", {})
    ckpt["dir"] = str(Path(ckpt.get("dir") or run_dir / "checkpoints").absolute())
    export_submitit_env()
    if joined_rank_env() and resolved["mode"] == "train":
        return join(resolved, run_dir)
    prepared = prepare(resolved)
    plan = prepared.plan
    resolved["resume_from"] = prepared.resume_from
    if prepared.resume_from:
        print(f"resuming from {prepared.resume_from}", flush=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    if prepared.choice is not None:
        print(f"scheduler=auto chose {prepared.generator.name}: the fastest simulated schedule on this "
              f"model's measured block profile\n{format_choice(prepared.choice)}", flush=True)
        resolved["scheduler_chosen"] = prepared.generator.name
    if resolved["mode"] == "plan":
        return dry_run(prepared, run_dir)
    from launcher.spawn import spawn_ranks  # the runtime is imported only when there is something to run
    from launcher.worker import RankJob

    job = RankJob(resolved, plan, str(run_dir))
    plan.write(run_dir / "plan.json")
    print(stage_table(plan), flush=True)
    print(f"schedule {plan.schedule.name}: pp={plan.pp} dp={plan.dp} microbatches={plan.microbatches}", flush=True)
    beats = run_dir / "heartbeat"
    env = {**rank_environment(resolved["huge_pages"]), **launcher_terminal(), HEARTBEAT_DIR: str(beats)}
    try:
        results = spawn_ranks(job, plan.pp * plan.dp, run_dir / "logs", env=env)
    except RankFailed as err:
        where = where_ranks_were(beats, plan)
        raise RankFailed(f"{err}\n{where}" if where else str(err)) from None
    metrics = results[0]["metrics"]
    # the launcher plans on the meta device: its own peak stays far below the model's size
    metrics["launcher_peak_memory_bytes"] = peak_memory_bytes(torch.device("cpu"))
    (run_dir / "metrics.json").write_text(json.dumps(metrics, indent=1, default=str))
    print(
        f"done: median step {metrics['step_time_s'] * 1e3:.1f} ms, {metrics['tokens_per_s']:.0f} tokens/s, "
        f"final loss {metrics['losses'][-1]:.4f}; metrics in {run_dir / 'metrics.json'}",
        flush=True,
    )
    return metrics


def join(resolved: dict, run_dir: Path) -> dict:
    """This process is one rank started by torchrun or SLURM. Every rank validates the config
    (cheap, deterministic, no profile); the Plan itself is built by rank 0 inside the process group
    and broadcast, since a profiled plan (auto, balanced, milp, cost-aware orders) depends on
    timings and every rank must run the very same one."""
    resolved["resume_from"] = prepare(resolved, profile=False).resume_from
    os.environ.setdefault(HEARTBEAT_DIR, str(run_dir / "heartbeat"))  # where each rank is, on a shared disk
    run_dir.mkdir(parents=True, exist_ok=True)
    from launcher.worker import RankJob, rank_main

    result = rank_main(RankJob(resolved, None, str(run_dir)))
    return result.get("metrics", {})


def dry_run(prepared: Prepared, run_dir: Path) -> dict:
    """mode=plan: the stage table, the schedule grid and the simulated step, without any rank."""
    plan, pred = prepared.plan, prepared.prediction
    plan.write(run_dir / "plan.json")
    print(stage_table(plan))
    print(f"\nschedule {plan.schedule.name} (compute actions per pipeline rank):\n{plan.schedule.grid()}\n")
    print(format_prediction(pred.result), flush=True)
    draw_timeline(run_dir / "timeline.png", pred.result.events, title=f"simulated {plan.schedule.name} pp={plan.pp}")
    summary = {"mode": "plan", "schedule": plan.schedule.name, **pred.result.summary(),
               "bubble_per_rank": pred.result.bubble, "peak_activation_bytes_per_rank": pred.result.peak_activation_bytes}
    (run_dir / "prediction.json").write_text(json.dumps(summary, indent=1))
    print(f"wrote {run_dir / 'plan.json'}, {run_dir / 'prediction.json'} and {run_dir / 'timeline.png'}")
    return summary


def run_safely(cfg: DictConfig, run_dir: Path, multirun: bool) -> dict | None:
    """Report bad config and failed ranks as one clear message; in a multirun, record the failure
    in the job's own metrics.json and carry on so the sweep's summary still happens."""
    try:
        return run(cfg, run_dir)
    except (ConfigError, RankFailed) as err:
        kind = "config error" if isinstance(err, ConfigError) else "a rank failed"
        print(f"error ({kind}): {err}", file=sys.stderr, flush=True)
        if multirun:
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "metrics.json").write_text(json.dumps({"status": "failed", "error": str(err)}, indent=1))
            return None
        sys.exit(2 if isinstance(err, ConfigError) else 1)
