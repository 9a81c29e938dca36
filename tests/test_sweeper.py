"""Hydra's sweeper plugins optimise what the task function returns: the run's `objective`."""

from __future__ import annotations

import json
import math

import pytest
import yaml
from omegaconf import OmegaConf

import pipelaunch.launcher.app as app
from pipelaunch.launcher.app import SweeperDirection, failed_value, objective_value, run_safely
from pipelaunch.launcher.validate import prepare
from pipelaunch.pipeline.core.errors import ConfigError
from tests.harness import FAST, compose_cfg
from tests.test_cli import train

OPTUNA = "hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper"
BASIC = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"
TWO_STEPS = [*(o for o in FAST if not o.startswith("steps=")), "steps=2"]

# what metrics.json holds, in the keys the objectives read
METRICS = {"tokens_per_s": 2500.0, "step_time_s": 0.05, "losses": [4.28, 4.25],
           "eval_loss": [{"step": 0, "eval_loss": 4.4}, {"step": 1, "eval_loss": 4.3}]}


@pytest.mark.timeout(180)
def test_optuna_sweep_runs_its_trials_and_names_the_best(tmp_path) -> None:
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    sweep = tmp_path / "sweep"
    # pp=1: one rank per trial (two ranks add ~6 s a trial on 2 cores and nothing the sweeper sees);
    # seed 0: the two trials draw different micro-batch counts
    proc = train(["-m", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=2", "hydra.sweeper.sampler.seed=0",
                  "microbatches=choice(2,4)", *TWO_STEPS, "pp=1", f"hydra.sweep.dir={sweep}"], None)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Return value must be float-castable" not in proc.stdout + proc.stderr
    jobs = {}
    for path in sorted(sweep.glob("*/metrics.json")):
        m = json.loads(path.read_text())
        assert m.get("status") != "failed", m
        jobs[path.parent.name] = m
    assert len(jobs) == 2, list(sweep.rglob("*"))
    assert {m["config"]["microbatches"] for m in jobs.values()} == {2, 4}
    results = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert results["name"] == "optuna"
    assert set(results["best_params"]) == {"microbatches"} and results["best_params"]["microbatches"] in (2, 4)
    best = results["best_value"]
    assert isinstance(best, float) and best > 0
    # tokens_per_s is maximised (the sweeper's direction follows the objective), in metrics.json's unit
    fastest = max(jobs.values(), key=lambda m: m["tokens_per_s"])
    assert best == pytest.approx(fastest["tokens_per_s"])
    assert results["best_params"]["microbatches"] == fastest["config"]["microbatches"]
    assert "hydra.sweeper.direction=maximize" in proc.stdout
    assert (sweep / "summary.md").is_file()  # the sweep report is written under Optuna too


@pytest.mark.parametrize(("objective", "expected"), [
    ("tokens_per_s", 2500.0), ("step_time_s", 0.05), ("loss", 4.25), ("eval_loss", 4.3)])
