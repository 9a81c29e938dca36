"""Sweep reports people can read: the keys that vary are the columns, the labels and the names."""

from __future__ import annotations

import json

from pipelaunch.launcher.sweep_names import sweep_dirname, swept_keys
from pipelaunch.launcher.sweep_report import collect, markdown, varying_keys


def test_swept_keys_come_from_sweep_syntax_and_sweeper_params() -> None:
    argv = ["-m", "scheduler=gpipe,1f1b", "steps=5", "placement.ranks=[0,1,1,0]", "pp=range(2,5)",
            "+model.x=choice(1,2)"]
    assert swept_keys(argv) == {"scheduler", "pp", "model.x"}  # a list value is not a sweep
    assert swept_keys([], {"scheduler": "gpipe,zbv", "partitioner": "uniform,balanced"}) == {"scheduler", "partitioner"}


def test_job_directories_are_named_by_what_varies(monkeypatch) -> None:
    monkeypatch.setattr("sys.argv", ["train.py", "-m", "scheduler=gpipe,1f1b", "steps=5", "model=hf/x"])
    assert sweep_dirname(["scheduler=1f1b", "steps=5", "model=hf/x"]) == "scheduler=1f1b"
    monkeypatch.setattr("sys.argv", ["train.py"])  # nothing to tell from: every override, as Hydra names it
    assert sweep_dirname(["steps=5", "model=a/b"]) == "steps=5,model=a_b"


def _job(root, num: int, overrides: list[str], metrics: dict) -> None:
    job = root / f"{num}_x"
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    (job / "metrics.json").write_text(json.dumps(metrics))


def test_table_columns_are_the_varying_keys(tmp_path) -> None:
    ok = {"losses": [1.0, 0.5], "tokens_per_s": 100.0, "step_time_s": 0.02, "predicted_step_time_s": 0.018,
          "schedule": "gpipe", "ranks": [{"rank": 0, "peak_memory_bytes": 2**20, "bubble": 0.1},
                                          {"rank": 1, "peak_memory_bytes": 3 * 2**20, "bubble": 0.2}]}
    _job(tmp_path, 0, ["scheduler=gpipe", "partitioner=uniform", "steps=5"], ok)
    _job(tmp_path, 1, ["scheduler=zbv", "partitioner=uniform", "steps=5"], {**ok, "tokens_per_s": 120.0})
    _job(tmp_path, 2, ["scheduler=zbv", "partitioner=milp", "steps=5"], {"status": "failed", "error": "boom"})
    rows = collect(tmp_path)
    assert varying_keys(rows) == ["scheduler", "partitioner"]
    table = markdown(rows)
    assert table.splitlines()[0] == "common to every job: steps=5"
    assert "| 0 | gpipe | uniform | 100 | 20.0 | 18.0 | 0.90 | 20.0% | 1 / 3 | 0.5000 |" in table
    assert "| 1 **best** | zbv | uniform |" in table and "| 2 | zbv | milp | failed: boom |" in table
    assert table.count("scheduler=") == 0  # no override string repeated in the rows
