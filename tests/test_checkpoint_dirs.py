"""Which checkpoint directories count: complete ones only, newest last; pruning keeps the newest."""

from __future__ import annotations

import json

import pytest

from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.runtime import checkpoint


def _fake(root, step: int, metadata: bool = True, meta: bool = True, partial: bool = False):
    path = checkpoint.step_dir(root, step)
    if partial:
        path = path.with_name(path.name + ".partial")
    path.mkdir(parents=True)
    if metadata:
        (path / ".metadata").write_bytes(b"")
    if meta:
        (path / checkpoint.META).write_text(json.dumps({"step": step}))
    return path


def test_only_complete_checkpoints_are_seen_newest_last(tmp_path) -> None:
    _fake(tmp_path, 2)
    _fake(tmp_path, 10)
    _fake(tmp_path, 4)
    _fake(tmp_path, 12, partial=True)  # a save that died midway
    _fake(tmp_path, 14, meta=False)  # renamed by hand without meta.json: not ours to trust
    _fake(tmp_path, 16, metadata=False)
    assert [p.name for p in checkpoint.complete_checkpoints(tmp_path)] == [
        "step_0000002", "step_0000004", "step_0000010"]
    assert checkpoint.resolve_resume("auto", tmp_path).name == "step_0000010"
    assert checkpoint.resolve_resume("none", tmp_path) is None
    assert checkpoint.resolve_resume("auto", tmp_path / "empty") is None  # a fresh start
    with pytest.raises(ConfigError, match="never loaded"):
        checkpoint.resolve_resume(str(checkpoint.step_dir(tmp_path, 12)) + ".partial", tmp_path)
    with pytest.raises(ConfigError, match="not a directory"):
        checkpoint.resolve_resume(str(tmp_path / "nope"), tmp_path)


def test_prune_keeps_the_newest(tmp_path) -> None:
    for step in (2, 4, 6, 8):
        _fake(tmp_path, step)
    gone = checkpoint.prune(tmp_path, keep=2)
    assert [p.name for p in gone] == ["step_0000002", "step_0000004"]
    assert [p.name for p in checkpoint.complete_checkpoints(tmp_path)] == ["step_0000006", "step_0000008"]
    assert checkpoint.prune(tmp_path, keep=0) == []  # 0 keeps everything
