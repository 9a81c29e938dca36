"""GPU launch hygiene and NCCL hang reports, checked on a machine without a GPU.

CUDA is made to look present by monkeypatching `torch.cuda.is_available` / `device_count`, and
every way into CUDA initialisation raises (`torch.cuda._lazy_init`, which the C++ side also calls
before making a tensor on a GPU; `torch.cuda.init`): a launcher path that would open a CUDA
context on a real GPU machine fails here instead.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

from pipelaunch.launcher.diagnose import where_ranks_were
from pipelaunch.launcher.plugins import build_plugin
from pipelaunch.launcher.validate import check_config, prepare
from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.graph.trace import trace_model
from pipelaunch.pipeline.planner.measure import profile as profile_mod
from pipelaunch.pipeline.planner.measure.autocast import autocast_dtypes
from pipelaunch.pipeline.runtime import flight_recorder
from pipelaunch.pipeline.runtime.context import select_device
from pipelaunch.pipeline.runtime.heartbeat import Heartbeat
from tests.harness import FAST, ROOT, compose_cfg

JOINED = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def _no_cuda_init(*_args, **_kwargs):
    raise AssertionError("CUDA was initialised")


@pytest.fixture
def fake_gpus(monkeypatch):
    """CUDA looks available with `n` GPUs (default 2); initialising it raises."""

    def install(n: int = 2, visible: str | None = "0,1", accelerator: bool = True) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "_lazy_init", _no_cuda_init)
        monkeypatch.setattr(torch.cuda, "init", _no_cuda_init)
        if accelerator:
            # where torch's fake tensors ask which accelerator this is, say CUDA, so that any fake
            # tensor code that would make a real tensor on the GPU reaches _lazy_init (torch's RNG
            # helpers, used by real CPU work, cannot take this answer)
            monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda check_available=False: "cuda")
        if visible is None:
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        else:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        for name in JOINED:
            monkeypatch.delenv(name, raising=False)

    return install


# ------------------------------------------------------------------------------------------ GPU count


@pytest.mark.parametrize("device", ["cuda", "auto"])
def test_node_with_fewer_gpus_than_ranks_is_refused_before_spawning(fake_gpus, device) -> None:
    fake_gpus(2)
    with pytest.raises(ConfigError) as info:
        check_config(compose_cfg([*FAST, "pp=2", "dp=2", f"device={device}"]))
    err = str(info.value)
    assert info.value.key == "device"
    assert "pp x dp = 2 x 2 = 4 ranks on this node need 4 GPUs" in err
    assert "2 are visible (torch.cuda.device_count(); CUDA_VISIBLE_DEVICES=0,1)" in err
    for way in ("lower pp or dp", "pp x dp <= 2", "device=cpu", "torchrun (--nproc-per-node 2",
                "hydra/launcher=submitit_slurm with hydra.launcher.tasks_per_node=2"):
        assert way in err, err
    assert "\n" not in err  # one paragraph


def test_enough_gpus_a_dry_run_and_the_cpu_are_not_refused(fake_gpus) -> None:
    fake_gpus(2)
    check_config(compose_cfg([*FAST, "pp=2", "device=cuda"]))
    check_config(compose_cfg([*FAST, "pp=4", "device=cuda", "mode=plan"]))  # plans for a larger node
    check_config(compose_cfg([*FAST, "pp=4", "device=cpu"]))


def test_joined_ranks_are_counted_by_local_world_size(fake_gpus, monkeypatch) -> None:
    fake_gpus(2, visible=None)
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("MASTER_ADDR", "node0")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(ConfigError) as info:
        check_config(compose_cfg([*FAST, "pp=4", "dp=2", "device=cuda"]))
    err = str(info.value)
    assert "LOCAL_WORLD_SIZE=4 ranks on this node need 4 GPUs" in err
    assert "CUDA_VISIBLE_DEVICES=<unset>" in err
    assert "torchrun --nproc-per-node 2" in err and "tasks_per_node=2" in err
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two nodes x four would fit two per node on eight
    check_config(compose_cfg([*FAST, "pp=4", "dp=2", "device=cuda"]))


def test_a_task_bound_to_its_own_gpu_by_the_scheduler_runs_on_it(fake_gpus, monkeypatch) -> None:
    """SLURM's --gpus-per-task=1 with binding: every task sees one GPU, named alone in its own
    CUDA_VISIBLE_DEVICES, whatever its local rank. Accepted for ranks torchrun or SLURM started;
    the launcher's own spawned ranks would all share that one GPU, so there it is refused."""
    fake_gpus(1, visible="3")
    for name, value in (("RANK", "6"), ("WORLD_SIZE", "8"), ("MASTER_ADDR", "node0"), ("MASTER_PORT", "29500"),
                        ("LOCAL_RANK", "2"), ("LOCAL_WORLD_SIZE", "4")):
        monkeypatch.setenv(name, value)
    check_config(compose_cfg([*FAST, "pp=4", "dp=2", "device=cuda"]))
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    assert select_device("cuda", 2) == torch.device("cuda", 0)
    for name in JOINED:
        monkeypatch.delenv(name)
    with pytest.raises(ConfigError, match="4 ranks on this node need 4 GPUs"):
        check_config(compose_cfg([*FAST, "pp=4", "device=cuda"]))


