"""A signal mid-run ends every rank after the same step with a complete checkpoint, and nothing is
lost: SIGTERM as SLURM sends a preempted job (torch elastic passes it on to the ranks), SIGUSR1 as
submitit sends before the time limit (the launcher asks the ranks through the run directory).
`python train.py` as typed, real gloo ranks."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from pipelaunch.pipeline.runtime.checkpoint import complete_checkpoints
from tests.harness import ROOT, assert_no_process_left, job_processes
from tests.test_cli import metrics, train
from tests.test_long_runs import SMALL

#: long enough that the signal always comes mid-run (a step takes ~0.1 s)
LONG = 400
ARGS = [*SMALL, "pp=2", "log_every=1"]


def _stop_mid_run(sig: signal.Signals, tmp_path, at_step: int = 4, args: list[str] = ARGS) -> tuple[str, int, float]:
    """Start a long run, send `sig` to the launcher once rank 0 printed step `at_step`; its output,
    exit code and the seconds from the signal to the launcher's exit."""
    cmd = [sys.executable, "train.py", *args, f"steps={LONG}", f"checkpoint.dir={tmp_path / 'ck'}",
           f"hydra.run.dir={tmp_path / 'stopped'}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=os.environ.copy())
    seen = []
    try:
        for line in proc.stdout:
            seen.append(line)
            found = re.search(rf"step +(\d+)/{LONG}", line)
            if found and int(found.group(1)) >= at_step:
                proc.send_signal(sig)
                break
        sent = time.monotonic()
        rest, _ = proc.communicate(timeout=120)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
    return "".join(seen) + rest, proc.returncode, took


@pytest.mark.timeout(400)
@pytest.mark.parametrize("layout", [[], pytest.param(["tp=2"], marks=pytest.mark.slow, id="tp")])
def test_sigterm_mid_run_checkpoints_every_rank_and_the_resumed_run_loses_nothing(tmp_path, layout) -> None:
    """pp=2, and pp=2 tp=2 (slow): each tp rank's slices in the checkpoint, resumed bitwise."""
    args = [*ARGS, *layout]
    before = job_processes()
    out, code, took = _stop_mid_run(signal.SIGTERM, tmp_path, args=args)
    assert code == 0, out[-3000:]
    # within SLURM's KillWait (30 s by default) on a shared 2-core machine; ~3 s alone: no rank
    # waits for torch elastic to collect a result it no longer collects
    assert took < 25, took
    assert "Traceback" not in out and "SignalException" not in out, out[-3000:]
    stopped = re.search(rf"stopped by SIGTERM after step (\d+) of {LONG}: every rank checkpointed to (\S+);", out)
    assert stopped, out[-3000:]
    step = int(stopped.group(1))
    assert 4 <= step < LONG
    # the only checkpoint (checkpoint.every=0) is the one the signal asked for: complete, every rank's part
    assert [p.name for p in complete_checkpoints(tmp_path / "ck")] == [f"step_{step:07d}"]
    assert not list((tmp_path / "ck").glob("*.partial"))
    assert metrics(tmp_path / "stopped") == {"status": "stopped", "stopped_by": "SIGTERM",
                                             "checkpoint": str(tmp_path / "ck" / f"step_{step:07d}")}
    assert_no_process_left(before)
    total = step + 3
    resumed = train([*args, f"steps={total}", "resume=auto", f"checkpoint.dir={tmp_path / 'ck'}"], tmp_path / "resumed")
    straight = train([*args, f"steps={total}"], tmp_path / "straight")
    assert resumed.returncode == 0 and straight.returncode == 0, resumed.stderr[-3000:] + straight.stderr[-3000:]
    assert metrics(tmp_path / "resumed")["start_step"] == step
    assert metrics(tmp_path / "resumed")["losses"] == metrics(tmp_path / "straight")["losses"]  # bitwise


@pytest.mark.timeout(300)
def test_sigusr1_stops_every_rank_after_one_step_and_the_run_reports(tmp_path) -> None:
    """The launcher itself is signalled (submitit's warning); the ranks stop through the stop file,
    return, and the run reports what it did: metrics.json with the steps run and `stopped_by`."""
    before = job_processes()
    out, code, _ = _stop_mid_run(signal.SIGUSR1, tmp_path)
    assert code == 0, out[-3000:]
    found = metrics(tmp_path / "stopped")
    step = len(found["losses"])
    assert found["stopped_by"] == "SIGUSR1" and 4 <= step < LONG
    assert f"stopped by SIGUSR1 after step {step} of {LONG}" in out
    assert [p.name for p in complete_checkpoints(tmp_path / "ck")] == [f"step_{step:07d}"]
    assert not (tmp_path / "stopped" / "stop").exists()
    assert_no_process_left(before)
