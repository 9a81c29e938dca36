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
from pipeline.runtime.memory import current_memory_bytes, peak_memory_bytes, reset_peak
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
from pipeline.runtime.memory import TensorPeak
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
