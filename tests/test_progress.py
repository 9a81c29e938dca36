"""Rank 0's progress: a tqdm bar on a terminal (a real pty here), plain lines otherwise."""

from __future__ import annotations

import os
import pty

from pipelaunch.pipeline.runtime import progress
from pipelaunch.pipeline.runtime.progress import PROGRESS_TTY, Progress


def _read_all(fd: int) -> str:
    out = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except (BlockingIOError, OSError):
            return out.decode(errors="replace")
        if not chunk:
            return out.decode(errors="replace")
        out += chunk


def test_bar_on_the_launchers_terminal_lines_in_the_log(monkeypatch, capsys) -> None:
    master, slave = pty.openpty()
    os.set_blocking(master, False)
    monkeypatch.setenv(PROGRESS_TTY, os.ttyname(slave))
    bar = Progress(steps=6, tokens_per_step=1000, log_every=2)
    for step in range(6):
        bar.update(step, 2.0 - step * 0.1, 0.5)
    bar.close()
    drawn = _read_all(master)
    os.close(master)
    os.close(slave)
    assert "6/6" in drawn and "loss=1.5000" in drawn and "tok_s=2000" in drawn, drawn
    lines = [line for line in capsys.readouterr().out.splitlines() if "| loss" in line]
    assert [line.split("/")[0].split()[-1] for line in lines] == ["0", "2", "4", "5"]
    assert all("tokens/s" in line and "eta" in line for line in lines)


def test_plain_lines_and_no_bar_without_a_terminal(monkeypatch, capsys) -> None:
    monkeypatch.delenv(PROGRESS_TTY, raising=False)
    bar = Progress(steps=8, tokens_per_step=100)
    assert bar.bar is None
    for step in range(8):
        bar.update(step, 1.0, 0.1)
    bar.close()
    out = capsys.readouterr()
    assert out.out.count("| loss") == 8 and "%|" not in out.out + out.err


def test_short_runs_print_lines_even_on_a_terminal(monkeypatch) -> None:
    master, slave = pty.openpty()
    monkeypatch.setenv(PROGRESS_TTY, os.ttyname(slave))
    assert Progress(steps=progress.MIN_BAR_STEPS - 1, tokens_per_step=1).bar is None
    os.close(master)
    os.close(slave)
