"""What `python train.py` does once Hydra has composed the config."""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from pipelaunch.launcher.config import typed_config
from pipelaunch.launcher.diagnose import where_ranks_were
from pipelaunch.launcher.gc_pause import few_full_collections
from pipelaunch.launcher.initial_weights import Initial
from pipelaunch.launcher.joined import export_submitit_env, joined_rank_env
from pipelaunch.launcher.preempt import forward_stop_signals, stopped_line
from pipelaunch.launcher.validate import Prepared, group_options, on_cuda, prepare
from pipelaunch.launcher.winner_command import winner_commands
from pipelaunch.pipeline.compute.host_allocator import rank_environment
from pipelaunch.pipeline.compute.memory import peak_memory_bytes
from pipelaunch.pipeline.core.config import OBJECTIVE_DIRECTION, CheckSplit, TrainConfig
from pipelaunch.pipeline.core.errors import ConfigError, RankFailed, RunStopped
from pipelaunch.pipeline.core.hardware import configured_hardware
from pipelaunch.pipeline.core.plan import Plan
from pipelaunch.pipeline.core.results import RankResult, TrainingHistory
from pipelaunch.pipeline.report.artifacts import report_run
from pipelaunch.pipeline.report.metrics import RunMetrics
from pipelaunch.pipeline.report.tables import device_memory_table, format_prediction, stage_table
from pipelaunch.pipeline.report.timeline import draw_timeline
from pipelaunch.pipeline.runtime.flight_recorder import dump_prefix, nccl_environment
from pipelaunch.pipeline.runtime.heartbeat import HEARTBEAT_DIR
from pipelaunch.pipeline.runtime.progress import launcher_terminal


def run(cfg: TrainConfig, run_dir: Path) -> dict:
    """Validate, plan, then spawn ranks (or join as one); returns rank 0's metrics."""
    export_submitit_env()
    if joined_rank_env() and cfg.mode == "train":
        return join(cfg, run_dir)
    with few_full_collections():  # a pp=64 plan's millions of small objects (launcher/gc_pause.py)
        prepared = prepare(cfg, run_dir=run_dir)
        if prepared.resume_from:
            print(f"resuming from {prepared.resume_from}", flush=True)
        run_dir.mkdir(parents=True, exist_ok=True)
        if prepared.search is not None:
            print_search(cfg, prepared)
        if cfg.mode == "plan":
            return dry_run(prepared, run_dir)
    from pipelaunch.launcher.initial_weights import launcher_initial_weights

    plan = prepared.plan
    plan.write(run_dir / "plan.json")
    print(stage_table(plan), flush=True)
    with launcher_initial_weights(cfg, prepared.spec, prepared.model) as initial:
        print(initial.line, flush=True)
        return spawn(cfg, prepared, initial, run_dir)


def spawn(cfg: TrainConfig, prepared: Prepared, initial: Initial, run_dir: Path) -> dict:
    """Check the split, start the ranks, wait for them, report; `initial`: where the weights come from."""
    # the runtime is imported only when there is something to run
    from pipelaunch.launcher.spawn import spawn_ranks
    from pipelaunch.launcher.split_check import check_split
    from pipelaunch.pipeline.runtime.rank import RankJob

    plan = prepared.plan
    job = RankJob(prepared.run, plan, str(run_dir), resume_from=prepared.resume_from,
                  initial_weights=str(initial.path) if initial.path is not None else None)
    print(check_split(cfg, prepared.spec, plan, prepared.model, initial), flush=True)
    more = (f" cp={plan.cp} ({plan.cp_method})" if plan.cp > 1 else "") + (f" tp={plan.tp}" if plan.tp > 1 else "")
    print(f"schedule {plan.schedule.name}: pp={plan.pp} dp={plan.dp}{more} microbatches={plan.microbatches}", flush=True)
    beats = run_dir / "heartbeat"
    env = {**rank_environment(cfg.huge_pages), **launcher_terminal(), HEARTBEAT_DIR: str(beats)}
    flight = None
    if on_cuda(cfg):  # NCCL: a stuck operation ends with the watchdog's abort and a flight recorder dump
        env.update({k: v for k, v in nccl_environment(run_dir / "logs").items() if k not in os.environ})
        flight = dump_prefix(run_dir / "logs")
    started = time.time()
    with forward_stop_signals(run_dir):  # SIGUSR1: every rank stops after a step, checkpointed
        try:
            results = spawn_ranks(job, plan.world_size, run_dir / "logs", env=env)
        except RankFailed as err:
            where = where_ranks_were(beats, plan, flight, since=started)
            raise RankFailed(f"{err}\n{where}" if where else str(err)) from None
        except RunStopped as stop:
            return stopped_run(stop.signal_name, prepared, run_dir)
        if results.get(0) is None:  # the ranks exited for a SIGTERM of their own, the launcher got none
            return stopped_run("SIGTERM", prepared, run_dir)
        return report(results[0], plan, cfg, run_dir)


