"""Shared helpers: compose configs like the CLI does, run real multi-rank jobs, compare with the
single-process reference."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from pipelaunch.launcher.config import register_configs
from pipelaunch.launcher.initial_weights import launcher_initial_weights
from pipelaunch.launcher.overrides import compose_checked
from pipelaunch.launcher.spawn import spawn_ranks
from pipelaunch.launcher.split_check import check_split
from pipelaunch.launcher.validate import prepare
from pipelaunch.pipeline.compute.host_allocator import rank_environment
from pipelaunch.pipeline.core.config import TrainConfig
from pipelaunch.pipeline.runtime.rank import RankJob
from tests.capture import CaptureState, rank_main_many

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"

# Small and fast, but with every moving part: 8 blocks, several micro-batches, two steps of SGD.
FAST = [
    "model.dim=32", "model.layers=6", "model.seq_len=8", "model.vocab_size=64",
    "batch_size=16", "steps=3", "warmup_steps=0", "optimizer=sgd", "timeout_s=60", "threads=1",
]


def compose_cfg(overrides: list[str]) -> TrainConfig:
    """Compose conf/train.yaml with overrides into the typed config, exactly as train.py would."""
    return compose_checked(overrides)


def group_options(group: str) -> list[str]:
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF)):
        return GlobalHydra.instance().config_loader().get_group_options(group)


def run_jobs(cfgs: list[TrainConfig], log_dir: Path, plans: list | None = None,
             split_check: bool = False, capture: bool = True) -> list[list[dict]]:
    """Run configs of the same world size in one spawn, each starting from the weights the launcher
    gives it (`launcher_initial_weights`); returns per config the list of rank results. `plans`:
    the plans to run (one per config), instead of those the configs give; `split_check`: first
    assert that the launcher's split check passes for each; `capture=False`: no copy of the weights
    and gradients is taken (a memory measurement counts what training holds)."""
    jobs = []
    with ExitStack() as files:
        for i, cfg in enumerate(cfgs):
            # NCCL's semantics on gloo: tags are always 0, and every pair's posting order is checked
            # at the end of the run (debug.record_p2p)
            cfg = replace(cfg, debug=replace(cfg.debug, record_p2p=True))
            prepared = prepare(cfg)
            initial = files.enter_context(launcher_initial_weights(cfg, prepared.spec, prepared.model))
            if split_check:
                line = check_split(cfg, prepared.spec, prepared.plan, prepared.model, initial)
                assert line.startswith(f"check_split: the {len(prepared.plan.stages)} stages match"), line
            plan = prepared.plan if plans is None else plans[i]
            jobs.append(RankJob(prepared.run, plan, None, callbacks=(CaptureState(),) if capture else (), resume_from=prepared.resume_from,
                                initial_weights=str(initial.path) if initial.path is not None else None))
        world = jobs[0].plan.world_size
        env = rank_environment(cfgs[0].huge_pages)
        # without the test's own marker: the ranks fork from one server for every test of this worker
        # (launcher/spawn.py keeps it while the environment is unchanged); job_processes looks for
        # the processes of command-line runs, which start a server of their own
        with unmarked():
            per_rank = spawn_ranks(jobs, world, log_dir, echo_rank0=False, entry=rank_main_many, env=env)
    return [[per_rank[r][i] for r in range(world)] for i in range(len(jobs))]


def merge_state(rank_results: list[dict], key: str, dp_rank: int = 0) -> dict[str, torch.Tensor]:
    """Stitch one replica's per-stage tensors back into one name -> tensor map."""
    merged: dict[str, torch.Tensor] = {}
    for res in rank_results:
        if res.rank_info.dp_rank == dp_rank:
            merged.update(res.extras["state"][key])
    return merged


def assert_state_close(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], what: str,
                       elementwise: bool = True) -> None:
    """Every tensor within 1e-5 of the reference, relative to its own norm, or to 1e-3 of the
    largest norm (so within 1e-8 of it in absolute terms, a tenth of fp32's epsilon) for a tensor
    that is zero in exact arithmetic: a key bias under softmax, whose reference gradient is
    rounding noise (1.3e-9 of the largest under tp=2, where the sums run in another order). And, unless
    `elementwise=False`, every element within 1e-5 of it plus 1e-6 of the tensor's largest: a
    model whose traced operators round otherwise than its eager ones (export's attention) differs
    there by rounding noise alone."""
    assert set(got) == set(ref), f"{what}: parameter names differ: {sorted(set(got) ^ set(ref))}"
    floor = 1e-3 * max((float(r.norm()) for r in ref.values()), default=0.0) + 1e-12
    for name, r in ref.items():
        g = got[name]
        rel = float((g - r).norm()) / max(float(r.norm()), floor)
        assert rel <= 1e-5, f"{what}: {name} differs from the single-process reference by {rel:.2e} (relative)"
        if elementwise:
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6 * float(r.abs().max()) + 1e-5 * floor,
                                       msg=f"{what}: {name}")


