"""The named presets of conf/model/ (#58): each at its published size (parameters counted on meta,
nothing allocated), naming its source; model=llama3_70b is the README's long Llama-70B command;
a preset with model.path reads that directory's weights and refuses another model's; training one
this machine cannot hold is refused before any rank starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipelaunch.launcher.plugins import build_plugins
from pipelaunch.launcher.validate import prepare
from pipelaunch.models.spec import ModelSpec
from pipelaunch.pipeline.core.errors import ConfigError
from tests.harness import CONF, compose_cfg

#: each preset's published parameter count (the model card's, or the paper's table)
PUBLISHED = {
    "llama3_8b": 8.03e9, "llama3_70b": 70.6e9, "llama3_405b": 405.9e9,
    "qwen2_5_7b": 7.62e9, "qwen2_5_72b": 72.7e9, "mistral_7b": 7.24e9, "mixtral_8x7b": 46.7e9,
    "qwen3_30b_a3b": 30.5e9, "deepseek_v3": 671e9, "gpt_deepseek_v3": 671e9, "gpt3_175b": 175e9,
    "gpt_sc21_7_5b": 7.5e9, "gpt_sc21_18b": 18.4e9, "gpt_sc21_39b": 39.1e9, "gpt_sc21_76b": 76.1e9,
    "gpt_sc21_145b": 145.6e9, "gpt_sc21_310b": 310.1e9, "gpt_sc21_530b": 529.6e9, "gpt_sc21_1t": 1008.0e9,
}
#: the README's Llama-70B-sized config, spelled out on the command line (before model=llama3_70b)
LONG_70B = ["model=hf", "+model.config.model_type=llama", "+model.config.hidden_size=8192",
            "+model.config.intermediate_size=28672", "+model.config.num_hidden_layers=80",
            "+model.config.num_attention_heads=64", "+model.config.num_key_value_heads=8",
            "+model.config.vocab_size=128256", "+model.config.max_position_embeddings=4096", "model.seq_len=4096"]
LAYOUT = ["mode=plan", "pp=8", "tp=8", "microbatches=16", "batch_size=16", "hardware=h100_sxm", "precision=bf16",
          "remat=full"]
#: what sets the model's shape and cost (the positions, RoPE's base and the norm's epsilon do not)
SIZES = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
         "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings", "hidden_act")


def spec_of(overrides: list[str]) -> ModelSpec:
    """The model a command line builds, as the launcher builds it (on meta: no weights)."""
    return build_plugins(compose_cfg(overrides)).model.build()


def parameters(spec: ModelSpec) -> int:
    return sum(p.numel() for p in spec.build_meta().parameters())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_has_its_published_size(name: str) -> None:
    count = parameters(spec_of([f"model={name}"]))
    assert count == pytest.approx(PUBLISHED[name], rel=0.01), f"{name}: {count / 1e9:.3f}B"


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_names_its_source(name: str) -> None:
    text = (CONF / "model" / f"{name}.yaml").read_text()
    head = text.split("_target_", 1)[0]
    assert "huggingface.co/" in head or "arXiv" in head, head


def hf_config(spec: ModelSpec):
    """The transformers config a model=hf spec builds (its wrapped model's, on meta)."""
    return spec.build_meta().model.config


def test_llama3_70b_is_the_readme_long_command() -> None:
    preset, long = spec_of(["model=llama3_70b"]), spec_of(LONG_70B)
    a, b = hf_config(preset).to_dict(), hf_config(long).to_dict()
    assert {k: a.get(k) for k in SIZES} == {k: b.get(k) for k in SIZES}
    assert parameters(preset) == parameters(long)
    assert preset.meta == long.meta
    assert preset.input_shape == long.input_shape and preset.tp_plan == long.tp_plan


def plan_content(overrides: list[str], run_dir: Path) -> dict:
    """plan.json as the launcher writes it for `overrides`, less the model's name (the preset's own
    name against model=hf's `hf_llama`)."""
    prepared = prepare(compose_cfg(overrides), run_dir=run_dir)
    run_dir.mkdir(parents=True)
    prepared.plan.write(run_dir / "plan.json")
    content = json.loads((run_dir / "plan.json").read_text())
    return {k: v for k, v in content.items() if k != "model"}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_llama3_70b_plans_as_the_readme_long_command(tmp_path) -> None:
    """The fixed layout the README priced (pp=8 tp=8): the same plan from the preset (about 60 s)."""
    ours = plan_content(["model=llama3_70b", *LAYOUT], tmp_path / "preset")
    theirs = plan_content([*LONG_70B, *LAYOUT], tmp_path / "long")
    assert ours == theirs


def tiny_llama_overrides(hidden: int) -> list[str]:
    """llama3_8b's architecture at a test's size (its RoPE scaling, epsilon, untied head kept)."""
    return ["model=llama3_8b", f"model.config.hidden_size={hidden}", "model.config.intermediate_size=128",
            "model.config.num_hidden_layers=2", "model.config.num_attention_heads=4",
            "model.config.num_key_value_heads=2", "model.config.vocab_size=256", "model.seq_len=32"]


def save_llama(directory: Path, hidden: int) -> dict[str, torch.Tensor]:
    """A save_pretrained directory of the preset's architecture at `hidden`; its tensors by name."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = compose_cfg(tiny_llama_overrides(hidden))
    config = AutoConfig.for_model(**cfg.model["config"])
    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(directory)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.timeout(120)
def test_preset_reads_weights_from_path(tmp_path) -> None:
    stored = save_llama(tmp_path / "llama", 64)
    spec = spec_of([*tiny_llama_overrides(64), f"model.path={tmp_path / 'llama'}"])
    assert spec.load is not None
    model = spec.build()
    tensors = dict(model.named_parameters())
    missing = spec.load.load(tensors.items(), {})
    assert not missing
    for name, t in tensors.items():
        torch.testing.assert_close(t, stored[name.removeprefix("model.")], rtol=0, atol=0)


@pytest.mark.timeout(120)
def test_preset_refuses_another_models_directory(tmp_path) -> None:
    save_llama(tmp_path / "llama", 32)
    with pytest.raises(ConfigError) as small:
        spec_of([*tiny_llama_overrides(64), f"model.path={tmp_path / 'llama'}"])
    assert small.value.key == "model.path" and "hidden_size=32 where model.config.hidden_size=64" in str(small.value)
    with pytest.raises(ConfigError) as full:
        spec_of(["model=llama3_8b", f"model.path={tmp_path / 'llama'}"])
    assert "hidden_size=32 where model.config.hidden_size=4096" in str(full.value), str(full.value)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["llama3_70b", "gpt3_175b"])
def test_training_a_preset_this_machine_cannot_hold_is_refused(name: str) -> None:
    """Refused in prepare, before any plan is made or rank spawned: one paragraph naming the way."""
    with pytest.raises(ConfigError) as err:
        prepare(compose_cfg([f"model={name}", "pp=2"]))
    message = str(err.value)
    assert err.value.key == "model" and "\n" not in message, message
    assert f"model={name} holds" in message and "mode=plan hardware=<gpu>" in message, message
