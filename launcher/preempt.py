"""The launcher's side of stopping a run on request (`pipelaunch.pipeline.runtime.preempt` is the
ranks' side): SIGUSR1 and SIGTERM end the run after a step, every rank checkpointed, nothing lost.

- SIGUSR1 (what submitit sends `hydra.launcher.signal_delay_s` before the time limit): the launcher
  writes the signal's name into the run directory's stop file; every rank stops after the same step
  and checkpoints; the launcher reports the run as usual and then calls the handler that was there
  before (submitit's, which requeues the job), if any.
- SIGTERM (what SLURM sends a preempted job; `kill`): while ranks run, torch elastic holds it: it
  passes SIGTERM on to every rank, which stop the same way and exit, then raises here
  (`launcher/spawn.py` turns that into `RunStopped`), and the launcher says which checkpoint the
  ranks wrote.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from pipelaunch.pipeline.runtime.preempt import STOP_FILE


@dataclass
class StopSignal:
    """The signal the launcher received while its ranks ran, and the one the ranks stopped for
    (a joined rank is its own launcher: its trainer takes the signal itself); None: none."""

    received: signal.Signals | None = None
    ranks_stopped_by: str | None = None


@contextmanager
def forward_stop_signals(run_dir: Path) -> Iterator[StopSignal]:
    """While the block runs, SIGUSR1 asks every rank to stop after its step (module docstring);
    after it, the previous handler is put back and, when the signal came (to the launcher, or to
    the ranks: `ranks_stopped_by`), called."""
    state = StopSignal()
    stop_file = run_dir / STOP_FILE

    def ask_ranks(signum: int, frame: object) -> None:
        state.received = signal.Signals(signum)
        stop_file.write_text(state.received.name)

    previous = signal.signal(signal.SIGUSR1, ask_ranks)
    try:
        yield state
    finally:
        signal.signal(signal.SIGUSR1, previous)
        stop_file.unlink(missing_ok=True)
    asked = state.received is not None or state.ranks_stopped_by == signal.SIGUSR1.name
    if asked and callable(previous):
        previous(int(signal.SIGUSR1), None)


def stopped_line(signal_name: str, steps_done: int | None, steps: int, checkpoint: Path | None) -> str:
    """What the launcher prints for a run stopped by a signal."""
    after = f"after step {steps_done} of {steps}" if steps_done is not None else "before its last step"
    if checkpoint is None:
        return f"stopped by {signal_name} {after}; no complete checkpoint was written"
    return (f"stopped by {signal_name} {after}: every rank checkpointed to {checkpoint}; resume with "
            f"resume={checkpoint} (or resume=auto with checkpoint.dir={checkpoint.parent})")
