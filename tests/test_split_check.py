"""The launcher's split check (#25): before any rank starts, every rank's stages, built as the ranks
build them, against the unsplit module built for real, on one micro-batch (launcher/split_check.py).

A model the pipeline would train wrongly without a word is refused with the first tensor that
differs; a correct one passes; the check is skipped where it says why, and can be forced on or off;
a reference that cannot be built or run here is an error, never a silent skip."""

from __future__ import annotations

import pytest
import torch

from pipelaunch.launcher import split_check, split_compare
from pipelaunch.launcher.split_check import check_split
from pipelaunch.launcher.validate import prepare
from pipelaunch.pipeline.core.errors import ConfigError
from tests.harness import compose_cfg
from tests.split_models import rotary_lm
from tests.test_cli import train

LM = ["model.seq_len=8", "model.vocab_size=64", "batch_size=8", "threads=1", "steps=2", "warmup_steps=0",
      "timeout_s=60"]
QUANTIZED = ["model=module", "model.module._target_=tests.split_models.quantized_lm", *LM]
ROTARY = ["model=module", "model.module._target_=tests.split_models.rotary_lm", *LM]


def _checked(overrides: list[str]) -> str:
    cfg = compose_cfg(overrides)
    prepared = prepare(cfg)
    return check_split(cfg, prepared.spec, prepared.plan, prepared.model)


@pytest.mark.timeout(120)
def test_a_lost_custom_backward_is_refused_before_any_rank(tmp_path) -> None:
    """A straight-through estimator traced through its forward: the same loss, other gradients.
    `python train.py` refuses it with the gradient that differs first, and spawns nothing."""
    run = tmp_path / "run"
    proc = train(QUANTIZED, run)
    assert proc.returncode == 2, proc.stderr[-3000:]
    error = proc.stderr
    assert error.startswith("error (config error): Invalid config `model`: the 2 stages the ranks would build"), error
    assert "the gradient of inner.4.norm.bias (the first in backward order" in error, error
    assert "torch.autograd.Function" in error and "model.leaf_modules=[...]" in error and "check_split=never" in error
    assert not (run / "logs").exists() and not (run / "metrics.json").exists()


def test_the_same_blocks_kept_whole_pass() -> None:
    """As leaf modules the blocks run their own forward and backward: the stages are exact."""
    line = _checked([*QUANTIZED, "model.leaf_modules=[1,2,3,4]"])
    assert line.startswith("check_split: the 2 stages match the unsplit module on one micro-batch"), line


@pytest.mark.filterwarnings("ignore:model rotary. no initialiser writes")
def test_a_buffer_no_initialiser_computes_is_refused_by_name() -> None:
    """A model family's own ModelSpec whose rotary `inv_freq` only its constructor computes: on
    the meta device it has no value, the ranks would start it from zeros."""
    with pytest.raises(ConfigError) as info:
        _checked(["model._target_=tests.split_models.rotary_spec", *LM])
    message = str(info.value)
    assert info.value.key == "model" and "buffer 1.rotary.inv_freq differs by 1.00e+00" in message, message
    assert "reset_parameters()" in message and "\n" not in message


def test_model_module_reads_the_buffers_its_constructor_computes() -> None:
    """Through model=module the same rotary model passes: each rank reads `inv_freq` by name, as
    the constructor computes it; and the launcher no longer warns that no initialiser writes it."""
    cfg = compose_cfg(ROTARY)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        prepared = prepare(cfg)
    stages = split_compare.every_stage(prepared.spec, prepared.plan, cfg.seed)[1]
    expected = dict(rotary_lm().named_buffers())
    held = split_compare.stage_buffers(stages)
    assert len(held) == 4 and all(torch.equal(b, expected[n.removeprefix("inner.")]) for n, b in held.items())
    assert check_split(cfg, prepared.spec, prepared.plan, prepared.model).startswith("check_split: the 2 stages match")


def test_a_tensor_kept_as_a_plain_attribute_is_refused_before_any_rank() -> None:
    cfg = compose_cfg(["model=module", "model.module._target_=tests.split_models.scaled_lm", *LM])
    prepared = prepare(cfg)
    with pytest.raises(ConfigError) as info:
        check_split(cfg, prepared.spec, prepared.plan, prepared.model)
    assert "is a tensor the module keeps as a plain attribute" in str(info.value)
    assert "register_buffer('scale', ..., persistent=False)" in str(info.value)


def test_skipped_where_it_says_why_and_forced_on_or_off(monkeypatch) -> None:
    """Skipped only where the log says why: turned off (never, or false), or under auto a model
    too large; `always` (or true) checks anyway. A reference that cannot be built is an error,
    under auto too (tests/test_own_loss.py: or run)."""
    cfg = compose_cfg(ROTARY)
    prepared = prepare(cfg)
    args = (prepared.spec, prepared.plan, prepared.model)
    for off in ("never", "false"):
        assert check_split(compose_cfg([*ROTARY, f"check_split={off}"]), *args) == "check_split: skipped: check_split=never"
    monkeypatch.setattr(split_check, "AUTO_LIMIT_BYTES", 1000)  # the tiny model is then "too big" for auto
    line = check_split(cfg, *args)
    assert line.startswith("check_split: skipped: the model's parameters and buffers take 0.0 GiB, above"), line
    for on in ("always", "true"):
        assert check_split(compose_cfg([*ROTARY, f"check_split={on}"]), *args).startswith("check_split: the 2 stages match")

    def unbuildable(spec):
        raise RuntimeError("needs CUDA")

    monkeypatch.setattr(split_compare, "built_for_real", unbuildable)
    monkeypatch.setattr(split_check, "AUTO_LIMIT_BYTES", 1 << 30)
    for checked in (cfg, compose_cfg([*ROTARY, "check_split=always"])):
        with pytest.raises(ConfigError) as info:
            check_split(checked, *args)
        message = str(info.value)
        assert info.value.key == "check_split" and message.startswith(
            "Invalid config `check_split`: the unsplit module cannot be built on the CPU here (RuntimeError: needs "
            "CUDA)") and "check_split=false" in message, message


def test_the_project_models_pass() -> None:
    """Every model family of the project, each with a split that stresses it (operator granularity,
    tied embeddings across stages under zbv, dropout drawn alike, long skips, batch norm)."""
    for overrides in (["model.granularity=op"], ["+model.tie_embeddings=true", "pp=4", "scheduler=zbv"],
                      ["model.dropout=0.1", "dp=2"], ["model=mlp"], ["model=unet", "data=images"],
                      ["model=resnet", "data=images", "data.task=classification"]):
        cfg = compose_cfg([*overrides, "threads=1"])
        prepared = prepare(cfg)
        line = check_split(cfg, prepared.spec, prepared.plan, prepared.model)
        assert line.startswith(f"check_split: the {len(prepared.plan.stages)} stages match"), (overrides, line)
