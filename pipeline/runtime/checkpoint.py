"""Checkpoints keyed by name, not by rank, so they resume under any (pp, dp, schedule, partition).

A checkpoint is a directory `step_<N>` (N: the next step to run) written with
torch.distributed.checkpoint (DCP): every rank saves the tensors of its own stages (under
`zero` >= 1 the shards it holds of them: DTensors, whose global shape DCP records, so any layout
reads back its own part),
`model/<fqn>` for parameters and buffers and `optim/<fqn>/<key>` for the optimizer's state, under
the full model's qualified names (replicas and tied copies hold the same key and DCP writes it
once). Rank 0 adds `meta.json`: the step, the global sample index, the LR schedule's state, the
optimizer's hyper-parameters and the losses so far (JSON: loading never unpickles anything).

Complete or invisible: the files go to `step_<N>.partial`, and only once DCP's metadata and
meta.json are both written does rank 0 rename it to `step_<N>` (an atomic rename on one
filesystem); every rank waits for that. `resume=auto` takes the highest complete `step_<N>`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from pipelaunch.pipeline.core.errors import ConfigError

META = "meta.json"
STEP_DIR = re.compile(r"^step_(\d+)$")
FORMAT = 1


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:07d}"


def is_complete(path: Path) -> bool:
    """DCP's own metadata and ours are both there: the rename happened after both were written."""
    return STEP_DIR.match(path.name) is not None and (path / ".metadata").is_file() and (path / META).is_file()


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and is_complete(p)]
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)))


def resolve_resume(resume: str, root: Path) -> Path | None:
    """`resume=none` -> None; `auto` -> the latest complete checkpoint under `root` (None when there
    is none yet: a fresh start); a path -> that checkpoint, which must be complete."""
    if resume in (None, "none"):
        return None
    if resume == "auto":
        found = complete_checkpoints(root)
        return found[-1] if found else None
    path = Path(resume)
    if not path.is_dir():
        raise ConfigError("resume", f"{resume!r} is not a directory; valid: none, auto (the latest complete "
                                    f"checkpoint under checkpoint.dir) or a step_<N> checkpoint directory")
    if not is_complete(path):
        raise ConfigError("resume", f"{resume} is not a complete checkpoint (a step_<N> directory holding .metadata "
                                    f"and {META}); an interrupted save leaves step_<N>.partial, which is never loaded")
    return path


def read_meta(path: Path) -> dict:
    return json.loads((path / META).read_text())


