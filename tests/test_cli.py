"""`python train.py ...` end to end, as a user types it (subprocesses, real ranks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.harness import FAST, ROOT


def train(args: list[str], run_dir: Path | None, timeout: float = 240, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "train.py", *args]
    if run_dir is not None:
        cmd.append(f"hydra.run.dir={run_dir}")
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env or os.environ.copy())


def metrics(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())


@pytest.mark.slow  # the same equivalence runs through run_jobs in test_equivalence; this is the CLI twin
@pytest.mark.timeout(300)
def test_losses_agree_across_pp_and_dp(tmp_path) -> None:
    runs = {}
    for name, extra in {"pp1": ["pp=1"], "pp2": ["pp=2"], "pp4dp2": ["pp=4", "dp=2"]}.items():
        proc = train([*FAST, "microbatches=4", *extra], tmp_path / name)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = metrics(tmp_path / name)
    base = runs["pp1"]["losses"]
    assert len(base) == 3
    for name, m in runs.items():
        assert m["losses"] == pytest.approx(base, rel=1e-5), name
    m = runs["pp4dp2"]
    assert len(m["ranks"]) == 8
    assert all(r["peak_memory_bytes"] > 0 for r in m["ranks"])
    assert sorted(s for r in m["ranks"] if r["dp_rank"] == 0 for s in r["stages"]) == [0, 1, 2, 3]
    assert m["step_time_s"] > 0 and m["tokens_per_s"] > 0
    assert m["config"]["pp"] == 4 and (tmp_path / "pp4dp2" / "plan.json").exists()


@pytest.mark.timeout(300)
def test_default_command_prints_step_lines(tmp_path) -> None:
    # the default model as typed runs in tests/test_readme_commands.py (quick-start); here a small one
    proc = train([*FAST, "pp=2"], tmp_path / "run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    step_lines = [line for line in proc.stdout.splitlines() if "| loss" in line]
    assert len(step_lines) == 3, proc.stdout
    assert "check_split: the 2 stages match the unsplit module on one micro-batch" in proc.stdout  # before spawning
    assert all("tokens/s" in line and "step time" in line for line in step_lines)


@pytest.mark.timeout(120)
def test_failing_rank_stops_the_job_with_its_traceback(tmp_path) -> None:
    start = time.monotonic()
    proc = train(
        # check_split=false: the launcher's split check would refuse the model before any rank
        # (its unsplit module fails on the CPU too), and this is about a rank that fails
        [*FAST, "pp=4", "microbatches=4", "model._target_=tests.faulty.faulty_gpt", "+model.fail_block=layer5",
         "timeout_s=600", "check_split=false"],
        tmp_path / "run",
        timeout=100,
    )
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert "deliberate failure injected by tests.faulty" in proc.stderr
    # the console has the short report naming the logs; the full traceback is in them
    assert "each rank's full output: " in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    logs = tmp_path / "run" / "logs"
    written = "".join(p.read_text() for p in [logs / "launcher.log", *logs.glob("*/attempt_0/3/stderr.log")])
    assert "Traceback" in written and "deliberate failure injected by tests.faulty" in written
    assert elapsed < 60, f"job took {elapsed:.0f}s to stop"  # 30 s for the ranks + interpreter start-up
    leftover = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout.strip()
    assert leftover == "", f"processes left behind: {leftover}"


@pytest.mark.slow  # test_sweep_with_a_failing_job_still_ends_with_a_report runs a multirun and its report too
@pytest.mark.timeout(300)
def test_multirun_gives_each_job_its_own_port_and_results(tmp_path) -> None:
    sweep = tmp_path / "sweep"
    proc = train(["-m", "scheduler=gpipe,1f1b", *FAST, f"hydra.sweep.dir={sweep}"], None)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = sorted(sweep.glob("*/metrics.json"))
    assert len(found) == 2, list(sweep.rglob("*"))
    schedules = {json.loads(p.read_text())["schedule"] for p in found}
    assert schedules == {"gpipe", "1f1b"}
    rows = json.loads((sweep / "summary.json").read_text())
    assert [r["status"] for r in rows] == ["ok", "ok"]
    assert "**best**" in (sweep / "summary.md").read_text()
    assert (sweep / "summary.png").stat().st_size > 0


@pytest.mark.timeout(300)
def test_sweep_with_a_failing_job_still_ends_with_a_report(tmp_path) -> None:
    sweep = tmp_path / "sweep"
    # dualpipev needs 2 pp micro-batches: 6 are enough at pp=2, not at pp=4
    proc = train(["-m", "pp=2,4", "scheduler=dualpipev", "microbatches=6", "batch_size=12", *FAST[:4], "steps=2",
                  f"hydra.sweep.dir={sweep}"], None)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((sweep / "summary.json").read_text())
    assert [r["status"] for r in rows] == ["ok", "failed"]
    assert "microbatches" in rows[1]["error"]
    # named and tabulated by what varies (pp); what every job shares is said once
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0_pp=2", "1_pp=4"]
    table = (sweep / "summary.md").read_text()
    assert table.startswith("common to every job: scheduler=dualpipev, microbatches=6, batch_size=12")
    assert "| job | pp | tokens/s | step ms | predicted ms | predicted / measured |" in table
    assert "| 0 **best** | 2 |" in table and "| 1 | 4 | failed:" in table


@pytest.mark.timeout(300)
def test_torchrun_ranks_join_instead_of_spawning(tmp_path) -> None:
    """Rank 0 plans inside the group (here plan=auto choosing the layout of the 2 ranks, on an
    empty profile cache: it profiles and probes before the ranks bind their cores), the others
    wait for its Plan."""
    run_dir = tmp_path / "tr"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
           "train.py", *FAST, "plan=auto", "plan.devices=2", "plan.schedulers=[1f1b]", "plan.microbatches=[4]",
           f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "PIPELAUNCH_CACHE": str(tmp_path / "empty-cache")}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = metrics(run_dir)
    assert len(m["ranks"]) == 2 and len(m["losses"]) == 3
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["pp"] * plan["dp"] == 2 and "plan=auto planned and simulated" in proc.stdout
    # rank 0's overhead probe ran as a job of its own (inside torchrun's environment it waited out its timeout)
    assert list((tmp_path / "empty-cache" / "overheads").glob("*.json"))
    assert not (run_dir / "logs").exists()  # nothing was spawned: the two processes were the ranks
    assert "check_split: skipped: ranks started by torchrun or SLURM plan on rank 0" in proc.stdout


@pytest.mark.timeout(300)
def test_wandb_logger_writes_an_offline_run(tmp_path) -> None:
    env = {**os.environ, "WANDB_SILENT": "true"}
    proc = train([*FAST, "logger=wandb", "steps=2"], tmp_path / "run", env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list((tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb"))


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_submitit_local_tasks_join_as_ranks(tmp_path) -> None:
    """The SLURM path, run locally: hydra-submitit-launcher starts 2 tasks, each becomes one rank."""
    sweep = tmp_path / "sub"
    proc = train(["-m", "hydra/launcher=submitit_local", "hydra.launcher.tasks_per_node=2",
                  "hydra.launcher.timeout_min=5", *FAST, "pp=2", f"hydra.sweep.dir={sweep}"], None, timeout=380)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = list(sweep.glob("*/metrics.json"))
    assert len(found) == 1
    assert len(json.loads(found[0].read_text())["ranks"]) == 2


@pytest.mark.timeout(300)
def test_zbv_pp4_dp2_runs_exactly_as_typed(tmp_path) -> None:
    proc = train(["scheduler=zbv", "pp=4", "dp=2"], tmp_path / "run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = metrics(tmp_path / "run")
    assert len(m["ranks"]) == 8 and len(m["stages"]) == 8 and m["schedule"] == "zbv"
    assert "predicted_step_time_s" in m and all("predicted_bubble" in r and "bubble" in r for r in m["ranks"])
    assert (tmp_path / "run" / "trace.json").exists() and (tmp_path / "run" / "timeline.png").stat().st_size > 0


@pytest.mark.timeout(300)
def test_plan_mode_is_a_dry_run(tmp_path) -> None:
    proc = train(["mode=plan", "scheduler=zbv", "pp=4"], tmp_path / "run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "simulated step" in proc.stdout and "rank 3:" in proc.stdout
    assert (tmp_path / "run" / "timeline.png").exists() and not (tmp_path / "run" / "logs").exists()


@pytest.mark.timeout(300)
def test_auto_scheduler_says_what_it_chose(tmp_path) -> None:
    proc = train([*FAST, "scheduler=auto", "pp=2", "microbatches=4"], tmp_path / "run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "scheduler=auto planned and simulated" in proc.stdout and "<- runs" in proc.stdout
    m = metrics(tmp_path / "run")
    assert m["schedule"] == m["plan_search"]["chosen"]["scheduler_option"] != "auto"
