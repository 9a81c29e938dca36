"""Run from your own project (#33): the installed `pipelaunch` command in a directory outside the
checkout, with the project's own `models/` package (the name of one of ours) and its own
`conf/model/mynet.yaml`, trains `model=mynet pp=2` as typed, and writes `outputs/` there."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipelaunch.cli import project_argv
from tests.harness import ROOT

MODEL = '''from torch import nn


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        return x + self.fc(x).tanh()


def mynet(vocab_size=64, dim=16, layers=4):
    return nn.Sequential(nn.Embedding(vocab_size, dim), *[Block(dim) for _ in range(layers)], nn.Linear(dim, vocab_size))
'''

CONF = '''defaults:
  - module
  - _self_
module:
  _target_: models.net.mynet
  dim: 16
seq_len: 8
vocab_size: 64
'''

FAST = ["steps=2", "warmup_steps=0", "batch_size=8", "microbatches=4", "threads=1", "timeout_s=90"]


def _project(root: Path) -> Path:
    """A research repository of its own: `models/` (a package named like ours) and `conf/model/`."""
    (root / "models").mkdir(parents=True)
    (root / "models" / "__init__.py").write_text("")
    (root / "models" / "net.py").write_text(MODEL)
    (root / "conf" / "model").mkdir(parents=True)
    (root / "conf" / "model" / "mynet.yaml").write_text(CONF)
    return root


def _command() -> list[str]:
    installed = Path(sys.executable).parent / "pipelaunch"
    if not installed.exists():
        pytest.skip(f"the pipelaunch command is not installed beside {sys.executable} (pip install -e .)")
    return [str(installed)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("entry", ["pipelaunch", "python -m pipelaunch"])
def test_the_installed_command_trains_a_projects_own_model_by_its_own_config_name(tmp_path, entry: str) -> None:
    project = _project(tmp_path / "myproject")
    command = _command() if entry == "pipelaunch" else [sys.executable, "-m", "pipelaunch"]
    proc = subprocess.run([*command, "model=mynet", "pp=2", *FAST], cwd=project, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = list((project / "outputs").glob("*/*/metrics.json"))
    assert len(runs) == 1, sorted(str(p) for p in (project / "outputs").rglob("*"))[:20]
    metrics = json.loads(runs[0].read_text())
    assert metrics["config"]["model"]["module"]["_target_"] == "models.net.mynet"
    assert len(metrics["losses"]) == 2 and metrics["config"]["pp"] == 2
    assert (runs[0].parent / "train.log").exists()  # Hydra's job log keeps its name whatever the entry point
    assert not (ROOT / "outputs" / runs[0].parent.parent.name / runs[0].parent.name).exists()


def test_a_config_error_names_the_projects_own_options(tmp_path) -> None:
    """An unknown model option lists the project's own options beside ours, before any rank starts."""
    project = _project(tmp_path / "myproject")
    proc = subprocess.run([sys.executable, "-m", "pipelaunch", "model=mynett", *FAST], cwd=project,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Invalid config `model`" in proc.stderr and "mynet" in proc.stderr and "gpt" in proc.stderr


def test_the_projects_conf_joins_hydras_search_path_before_any_given() -> None:
    project = ROOT / "tests"  # any directory with a conf/ would do; this one has none
    assert project_argv(["pp=2"], project) == ["pp=2"]
    assert project_argv(["pp=2"], ROOT) == ["pp=2"]  # the checkout's own conf/ is ours, not a project's


def test_the_projects_conf_is_merged_into_a_search_path_the_command_line_gives(tmp_path) -> None:
    (tmp_path / "conf").mkdir()
    mine = f"file://{(tmp_path / 'conf').resolve()}"
    assert project_argv(["pp=2"], tmp_path) == ["pp=2", f"hydra.searchpath=[{mine}]"]
    assert project_argv(["hydra.searchpath=[pkg://other]"], tmp_path) == [f"hydra.searchpath=[{mine},pkg://other]"]


def test_a_wheel_holds_every_package_and_config(tmp_path) -> None:
    """A wheel of a copy of the checkout: every package and every YAML of conf/ under `pipelaunch/`,
    so a non-editable install runs too (pyproject.toml lists the packages by hand)."""
    import zipfile

    source = tmp_path / "src"
    for name in ("pyproject.toml", "README.md"):
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, source / name)
    for name in ("pipelaunch", "launcher", "pipeline", "models", "conf"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                           str(tmp_path / "dist"), str(source)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    names = set(zipfile.ZipFile(next((tmp_path / "dist").glob("*.whl"))).namelist())
    for folder in ("launcher", "pipeline", "models"):
        for path in (ROOT / folder).rglob("*.py"):
            assert f"pipelaunch/{path.relative_to(ROOT)}" in names, path
    for path in (ROOT / "conf").rglob("*.yaml"):
        assert f"pipelaunch/{path.relative_to(ROOT)}" in names, path
