"""Fault injection for testing how a job fails (`debug.*` keys; never set in real runs)."""

from __future__ import annotations

import os
import signal
import time

from pipelaunch.pipeline.core.config import DebugConfig
from pipelaunch.pipeline.runtime import heartbeat as hb


def fault_injection(debug: DebugConfig, rank: int, step: int, heartbeat: hb.Heartbeat | None = None) -> None:
    """`debug.kill_rank=R debug.kill_step=S`: global rank R kills itself with SIGKILL as step S
    begins, as a node failure or the OOM killer would: no Python cleanup, no error file.
    `debug.hang_rank=R debug.hang_step=S`: rank R stops answering as step S begins (it sleeps for
    good, as a deadlocked or stuck process would); its peers time out after `timeout_s`."""
    if debug.kill_rank == rank and debug.kill_step == step:
        os.kill(os.getpid(), signal.SIGKILL)
    if debug.hang_rank == rank and debug.hang_step == step:
        if heartbeat is not None:
            heartbeat.phase(hb.HUNG, step)
        while True:
            time.sleep(3600)
