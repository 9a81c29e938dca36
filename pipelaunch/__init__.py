"""pipelaunch: config-driven pipeline-parallel training. The product's packages live under this one
name (`pipelaunch.launcher`, `pipelaunch.pipeline`, `pipelaunch.models`, configs in `conf/`), so a
user's own `models` or `pipeline` package imports beside ours.

In a checkout (and an editable install) those folders sit at the repository's top level, beside
this one: the package's path takes them in from there. An installed wheel holds them inside it.
"""

from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).resolve().parent
_CHECKOUT = _HERE.parent
if not (_HERE / "launcher").is_dir() and all((_CHECKOUT / d).is_dir() for d in ("launcher", "pipeline", "models", "conf")):
    __path__.append(str(_CHECKOUT))  # noqa: F821 - a package's __path__, extended by design
