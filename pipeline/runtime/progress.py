"""Rank 0's view of a run: a tqdm bar (loss, tokens/s, ETA) on a terminal, plain lines otherwise.

A spawned rank's stdout is a log file that the launcher tees to its console line by line, where
a redrawn bar would pile up into one endless line. So the launcher, when its own stdout is a
terminal, passes that terminal's path in PROGRESS_TTY; rank 0 draws the bar there, and its step
lines still go to the log. A rank torchrun started on a terminal draws on its own stderr.
"""

from __future__ import annotations

import os
import sys
import time
from typing import IO

#: the launcher's terminal, for rank 0's bar (unset when the launcher's output is not a terminal)
PROGRESS_TTY = "PIPELAUNCH_PROGRESS_TTY"
#: runs shorter than this print lines even on a terminal: a bar would flash by
MIN_BAR_STEPS = 5


def launcher_terminal() -> dict[str, str]:
    """The environment that lets spawned ranks draw on the launcher's terminal, if it has one."""
    try:
        return {PROGRESS_TTY: os.ttyname(sys.stdout.fileno())} if sys.stdout.isatty() else {}
    except (OSError, ValueError, AttributeError):  # a captured or closed stdout
        return {}


def _terminal() -> IO[str] | None:
    path = os.environ.get(PROGRESS_TTY)
    if path:
        try:
            return open(path, "w")  # noqa: SIM115 (closed by Progress.close)
        except OSError:
            return None
    return sys.stderr if sys.stderr.isatty() else None


def _width(file: IO[str]) -> int:
    """The terminal's width, or 100 columns where it reports none (a pty nobody sized)."""
    try:
        return os.get_terminal_size(file.fileno()).columns or 100
    except OSError:
        return 100


class Progress:
    """Report each step: `update(step, loss, seconds)`, then `close()`."""

    def __init__(self, steps: int, tokens_per_step: int, log_every: int = 1, start: int = 0,
                 unit: str = "tokens") -> None:
        """`steps` in all, the first `start` of them done before (a resumed run); throughput in
        `unit` (tokens for language models, samples for image models) per second."""
        self.steps, self.tokens_per_step, self.log_every = steps, tokens_per_step, max(1, log_every)
        self.unit = unit
        self.start, self.started = start, time.perf_counter()
        self.bar = None
        self._file = _terminal() if steps - start >= MIN_BAR_STEPS else None
        if self._file is not None:
            from tqdm import tqdm

            self.bar = tqdm(total=steps, initial=start, unit="step", file=self._file, ncols=_width(self._file),
                            desc="train")

    def update(self, step: int, loss: float, seconds: float, scored_tokens_per_s: float | None = None,
               padding_share: float | None = None, tokens: int | None = None,
               expert_load: float | None = None) -> None:
        """One step's line; on fine-tuning data the scored tokens/s and the padding share too.
        `tokens`: the input tokens the step ran, when not `tokens_per_step` (data.buckets).
        `expert_load`: with MoE layers, the busiest expert's tokens over the mean, worst layer."""
        rate = (tokens or self.tokens_per_step) / seconds if seconds > 0 else float("inf")
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", **{f"{self.unit[:3]}_s": f"{rate:.0f}"}, refresh=False)
            self.bar.update(1)
        if step % self.log_every == 0 or step == self.steps - 1:
            done = step + 1
            eta = (time.perf_counter() - self.started) / (done - self.start) * (self.steps - done)
            line = (f"step {step:>4}/{self.steps} | loss {loss:.4f} | step time {seconds * 1e3:8.1f} ms | "
                    f"{rate:10.0f} {self.unit}/s | "
                    + (f"{scored_tokens_per_s:10.0f} scored tokens/s | " if scored_tokens_per_s is not None else "")
                    + (f"padding {padding_share:4.0%} | " if padding_share is not None else "")
                    + (f"experts max/mean {expert_load:4.2f} | " if expert_load is not None else "")
                    + f"eta {eta:6.1f} s")
            if self.bar is not None and sys.stdout.isatty():
                self.bar.write(line, file=sys.stdout)  # above the bar, which is redrawn below it
            else:
                print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self._file is not None and self._file is not sys.stderr:
            self._file.close()
