"""Command-line overrides checked before Hydra sees them, so that a mistake in one is a ConfigError
naming the key (exit code 2), not a traceback from inside Hydra.

Two things happen here. A list given to a config group (`placement=[0,1,1,0]`, the syntax ELF
uses for a placement) is read as that group's explicit option. Then the config is composed once
with Hydra's compose API; what Hydra refuses (an unknown group option, a key the schema lacks, a
value of the wrong type for a typed key, a bad override) becomes a ConfigError that names the key
and what would be valid.
"""

from __future__ import annotations

import re
from pathlib import Path

from pipelaunch.pipeline.core.config import TrainConfig
from pipelaunch.pipeline.core.errors import ConfigError

CONF = Path(__file__).resolve().parents[1] / "conf"
#: group -> (its explicit option, the key a list goes to)
LIST_AS_OPTION = {"placement": ("explicit", "placement.ranks")}
_OVERRIDE = re.compile(r"^(?P<prefix>[+~]{0,2})(?P<key>[\w./@-]+)=(?P<value>.*)$")


def rewrite_lists(overrides: list[str]) -> list[str]:
    """`placement=[0,1,1,0]` -> `placement=explicit placement.ranks=[0,1,1,0]`."""
    out = []
    for item in overrides:
        match = _OVERRIDE.match(item)
        if match and not match["prefix"] and match["key"] in LIST_AS_OPTION and match["value"].startswith("["):
            option, key = LIST_AS_OPTION[match["key"]]
            out += [f"{match['key']}={option}", f"{key}={match['value']}"]
        else:
            out.append(item)
    return out


def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def _key_of(message: str, overrides: list[str]) -> str:
    """The key a Hydra/OmegaConf message is about: quoted in it, or the first override it names."""
    for pattern in (r"full_key: ([\w.]+)", r"[Kk]ey '([\w.]+)'", r"override '([\w.]+)'", r"'([\w./]+)'"):
        found = re.search(pattern, message)
        if found:
            return found.group(1).split("/")[0] if "/" in found.group(1) else found.group(1)
    for item in overrides:
        match = _OVERRIDE.match(item)
        if match and match["key"] in message:
            return match["key"]
    return "overrides"


def compose_checked(overrides: list[str], config_dir: Path = CONF, config_name: str = "train") -> TrainConfig:
    """Compose the config like train.py does, as the typed object; Hydra's refusals become ConfigErrors."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from pipelaunch.launcher.config import register_configs, typed_config

    register_configs()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(version_base="1.3", config_dir=str(config_dir)):
            cfg = compose(config_name=config_name, overrides=overrides)
        return typed_config(cfg)
    except ConfigError:
        raise
    except (HydraException, OmegaConfBaseException, ValueError, TypeError) as err:
        raise compose_error(err, overrides) from None
    finally:
        GlobalHydra.instance().clear()


def compose_error(err: Exception, overrides: list[str]) -> ConfigError:
    """One paragraph for what Hydra or OmegaConf refused."""
    chain, cause = [str(err)], err.__cause__
    while cause is not None and len(chain) < 4:
        chain.append(str(cause))
        cause = cause.__cause__
    message = " ".join(" ".join(chain).split())
    found = re.search(r"Could not find '(\w+)/(\w+)'", message) or re.search(r"In '\w+': Could not load '(\w+)/(\w+)'", message)
    if found and (CONF / found.group(1)).is_dir():
        group, option = found.groups()
        return ConfigError(group, f"{option!r} is not an option; valid: {', '.join(group_options(group))}")
    enum = re.search(r"Invalid value '([^']*)', expected one of \[([^\]]*)\].*?full_key: ([\w.]+)", message)
    if enum:
        value, valid, key = enum.groups()
        return ConfigError(key, f"got {value!r}; valid: {valid}")
    if "not in struct" in message or "Could not override" in message or "Could not append" in message:
        key = _key_of(message, overrides)
        return ConfigError(key, f"{message}. Use an existing key (see `python train.py --cfg job`), or `+key=value` "
                                "to add one to a group option that takes extra arguments")
    key = _key_of(message, overrides)
    return ConfigError(key, message)


def precheck_argv(argv: list[str]) -> list[str]:
    """What train.py does before Hydra: rewrite list-valued group overrides, then compose once and
    turn Hydra's refusals into a one-paragraph ConfigError (exit 2). Multirun sweeps (their
    `a,b` values are Hydra's to expand), other Hydra flags and HYDRA_FULL_ERROR=1 are left to Hydra."""
    import os
    import sys

    argv = rewrite_lists(argv)
    if os.environ.get("HYDRA_FULL_ERROR") == "1" or any(a.startswith("-") for a in argv):
        return argv
    # the user's search path adds group options (their own schedules): compose with it
    overrides = [a for a in argv if not a.lstrip("+~").startswith("hydra") or a.startswith("hydra.searchpath=")]
    try:
        compose_checked(overrides)
    except ConfigError as err:
        print(f"error (config error): {err}", file=sys.stderr, flush=True)
        sys.exit(2)
    return argv
