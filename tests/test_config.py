"""Every option of every config group composes and plans; the schema types the top-level keys."""

from __future__ import annotations

import pytest

from launcher.validate import prepare
from tests.harness import FAST, compose_cfg, group_options

GROUPS = ["model", "data", "scheduler", "partitioner", "placement", "optimizer", "logger", "memory"]
NEEDS = {
    ("partitioner", "manual"): ["partitioner.split_points=[layer3]"],
    ("placement", "explicit"): ["scheduler=gpipe", "placement.ranks=[0,1,1,0]"],
    ("placement", "interleaved"): ["scheduler=interleaved_1f1b"],
    ("placement", "v"): ["scheduler=zbv"],
    ("model", "gpt_bench"): ["batch_size=8"],
    ("model", "unet"): ["data=images"],
    ("model", "resnet"): ["data=images"],
    ("data", "images"): ["model=unet"],
}


@pytest.mark.parametrize("group", GROUPS)
def test_every_group_option_composes_and_plans(group: str) -> None:
    options = group_options(group)
    assert options, group
    for option in options:
        overrides = [*FAST, "pp=2", "microbatches=4", f"{group}={option}", *NEEDS.get((group, option), [])]
        if group == "model" or option == "images":
            overrides = [o for o in overrides if not o.startswith("model.")]
        cfg = compose_cfg(overrides)
        prepared = prepare(cfg, profile=False if option not in ("auto", "balanced", "milp") else None)
        assert prepared.plan.pp == 2, f"{group}={option}"


def test_text_data_reads_the_standard_library() -> None:
    from hydra.utils import instantiate

    data = instantiate(compose_cfg([*FAST, "data=text", "model.vocab_size=256"])["data"])
    x, y = data.batch(0, 4)
    assert x.shape == (4, 8) and int(x.max()) < 256
    assert (x[:, 1:] == y[:, :-1]).all()


def test_data_must_match_the_model() -> None:
    from pipeline.errors import ConfigError

    with pytest.raises(ConfigError, match="data=images"):
        prepare(compose_cfg(["model=unet", "data=synthetic", "data.vocab_size=8", "data.seq_len=8"]))


def test_sweep_config_holds_a_benchmark_matrix() -> None:
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from launcher.config import register_configs
    from tests.harness import CONF

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF)):
        cfg = compose(config_name="train", overrides=["+sweep=schedules"], return_hydra_config=True)
    params = cfg.hydra.sweeper.params
    assert "zbv" in params.scheduler and "balanced" in params.partitioner
    assert cfg.hydra.callbacks.sweep_report._target_ == "launcher.sweep_report.SweepReport"