def test_the_task_returns_the_objective_in_the_data_unit(objective, expected, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(app, "run", lambda cfg, run_dir: METRICS)
    cfg = OmegaConf.structured(compose_cfg([f"objective={objective}", "eval.every=1"]))
    for multirun, sweeper in ((False, ""), (True, OPTUNA), (True, BASIC)):
        value = run_safely(cfg, tmp_path, multirun=multirun, sweeper=sweeper)
        assert isinstance(value, float) and value == pytest.approx(expected)


def test_a_dry_run_returns_the_planned_step() -> None:
    planned = {"mode": "plan", "planned_step_time_s": 0.02, "planned_tokens_per_s": 6400.0}
    assert objective_value("step_time_s", planned) == 0.02
    assert objective_value("tokens_per_s", planned) == 6400.0
    assert objective_value("tokens_per_s", {}) is None  # a joined rank other than 0: no metrics
    assert math.isnan(objective_value("eval_loss", {**METRICS, "eval_loss": []}))


def test_a_failed_job_returns_what_its_sweeper_counts_as_a_failure(tmp_path, monkeypatch) -> None:
    cfg = OmegaConf.structured(compose_cfg([*TWO_STEPS, "batch_size=15"]))  # a config error, before any rank
    assert run_safely(cfg, tmp_path / "optuna", multirun=True, sweeper=OPTUNA) is None
    assert json.loads((tmp_path / "optuna" / "metrics.json").read_text())["status"] == "failed"
    assert math.isnan(run_safely(cfg, tmp_path / "basic", multirun=True, sweeper=BASIC))
    with pytest.raises(SystemExit) as stopped:  # a single run stops with the message, as before
        run_safely(cfg, tmp_path / "single", multirun=False)
    assert stopped.value.code == 2
    # a diverged loss is no value either
    monkeypatch.setattr(app, "run", lambda cfg, run_dir: {**METRICS, "losses": [float("nan")]})
    assert run_safely(OmegaConf.structured(compose_cfg(["objective=loss"])), tmp_path, multirun=True, sweeper=OPTUNA) is None
    assert failed_value(OPTUNA) is None and math.isnan(failed_value(BASIC))


@pytest.mark.parametrize(("overrides", "fragment"), [
    (["objective=accuracy"], "valid: tokens_per_s, step_time_s, loss, eval_loss"),
    (["objective=eval_loss"], "eval.every=0 never evaluates; set eval.every=<steps>"),
    (["objective=loss", "mode=plan"], "mode=plan trains nothing"),
])
def test_an_objective_the_run_cannot_produce_is_refused(overrides, fragment) -> None:
    with pytest.raises(ConfigError) as info:
        prepare(compose_cfg([*TWO_STEPS, *overrides]))
    assert info.value.key == "objective" and fragment in str(info.value)


def _multirun_cfg(objective: str, direction="minimize", command_line: list[str] | None = None):
    cfg = OmegaConf.create({"objective": objective, "hydra": {
        "sweeper": {"_target_": OPTUNA, "direction": direction}, "overrides": {"hydra": command_line or []}}})
    OmegaConf.set_readonly(cfg.hydra, True)
    return cfg


def test_optuna_direction_follows_the_objective_unless_the_command_line_sets_it(capsys) -> None:
    cfg = _multirun_cfg("tokens_per_s")
    SweeperDirection().on_multirun_start(cfg)
    assert cfg.hydra.sweeper.direction == "maximize"
    assert list(cfg.hydra.overrides.hydra) == ["hydra.sweeper.direction=maximize"]  # the jobs record it too
    cfg = _multirun_cfg("loss")
    SweeperDirection().on_multirun_start(cfg)
    assert cfg.hydra.sweeper.direction == "minimize" and not cfg.hydra.overrides.hydra
    cfg = _multirun_cfg("tokens_per_s", command_line=["hydra.sweeper.direction=minimize"])
    SweeperDirection().on_multirun_start(cfg)
    assert cfg.hydra.sweeper.direction == "minimize"
    assert "should be maximized" in capsys.readouterr().err
    cfg = _multirun_cfg("tokens_per_s", direction=["minimize", "maximize"])  # multi-objective: left alone
    SweeperDirection().on_multirun_start(cfg)
    assert list(cfg.hydra.sweeper.direction) == ["minimize", "maximize"]


@pytest.mark.timeout(120)
def test_mode_plan_returns_the_predicted_step(tmp_path) -> None:
    cfg = OmegaConf.structured(compose_cfg([*TWO_STEPS, "mode=plan", "objective=step_time_s"]))
    value = run_safely(cfg, tmp_path, multirun=True, sweeper=OPTUNA)
    prediction = json.loads((tmp_path / "prediction.json").read_text())
    assert value == prediction["planned_step_time_s"] > 0
    # the tokens a step trains (batch_size x seq_len) over the planned step
    assert prediction["planned_tokens_per_s"] == pytest.approx(16 * 8 / value)
