"""A rank that stops answering: the job ends within timeout_s, says where every rank was, and
leaves no process behind (a killed rank: tests/test_long_runs.py)."""

from __future__ import annotations

import time

import pytest

from tests.harness import FAST, assert_no_process_left, job_processes
from tests.test_cli import train


@pytest.mark.timeout(120)
def test_a_hung_rank_ends_the_job_within_timeout_naming_where_each_rank_was(tmp_path) -> None:
    before = job_processes()
    start = time.monotonic()
    proc = train([*FAST, "pp=2", "steps=5", "timeout_s=8", "debug.hang_rank=1", "debug.hang_step=2"],
                 tmp_path / "run", timeout=100)
    took = time.monotonic() - start
    assert proc.returncode == 1, proc.stderr[-2000:]
    err = proc.stderr
    assert "Timed out waiting" in err, err[-2000:]
    assert "rank 0 (pp 0, dp 0): step 2, RECV_B stage 0 mb 0 from rank 1, for" in err, err[-2000:]
    assert "rank 1 (pp 1, dp 0): step 2, hung on purpose (debug.hang_rank)" in err
    assert "[RECV_B(0,0<1)]" in err  # the program around the action it was waiting on
    # the console holds the short report; torch elastic's tracebacks go to the logs it names
    assert "Traceback" not in err and "leaked semaphore" not in err and "api.py" not in err, err[-3000:]
    assert "each rank's full output: " in err and "Traceback" in (tmp_path / "run" / "logs" / "launcher.log").read_text()
    assert took < 60, took  # timeout_s=8, plus start-up and tear-down on a loaded 2-core machine
    assert_no_process_left(before)
