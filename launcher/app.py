"""What `python train.py` does once Hydra has composed the config."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from launcher.config import group_configs
from launcher.diagnose import where_ranks_were
from launcher.joined import export_submitit_env, joined_rank_env
from launcher.validate import Prepared, on_cuda, prepare
from pipeline.errors import ConfigError, RankFailed
from pipeline.report.tables import device_memory_table, format_prediction, stage_table
from pipeline.report.timeline import draw_timeline
from pipeline.runtime.flight_recorder import dump_prefix, nccl_environment
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
    if resolved["plan"].get("search") or str(resolved["scheduler"].get("_target_", "")).endswith("AutoSchedule"):
        # the options of the scheduler and partitioner groups on this run's search path (a user's own too)
        resolved["plan"]["scheduler_options"] = group_configs("scheduler")
        resolved["plan"]["partitioner_options"] = group_configs("partitioner")
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
    if prepared.search is not None:
        adopt_search_winner(resolved, prepared)
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
    flight = None
    if on_cuda(resolved):  # NCCL: a stuck operation ends with the watchdog's abort and a flight recorder dump
        env.update({k: v for k, v in nccl_environment(run_dir / "logs").items() if k not in os.environ})
        flight = dump_prefix(run_dir / "logs")
    started = time.time()
    try:
        results = spawn_ranks(job, plan.pp * plan.dp, run_dir / "logs", env=env)
    except RankFailed as err:
        where = where_ranks_were(beats, plan, flight, since=started)
        raise RankFailed(f"{err}\n{where}" if where else str(err)) from None
    metrics = results[0]["metrics"]
    if prepared.prediction is not None:  # what the plan predicted before any rank started
        metrics["planned_step_time_s"] = prepared.prediction.step_s
        metrics["planned_schedule_s"] = prepared.prediction.schedule_s
    # the launcher plans on the meta device: its own peak stays far below the model's size
    metrics["launcher_peak_memory_bytes"] = peak_memory_bytes(torch.device("cpu"))
    (run_dir / "metrics.json").write_text(json.dumps(metrics, indent=1, default=str))
    if plan.meta.get("device_memory"):
        print(device_memory_table(plan, metrics["ranks"]), flush=True)
    print(
        f"done: median step {metrics['step_time_s'] * 1e3:.1f} ms, {metrics['tokens_per_s']:.0f} tokens/s, "
        f"final loss {metrics['losses'][-1]:.4f}; metrics in {run_dir / 'metrics.json'}",
        flush=True,
    )
    return metrics


def adopt_search_winner(resolved: dict, prepared: Prepared) -> None:
    """Print what plan=auto (or scheduler=auto) compared and why the winner won; the run goes on
    with the winner's settings, recorded in the config the ranks and metrics.json see."""
    result = prepared.search
    win = result.winner.candidate
    what = "plan=auto" if (resolved.get("plan") or {}).get("search") else "scheduler=auto"
    print(f"{what} planned and simulated {len(result.outcomes)} candidates in {result.seconds:.1f} s on this "
          f"model's measured profile:\n{result.table()}\nwhy: {result.why()}", flush=True)
    resolved["scheduler_chosen"] = win.scheduler
    resolved["plan_chosen"] = {"label": win.label, **win.overrides()}
    resolved["plan_search"] = result.to_dict()
    resolved["microbatches"], resolved["remat"] = win.microbatches, win.remat


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
               "bubble_per_rank": pred.result.bubble, "peak_activation_bytes_per_rank": pred.result.peak_activation_bytes,
               "device_memory": [d.to_dict() for d in pred.devices]}
    if prepared.search is not None:
        summary["plan_search"] = prepared.search.to_dict()
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
