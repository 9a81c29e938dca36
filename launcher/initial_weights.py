"""Which initial weights a run starts from, and the file that carries them to the ranks (#33).

The contract (docs/your_model.md):
- **constructor** (`init.weights=auto` up to `init.max_bytes`, or asked for): the model is built
  once per node, for real, on the CPU, as `torch.manual_seed(seed); factory()` builds it in the
  user's own script; its tensors go to one safetensors file under $TMPDIR, and each rank reads
  only its own stages' tensors from it by name. The same weights under every layout, bit for bit,
  and the same as the user's own script.
- **by_name** (above the limit, or asked for): no process ever holds the whole model; each rank
  initialises its own stages' tensors by (seed, name) (`pipeline.graph.init`). The same under every
  layout, but only the distributions the model's initialisers give: what a constructor does
  outside `reset_parameters`, `_init_weights` or `init_weights()` is not reproduced.
- Pretrained weights (`model.path`) are read by name over either: the tensors they do not hold
  (a constructor's non-persistent buffers) keep the constructor's values, or by_name's.

Spawned ranks get the launcher's file; ranks torchrun or SLURM started write one per node (its
local rank 0 builds it; every rank learns its node's path over a gloo group whose timeout allows
for the build).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from torch import nn

from pipelaunch.models.spec import ModelSpec
from pipelaunch.pipeline.core.config import InitWeights, TrainConfig
from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.graph.initial_weights import (
    built_as_written,
    load_into,
    model_bytes,
    write_initial_weights,
)

FILE = "initial_weights.safetensors"
#: the longest a rank waits for its node's file (a large model's build on the CPU)
NODE_WAIT = timedelta(hours=2)


@dataclass
class Initial:
    """What the run starts from: `kind` (constructor or by_name; pretrained weights override either),
    the file the ranks read (constructor), the model built for it (the split check's reference),
    and the log line."""

    kind: str
    path: Path | None = None
    model: nn.Module | None = None
    line: str = ""


def choose(cfg: TrainConfig, spec: ModelSpec, meta_model: nn.Module | None) -> tuple[str, str]:
    """(kind, why): `constructor` or `by_name`, whether or not pretrained weights (`model.path`) then
    override what they hold; refuses by_name where it cannot reproduce a buffer the forward reads."""
    size = model_bytes(meta_model if meta_model is not None else spec.build_meta())
    weights = InitWeights(str(cfg.init.weights))
    if weights == InitWeights.constructor or (weights == InitWeights.auto and size <= cfg.init.max_bytes):
        return "constructor", f"init.weights={weights}, {size / 2**20:.1f} MiB of parameters and buffers"
    why = ("init.weights=by_name" if weights == InitWeights.by_name else
           f"the model's {size / 2**30:.1f} GiB of parameters and buffers exceed init.max_bytes="
           f"{cfg.init.max_bytes / 2**30:g} GiB")
    uncomputed = spec.meta.get("uncomputed_buffers_read") or []
    if uncomputed:
        raise ConfigError("init.weights", f"by_name ({why}) cannot reproduce the buffer(s) "
                                          f"{', '.join(uncomputed[:6])} the model's constructor computes and its forward "
                                          "reads: no initialiser computes them again and no checkpoint holds them, so "
                                          "every rank would start them from zeros. Use init.weights=constructor (the "
                                          "model built once on the CPU; raise init.max_bytes if it is large)")
    return "by_name", why


def describe(kind: str, why: str, seed: int, pretrained: bool, nbytes: int = 0, seconds: float = 0.0) -> str:
    """The run log's line saying where the weights come from and what that means."""
    if kind == "constructor":
        line = (f"the model's own constructor, torch.manual_seed({seed}); factory(), built once on the CPU "
                f"({nbytes / 2**20:.1f} MiB in {seconds:.2f} s; {why}); each rank reads its stages' tensors by name")
        if pretrained:
            return f"initial weights: pretrained (model.path), read by name; the tensors it lacks from {line}"
        return f"initial weights: {line}: the same weights under every layout as in your own script"
    line = (f"by (seed, name) ({why}): each rank initialises its own stages' tensors through reset_parameters and "
            "the model's _init_weights / init_weights(); the same under every layout, but not the values your "
            "constructor draws (init.weights=constructor builds it as written)")
    if pretrained:
        return f"initial weights: pretrained (model.path), read by name; the tensors it lacks {line}"
    return f"initial weights: {line}"


def _write(spec: ModelSpec, seed: int, directory: Path) -> tuple[Path, nn.Module, int, float]:
    """The model as written, under pretrained weights where the spec has them, into `directory`:
    the file holds exactly what the ranks start from, and the model is the split check's reference."""
    start = time.perf_counter()
    model = built_as_written(spec.build, seed)
    if spec.from_checkpoint:
        load_into(model, spec.load)
    path = directory / FILE
    nbytes = write_initial_weights(model, path)
    return path, model, nbytes, time.perf_counter() - start


@contextmanager
def launcher_initial_weights(cfg: TrainConfig, spec: ModelSpec, meta_model: nn.Module | None) -> Iterator[Initial]:
    """The weights of a run whose ranks this launcher spawns: for the constructor path, the file
    (removed when the block ends) and the model built for it."""
    kind, why = choose(cfg, spec, meta_model)
    if kind != "constructor":
        yield Initial(kind, line=describe(kind, why, cfg.seed, spec.from_checkpoint))
        return
    directory = Path(tempfile.mkdtemp(prefix="pipelaunch-init-"))
    try:
        path, model, nbytes, seconds = _write(spec, cfg.seed, directory)
        yield Initial(kind, path, model, describe(kind, why, cfg.seed, spec.from_checkpoint, nbytes, seconds))
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@contextmanager
def node_initial_weights(cfg: TrainConfig, spec: ModelSpec, meta_model: nn.Module | None,
                         local_rank: int) -> Iterator[Initial]:
    """For ranks torchrun or SLURM started, inside their process group: each node's local rank 0
    writes the file, and every rank learns its node's path over a gloo group whose timeout allows
    for the build. A node's ranks are consecutive (torchrun and SLURM number them so), so a rank's
    leader is global rank - LOCAL_RANK. Every rank calls this."""
    import torch.distributed as dist

    kind, why = choose(cfg, spec, meta_model)
    if kind != "constructor":
        yield Initial(kind, line=describe(kind, why, cfg.seed, spec.from_checkpoint))
        return
    group = dist.new_group(backend="gloo", timeout=NODE_WAIT)
    directory, line, model = None, "", None
    try:
        mine = None
        if local_rank == 0:
            directory = Path(tempfile.mkdtemp(prefix="pipelaunch-init-"))
            path, model, nbytes, seconds = _write(spec, cfg.seed, directory)
            mine, line = str(path), describe(kind, why, cfg.seed, spec.from_checkpoint, nbytes, seconds)
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine, group=group)
        leader = dist.get_rank() - local_rank
        if everyone[leader] is None:
            raise RuntimeError(f"rank {leader}, this node's LOCAL_RANK=0 by numbering, wrote no initial weights: "
                               "ranks of one node must be numbered consecutively (torchrun and SLURM do)")
        yield Initial(kind, Path(everyone[leader]), model, line or describe(kind, why, cfg.seed, spec.from_checkpoint))
    finally:
        dist.destroy_process_group(group)
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)