def report(rank0: RankResult, plan: Plan, cfg: TrainConfig, run_dir: Path) -> dict:
    """Write metrics.json and the run's pictures; print the memory table and the run's last line."""
    metrics = finish_report(rank0, plan, cfg, run_dir)
    history = metrics.history
    if plan.meta.device_memory:
        print(device_memory_table(plan, history.ranks), flush=True)
    print(
        f"done: median step {history.step_time_s * 1e3:.1f} ms, {history.tokens_per_s:.0f} {history.throughput_unit}/s, "
        + (f"{history.scored_tokens_per_s:.0f} scored tokens/s, " if history.scored_tokens_per_s is not None else "")
        + (f"padding {history.padding_share:.0%}, " if history.padding_share is not None else "")
        + f"final loss {history.losses[-1]:.4f}; metrics in {run_dir / 'metrics.json'}",
        flush=True,
    )
    say_if_stopped(history, cfg.steps)
    return metrics.to_json()


def say_if_stopped(history: TrainingHistory, steps: int) -> None:
    """The stopped run's line (a signal ended it after a step, checkpointed: `history.stopped_by`)."""
    if history.stopped_by is not None:
        last = Path(history.checkpoints[-1]) if history.checkpoints else None
        print(stopped_line(history.stopped_by, len(history.losses), steps, last), flush=True)


def stopped_run(signal_name: str, prepared: Prepared, run_dir: Path) -> dict:
    """The ranks stopped for a signal and exited before reporting (SIGTERM): say which checkpoint
    they wrote; metrics.json records the stop (a sweeper counts the job as failed)."""
    from pipelaunch.pipeline.runtime.checkpoint import complete_checkpoints, read_meta

    root = prepared.run.checkpoint.root
    found = complete_checkpoints(Path(root)) if root else []
    latest = found[-1] if found else None
    step = read_meta(latest).get("step") if latest is not None else None
    print(stopped_line(signal_name, step, prepared.run.steps, latest), flush=True)
    result = {"status": "stopped", "stopped_by": signal_name, "checkpoint": str(latest) if latest else None}
    (run_dir / "metrics.json").write_text(json.dumps(result, indent=1))
    return result


def finish_report(rank0: RankResult, plan: Plan, cfg: TrainConfig, run_dir: Path) -> RunMetrics:
    """metrics.json and the run's pictures from rank 0's result, the plan (what it predicted
    before any rank started, what a search chose) and the config."""
    latency = plan.meta.machine.link_latency_s
    latency = cfg.link[0] if latency is None else latency
    # the launcher plans on the meta device: its own peak stays far below the model's size
    return report_run(rank0, plan, cfg.to_dict(), (latency, cfg.link_bandwidth),
                      peak_memory_bytes(torch.device("cpu")), run_dir)


