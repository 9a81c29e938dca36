"""Fault injection for testing how a job fails (`debug.*` keys; never set in real runs)."""

from __future__ import annotations

import os
import signal


def fault_injection(debug: dict | None, rank: int, step: int) -> None:
    """`debug.kill_rank=R debug.kill_step=S`: global rank R kills itself with SIGKILL as step S
    begins, as a node failure or the OOM killer would: no Python cleanup, no error file."""
    if not debug:
        return
    if debug.get("kill_rank") == rank and debug.get("kill_step") == step:
        os.kill(os.getpid(), signal.SIGKILL)
