"""host_allocator=retain: freed activation-sized buffers are reused instead of being faulted back in."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.errors import ConfigError
from tests.harness import compose_cfg

ROOT = Path(__file__).resolve().parents[1]
# A step's worth of activations: 32 tensors of 1 MiB alive together, then all freed (as at the end of
# a backward); 20 such steps after 3 warm-up ones. Prints whether malloc was tuned and the page faults.
PROBE = """
import resource, sys, torch
from pipeline.runtime.host_allocator import configure_host_allocator
print(configure_host_allocator(sys.argv[1]))
def step():
    live = [torch.ones(2**18) for _ in range(32)]
    del live
for _ in range(3):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(choice: str) -> tuple[bool, int]:
    out = subprocess.run([sys.executable, "-c", PROBE, choice], cwd=ROOT, capture_output=True, text=True,
                         check=True, timeout=120).stdout.split()
    return out[0] == "True", int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_retain_stops_page_faults_on_reallocation() -> None:
    tuned, retained = _faults("retain")
    untouched, system = _faults("system")
    assert tuned and not untouched
    assert system > 20 * 4096  # glibc's default trims the freed heap: each step faults most of its 8192 pages
    assert retained < 0.05 * system


def test_bad_host_allocator_is_named() -> None:
    from launcher.validate import check_scalars

    cfg = compose_cfg(["host_allocator=jemalloc"])
    with pytest.raises(ConfigError, match="host_allocator.*retain, system"):
        check_scalars(cfg)
