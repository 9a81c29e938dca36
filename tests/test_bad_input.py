"""The mistakes a new user made, each refused before any rank starts with one paragraph naming the
key, exit code 2 and no traceback (issue #13's list)."""

from __future__ import annotations

import pytest

from pipelaunch.launcher.overrides import compose_checked, rewrite_lists
from pipelaunch.launcher.validate import prepare
from pipelaunch.pipeline.core.errors import ConfigError
from tests.test_cli import train

CASES = [
    (["model.dim=-4"], "model.dim", "positive integer"),
    (["threads=-1"], "threads", ">= 0"),
    (["timeout_s=0"], "timeout_s", ">= 1"),
    (["optimizer.lr=-1"], "optimizer.lr", ">= 0"),
    (["optimizer.lr=abc"], "optimizer.lr", "'abc'"),
    (["model.heads=3"], "model.heads", "not divisible"),
    (["data=text", "data.paths=[/nonexistent]"], "data.paths", "does not exist"),
    (["model=unet"], "data", "use data=images"),
    (["placement=[0,1,1,0]", "pp=2"], "placement", "v placement [0, 1, 1, 0]"),
    (["scheduler=pipedream"], "scheduler", "valid: 1f1b"),
    (["pp=abc"], "pp", "could not be converted"),
    (["+ppp=4"], "ppp", "not a setting"),
]


@pytest.mark.parametrize(("overrides", "key", "fragment"), CASES)
def test_each_mistake_names_its_key(overrides, key, fragment) -> None:
    with pytest.raises(ConfigError) as info:
        prepare(compose_checked(rewrite_lists(["mode=plan", *overrides])), profile=False)
    assert info.value.key == key and fragment in str(info.value), str(info.value)


def test_a_list_placement_is_an_explicit_one() -> None:
    cfg = compose_checked(rewrite_lists(["placement=[0,1,1,0]", "pp=2", "scheduler=gpipe"]))
    assert cfg.placement["ranks"] == [0, 1, 1, 0]
    assert prepare(cfg, profile=False).plan.schedule.placement == [0, 1, 1, 0]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("overrides", [["placement=[0,1,1,0]", "pp=2"], ["model.dim=-4"], ["optimizer=lamb"]])
def test_the_command_line_exits_2_without_a_traceback(overrides, tmp_path) -> None:
    proc = train(["mode=plan", *overrides], tmp_path / "run", timeout=100)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.startswith("error (config error): Invalid config `"), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
