"""Start pp x dp local ranks with torch elastic and return what each rank returned.

elastic_launch picks a free rendezvous port (so parallel sweeps never collide), writes one log
file per rank, and when one rank raises it stops the others and raises ChildFailedError.
"""

from __future__ import annotations

import logging
import multiprocessing.forkserver
import os
import signal
import sys
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from pipelaunch.pipeline.core.errors import RankFailed, RunStopped
from pipelaunch.pipeline.runtime.progress import PROGRESS_TTY
from pipelaunch.pipeline.runtime.rank import RankJob, rank_main


def failure_report(err: ChildFailedError) -> str:
    """Each failed rank's traceback, from the error file torch elastic records for it, the first
    to fail first: the others usually failed because of it (a peer's closed connection)."""
    parts = []
    failures = sorted(err.failures.items(), key=lambda item: (item[1].timestamp or 0, item[0]))
    for n, (local_rank, failure) in enumerate(failures):
        text = failure.message
        if isinstance(text, dict):  # {"message": {"message": ..., "extraInfo": {"py_callstack": ...}}}
            inner = text.get("message", {})
            if isinstance(inner, dict):
                text = inner.get("extraInfo", {}).get("py_callstack") or inner.get("message") or str(text)
            else:
                text = str(inner)
        after = " (after the rank above)" if n else ""
        parts.append(f"--- rank {local_rank} failed (exit code {failure.exitcode}){after} ---\n{text}")
    return "\n".join(parts)


def spawn_ranks(
    job: RankJob | list[RankJob],
    nprocs: int,
    log_dir: Path,
    echo_rank0: bool = True,
    entry: Callable[..., Any] = rank_main,
    env: dict[str, str] | None = None,
) -> dict[int, Any]:
    """Run `entry(job)` on `nprocs` local processes with `env` added to their environment; raise
    RankFailed with the traceback. Rank 0's output is echoed here; only its stderr when it draws a
    progress bar on this terminal itself (its step lines then stay in its log)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    logs = DefaultLogsSpecs(
        log_dir=str(log_dir),
        redirects=Std.ALL,
        tee={0: Std.ERR if PROGRESS_TTY in (env or {}) else Std.ALL} if echo_rank0 else Std.NONE,
    )
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nprocs,
        run_id=uuid.uuid4().hex,
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        start_method="forkserver",
        monitor_interval=0.1,
        logs_specs=logs,
        log_line_prefix_template="[rank${rank}]:",
    )
    # multiprocessing's resource tracker (started with the ranks) warns, at exit, about the
    # semaphores of ranks that were torn down after a failure, and unlinks them itself
    quiet = ",".join(filter(None, [os.environ.get("PYTHONWARNINGS"), "ignore:resource_tracker:UserWarning"]))
    try:
        with environment({**(env or {}), "PYTHONWARNINGS": quiet}), elastic_log_to(log_dir / "launcher.log"), \
                fork_server(entry):
            return elastic_launch(config, entry)(job)
    except SignalException as sig:  # elastic passed it on to every rank, which checkpointed and exited
        raise RunStopped(signal.Signals(sig.sigval).name) from None
    except ChildFailedError as err:
        logs = sorted(log_dir.glob(f"{config.run_id}*/attempt_0"))
        where = f"\neach rank's full output: {logs[0]}/<rank>/stderr.log (and error.json)" if logs else ""
        raise RankFailed(failure_report(err) + where) from None


#: loggers that print a failed rank's whole traceback (and the tear-down of the others) on the
#: console; it goes to logs/launcher.log instead, and the launcher prints its own short report
ELASTIC_LOGGERS = ("torch.distributed.elastic", "torch.multiprocessing")


@contextmanager
def elastic_log_to(path: Path) -> Iterator[None]:
    """While ranks run, torch elastic's own log lines go to `path`, not to the console."""
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    saved = []
    for name in ELASTIC_LOGGERS:
        logger = logging.getLogger(name)
        saved.append((logger, logger.propagate, list(logger.handlers)))
        logger.handlers = [handler]
        logger.propagate = False
    try:
        yield
    finally:
        for logger, propagate, handlers in saved:
            logger.handlers, logger.propagate = handlers, propagate
        handler.close()


#: what the running fork server was started with: its preload, and this process's environment,
#: working directory and import path then (None: none started here)
_SERVER_KEY: list[tuple | None] = [None]


@contextmanager
def fork_server(entry: Callable[..., Any]) -> Iterator[None]:
    """The ranks are forked from one server process that imported torch and the rank code once
    (about 3.5 s of CPU a launch saved: most of a short job's). A rank inherits the server's
    environment, working directory and import path, so the server holds this launch's: one left
    by an earlier launch of this process is kept where all of them are unchanged (a sweep's jobs,
    a test's runs: the 3.5 s once), else stopped and started afresh. It ends with this process."""
    server = multiprocessing.forkserver._forkserver  # noqa: SLF001 - the one server the context forks from
    preload = ["pipelaunch.pipeline.runtime.rank", "torch._dynamo", entry.__module__]

    def held() -> tuple:
        return tuple(preload), tuple(sorted(os.environ.items())), os.getcwd(), tuple(sys.path)

    fresh = held() != _SERVER_KEY[0]
    if fresh:
        server._stop()  # noqa: SLF001 - it holds another launch's environment
        server.set_forkserver_preload(preload)
    try:
        yield
    finally:
        if fresh:  # the server started inside the launch: with what torch elastic set by then (its signals)
            _SERVER_KEY[0] = held()


@contextmanager
def environment(variables: dict[str, str]) -> Iterator[None]:
    """Set `variables` while ranks are spawned (they inherit this process's environment), then
    restore what was there."""
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
