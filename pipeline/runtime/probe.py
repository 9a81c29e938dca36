"""The probe `pipelaunch.pipeline.planner.measure.overheads` starts: two ranks measuring what the runtime pays per
message and per compute action, with the runtime's own P2P. Its own program
(`python -m pipelaunch.pipeline.runtime.probe RANK PORT THREADS ALL_REDUCE_BYTES`, one JSON line out), so that a probe
process imports torch and this module, not the launcher's or the planner's."""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from pipelaunch.pipeline.runtime.comm import P2P

#: round trips per block (BLOCKS blocks timed after one of warm-up) and tiny actions timed per probe
ROUNDS = 200
BLOCKS = 3
ACTIONS = 200


def probe(rank: int, port: int, threads: int, all_reduce_bytes: int = 1 << 20) -> dict:
    """One probe rank: the ping-pong with its peer while both keep their compute threads busy, then
    tiny actions while the peer does the same (both ranks busy, as in a step)."""
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        with busy_cores():
            latency = _ping_pong(rank)
            all_reduce, big = _all_reduces(1), _all_reduces(all_reduce_bytes // 4)
        dist.barrier()
        figures = {"latency_s": latency, "all_reduce_s": all_reduce, "all_reduce_big_s": big}
        return {"action_s": _tiny_actions(), **(figures if rank == 0 else {})}
    finally:
        dist.destroy_process_group()


@contextmanager
def busy_cores() -> Iterator[None]:
    """Keep this rank's compute threads busy (matrix products on a second Python thread, which
    torch runs without the GIL) while the block runs. In a step a message mostly arrives while both
    ranks compute: where the ranks' threads fill the cores, gloo's thread that moves it waits for a
    core (on this project's 2-core machine an idle ping-pong took 0.12 ms a message, a busy one
    0.9 ms, and steps paid about 0.5 ms); where cores are to spare, it costs nothing more."""
    stop = threading.Event()
    block = torch.randn(192, 192)

    def work() -> None:
        while not stop.is_set():
            block @ block

    worker = threading.Thread(target=work, daemon=True)
    worker.start()
    try:
        yield
    finally:
        stop.set()
        worker.join()


def _ping_pong(rank: int) -> float:
    """One-way seconds per message: half a round trip, through the runtime's P2P. The mean of each
    of BLOCKS blocks of ROUNDS round trips, then the median block: on a busy core most trips take
    0.1-0.2 ms and about one in ten waits for a time slice (2-10 ms); a block that also meets a
    stall of the machine (seconds-long on this project's shared 2-core VM) is left out."""
    p2p, peer = P2P(torch.device("cpu")), 1 - rank
    x, shapes = torch.zeros(1), [((1,), torch.float32)]

    def trip(i: int) -> None:
        if rank == 0:
            p2p.send("ping", peer, [x])
            p2p.post_recv(i, "pong", peer, shapes, 0)
            p2p.wait_recv(i)
        else:
            p2p.post_recv(i, "ping", peer, shapes, 0)
            p2p.wait_recv(i)
            p2p.send("pong", peer, [x])
        p2p.release_completed()

    for i in range(ROUNDS):
        trip(i)
    blocks = []
    for b in range(BLOCKS):
        start = time.perf_counter()
        for i in range(ROUNDS):
            trip((b + 1) * ROUNDS + i)
        blocks.append((time.perf_counter() - start) / ROUNDS / 2)
    p2p.wait_sends()
    return statistics.median(blocks)


def _all_reduces(numel: int) -> float:
    """Seconds per all-reduce of `numel` float32 values between the two ranks, as `_ping_pong`
    times its trips (the median block): of one value, what tensor parallelism's collectives pay
    beyond their bytes; of a MiB (the launcher's `all_reduce_bytes`), with the bytes."""
    x = torch.zeros(numel)
    rounds = ROUNDS if numel == 1 else ROUNDS // 10
    for _ in range(rounds // 4):
        dist.all_reduce(x)
    blocks = []
    for _ in range(BLOCKS):
        start = time.perf_counter()
        for _ in range(rounds):
            dist.all_reduce(x)
        blocks.append((time.perf_counter() - start) / rounds)
    return statistics.median(blocks)


def _tiny_actions() -> float:
    """Seconds per compute action of a stage whose own work is negligible: an input made a leaf,
    a forward and its non-finite check, then a backward from the output's gradient, as the
    executor runs them."""
    layer = torch.nn.Linear(4, 4)
    x, grad = torch.randn(2, 4), torch.ones(2, 4)
    flag = torch.zeros((), dtype=torch.bool)

    def action_pair() -> None:
        nonlocal flag
        inp = x.detach().requires_grad_(True)
        out = layer(inp)
        flag |= ~torch.isfinite(out.detach()).all()
        torch.autograd.backward([out], [grad])

    for _ in range(ACTIONS // 4):
        action_pair()
    start = time.perf_counter()
    for _ in range(ACTIONS):
        action_pair()
    return (time.perf_counter() - start) / ACTIONS / 2


if __name__ == "__main__":
    print(json.dumps(probe(*map(int, sys.argv[1:5]))))
