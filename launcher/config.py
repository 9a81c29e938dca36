"""The typed schema of the primary config, registered in Hydra's ConfigStore.

Top-level numbers (`pp`, `dp`, ...) are plain int keys, not config groups: Hydra cannot select a
group option by a number on the command line. Group contents stay open (`Any`) because each
option carries its own fields and `_target_`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


@dataclass
class TrainConfig:
    model: Any = MISSING
    data: Any = MISSING
    scheduler: Any = MISSING
    partitioner: Any = MISSING
    placement: Any = MISSING
    optimizer: Any = MISSING
    logger: Any = MISSING
    memory: Any = MISSING
    #: pipeline-parallel degree: ranks per pipeline.
    pp: int = 2
    #: data-parallel degree: number of pipeline replicas.
    dp: int = 1
    #: micro-batches per step in each replica.
    microbatches: int = 4
    #: the global batch (sequences per optimizer step), the same whatever pp and dp are.
    batch_size: int = 16
    steps: int = 10
    #: steps excluded from timing (the first ones pay for allocation and warm caches).
    warmup_steps: int = 2
    seed: int = 0
    #: auto | cpu | cuda
    device: str = "auto"
    #: none | full (keep only stage inputs in the forward, recompute in the backward) | auto (under
    #: memory=budget: recompute only on the stages that would not fit otherwise)
    remat: str = "none"
    #: train | plan (dry run: plan, simulate, draw; no ranks)
    mode: str = "train"
    #: print a line every this many steps on rank 0.
    log_every: int = 1
    #: seconds any collective or P2P wait may take before the job fails.
    timeout_s: int = 120
    #: CPU threads per rank; 0 = cores / local ranks, at least 1.
    threads: int = 0
    #: retain (keep freed host memory for reuse: no page faults on every new activation) | system
    host_allocator: str = "retain"
    #: back rank heaps with transparent huge pages (glibc tunable, set for the ranks the launcher spawns)
    huge_pages: bool = True
    #: auto (bind each local rank to its own `threads` cores when they cover all ranks) | none
    cpu_affinity: str = "auto"
    #: link model for the simulator's predictions (seconds per message, bytes per second).
    link_latency_s: float = 5e-5
    link_bandwidth: float = 1e9


def group_configs(group: str) -> dict[str, dict]:
    """Every option of a config group as a plain dict, found on this run's own search path (the
    project's conf/ and any `hydra.searchpath` entry, so a user's package counts); empty outside a
    Hydra app. Why: `scheduler=auto` compares every schedule the user could have chosen by name,
    not a list kept in code."""
    from hydra._internal.config_repository import ConfigRepository
    from hydra._internal.config_search_path_impl import ConfigSearchPathImpl
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.object_type import ObjectType
    from omegaconf import OmegaConf

    if not HydraConfig.initialized():
        return {}
    search_path = ConfigSearchPathImpl()
    for source in HydraConfig.get().runtime.config_sources:
        search_path.append(source.provider, f"{source.schema}://{source.path}")
    repo = ConfigRepository(config_search_path=search_path)
    out = {}
    for option in repo.get_group_options(group, results_filter=ObjectType.CONFIG):
        loaded = repo.load_config(f"{group}/{option}")
        if loaded is not None:
            out[option] = OmegaConf.to_container(loaded.config, resolve=False)
    return out


def register_configs() -> None:
    ConfigStore.instance().store(name="train_schema", node=TrainConfig)