def test_a_rank_takes_its_own_gpu_and_never_wraps_around(fake_gpus, monkeypatch) -> None:
    fake_gpus(2)
    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    assert select_device("cuda", 1) == torch.device("cuda", 1)
    assert chosen == [torch.device("cuda", 1)]
    with pytest.raises(RuntimeError, match="local rank 2 has no GPU of its own: 2 visible"):
        select_device("cuda", 2)
    assert chosen == [torch.device("cuda", 1)]
    assert select_device("cpu", 5) == torch.device("cpu")


# ------------------------------------------------------------------------- no CUDA context in planning


@pytest.mark.parametrize("profile", [None, False])  # the launcher's path; a joined rank's validation
def test_planning_bf16_for_cuda_never_initialises_cuda(fake_gpus, profile) -> None:
    fake_gpus(2)
    cfg = compose_cfg([*FAST, "pp=2", "precision=bf16", "device=cuda"])
    plan = prepare(cfg, profile=profile).plan
    assert plan.meta.precision == "bf16"
    assert {dtype for stage in plan.stages for _, dtype in stage.values.values()} == {"float32", "bfloat16"}
    assert not torch.cuda.is_initialized()


class _Policy(nn.Module):
    """Ops whose autocast dtype differs between CUDA's policy and the CPU's, and a constant made
    on the input's device (diffusers does this)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        h = self.lin(x)
        s = torch.softmax(h, -1)
        return self.norm(s * torch.tensor([2.0], device=x.device))


def test_the_dtype_pass_applies_cudas_autocast_policy_without_a_gpu(fake_gpus) -> None:
    with torch.device("meta"):
        model = _Policy()
    traced = trace_model(model, torch.empty(2, 8, device="meta"))
    x = torch.empty(2, 8, device="meta")
    fake_gpus(1)
    on_cuda = autocast_dtypes(traced, x, torch.device("cuda"), torch.bfloat16)
    on_cpu = autocast_dtypes(traced, x, torch.device("cpu"), torch.bfloat16)
    assert on_cuda["lin"] == on_cpu["lin"] == torch.bfloat16
    assert on_cuda["softmax"] == torch.float32  # CUDA's policy runs softmax in fp32 ...
    assert on_cpu["softmax"] == torch.bfloat16  # ... the CPU's does not: the pass follows the device
    assert not torch.is_autocast_enabled("cuda") and not torch.is_autocast_enabled("cpu")  # restored
    assert not torch.cuda.is_initialized()


# ------------------------------------------------------------------------------ profiling on the GPU


def test_profile_cache_key_names_the_gpu_model_not_its_index(monkeypatch) -> None:
    names = {0: "NVIDIA H100 80GB HBM3", 3: "NVIDIA H100 80GB HBM3", 1: "NVIDIA A100-SXM4-40GB"}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: names[torch.device(d).index])
    inputs = [torch.zeros(2, 8, dtype=torch.long)]
    key = lambda device: profile_mod.profile_key({"model": {"dim": 8}}, inputs, device)  # noqa: E731
    assert profile_mod.device_label("cuda:3") == "cuda:NVIDIA H100 80GB HBM3"
    assert key("cuda:0") == key(torch.device("cuda", 3))  # the same model of GPU: one profile
    assert key("cuda:0") != key("cuda:1")  # another model: another profile
    assert key("cuda:0") != key("cpu")
    assert profile_mod.device_label("cpu") == "cpu"


def test_a_gpu_run_is_profiled_by_a_child_on_rank_0s_gpu_and_a_rank_on_its_own(fake_gpus, monkeypatch) -> None:
    from pipelaunch.pipeline.planner.measure import traced as search

    fake_gpus(2, accelerator=False)  # the stand-ins below profile on the CPU for real
    asked = []

    def child(cfg, model, micro_batch_size, device, tp_modules=None, tp=1, ep=None):  # the child process, on the CPU here
        asked.append(("child", device))
        spec = model.build()
        traced = spec.trace(micro_batch_size, spec.build_meta())
        search.profile_traced(spec, cfg, [traced], [micro_batch_size], torch.device("cpu"))
        return search.profiled_nodes(traced.graph), False

    monkeypatch.setattr(search, "profile_in_child", child)
    cfg = compose_cfg([*FAST, "pp=2", "device=cuda", "partitioner=balanced"])
    prepare(cfg)
    assert asked == [("child", torch.device("cuda", 0))] and not torch.cuda.is_initialized()

    real = search.profile_graphs

    def here(jobs, device="cpu", **kwargs):  # a rank's own GPU, timed on the CPU here
        asked.extend(("here", torch.device(device), job.model_config) for job in jobs)
        real(jobs, device="cpu", **{**kwargs, "use_cache": False})

    monkeypatch.setattr(search, "profile_graphs", here)
    asked.clear()
    prepare(cfg, device=torch.device("cuda", 1))  # rank 0 of a joined run, on GPU 1 of its node
    assert asked == [("here", torch.device("cuda", 1), {"model": cfg.model})]  # no CPU threads in the key


def test_the_profiling_child_retraces_to_the_same_nodes(tmp_path, monkeypatch) -> None:
    """The real child process (on the CPU here): its profile fits the parent's trace node for node."""
    from pipelaunch.pipeline.planner.measure import traced as search

    monkeypatch.setenv("PIPELAUNCH_CACHE", str(tmp_path))
    cfg = compose_cfg([*FAST, "pp=2"])
    model = build_plugin("model", cfg.model)
    spec = model.build()
    traced = spec.trace(4, spec.build_meta())
    nodes, cached = search.profile_in_child(cfg, model, 4, torch.device("cpu"))
    profile_mod.apply_profile(traced.graph, nodes)
    assert cached is False and all(traced.graph.nodes[n]["forward_s"] > 0 for n in traced.graph.nodes)


