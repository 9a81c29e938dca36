"""Where each rank is, readable from outside it: for the report when a job hangs or dies.

Every rank keeps a tiny memory-mapped file `<dir>/rank<r>` holding (step, phase, action index,
monotonic time the phase began). Writing it is a `struct.pack_into` into shared memory: cheap
enough to do before every schedule action. When the job fails (a rank raised, or timed out
waiting), the launcher reads every rank's file, even that of a rank stuck forever or killed, and
says what each was executing or waiting on, for how long, and the schedule around it.
CLOCK_MONOTONIC is shared by the processes of one machine, so the launcher's `time.monotonic()`
gives each rank's waiting time (ranks on other machines are reported without it).
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from pathlib import Path

#: the environment variable naming the directory (set by the launcher for the ranks it spawns)
HEARTBEAT_DIR = "PIPELAUNCH_HEARTBEAT_DIR"
_FORMAT = "<iiid"  # step, phase, action index, monotonic seconds
_SIZE = struct.calcsize(_FORMAT)

PHASES = ("starting", "schedule", "gradient sync and optimizer", "evaluation", "checkpoint", "finished",
          "hung on purpose (debug.hang_rank)", "loading the step's data")
STARTING, SCHEDULE, UPDATE, EVALUATION, CHECKPOINT, FINISHED, HUNG, STEP_START = range(len(PHASES))


class Heartbeat:
    """This rank's file; every method is a no-op when the launcher asked for none."""

    def __init__(self, rank: int, directory: str | None = None) -> None:
        directory = directory if directory is not None else os.environ.get(HEARTBEAT_DIR)
        self._map: mmap.mmap | None = None
        self.step = 0
        if not directory:
            return
        path = Path(directory) / f"rank{rank}"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("wb") as f:
            f.write(b"\0" * _SIZE)
        with path.open("r+b") as f:
            self._map = mmap.mmap(f.fileno(), _SIZE)
        self.phase(STARTING)

    def phase(self, phase: int, step: int | None = None) -> None:
        if step is not None:
            self.step = step
        if self._map is not None:
            struct.pack_into(_FORMAT, self._map, 0, self.step, phase, -1, time.monotonic())

    def action(self, index: int) -> None:
        """About to run (or wait on) action `index` of this rank's schedule program."""
        if self._map is not None:
            struct.pack_into(_FORMAT, self._map, 0, self.step, SCHEDULE, index, time.monotonic())


def read(directory: Path, rank: int) -> dict | None:
    """A rank's last heartbeat: step, phase (its name), action index and seconds since, or None."""
    path = Path(directory) / f"rank{rank}"
    try:
        data = path.read_bytes()[:_SIZE]
    except OSError:
        return None
    if len(data) < _SIZE:
        return None
    step, phase, index, since = struct.unpack(_FORMAT, data)
    return {"step": step, "phase": PHASES[phase] if 0 <= phase < len(PHASES) else str(phase),
            "action": index if phase == SCHEDULE else None, "for_s": max(0.0, time.monotonic() - since)}
