"""Stop on request at a step boundary, every rank at the same step: SIGTERM and SIGUSR1.

Why: SLURM sends SIGTERM to a preempted job (and SIGKILL after `KillWait`, 30 s by default), and
submitit sends SIGUSR1 `signal_delay_s` before the time limit so that the job can checkpoint and
requeue itself. A rank that dies on either loses every step since its last checkpoint. Here a
signal only raises a flag; at the end of each step the ranks agree on it (one all-reduce of a
small integer, MAX, over a gloo group, so no CUDA sync enters the step) and, if any rank was
asked, all of them stop after that same step, write a checkpoint and return normally.

A rank is asked by its own signal (SIGTERM from torch elastic or torchrun tearing the job down,
either signal from SLURM) or by the launcher, which writes the signal's name into `STOP_FILE`
under the run directory when it is signalled itself (`launcher/preempt.py`, which afterwards
calls the handler that was there before: submitit's SIGUSR1 handler requeues the job). The
handlers the process had before are put back when training ends.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path
from types import FrameType

import torch
import torch.distributed as dist

#: the signals that stop a run at its next step boundary, in the order of their codes
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
#: written by the launcher into the run directory: a signal's name, asking every rank to stop
STOP_FILE = "stop"

Handler = Callable[[int, FrameType | None], object] | int | None


class StopRequests:
    """This rank's stop flag and the agreement on it (module docstring)."""

    def __init__(self, run_dir: Path | None, group: dist.ProcessGroup | None, world_size: int) -> None:
        self.stop_file = run_dir / STOP_FILE if run_dir is not None else None
        self.group = group
        self.world_size = world_size
        self.received: signal.Signals | None = None
        self.previous: dict[signal.Signals, Handler] = {}

    def install(self) -> None:
        """Catch the stop signals (main thread only, as Python requires)."""
        for sig in STOP_SIGNALS:
            self.previous[sig] = signal.signal(sig, self._receive)

    def restore(self) -> None:
        """Put the handlers the process had back."""
        for sig, handler in self.previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self.previous = {}

    def _receive(self, signum: int, frame: FrameType | None) -> None:
        self.received = self.received or signal.Signals(signum)

    def _local_code(self) -> int:
        if self.received is not None:
            return STOP_SIGNALS.index(self.received) + 1
        if self.stop_file is not None and self.stop_file.is_file():
            name = self.stop_file.read_text().strip()
            return next((i + 1 for i, s in enumerate(STOP_SIGNALS) if s.name == name), 1)
        return 0

    def agreed(self) -> signal.Signals | None:
        """The signal every rank stops for after this step, or None to go on (collective: every rank
        calls it after every step)."""
        code = self._local_code()
        if self.world_size > 1:
            flag = torch.tensor([code], dtype=torch.int64)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
            code = int(flag.item())
        return STOP_SIGNALS[code - 1] if code else None


def control_group(device: torch.device) -> dist.ProcessGroup | None:
    """The group the ranks agree on host values in: the default one on CPU (gloo), a gloo group
    over every rank beside NCCL's (created by every rank, at the same point of the run)."""
    if not dist.is_initialized() or device.type == "cpu":
        return None
    return dist.new_group(backend="gloo")