# -------------------------------------------------------------------------------- NCCL hang reports


def test_ranks_on_nccl_get_the_timeout_settings_and_the_flight_recorder(tmp_path) -> None:
    env = flight_recorder.nccl_environment(tmp_path / "logs")
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert int(env["TORCH_NCCL_TRACE_BUFFER_SIZE"]) == int(env["TORCH_FR_BUFFER_SIZE"]) > 0
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == env["TORCH_FR_DUMP_TEMP_FILE"] == \
        str(tmp_path / "logs" / "nccl_trace_rank_")
    mine = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}
    added = flight_recorder.apply_nccl_environment(tmp_path / "logs", mine)
    assert mine["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3" and "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in added
    assert mine["TORCH_FR_DUMP_TEMP_FILE"] == env["TORCH_FR_DUMP_TEMP_FILE"] and (tmp_path / "logs").is_dir()


def _entry(record_id: int, name: str, state: str, group=("0", "default_pg"), p2p: bool = True, seq: int = 0,
           sizes=((4, 8, 32),), dtype: str = "Float") -> dict:
    """One flight recorder entry with the fields torch writes (ProcessGroupNCCL's names)."""
    return {
        "record_id": record_id, "pg_id": int(group[0]), "process_group": group,
        "collective_seq_id": 0 if p2p else seq, "p2p_seq_id": seq if p2p else 0, "op_id": record_id + 1,
        "profiling_name": name, "time_created_ns": 1_700_000_000_000_000_000 + record_id,
        "input_sizes": [list(s) for s in sizes], "input_dtypes": [dtype] * len(sizes),
        "output_sizes": [list(s) for s in sizes], "output_dtypes": [dtype] * len(sizes),
        "state": state, "time_discovered_started_ns": None, "time_discovered_completed_ns": None,
        "retired": state == "completed", "timeout_ms": 120_000, "is_p2p": p2p, "duration_ms": None,
        "thread_id": "1", "thread_name": "pt_main_thread", "frames": [],
    }


def _dump(entries: list[dict], groups: dict[str, list[int]]) -> dict:
    return {
        "version": "2.10", "comm_lib_version": "2.27.5",
        "pg_config": {name: {"name": name, "desc": "default_pg" if name == "0" else "undefined", "ranks": str(ranks)}
                      for name, ranks in groups.items()},
        "pg_status": {name: {"last_enqueued_collective": 3, "last_started_collective": 2,
                             "last_completed_collective": 1} for name in groups},
        "entries": entries,
    }


def _write_dumps(directory, groups) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    prefix = flight_recorder.dump_prefix(directory)
    rank0 = [
        _entry(0, "nccl:all_reduce", "completed", p2p=False, seq=1, sizes=((1,),)),
        _entry(1, "nccl:send 0->1", "completed", seq=1),
        _entry(2, "nccl:recv 0<-1", "started", seq=2, dtype="BFloat16"),
        _entry(3, "nccl:send 0->1", "scheduled", seq=3),
    ]
    # rank 3 in a pipeline group of global ranks [2, 3]: its group rank 0 is global rank 2
    rank3 = [_entry(0, "nccl:send 1->0", "completed", group=("1", "undefined"), seq=1),
             _entry(1, "nccl:all_reduce", "completed", group=("1", "undefined"), p2p=False, seq=1, sizes=((1,),))]
    for rank, entries in ((0, rank0), (3, rank3)):
        with open(f"{prefix}{rank}", "wb") as f:
            pickle.dump(_dump(entries, groups), f)
    return prefix


def test_flight_recorder_dumps_say_which_operation_each_rank_was_in(tmp_path) -> None:
    prefix = _write_dumps(tmp_path, {"0": [0, 1, 2, 3], "1": [2, 3]})
    where = flight_recorder.where_ranks(prefix)
    assert where[0] == ("recv from rank 1, [4, 8, 32] BFloat16 (P2P #2), started, not completed; "
                        "1 more queued behind it")
    assert where[3] == ("every recorded NCCL operation completed, the last: all_reduce over ranks [2, 3], "
                        "[1] Float (collective #1), completed")
    assert flight_recorder.describe_entry(_dump([], {"1": [2, 3]}),
                                          _entry(0, "nccl:send 1->0", "scheduled", group=("1", "undefined"))) \
        == "send to rank 2, [4, 8, 32] Float (P2P #0), enqueued, not started"
    assert flight_recorder.where_ranks(prefix, since=time.time() + 60) == {}  # an earlier run's dumps


def test_a_dump_that_names_code_is_not_run(tmp_path) -> None:
    prefix = flight_recorder.dump_prefix(tmp_path)
    with open(f"{prefix}0", "wb") as f:
        pickle.dump({"entries": [os.getcwd]}, f)  # would need a global to load
    with open(f"{prefix}1", "wb") as f:
        f.write(b"\x80\x04half a dump")
    assert flight_recorder.read_dumps(prefix) == {}


def test_the_hang_report_folds_the_dump_under_each_ranks_heartbeat(tmp_path) -> None:
    plan = prepare(compose_cfg([*FAST, "pp=2", "dp=2"])).plan
    beats = tmp_path / "heartbeat"
    Heartbeat(0, str(beats)).action(3)
    prefix = _write_dumps(tmp_path / "logs", {"0": [0, 1, 2, 3], "1": [2, 3]})
    report = where_ranks_were(beats, plan, prefix)
    lines = report.splitlines()
    assert lines[0] == "where each rank was:"
    head = lines.index(next(line for line in lines if line.startswith("  rank 0 (pp 0, dp 0): step 0, ")))
    assert lines[head + 1].startswith("    on NCCL: recv from rank 1, [4, 8, 32] BFloat16 (P2P #2), started")
    assert "  rank 1 (pp 1, dp 0): no heartbeat (it never started)" in lines
    assert lines[lines.index("  rank 3 (pp 1, dp 1): no heartbeat") + 1].startswith(
        "    on NCCL: every recorded NCCL operation completed")
    assert where_ranks_were(tmp_path / "none", plan, tmp_path / "none" / "x") == ""
    assert "on NCCL" not in where_ranks_were(beats, plan)  # gloo: heartbeats only


def test_a_dump_torch_itself_wrote_is_read(tmp_path) -> None:
    """torch's own flight recorder (recording gloo collectives on the CPU) writes the pickle that
    ProcessGroupNCCL's watchdog writes on a timeout; the reader takes it as it is."""
    prefix = flight_recorder.dump_prefix(tmp_path)
    code = (
        "import os, sys, torch, torch.distributed as dist\n"
        "from torch._C._distributed_c10d import _dump_fr_trace\n"
        "dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)\n"
        "dist.all_reduce(torch.ones(3))\n"
        "open(sys.argv[1] + '0', 'wb').write(_dump_fr_trace())\n"
    )
    env = {**os.environ, "TORCH_FR_BUFFER_SIZE": "16"}
    subprocess.run([sys.executable, "-c", code, prefix], check=True, env=env, timeout=120, cwd=ROOT)
    dump = flight_recorder.read_dumps(prefix)[0]
    assert {"version", "pg_config", "entries"} <= set(dump)
    assert flight_recorder.where_ranks(prefix)[0].startswith("all_reduce")
    assert "[3] Float (collective #1)" in flight_recorder.where_ranks(prefix)[0]


# ---------------------------------------------------------------------------------- the smoke check


def test_gpu_smoke_check_says_so_without_cuda(tmp_path) -> None:
    proc = subprocess.run([sys.executable, "bench/gpu_smoke.py", "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 2, proc.stderr
    assert "no CUDA device" in proc.stderr
    report = (tmp_path / "gpu_smoke.json").read_text()
    assert '"status": "no_cuda"' in report