def stored_tensors(path: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor of a checkpoint: key -> (shape, dtype), from DCP's metadata alone."""
    import torch.distributed.checkpoint as dcp  # DCP (a second of imports) only where a run checkpoints
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    return {key: (tuple(meta.size), meta.properties.dtype) for key, meta in metadata.state_dict_metadata.items()
            if isinstance(meta, TensorStorageMetadata)}


def named_tensors(modules: list[nn.Module]) -> Iterator[tuple[str, torch.Tensor, bool]]:
    """(qualified name in the full model, tensor, is a parameter) for this rank's stages, each once."""
    seen: set[str] = set()
    for module in modules:
        for name, p in module.named_model_parameters():
            if name not in seen:
                seen.add(name)
                yield name, p, True
        for name, b in module.gm.named_buffers():
            canonical = module.aliases.get(name, name)
            if canonical not in seen:
                seen.add(canonical)
                yield canonical, b, False


def _rng_key(ctx) -> str:
    tp = f"_tp{ctx.tp_rank}of{ctx.tp}" if ctx.tp > 1 else ""
    return f"rng/pp{ctx.pp_rank}of{ctx.pp}_dp{ctx.dp_rank}of{ctx.dp}{tp}"


def split_dims(modules: list[nn.Module]) -> dict[str, int]:
    """Under tp > 1, the parameters this rank holds a slice of (by every name) -> the dimension."""
    return {n: d for m in modules for n, d in getattr(m, "split_dims", {}).items()}


def expert_params(modules: list[nn.Module]) -> set[str]:
    """Under ep > 1, the parameters this rank holds its experts' share of, stacked along the
    experts (runtime/experts.py): what `expert_view` puts back whole. A list's experts are each
    held whole by their owner, under their own names: written and read as they are."""
    return {n for m in modules for n in getattr(m, "expert_params", ()) if n not in getattr(m, "whole_experts", ())}


def expert_view(tensor: torch.Tensor, ctx) -> torch.Tensor:
    """This rank's experts of a parameter (or its optimizer state) as a DTensor over the ep group,
    Shard(0) along the expert dimension: the checkpoint holds every expert, keyed by the
    parameter's name, whatever ep wrote it. Sharded over the expert replicas too (zero >= 1 with
    1 < ep < dp: FSDP2's Shard(0) on the expert_dp mesh), 2-D: Shard(0) over ep, then Shard(0) over
    expert_dp within each rank's experts, as `global_view` nests tp and dp."""
    if tensor.dim() == 0:
        return tensor
    shape = [tensor.shape[0] * ctx.ep, *tensor.shape[1:]]  # a DTensor's: its shard group's experts
    stride = torch.empty(shape, device="meta").stride()
    if isinstance(tensor, DTensor):
        return DTensor.from_local(tensor.to_local(), ctx.mesh.ep_expert_dp, [Shard(0), Shard(0)], run_check=False,
                                  shape=torch.Size(shape), stride=stride)
    return DTensor.from_local(tensor, ctx.mesh["ep"], [Shard(0)], run_check=False, shape=torch.Size(shape),
                              stride=stride)


def global_view(tensor: torch.Tensor, dim: int | None, ctx) -> torch.Tensor:
    """What DCP writes and reads for this rank's `tensor` of a parameter (or its optimizer state):
    the tensor itself, or, split by tensor parallelism along `dim`, a DTensor over the tp ranks
    (2-D over tp x replicas when zero >= 1 shards the slice too) whose global shape is the whole
    parameter's. Shares the tensor's memory: a load fills it in place. So a checkpoint holds every
    parameter whole, keyed by name, whatever tp, pp, dp and zero wrote it."""
    if dim is None or tensor.dim() == 0:
        return tensor
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    shape = list(tensor.shape)  # a DTensor's over the replicas: the tp slice's
    shape[dim] *= ctx.tp
    stride = torch.empty(shape, device="meta").stride()
    if isinstance(tensor, DTensor):  # FSDP2's Shard(0) over the replicas, inside the tp slice
        return DTensor.from_local(local, ctx.tp_dp_mesh(), [Shard(dim), Shard(0)], run_check=False,
                                  shape=torch.Size(shape), stride=stride)
    return DTensor.from_local(local, ctx.mesh["tp"], [Shard(dim)], run_check=False, shape=torch.Size(shape),
                              stride=stride)


def rank_state(modules: list[nn.Module], optimizer: torch.optim.Optimizer | None, ctx) -> dict[str, torch.Tensor]:
    """What this rank writes: its stages' tensors, their optimizer state, its RNG states."""
    state: dict[str, torch.Tensor] = {}
    dims, experts = split_dims(modules), expert_params(modules)

    def view(name: str, t: torch.Tensor) -> torch.Tensor:
        return expert_view(t, ctx) if name in experts else global_view(t, dims.get(name), ctx)

    for name, tensor, is_param in named_tensors(modules):
        state[f"model/{name}"] = view(name, tensor.detach())
        if is_param and optimizer is not None:
            for key, value in optimizer.state.get(tensor, {}).items():
                if isinstance(value, torch.Tensor):
                    state[f"optim/{name}/{key}"] = view(name, value.detach())
    state[f"{_rng_key(ctx)}/cpu"] = torch.get_rng_state()
    if ctx.device.type == "cuda":
        state[f"{_rng_key(ctx)}/cuda"] = torch.cuda.get_rng_state(ctx.device)
    return state


def save(root: Path, step: int, modules: list[nn.Module], optimizer, lr_scheduler, ctx, meta: dict) -> Path:
    """Write checkpoint `step_<step>` collectively (every rank calls this); returns its path."""
    final = step_dir(root, step)
    partial = final.with_name(final.name + ".partial")
    if ctx.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob("*.partial"):  # left by a job that died while saving
            shutil.rmtree(stale, ignore_errors=True)
    dist.barrier()
    import torch.distributed.checkpoint as dcp

    dcp.save(rank_state(modules, optimizer, ctx), storage_writer=dcp.FileSystemWriter(str(partial)))
    if ctx.rank == 0:
        record = {
            "format": FORMAT, **meta, "step": step,
            "lr_scheduler": _jsonable(lr_scheduler.state_dict()) if lr_scheduler is not None else None,
            "param_groups": ([{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
                             if optimizer is not None else None),
        }
        with (partial / META).open("w") as f:
            json.dump(record, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        if final.exists():  # the same step saved again (a rerun in the same directory)
            shutil.rmtree(final)
        os.replace(partial, final)
    dist.barrier()  # nobody goes on (or dies) before the checkpoint is visible
    return final


def prune(root: Path, keep: int) -> list[Path]:
    """Delete all but the `keep` newest complete checkpoints (rank 0 only); returns what went."""
    if keep <= 0:
        return []
    old = complete_checkpoints(root)[:-keep]
    for path in old:
        shutil.rmtree(path, ignore_errors=True)
    return old


def load(path: Path, modules: list[nn.Module], optimizer, lr_scheduler, ctx) -> dict:
    """Fill this rank's tensors, optimizer state, LR schedule (and RNG, on the same layout) from
    checkpoint `path` (every rank calls this); returns its meta.json."""
    stored = stored_tensors(path)
    meta = read_meta(path)
    optim_keys: dict[str, list[tuple[str, str]]] = {}  # parameter name -> (stored key, state key)
    for key in stored:
        if key.startswith("optim/"):
            name, state_key = key.removeprefix("optim/").rsplit("/", 1)
            optim_keys.setdefault(name, []).append((key, state_key))
    dest: dict[str, torch.Tensor] = {}
    optim_state: dict[str, dict[str, torch.Tensor]] = {}
    params: dict[str, torch.Tensor] = {}
    dims, experts = split_dims(modules), expert_params(modules)

    def view(name: str, t: torch.Tensor) -> torch.Tensor:
        return expert_view(t, ctx) if name in experts else global_view(t, dims.get(name), ctx)

    for name, tensor, is_param in named_tensors(modules):
        key = f"model/{name}"
        if key not in stored:
            if is_param:
                raise RuntimeError(f"checkpoint {path} has no parameter {name!r}: it was written for another model")
            continue  # a buffer the model recomputes (not in the checkpoint): keep the initialised one
        dest[key] = view(name, tensor.detach())
        if not is_param or optimizer is None:
            continue
        params[name] = tensor
        for skey, state_key in optim_keys.get(name, []):
            shape, dtype = stored[skey]
            # a sharded parameter's state is sharded as it is (zero >= 1): DCP reads this rank's part
            # whatever layout wrote it
            like = ((name in dims or name in experts) and len(shape) > 0) or (
                isinstance(tensor, DTensor) and tuple(shape) == tuple(tensor.shape))
            value = torch.empty_like(tensor.detach(), dtype=dtype) if like else torch.empty(shape, dtype=dtype)
            optim_state.setdefault(name, {})[state_key] = value
            dest[skey] = view(name, value) if like else value
    rng = _rng_key(ctx)
    same_layout = f"{rng}/cpu" in stored
    if same_layout:  # dropout continues exactly only on the layout that wrote it
        dest[f"{rng}/cpu"] = torch.empty(stored[f"{rng}/cpu"][0], dtype=torch.uint8)
        if ctx.device.type == "cuda" and f"{rng}/cuda" in stored:
            dest[f"{rng}/cuda"] = torch.empty(stored[f"{rng}/cuda"][0], dtype=torch.uint8)
    with torch.no_grad():
        import torch.distributed.checkpoint as dcp

        dcp.load(dest, storage_reader=dcp.FileSystemReader(str(path)))
    if optimizer is not None:
        for name, values in optim_state.items():
            p = params[name]
            optimizer.state[p] = {k: v if v.dim() == 0 else v.to(p.device) for k, v in values.items()}
        for group, saved in zip(optimizer.param_groups, meta.get("param_groups") or [], strict=False):
            group.update({k: tuple(v) if k == "betas" else v for k, v in saved.items()})
    if lr_scheduler is not None and meta.get("lr_scheduler"):
        lr_scheduler.load_state_dict(meta["lr_scheduler"])
    if same_layout:
        torch.set_rng_state(dest[f"{rng}/cpu"])
        if f"{rng}/cuda" in dest:
            torch.cuda.set_rng_state(dest[f"{rng}/cuda"], ctx.device)
    return meta


def _jsonable(value):
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items() if not callable(v)}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, torch.Tensor):
        return value.tolist()
    return value