def print_search(cfg: TrainConfig, prepared: Prepared) -> None:
    """What plan=auto (or scheduler=auto) compared and why the winner won; the run goes on with
    the winner's settings, which the Plan holds (its meta.search says what was chosen)."""
    result = prepared.search
    what = "plan=auto" if cfg.plan.search else "scheduler=auto"
    source = prepared.plan.meta.machine.cost_source or "hardware=local: measured on this machine"
    print(f"{what} planned and simulated {len(result.outcomes)} candidates in {result.seconds:.1f} s, costs from "
          f"{source}:\n{result.table()}\nwhy: {result.why()}", flush=True)
    win = result.winner.candidate
    if cfg.plan.search and win.pp is not None:  # plan.devices: the layout to type back
        hw = configured_hardware(cfg.hardware)
        lines = winner_commands(task_overrides(), win, cfg.plan.devices, hw)
        print("run the winner:\n  " + "\n  ".join(lines), flush=True)


def join(cfg: TrainConfig, run_dir: Path) -> dict:
    """This process is one rank started by torchrun or SLURM. Every rank validates the config
    (cheap, deterministic, no profile); the Plan itself is built by rank 0 inside the process group
    (profiled on its own device) and broadcast, since a profiled plan (auto, balanced, milp,
    cost-aware orders) depends on timings and every rank must run the very same one. Rank 0 then
    writes the report, as the launcher does for the ranks it spawns."""
    world = int(os.environ.get("WORLD_SIZE") or 1)
    if cfg.plan.devices is not None and world != cfg.plan.devices:  # refused on every rank, before joining
        raise ConfigError("plan.devices", f"plan.devices={cfg.plan.devices} lays the run out on that many ranks, "
                                          f"but WORLD_SIZE={world} were started; set plan.devices={world} or start "
                                          f"{cfg.plan.devices} ranks")
    options = group_options(cfg)  # read once here: the same options on every rank
    validated = prepare(cfg, profile=False, options=options, run_dir=run_dir)
    os.environ.setdefault(HEARTBEAT_DIR, str(run_dir / "heartbeat"))  # where each rank is, on a shared disk
    run_dir.mkdir(parents=True, exist_ok=True)
    from pipelaunch.launcher.initial_weights import node_initial_weights
    from pipelaunch.pipeline.runtime.context import env_int
    from pipelaunch.pipeline.runtime.rank import (
        RankJob,
        bind_local_cores,
        broadcast_plan,
        join_process_group,
        leave_process_group,
        run_job,
    )

    # cores are bound once the Plan is there: rank 0 profiles and probes on all of the machine's
    rank, device = join_process_group(validated.run.process, cfg.world_size, str(run_dir), ranks_needed(cfg),
                                      bind_cores=False)
    plan = None
    if rank == 0:
        with few_full_collections():
            prepared = prepare(cfg, device=device, options=options, run_dir=run_dir)
        plan = prepared.plan
        if prepared.search is not None:
            print_search(cfg, prepared)
        plan.write(run_dir / "plan.json")
        print(stage_table(plan), flush=True)
    plan = broadcast_plan(plan)
    bind_local_cores(validated.run.process)
    if rank == 0 and cfg.check_split != CheckSplit.never:  # a check here would hold every other rank
        print("check_split: skipped: ranks started by torchrun or SLURM plan on rank 0 inside the process group; "
              "the same command through the launcher (python train.py ... steps=1) checks the split", flush=True)
    with node_initial_weights(cfg, validated.spec, validated.model, env_int("LOCAL_RANK", 0)) as initial:
        if rank == 0:
            print(initial.line, flush=True)
        job = RankJob(validated.run, plan, str(run_dir), resume_from=validated.resume_from,
                      initial_weights=str(initial.path) if initial.path is not None else None)
        with forward_stop_signals(run_dir) as stop:  # submitit's SIGUSR1 handler requeues after the report
            result = run_job(job, rank, device)
            stop.ranks_stopped_by = result.stopped_by
            metrics = {}
            if rank == 0:
                reported = finish_report(result, plan, cfg, run_dir)
                say_if_stopped(reported.history, cfg.steps)
                metrics = reported.to_json()
    leave_process_group()
    if result.stopped_by == signal.SIGTERM.name:
        # checkpointed, but terminated: a rank ending 0 would leave the torchrun agent of a node that
        # was not signalled waiting in elastic's exit barrier (300 s) for the agent that was
        sys.stdout.flush()
        sys.exit(128 + signal.SIGTERM)
    return metrics


