"""Name a sweep's job directories by what varies: `3_scheduler=zbv,partitioner=balanced`, not
every override of the command line.

`hydra.sweep.subdir` calls the `sweep_dirname` resolver with the job's overrides. The keys that
vary are the sweeper's `params` (a `+sweep=...` matrix) and the command-line overrides written
as sweeps (`a,b`, `range(...)`, `choice(...)`, `glob(...)`), read from the launching process's
arguments; a key set once for every job is left out of the name. Where neither can be read (a
job started by a remote launcher) the name is every override, as Hydra's own `override_dirname`.
"""

from __future__ import annotations

import re
import sys
from typing import Any

from omegaconf import OmegaConf

SWEEP_FUNCTIONS = ("range(", "choice(", "glob(", "interval(")
_ITEM = re.compile(r"^(?P<prefix>[+~]{0,2})(?P<key>[\w./@-]+)=(?P<value>.*)$")


def _is_sweep(value: str) -> bool:
    """A value Hydra expands into several jobs: a top-level comma, or a sweep function."""
    if value.startswith(SWEEP_FUNCTIONS):
        return True
    depth = 0
    for ch in value:
        depth += ch in "[{("
        depth -= ch in "]})"
        if ch == "," and depth == 0:
            return True
    return False


def swept_keys(argv: list[str], params: Any = None) -> set[str]:
    keys = {str(k).lstrip("+~") for k in (params or {})}
    for item in argv:
        match = _ITEM.match(item)
        if match and _is_sweep(match["value"]):
            keys.add(match["key"])
    return keys


def sweep_dirname(task: Any, params: Any = None) -> str:
    items = [str(t) for t in (OmegaConf.to_container(task) if OmegaConf.is_config(task) else task or [])]
    params = OmegaConf.to_container(params) if OmegaConf.is_config(params) else params
    keys = swept_keys(sys.argv[1:], params)
    chosen = [i for i in items if (m := _ITEM.match(i)) and m["key"] in keys] if keys else items
    return ",".join(chosen or items).replace("/", "_")


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("sweep_dirname"):
        OmegaConf.register_new_resolver("sweep_dirname", sweep_dirname)
