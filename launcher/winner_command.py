"""The command line that runs what `plan=auto` chose: the user's own overrides, less what the search
decided, plus the winner's settings; on a hardware file, the same for SLURM through
hydra-submitit-launcher (nodes, a task and a GPU per device).

Why: a search over thousands of devices ends in a layout the user must type back by hand
(pp, dp, tp, a schedule and its settings, micro-batches, recomputation, sharding); a typo there
runs another job than the one planned.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from pipelaunch.pipeline.core.hardware import Hardware
from pipelaunch.pipeline.planner.search.choose import Candidate

#: keys only planning reads: left out of the user's overrides, as is every key the winner sets
PLANNING = ("mode", "plan")


def _key(override: str) -> str:
    return override.lstrip("+~").split("=", 1)[0]


def chosen_overrides(c: Candidate) -> list[str]:
    """The winner as overrides: its layout, schedule (with a variant's settings), split,
    micro-batches, recomputation and sharding."""
    name, _, settings = c.scheduler.partition("(")
    out = [f"{k}={v}" for k, v in c.layout().items()] + [f"scheduler={name}"]
    out += [f"scheduler.{k.strip()}={v.strip()}" for k, v in
            (pair.split("=", 1) for pair in re.split(r",\s*", settings.rstrip(")")) if "=" in pair)]
    out += [f"partitioner={c.partitioner}", f"microbatches={c.microbatches}", f"remat={c.remat}"]
    if c.zero is not None:
        out.append(f"zero={c.zero}")
    if c.reshard is not None:
        out.append(f"reshard={c.reshard}")
    return out


def _quoted(override: str) -> str:
    return f"'{override}'" if any(ch in override for ch in " []{},*$") else override


def winner_commands(overrides: Sequence[str], c: Candidate, devices: int, hw: Hardware | None) -> list[str]:
    """The command lines that run `c`: here (or under torchrun), and on a hardware file through
    SLURM (`devices` GPUs, `hw.devices_per_node` a node)."""
    chosen = chosen_overrides(c)
    # what the search did not vary (the configured zero, say) keeps the user's own value
    decided = {*PLANNING, *(_key(o).split(".")[0] for o in chosen)}
    kept = [o for o in overrides if _key(o).split(".")[0] not in decided]
    args = " ".join(_quoted(o) for o in [*kept, *chosen])
    lines = [f"python train.py {args}"]
    if hw is not None:
        per_node = min(devices, hw.devices_per_node)
        nodes = math.ceil(devices / per_node)
        lines.append(f"python train.py -m hydra/launcher=submitit_slurm hydra.launcher.nodes={nodes} "
                     f"hydra.launcher.tasks_per_node={per_node} hydra.launcher.gpus_per_node={per_node} "
                     f"device=cuda {args}")
    return lines