def task_overrides() -> list[str]:
    """The command line's overrides (Hydra's), none outside a Hydra app."""
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def ranks_needed(cfg: TrainConfig) -> str:
    """Why the run needs `cfg.world_size` ranks, for the error when another number joined."""
    if cfg.plan.devices is not None:
        return "plan.devices"
    if cfg.tp > 1 or cfg.cp > 1:
        return f"pp x dp x cp x tp = {cfg.pp} x {cfg.dp} x {cfg.cp} x {cfg.tp}"
    return f"pp x dp = {cfg.pp} x {cfg.dp}"


def dry_run(prepared: Prepared, run_dir: Path) -> dict:
    """mode=plan: the stage table, the schedule grid and the simulated step, without any rank."""
    plan, pred = prepared.plan, prepared.prediction
    plan.write(run_dir / "plan.json")
    print(stage_table(plan))
    print(f"\nschedule {plan.schedule.name} (compute actions per pipeline rank):\n{plan.schedule.grid()}\n")
    print(format_prediction(pred.result), flush=True)
    lengths = plan.meta.prediction.variable_lengths if plan.meta.prediction is not None else None
    if lengths:
        print(f"micro-batches at their own lengths (data.buckets, mean {lengths['mean_length']:.1f} tokens over the "
              f"first {lengths['steps_priced']} steps): predicted step {lengths['step_time_s'] * 1e3:.1f} ms, "
              f"{lengths['longest_step_time_s'] * 1e3:.1f} ms with every micro-batch at model.seq_len", flush=True)
    source = plan.meta.machine.cost_source
    if source:
        print(f"costs from {source}", flush=True)
    if plan.cp > 1:
        print(f"cp={plan.cp} ({plan.cp_method}): priced on one rank's 1/{plan.cp} of the positions, its attention "
              f"over all of them and its exchanges in line; the gradients' sum over dp x cp "
              "(docs/long_sequences.md)", flush=True)
    # the compute, and the replicas' collectives on each rank's own dp lane (none without dp)
    draw_timeline(run_dir / "timeline.png", pred.timeline_events(),
                  title=f"simulated {plan.schedule.name} pp={plan.pp}")
    # as the ranks count tokens_per_s: tokens for language models, samples otherwise
    tokens_per_step = plan.dp * plan.microbatches * plan.micro_batch_size * prepared.spec.tokens_per_sample
    summary = {"mode": "plan", "schedule": plan.schedule.name, **pred.result.summary(),
               "planned_step_time_s": pred.step_s,
               "planned_tokens_per_s": tokens_per_step / pred.step_s if pred.step_s > 0 else 0.0,
               "bubble_per_rank": pred.result.bubble, "peak_activation_bytes_per_rank": pred.result.peak_activation_bytes,
               "device_memory": [d.to_dict() for d in pred.devices], "cost_source": source}
    if lengths:
        summary["variable_lengths"] = lengths
    if plan.meta.search:
        summary["plan_search"] = asdict(plan.meta.search)
    (run_dir / "prediction.json").write_text(json.dumps(summary, indent=1))
    print(f"wrote {run_dir / 'plan.json'}, {run_dir / 'prediction.json'} and {run_dir / 'timeline.png'}")
    return summary


def objective_value(objective: str, result: dict) -> float | None:
    """The run's `objective`, read from its metrics (or, for a dry run, its prediction.json), in
    their unit. tokens_per_s is maximised; step_time_s, loss (the final training loss) and
    eval_loss (the last held-out loss) are minimised (OBJECTIVE_DIRECTION). A dry run has only the planned
    step (planned_step_time_s, planned_tokens_per_s); validation refuses loss objectives there.
    None for a rank of a torchrun/SLURM job other than rank 0, which holds no metrics (the launcher
    reads rank 0's return); NaN when the value is missing."""
    if not result:
        return None
    if result.get("mode") == "plan":
        value = result.get(f"planned_{objective}")
    elif objective == "loss":
        value = (result.get("losses") or [None])[-1]
    elif objective == "eval_loss":
        value = (result.get("eval_loss") or [{}])[-1].get("eval_loss")
    else:
        value = result.get(objective)
    return float("nan") if value is None else float(value)


