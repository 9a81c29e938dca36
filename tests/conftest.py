"""Every test's processes carry a marker in their environment (`TEST_JOB_MARK`), inherited by
everything they start: `tests.harness.job_processes` finds a test's own launchers, torchrun agents
and ranks by it, and never another test's running beside it (`pytest -n 2`). The ranks the
harness spawns in the test process itself (`run_jobs`) carry none: they fork from one server kept
for every test of the worker (launcher/spawn.py)."""

from __future__ import annotations

import uuid

import pytest

from tests.harness import JOB_MARK


@pytest.fixture(autouse=True)
def job_mark(monkeypatch) -> str:
    mark = uuid.uuid4().hex
    monkeypatch.setenv(JOB_MARK, mark)
    return mark
