"""The initialisation contract (#33): a run starts from `torch.manual_seed(seed); factory()`, bit for
bit, under every layout; initialised by name (`init.weights=by_name`), it starts from the same
weights under every layout too. On a zoo of models nobody here wrote (tests/zoo.py says which are
stand-ins and why): every rank's stages are built as the ranks build them (in this process, from
the file the launcher writes) and compared with the model as its author builds it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from hydra.utils import instantiate

from pipelaunch.launcher.initial_weights import choose, launcher_initial_weights
from pipelaunch.launcher.split_compare import every_stage
from pipelaunch.launcher.validate import prepare
from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.graph.initial_weights import InitialWeights, built_as_written, write_initial_weights
from tests.harness import ROOT, compose_cfg

SMALL = ["batch_size=16", "microbatches=4", "threads=1", "check_split=never"]
IMAGES = ["data=images", "data.channels=3", "data.image_size=8", "model.input.shape=[3,8,8]"]

#: name -> (overrides, the author's own build under the seed, the prefix our wrapper puts before its names)
ZOO: dict[str, tuple[list[str], object, str]] = {
    "vit": ([*IMAGES, "data.task=classification", "data.num_classes=10", "model=module",
             "model.module._target_=tests.zoo.vit", "model.num_classes=10"],
            lambda: __import__("tests.zoo", fromlist=["vit"]).vit(), "inner."),
    "nanogpt": (["model=module", "model.module._target_=tests.zoo.nanogpt", "model.seq_len=16", "model.vocab_size=64",
                 "model.loss=model"],
                lambda: __import__("tests.zoo", fromlist=["nanogpt"]).nanogpt(vocab_size=64, block_size=16), "inner."),
    "sequential": (["model=module", "model.module._target_=tests.zoo.sequential", "model.seq_len=8",
                    "model.vocab_size=64"],
                   lambda: __import__("tests.zoo", fromlist=["sequential"]).sequential(), "inner."),
    "unet2d": ([*IMAGES, "data.task=regression", "data.out_channels=3", "model=module",
                "model.module._target_=diffusers.UNet2DModel", "+model.module.sample_size=8",
                "+model.module.block_out_channels=[8,16]", "+model.module.layers_per_block=1",
                "+model.module.norm_num_groups=4", "+model.module.down_block_types=[DownBlock2D,DownBlock2D]",
                "+model.module.up_block_types=[UpBlock2D,UpBlock2D]", "model.output=sample",
                "model.extra_inputs=[10]", "model.loss=mse"],
               lambda: __import__("diffusers").UNet2DModel(
                   sample_size=8, block_out_channels=[8, 16], layers_per_block=1, norm_num_groups=4,
                   down_block_types=["DownBlock2D", "DownBlock2D"], up_block_types=["UpBlock2D", "UpBlock2D"]),
               "inner."),
    "hf_llama": (["model=hf_llama_tiny", "model.seq_len=16"], lambda: _from_config("hf_llama_tiny"), "model."),
    "hf_gpt2": (["model=hf_gpt2_tiny", "model.seq_len=16"], lambda: _from_config("hf_gpt2_tiny"), "model."),
    "hf_qwen2": (["model=hf", "+model.config.model_type=qwen2", "+model.config.hidden_size=32",
                  "+model.config.intermediate_size=64", "+model.config.num_hidden_layers=4",
                  "+model.config.num_attention_heads=4", "+model.config.num_key_value_heads=2",
                  "+model.config.vocab_size=64", "model.vocab_size=64", "model.seq_len=16"],
                 lambda: _from_config("qwen2"), "model."),
}

#: the layouts every model is built under: pipeline depth, schedule (placement), replicas, recompute
LAYOUTS = [["pp=1"], ["pp=2"], ["pp=2", "scheduler=zbv"], ["pp=4"], ["pp=2", "dp=2"],
           ["pp=2", "scheduler=gpipe", "placement=explicit", "placement.ranks=[1,0,0]"], ["pp=2", "remat=full"]]
#: models traced through torch.export take seconds a layout: the default suite builds them under
#: these (one process, and a V of four stages), the slow one under every layout
HEAVY = ("unet2d", "hf_llama", "hf_gpt2", "hf_qwen2")
FEW = [["pp=1"], ["pp=2", "scheduler=zbv"]]


def _layouts(models: list[str]) -> list:
    """(model, layouts) cases: every layout for the light models; for the heavy ones, a few by
    default and every layout in the slow suite."""
    cases = []
    for model in models:
        if model in HEAVY:
            cases += [pytest.param(model, FEW, id=f"{model}-few"),
                      pytest.param(model, LAYOUTS, id=f"{model}-all", marks=pytest.mark.slow)]
        else:
            cases.append(pytest.param(model, LAYOUTS, id=model))
    return cases


def _from_config(preset: str) -> torch.nn.Module:
    """transformers' own `AutoModelForCausalLM.from_config` of a preset (dropout as the project sets it)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if preset == "qwen2":
        config = AutoConfig.for_model("qwen2", hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
    else:
        import yaml

        fields = yaml.safe_load((ROOT / "conf" / "model" / f"{preset}.yaml").read_text())["config"]
        config = AutoConfig.for_model(**fields)
    return AutoModelForCausalLM.from_config(config)


def _cfg(model: str, layout: list[str], weights: str):
    overrides, _, _ = ZOO[model]
    return compose_cfg([*SMALL, *overrides, *layout, f"init.weights={weights}"])


def starting_weights(cfg) -> dict[str, torch.Tensor]:
    """Every tensor of every rank's stages, by the full model's names, as the ranks start."""
    prepared = prepare(cfg, profile=False)
    with launcher_initial_weights(cfg, prepared.spec, prepared.model) as initial:
        _, stages = every_stage(prepared.spec, prepared.plan, cfg.seed, initial_weights=initial.path)
    out: dict[str, torch.Tensor] = {}
    for stage in stages:
        for name, t in [*stage.named_model_parameters(), *stage.gm.named_buffers()]:
            out.setdefault(name, t.detach().clone())
    return out


def _author(model: str, seed: int) -> dict[str, torch.Tensor]:
    """The model as its author builds it in their own script: `torch.manual_seed(seed); factory()`."""
    _, make, prefix = ZOO[model]
    torch.manual_seed(seed)
    built = make()
    return {prefix + n: t.detach() for n, t in [*built.named_parameters(remove_duplicate=False),
                                                 *built.named_buffers(remove_duplicate=False)]}


@pytest.mark.parametrize(("model", "layouts"), _layouts(list(ZOO)))
def test_every_layout_starts_from_the_authors_own_weights(model: str, layouts: list) -> None:
    """Bit for bit: the author's `torch.manual_seed(0); factory()`, under every layout."""
    author = _author(model, 0)
    for layout in layouts:
        got = starting_weights(_cfg(model, layout, "constructor"))
        assert got, layout
        # constants an export trace lifted out of the forward are the stages' own, not the model's
        assert {n for n in got if n not in author and "lifted_tensor" not in n} == set(), layout
        differ = sorted(n for n, t in got.items() if n in author and not torch.equal(t, author[n]))
        assert differ == [], f"{model} {layout}: {len(differ)} of {len(got)} tensors differ, e.g. {differ[:4]}"


@pytest.mark.parametrize(("model", "layouts"), _layouts(["vit", "nanogpt", "hf_gpt2", "unet2d"]))
def test_initialised_by_name_the_weights_are_the_same_under_every_layout(model: str, layouts: list) -> None:
    """timm's ViT initialises every Linear in one `init_weights()` call: seeded per tensor, each
    still gets the same value whichever stages are real in a process."""
    first = starting_weights(_cfg(model, layouts[0], "by_name"))
    for layout in layouts[1:]:
        got = starting_weights(_cfg(model, layout, "by_name"))
        differ = sorted(n for n, t in got.items() if not torch.equal(t, first[n]))
        assert differ == [], f"{model} {layout}: {differ[:4]}"


def test_by_name_takes_the_models_own_initialisers_and_differs_from_the_constructor() -> None:
    """timm's ViT by name: its `init_weights()` runs (class token N(0, 1e-6), Linear weights
    truncated N(0, 0.02)); values are not the constructor's, and the log line says so."""
    by_name = starting_weights(_cfg("vit", ["pp=2"], "by_name"))
    assert float(by_name["inner.cls_token"].abs().max()) < 1e-4
    assert float(by_name["inner.blocks.0.mlp.fc1.weight"].std()) == pytest.approx(0.02, rel=0.15)
    author = _author("vit", 0)
    assert not torch.equal(by_name["inner.blocks.0.mlp.fc1.weight"], author["inner.blocks.0.mlp.fc1.weight"])
    cfg = _cfg("vit", ["pp=2"], "by_name")
    prepared = prepare(cfg, profile=False)
    with launcher_initial_weights(cfg, prepared.spec, prepared.model) as initial:
        assert initial.kind == "by_name" and initial.path is None
        assert "not the values your constructor draws" in initial.line


@pytest.mark.timeout(600)
def test_the_zoo_trains_at_pp2_as_one_process(tmp_path) -> None:
    """Four SGD steps at pp=2 on real gloo ranks against one process starting from the author's own
    build (`tests.reference`): losses, first gradients and final weights within 1e-5. (nanoGPT with
    its own loss: tests/test_own_loss.py; transformers' GPT-2 and Llama, diffusers' UNets:
    tests/test_bring_your_own.py.)"""
    from tests.harness import assert_state_close, merge_state, run_jobs
    from tests.reference import reference_run

    cases = {"vit zbv": _cfg("vit", ["pp=2", "scheduler=zbv", "steps=4", "warmup_steps=0", "optimizer=sgd"], "auto"),
             "sequential 1f1b": _cfg("sequential", ["pp=2", "steps=4", "warmup_steps=0", "optimizer=sgd"], "auto"),
             "hf_qwen2 1f1b": _cfg("hf_qwen2", ["pp=2", "steps=4", "warmup_steps=0", "optimizer=sgd"], "auto")}
    for (what, cfg), ranks in zip(cases.items(), run_jobs(list(cases.values()), tmp_path / "logs"), strict=True):
        ref = reference_run(cfg)
        assert ranks[0].losses == pytest.approx(ref["losses"], rel=1e-5), what
        assert_state_close(merge_state(ranks, "grads_step0"), ref["grads_step0"], f"{what} gradients")
        assert_state_close(merge_state(ranks, "params_final"), ref["params_final"], f"{what} weights")


def test_auto_builds_up_to_the_size_limit_and_initialises_by_name_above_it() -> None:
    cfg = _cfg("sequential", ["pp=2"], "auto")
    prepared = prepare(cfg, profile=False)
    assert choose(cfg, prepared.spec, prepared.model)[0] == "constructor"
    small = compose_cfg([*SMALL, *ZOO["sequential"][0], "pp=2", "init.max_bytes=1000"])
    kind, why = choose(small, prepared.spec, prepared.model)
    assert kind == "by_name" and "exceed init.max_bytes" in why


def test_the_file_holds_each_tensor_once_and_answers_to_every_tied_name(tmp_path) -> None:
    """nanoGPT ties lm_head to wte: written once, read under either name; a view of another tensor's
    storage is written as its own copy."""
    from tests.zoo import nanogpt

    model = built_as_written(nanogpt, 0)
    write_initial_weights(model, tmp_path / "w.safetensors")
    reader = InitialWeights(tmp_path / "w.safetensors")
    assert {"lm_head.weight", "transformer.wte.weight"} <= reader.keys()
    from safetensors import safe_open

    with safe_open(str(tmp_path / "w.safetensors"), "pt") as f:
        stored = set(f.keys())
    assert len({"lm_head.weight", "transformer.wte.weight"} & stored) == 1
    target = torch.empty_like(model.lm_head.weight)
    name = "transformer.wte.weight" if "transformer.wte.weight" not in stored else "lm_head.weight"
    assert reader.load([(name, target)], {}) == []
    assert torch.equal(target, model.lm_head.weight)
    assert not (tmp_path / "w.safetensors.partial").exists()


def test_a_constructor_that_builds_another_structure_for_real_is_refused(tmp_path) -> None:
    """The file must hold every tensor the planned (meta) model holds: a name it lacks is an error
    naming it, not a silent initialisation."""
    from pipelaunch.pipeline.graph.materialize import materialize
    from tests.zoo import sequential

    model = built_as_written(sequential, 0)
    model[1] = torch.nn.Identity()  # the file lacks the first hidden layer's weight and bias
    write_initial_weights(model, tmp_path / "w.safetensors")
    with torch.device("meta"):
        meta = sequential()
    with pytest.raises(ConfigError, match=r"lacks 2 tensor\(s\) .*\(1\.0\.weight, 1\.0\.bias\)"):
        materialize(meta, 0, torch.device("cpu"), initial=InitialWeights(tmp_path / "w.safetensors"))


def test_a_run_logs_where_its_weights_came_from(tmp_path) -> None:
    """The run's log and every rank's metrics say which path was taken."""
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "train.py", *SMALL, *ZOO["vit"][0], "pp=2", "steps=1", "warmup_steps=0",
                           "optimizer=sgd", f"hydra.run.dir={run}"], cwd=ROOT, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "initial weights: the model's own constructor, torch.manual_seed(0); factory()" in proc.stdout
    metrics = json.loads((run / "metrics.json").read_text())
    assert {r["initial_weights"] for r in metrics["ranks"]} == {"constructor"}
    spec = instantiate(metrics["config"]["model"])
    assert spec.name == "module"
