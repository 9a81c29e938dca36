"""What the runtime pays per action and per transfer beyond the model's own compute, measured once.

Why: the profile times each node alone, but a rank also pays a fixed cost for every action it
runs (preparing inputs, the autograd call, the non-finite check) and a latency for every
message (posting, the peer's thread waking up, gloo's socket round trip). On a large stage these
are noise; on the default model's 2-3 ms stages they decide between schedules: an interleaved
schedule runs twice the actions and sends three times the messages of 1F1B, and priced at zero
it wins on paper and loses on the machine.

Measured with the runtime's own code (`pipelaunch.pipeline.runtime.comm.P2P`) by two spawned gloo ranks of
`threads` threads each: a ping-pong of one-element messages while each rank's compute threads are
busy (as they are in a step) gives the one-way latency, and a
forward and a backward of a tiny stage, done the way the executor does them, the fixed cost per
compute action. Cached per machine, torch version, thread count and core count, like the profile,
in `$PIPELAUNCH_CACHE`. On a GPU both stay at the configured defaults: NCCL's latency needs two
GPUs to measure, and a GPU action's fixed cost is host time the device's queue hides.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pipelaunch.pipeline.compute.threads import available_cores
from pipelaunch.pipeline.planner.measure.profile import cache_dir

#: the repository root: where `python -m pipelaunch.pipeline.runtime.probe` finds the package
ROOT = Path(__file__).resolve().parents[2]
#: the all-reduce the probe times with its bytes (a block's activations in a small model)
ALL_REDUCE_BYTES = 1 << 20
#: the probe gives up (the defaults stand) after this long
PROBE_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Overheads:
    """Seconds a message takes beyond its bytes, and a compute action beyond its module's work."""

    latency_s: float
    action_s: float
    #: one all-reduce of a value between two busy ranks (tp's collectives' fixed cost), and of
    #: `ALL_REDUCE_BYTES` (with the bytes): the tp link's latency and bandwidth follow
    all_reduce_s: float = 0.0
    all_reduce_big_s: float = 0.0

    def all_reduce_link(self) -> tuple[float, float] | None:
        """(seconds per ring step, bytes per second) of two busy ranks' all-reduce: a ring of two
        takes two steps, each sending half the bytes; None when the probe did not time it."""
        if not self.all_reduce_s or self.all_reduce_big_s <= self.all_reduce_s:
            return None
        return self.all_reduce_s / 2, ALL_REDUCE_BYTES / (self.all_reduce_big_s - self.all_reduce_s)


def cached_overheads(threads: int) -> Overheads | None:
    """This machine's overheads for ranks of `threads` threads: from the cache, else measured and
    cached. None when the probe cannot run here (its error is not the run's problem: the
    configured defaults stand)."""
    path = cache_path(threads)
    if path.exists():
        return Overheads(**json.loads(path.read_text()))
    found = measure_overheads(threads)
    if found is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(asdict(found)))
        tmp.replace(path)  # complete or invisible: concurrent planners never read half a file
    return found


def cache_path(threads: int) -> Path:
    """Where `cached_overheads(threads)` keeps its figures."""
    return cache_dir() / "overheads" / f"{_key(threads)}.json"


#: how the probe measures (part of the cache key: figures of an earlier probe are measured again)
PROBE_VERSION = "busy-ping-pong-median-all-reduce-2"


def _key(threads: int) -> str:
    return "-".join([platform.node() or "host", torch.__version__.replace("+", "_"), f"t{threads}",
                     f"c{available_cores()}", PROBE_VERSION])


def measure_overheads(threads: int) -> Overheads | None:
    """Start two probe ranks (gloo on 127.0.0.1) and read their figures; None if either fails or
    runs past PROBE_TIMEOUT_S."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**_outside_any_job(os.environ), "OMP_NUM_THREADS": str(threads)}
    procs = [subprocess.Popen([sys.executable, "-m", "pipelaunch.pipeline.runtime.probe", str(rank), str(port), str(threads),
                              str(ALL_REDUCE_BYTES)],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
                              cwd=ROOT, start_new_session=True)
             for rank in range(2)]
    try:
        results = [json.loads(p.communicate(timeout=PROBE_TIMEOUT_S)[0]) for p in procs]
    except (subprocess.TimeoutExpired, json.JSONDecodeError):
        return None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(p.returncode for p in procs):
        return None
    first = next(r for r in results if "latency_s" in r)
    return Overheads(latency_s=first["latency_s"], action_s=statistics.mean(r["action_s"] for r in results),
                     all_reduce_s=first["all_reduce_s"], all_reduce_big_s=first["all_reduce_big_s"])


#: what torchrun and SLURM tell a rank about its job; the probe's two processes are a job of their own
JOB_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _outside_any_job(environ: os._Environ | dict) -> dict[str, str]:
    """The environment without the job's rendezvous: under torchrun, TORCHELASTIC_USE_AGENT_STORE
    makes every tcp:// rendezvous a client of the agent's store, so the probe's own rank 0 never
    serves its port and both probe ranks waited out PROBE_TIMEOUT_S (a joined rank 0 planning
    plan=auto took 2 minutes and priced the defaults)."""
    return {k: v for k, v in environ.items() if k not in JOB_VARIABLES and not k.startswith("TORCHELASTIC_")}
