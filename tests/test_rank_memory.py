"""A CPU rank's measured peak covers training only: the set-up before it is not counted."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# A 256 MiB set-up spike, freed; the peak is reset; then 64 MiB held while "training".
PROBE = """
import torch
from pipelaunch.pipeline.compute.memory import current_memory_bytes, peak_memory_bytes, reset_peak
cpu = torch.device("cpu")
spike = torch.ones(64 * 2**20); spike += 1; del spike
before = peak_memory_bytes(cpu)
reset_peak(cpu)
start = current_memory_bytes(cpu)
held = torch.ones(16 * 2**20); held += 1
print(before, start, peak_memory_bytes(cpu))
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="Linux resets the RSS high-water mark")
@pytest.mark.timeout(60)
def test_peak_after_reset_measures_what_follows_not_the_set_up() -> None:
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    before, start, peak = map(int, proc.stdout.split())
    mib = 2**20
    assert before - start > 200 * mib  # the spike counted before the reset
    assert 60 * mib < peak - start < 100 * mib  # after it, only the 64 MiB held


# 4 MiB held before a counted step; in it 16 MiB allocated and freed, then 32 and 8 MiB, the 8 freed.
TENSOR_PROBE = """
import torch
from pipelaunch.pipeline.compute.memory import TensorPeak
held = torch.ones(2**20)
meter = TensorPeak(torch.device("cpu"), lambda: held.untyped_storage().nbytes(), run_steps=3)
with meter.measure(0):
    a = torch.ones(4 * 2**20); del a
    b = torch.ones(8 * 2**20); c = torch.ones(2 * 2**20); del c
with meter.measure(2):  # past the counted steps: not counted
    d = torch.ones(64 * 2**20)
print(meter.steps, meter.peak_bytes())
"""


@pytest.mark.timeout(60)
def test_tensor_peak_counts_what_tensors_held_at_once_like_cuda_does() -> None:
    """On CPU the tensors' peak is exact: held before the step plus the most its allocations
    held at once (32 + 8 MiB live at the top), not what the heap kept of freed blocks; steps after
    the counted ones are not counted."""
    proc = subprocess.run([sys.executable, "-c", TENSOR_PROBE], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "USDT" not in proc.stderr and "profiler" not in proc.stderr
    steps, peak = map(int, proc.stdout.split())
    assert steps == 2
    assert peak == 4 * 2**20 + 32 * 2**20 + 8 * 2**20


# Rank 0 sends eight 1 MiB messages to rank 1, receiving a small reply after each; rank 1 replies
# after each message it receives. What rank 0's tensors hold at once is printed.
SENDS_PROBE = """
import sys, torch, torch.distributed as dist
from pipelaunch.pipeline.runtime.comm import P2P
from pipelaunch.pipeline.compute.memory import TensorPeak
rank, store = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2)
p2p, peer, one = P2P(torch.device("cpu")), 1 - rank, ((1,), torch.float32)
meter = TensorPeak(torch.device("cpu"), lambda: 0, run_steps=2)
with meter.measure(0):
    for i in range(8):
        if rank == 0:
            p2p.send("message", peer, [torch.ones(2**18)])
            p2p.post_recv(i, "reply", peer, [one], i)
            p2p.wait_recv(i)
        else:
            p2p.post_recv(i, "message", peer, [((2**18,), torch.float32)], i)
            p2p.wait_recv(i)
            p2p.send("reply", peer, [torch.ones(1)])
    p2p.wait_sends()
dist.barrier()
print(meter.peak)
dist.destroy_process_group()
"""


@pytest.mark.timeout(90)
def test_a_cpu_rank_drops_what_it_sent_once_the_peer_has_answered(tmp_path: Path) -> None:
    """gloo's send works never report completion before `wait()`: without the pair-order release a
    rank held every message of the step (8 MiB here); with it, a message is dropped once the
    peer's next message arrives, so rank 0 never holds more than two at once."""
    store = str(tmp_path / "store")
    procs = [subprocess.Popen([sys.executable, "-c", SENDS_PROBE, str(r), store], cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in range(2)]
    try:
        outs = [p.communicate(timeout=80) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), [err for _, err in outs]
    peak = int(outs[0][0].split()[-1])
    assert peak <= 2 * 2**20 + 4096, peak
