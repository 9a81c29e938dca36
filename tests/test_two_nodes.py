"""Two torchrun agents on one machine stand in for two nodes (`--nnodes 2`, c10d rendezvous on
127.0.0.1): the ranks join instead of spawning, pp=2 dp=2 gives one process's losses and one
metrics.json; stopping one agent ends the other promptly with the failure named."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import pytest

from pipelaunch.pipeline.runtime import heartbeat
from pipelaunch.pipeline.runtime.checkpoint import complete_checkpoints
from tests.harness import FAST, ROOT, assert_no_process_left, compose_cfg, job_processes
from tests.test_cli import metrics


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _agents(run_dir, port: int, extra: list[str]) -> list[subprocess.Popen]:
    return [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
         "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
         "--rdzv-id", f"two-nodes-{port}", "train.py", *FAST, "pp=2", "dp=2", *extra, f"hydra.run.dir={run_dir}"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for node in (0, 1)]


@pytest.mark.timeout(300)
def test_two_agents_train_as_one_job(tmp_path) -> None:
    from tests.reference import reference_run

    before = job_processes()
    run_dir = tmp_path / "run"
    agents = _agents(run_dir, _free_port(), [])
    outs = [a.communicate(timeout=240) for a in agents]
    for agent, (_, err) in zip(agents, outs, strict=True):
        assert agent.returncode == 0, err[-3000:]
    m = metrics(run_dir)
    assert len(m["ranks"]) == 4 and sorted(r["rank"] for r in m["ranks"]) == [0, 1, 2, 3]
    ref = reference_run(compose_cfg([*FAST, "pp=2", "dp=2"]), capture_state=False)
    assert m["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    assert len(list(tmp_path.rglob("metrics.json"))) == 1
    assert_no_process_left(before)


@pytest.mark.timeout(300)
def test_stopping_one_agent_ends_the_other_promptly(tmp_path) -> None:
    before = job_processes()
    run_dir = tmp_path / "run"
    agents = _agents(run_dir, _free_port(), ["steps=100000", "timeout_s=20"])
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:  # until every rank is training
        beats = [heartbeat.read(run_dir / "heartbeat", r) for r in range(4)]
        if all(b and b["step"] >= 2 for b in beats):
            break
        assert all(a.poll() is None for a in agents), "an agent ended before training started"
        time.sleep(0.5)
    else:
        pytest.fail("the ranks never reached step 2")
    agents[1].send_signal(signal.SIGTERM)  # a node going away: its agent stops its workers
    start = time.monotonic()
    _, err = agents[0].communicate(timeout=120)
    took = time.monotonic() - start
    agents[1].communicate(timeout=60)
    assert agents[0].returncode != 0
    assert took < 30, took
    assert "ChildFailedError" in err or "failed" in err, err[-3000:]
    # every rank, on both nodes, stopped after the same step and wrote its part of one checkpoint
    # (pipeline/runtime/preempt.py), then the ranks ended with 128 + SIGTERM
    assert len(complete_checkpoints(run_dir / "checkpoints")) == 1
    assert_no_process_left(before)