def failed_value(sweeper: str) -> float | None:
    """What a job of a multirun returns when it has no objective: it failed (a config error, a
    rank failed) or its objective is NaN (a diverged loss). `sweeper` is hydra.sweeper._target_.

    Optuna's sweeper gets None: it marks the trial FAIL ("Return value must be float-castable.
    Got 'None'") and goes on with the next one. Not NaN: hydra-optuna-sweeper 1.3.0 (the latest
    release) tells Optuna the NaN once more while marking the trial failed, which raises and ends
    the whole sweep (facebookresearch/hydra issue 2237). Every other sweeper gets NaN, a float
    that is no value (Nevergrad records it with a warning; the basic sweeper ignores returns and
    its report lists the job as failed from its metrics.json)."""
    return None if "optuna" in sweeper.lower() else float("nan")


def run_safely(cfg: DictConfig, run_dir: Path, multirun: bool, sweeper: str = "") -> float | None:
    """Run, and return the run's objective (`objective_value`) for a sweeper. Report bad config
    and failed ranks as one clear message; in a multirun, record the failure in the job's own
    metrics.json and return `failed_value` instead of raising, so the sweep goes on to its next
    job and its summary still happens."""
    try:
        typed = typed_config(cfg)
        value = objective_value(str(typed.objective), run(typed, run_dir))
    except (ConfigError, RankFailed) as err:
        kind = "config error" if isinstance(err, ConfigError) else "a rank failed"
        print(f"error ({kind}): {err}", file=sys.stderr, flush=True)
        if multirun:
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "metrics.json").write_text(json.dumps({"status": "failed", "error": str(err)}, indent=1))
            return failed_value(sweeper)
        sys.exit(2 if isinstance(err, ConfigError) else 1)
    return failed_value(sweeper) if multirun and value is not None and math.isnan(value) else value


class SweeperDirection(Callback):
    """Optuna minimises unless told otherwise, and objective=tokens_per_s is maximised: a sweep
    that does not say would search for the slowest configuration. So before the sweeper starts,
    a sweeper with a single `direction` (Optuna's) takes the objective's direction
    (OBJECTIVE_DIRECTION) unless the command line names hydra.sweeper.direction; a direction given there
    is kept, with a warning when it contradicts the objective. Other sweepers name their
    direction otherwise (Nevergrad: hydra.sweeper.optim.maximize) and are left as they are."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        sweeper = config.hydra.sweeper
        objective = str(config.get("objective"))
        wanted = OBJECTIVE_DIRECTION.get(objective)
        if "direction" not in sweeper or wanted is None:  # a bad objective: validation names it in each job
            return
        current = sweeper.direction
        if OmegaConf.is_list(current) or isinstance(current, (list, tuple)):  # multi-objective: the user's own
            return
        current = str(getattr(current, "name", current))
        given = any(str(o).split("=", 1)[0].lstrip("+~") == "hydra.sweeper.direction"
                    for o in config.hydra.overrides.hydra)
        if current == wanted:
            return
        if given:
            print(f"warning: objective={objective} should be {wanted}d, but the command line sets "
                  f"hydra.sweeper.direction={current}", file=sys.stderr, flush=True)
            return
        with read_write(config.hydra), open_dict(config.hydra):
            sweeper.direction = wanted
            # the jobs' configs are composed from these overrides: their hydra.yaml says the same
            config.hydra.overrides.hydra.append(f"hydra.sweeper.direction={wanted}")
        print(f"objective={objective}: hydra.sweeper.direction={wanted}", flush=True)