def check_like_one_process(cases: list[tuple[str, TrainConfig]], tmp_path: Path,
                           inexact: tuple[str, ...] = ()) -> dict[str, list[dict]]:
    """Run (what, config) cases on real ranks, one spawn per world size, and check each against one
    process (`tests.reference`, the model as `torch.manual_seed(seed); factory()` builds it): losses,
    step 0's gradients and the final weights of every replica within 1e-5; element-wise too, but
    for the cases whose `what` starts with one of `inexact` (see `assert_state_close`). Returns
    each case's rank results, by `what`."""
    from tests.reference import reference_run

    worlds = sorted({cfg.world_size for _, cfg in cases})
    by_world = {w: [(what, cfg) for what, cfg in cases if cfg.world_size == w] for w in worlds}
    done = [(case, ranks) for w, group in by_world.items()
            for case, ranks in zip(group, run_jobs([cfg for _, cfg in group], tmp_path / f"logs{w}"), strict=True)]
    for (what, cfg), ranks in done:
        ref = reference_run(cfg)
        assert ranks[0].losses == pytest.approx(ref["losses"], rel=1e-5), what
        exact = not what.startswith(inexact)
        for d in range(cfg.dp):
            assert_state_close(merge_state(ranks, "grads_step0", d), ref["grads_step0"], f"{what} replica {d} grads",
                               exact)
            assert_state_close(merge_state(ranks, "params_final", d), ref["params_final"],
                               f"{what} replica {d} weights", exact)
    return {what: ranks for (what, _), ranks in done}


#: the environment variable tests/conftest.py sets to a fresh value for each test
JOB_MARK = "TEST_JOB_MARK"


@contextmanager
def unmarked() -> Iterator[None]:
    """This process's environment without the test's `JOB_MARK` for a while."""
    mark = os.environ.pop(JOB_MARK, None)
    try:
        yield
    finally:
        if mark is not None:
            os.environ[JOB_MARK] = mark


def job_processes() -> set[int]:
    """This test's processes (launchers, torchrun agents, spawned ranks): those whose environment
    carries its `JOB_MARK`, whatever session or parent they moved to; not multiprocessing's resource
    tracker, which the test process starts once and keeps for its life."""
    mark = os.environ.get(JOB_MARK)
    if mark is None:
        return set()
    needle = f"{JOB_MARK}={mark}".encode()
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if (needle in (entry / "environ").read_bytes().split(b"\0")
                    and b"resource_tracker" not in (entry / "cmdline").read_bytes()):
                found.add(int(entry.name))
        except OSError:
            continue
    return found


def assert_no_process_left(before: set[int], grace_s: float = 10.0) -> None:
    """Every job process started since `before` is gone (after a short grace for exits)."""
    import time

    deadline = time.monotonic() + grace_s
    while True:
        left = job_processes() - before
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not left, f"processes left behind: {sorted(left)}"


def use_stored_profile(mp, cache: Path, profile_file: Path, temporaries_file: Path) -> None:
    """Plan on stored measurements: $PIPELAUNCH_CACHE at `cache`, where the model's profile, the
    optimizer's temporaries and its step time (`sgd-step-time.json` beside the temporaries: SGD at
    one thread, measured on the development machine) are copied under whatever key the planner asks
    for (the keys hold the torch version). A test whose assertion hangs on a timing-driven choice (a balanced split, a
    recomputation) then plans the same way on every machine; measuring instead fails the test."""
    from pipelaunch.pipeline.planner.measure import optimizer_costs, profile

    mp.setenv("PIPELAUNCH_CACHE", str(cache))
    load = profile.load_cached

    def stored_load(key: str):
        path = cache / f"{key}.json"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            stored = (temporaries_file.with_name("sgd-step-time.json") if key.startswith("optimizer/time-")
                      else temporaries_file if key.startswith("optimizer/") else profile_file)
            shutil.copy(stored, path)
        return load(key)

    def no_save(key: str, data) -> None:
        raise AssertionError(f"the planner measured {key} instead of reading {profile_file.parent} (the model's "
                             f"nodes changed? then store a new profile there)")

    mp.setattr(profile, "load_cached", stored_load)
    mp.setattr(profile, "save_cached", no_save)
    mp.setattr(optimizer_costs, "load_cached", stored_load)  # it imported both by name
    mp.setattr(optimizer_costs, "save_cached", no_save)


def run_probe(script: str, world: int, tmp_path: Path, *args: str, timeout: float = 100) -> list[str]:
    """`python -c script <rank> <world> <file store> *args` on `world` processes (gloo ranks the
    script joins itself); every one must exit 0. Returns each rank's stdout."""
    store = str(tmp_path / "store")
    procs = [subprocess.Popen([sys.executable, "-c", script, str(r), str(world), store, *args], cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in range(world)]
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    return [out for out, _ in outs]
