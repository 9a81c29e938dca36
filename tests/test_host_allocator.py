"""host_allocator=retain: freed activation-sized buffers are reused instead of being faulted back in."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pipelaunch.pipeline.core.errors import ConfigError
from tests.harness import compose_cfg

ROOT = Path(__file__).resolve().parents[1]
# Five split backwards (I then W, as zero-bubble schedules run them) of two gpt_bench-sized decoder
# blocks, after three warm-up ones. Prints whether malloc was tuned and the minor page faults.
PROBE = """
import resource, sys, torch
from pipelaunch.pipeline.compute.backward import backward_input, backward_weight
from pipelaunch.pipeline.compute.host_allocator import configure_host_allocator
print(configure_host_allocator(sys.argv[1]))
torch.set_num_threads(1)
from pipelaunch.models.gpt import DecoderBlock
torch.manual_seed(0)
stage = torch.nn.Sequential(DecoderBlock(256, 4), DecoderBlock(256, 4))
params = list(stage.parameters())
grad = torch.randn(4, 128, 256)
def step():
    x = torch.randn(4, 128, 256, requires_grad=True)
    _, stash = backward_input([stage(x)], [grad], {"x": x}, params)
    backward_weight(stash)
for _ in range(3):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
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
    # glibc's defaults hand freed activation memory back and fault it in again (thousands of pages
    # per split backward here: 13,000-22,000 on an idle machine, 4,939 once under CI's load);
    # retained memory is reused
    assert system > 1000, system
    assert retained < 0.2 * system, (retained, system)


def test_bad_host_allocator_is_named() -> None:
    with pytest.raises(ConfigError, match="host_allocator.*retain, system"):
        compose_cfg(["host_allocator=jemalloc"])


# Touch 64 MiB through torch (as an activation would be) and report the huge pages backing it.
HUGE_PROBE = """
import torch
from pipelaunch.pipeline.compute.host_allocator import configure_host_allocator, huge_pages_active
configure_host_allocator("retain")
x = torch.ones(16 * 2**20)
print(huge_pages_active(), next(int(line.split()[1]) for line in open("/proc/self/smaps_rollup")
                                if line.startswith("AnonHugePages")))
"""


def _huge_kib(env: dict[str, str]) -> tuple[bool, int]:
    import os

    out = subprocess.run([sys.executable, "-c", HUGE_PROBE], cwd=ROOT, capture_output=True, text=True, check=True,
                         timeout=120, env={**os.environ, **env}).stdout.split()
    return out[0] == "True", int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc tunables, /proc")
def test_huge_pages_back_the_rank_heap() -> None:
    from pipelaunch.pipeline.compute.host_allocator import (
        THP_SETTING,
        rank_environment,
        transparent_huge_pages_available,
    )

    if not transparent_huge_pages_available():
        pytest.skip("the kernel has transparent huge pages switched off")
    env = rank_environment(True, environ={})
    assert env == {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    active, huge_kib = _huge_kib(env)
    assert active and huge_kib >= 32 * 1024, huge_kib  # most of the 64 MiB sits on 2 MiB pages
    if "[madvise]" in THP_SETTING.read_text():  # without the tunable nothing asks for huge pages
        assert _huge_kib({"GLIBC_TUNABLES": ""}) == (False, 0)


def test_rank_environment_merges_and_respects_the_user(monkeypatch, tmp_path) -> None:
    from pipelaunch.pipeline.compute import host_allocator as ha

    setting = tmp_path / "enabled"
    monkeypatch.setattr(ha, "THP_SETTING", setting)
    setting.write_text("always [madvise] never\n")
    assert ha.rank_environment(False, environ={}) == {}
    assert ha.rank_environment(True, environ={"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}) == {
        "GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"}
    assert ha.rank_environment(True, environ={"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}) == {}
    setting.write_text("always madvise [never]\n")
    assert ha.rank_environment(True, environ={}) == {}


def test_bad_huge_pages_is_named() -> None:
    with pytest.raises(ConfigError, match="maybe.*not a valid bool") as err:
        compose_cfg(["huge_pages=maybe"])
    assert err.value.key == "huge_pages"
