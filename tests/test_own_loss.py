"""Outputs and losses users have (#33): a model that computes its own loss trains with it, the
targets reaching the stage that reads them; `model.output=0` picks an element of a tuple; a model
whose output cannot match the targets is refused before any rank starts.

The references are the users' own models run as their authors run them: nanoGPT's
`torch.manual_seed(seed); m = GPT(...); logits, loss = m(x, y)` on the whole batch, transformers'
`torch.manual_seed(seed); m = AutoModelForCausalLM.from_config(c); m(x, labels=x).loss`, each
with the run's optimizer. The ranks start from the constructor's weights, as the launcher gives
them (`launcher.initial_weights`)."""

from __future__ import annotations

import pytest
import torch
from hydra.utils import instantiate
from torch import nn

from pipelaunch.launcher import split_compare
from pipelaunch.launcher.plugins import build_plugins
from pipelaunch.launcher.split_check import check_split
from pipelaunch.launcher.validate import prepare
from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.runtime.optim import build_optimizer
from tests.harness import assert_state_close, compose_cfg, merge_state, run_jobs
from tests.zoo import nanogpt

COMMON = ["data=synthetic", "batch_size=16", "microbatches=4", "steps=4", "warmup_steps=0", "optimizer=sgd",
          "timeout_s=120", "threads=1", "pp=2"]
BLOCKS = "model.leaf_modules=[transformer.h.0,transformer.h.1,transformer.h.2,transformer.h.3]"
NANOGPT = ["model=module", "model.module._target_=tests.zoo.nanogpt", "model.seq_len=16", "model.vocab_size=64",
           BLOCKS]
#: nanoGPT training with its own loss: forward(idx, targets) returns (logits, loss)
OWN = [*NANOGPT, "model.loss=model"]
GPT2 = ["model=hf_gpt2_tiny", "model.loss=model"]


class TupleLM(nn.Module):
    """A language model returning `(logits, hidden states)`, the logits of every position."""

    def __init__(self, vocab_size: int = 64, dim: int = 16) -> None:
        super().__init__()
        self.embed, self.block = nn.Embedding(vocab_size, dim), nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab_size)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = torch.tanh(self.block(self.embed(ids)))
        return self.head(hidden), hidden


def _user_script(cfg, model: nn.Module, loss_of) -> dict:
    """The user's own single-process loop: the whole batch, its own loss, the run's optimizer;
    the held-out loss (`eval.every`) as the mean over the held-out batches."""
    data = instantiate(cfg.data)
    plugins = build_plugins(cfg)
    optimizer, lr_scheduler = build_optimizer(plugins.optimizer, plugins.lr_scheduler, list(model.parameters()))
    losses, eval_losses = [], []
    for step in range(cfg.steps):
        loss = loss_of(model, *data.batch(step, cfg.batch_size))
        loss.backward()
        losses.append(float(loss.detach()))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        lr_scheduler.step()
        if cfg.eval.every and ((step + 1) % cfg.eval.every == 0 or step + 1 == cfg.steps):
            model.eval()
            with torch.no_grad():
                held = [float(loss_of(model, *data.val_batch(i, cfg.batch_size))) for i in range(cfg.eval.batches)]
            model.train()
            eval_losses.append({"step": step, "eval_loss": sum(held) / len(held)})
    return {"losses": losses, "eval_losses": eval_losses,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _nanogpt_script(cfg) -> dict:
    torch.manual_seed(cfg.seed)
    model = nanogpt(vocab_size=64, block_size=16)
    return _user_script(cfg, model, lambda m, x, y: m(x, y)[1])


def _transformers_script(cfg) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**cfg.model["config"])
    for key in ("resid_pdrop", "embd_pdrop", "attn_pdrop"):  # model=hf trains without dropout by default
        setattr(config, key, 0.0)
    torch.manual_seed(cfg.seed)
    model = AutoModelForCausalLM.from_config(config)
    return _user_script(cfg, model, lambda m, x, y: m(x, labels=x).loss)


CASES = {
    # targets through the data to the last stage; a held-out loss every 2 steps (the forward-only program)
    "nanogpt 1f1b": ([*OWN, "scheduler=1f1b", "eval.every=2"], _nanogpt_script),
    # four stages in a V, the I/W split, a measured profile of the loss computed in the graph
    "nanogpt zbv": ([*OWN, "scheduler=zbv", "partitioner=balanced"], _nanogpt_script),
    # the I/W split on one stage per rank, each stage recomputed (R) before its backward
    "nanogpt zb_h1 remat": ([*OWN, "scheduler=zb_h1", "remat=full"], _nanogpt_script),
    # transformers' own loss: labels= the input ids, read by the first and the last stage
    "gpt2 1f1b": ([*GPT2, "scheduler=1f1b"], _transformers_script),
}


@pytest.fixture(scope="module")
def own_loss_runs(tmp_path_factory) -> dict:
    cfgs = {what: compose_cfg([*COMMON, *overrides]) for what, (overrides, _) in CASES.items()}
    runs = run_jobs(list(cfgs.values()), tmp_path_factory.mktemp("own_loss") / "logs", split_check=True)
    return {what: (cfgs[what], ranks) for what, ranks in zip(cfgs, runs, strict=True)}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("what", list(CASES))
def test_a_model_trains_with_its_own_loss_as_in_its_own_script(own_loss_runs, what: str) -> None:
    """Losses of 4 steps within 1e-5 of the user's own script and the final weights as close; the
    first loss is the model's own on the first batch (nanoGPT: `m(x, y)[1]`, GPT-2: `m(x, labels=x).loss`)."""
    cfg, ranks = own_loss_runs[what]
    expected = CASES[what][1](cfg)
    assert ranks[0].losses == pytest.approx(expected["losses"], rel=1e-5), what
    prefix = "inner." if what.startswith("nanogpt") else "model."
    got = {n.removeprefix(prefix): p for n, p in merge_state(ranks, "params_final").items()}
    assert_state_close(got, expected["params"], f"{what} weights")
    if cfg.eval.every:  # the held-out losses, forward only, as rank 0's metrics report them
        metrics = ranks[0].history
        assert [e["step"] for e in metrics.eval_loss] == [e["step"] for e in expected["eval_losses"]]
        assert [e["eval_loss"] for e in metrics.eval_loss] == pytest.approx(
            [e["eval_loss"] for e in expected["eval_losses"]], rel=1e-5)


def test_the_targets_are_an_input_of_the_stage_computing_the_loss() -> None:
    """nanoGPT's targets are a second model input, read by the last stage; GPT-2's labels are the
    input ids, read by the first stage (embedding) and the last (its loss)."""
    plan = prepare(compose_cfg([*COMMON, *OWN, "mode=plan"]), profile=False).plan
    assert plan.model_inputs == {"x": "input", "target": "target"}
    assert plan.stages[0].inputs == {"x": None} and plan.stages[-1].inputs.get("target", 0) is None
    plan = prepare(compose_cfg([*COMMON, *GPT2, "mode=plan"]), profile=False).plan
    assert plan.model_inputs == {"ids": "input"}
    assert all(s.inputs.get("ids", 0) is None for s in plan.stages)


def test_a_transformers_model_brought_as_a_module_trains_with_its_labels() -> None:
    """`model=module` around transformers' GPT2LMHeadModel: `model.loss=model` finds its `labels`
    argument and gives it the inputs (transformers shifts them); the stages match the module."""
    gpt2 = ["model=module", "model.module._target_=transformers.GPT2LMHeadModel",
            "+model.module.config._target_=transformers.GPT2Config", "+model.module.config.n_embd=32",
            "+model.module.config.n_layer=2", "+model.module.config.n_head=2", "+model.module.config.vocab_size=64",
            "+model.module.config.n_positions=32", "+model.module.config.resid_pdrop=0",
            "+model.module.config.embd_pdrop=0", "+model.module.config.attn_pdrop=0",
            "+model.module.config.use_cache=false", "model.seq_len=16", "model.vocab_size=64", "model.loss=model"]
    cfg = compose_cfg([*COMMON, *gpt2])
    prepared = prepare(cfg)
    assert prepared.spec.own_loss and prepared.spec.data_args == ("input",)
    assert prepared.spec.build_meta().targets_arg == "labels"
    line = check_split(cfg, prepared.spec, prepared.plan, prepared.model)
    assert line.startswith("check_split: the 2 stages match"), line


def test_output_index_picks_logits_from_a_tuple() -> None:
    """`model.output=0` takes the logits of `(logits, hidden)`; the stages match the module's own
    `model(x)[0]` scored by causal_lm; a position or a name that is not there is refused naming
    model.output and what is."""
    base = [*COMMON, "model=module", "model.module._target_=tests.test_own_loss.TupleLM", "model.seq_len=16",
            "model.vocab_size=64"]
    cfg = compose_cfg([*base, "model.output=0"])
    prepared = prepare(cfg)
    last = prepared.plan.stages[-1]
    assert last.values[last.loss_value] == [[4, 16, 64], "float32"]
    line = check_split(cfg, prepared.spec, prepared.plan, prepared.model)
    assert line.startswith("check_split: the 2 stages match"), line
    for output, fragment in (("2", "2 picks an element by position, but the module returns a tuple of 2; valid: 0 to 1"),
                             ("logits", "pick an element by position, e.g. model.output=0")):
        with pytest.raises(ConfigError) as info:
            prepare(compose_cfg([*base, f"model.output={output}"]), profile=False)
        assert info.value.key == "model.output" and fragment in str(info.value), str(info.value)


def test_a_loss_that_is_not_a_scalar_is_refused() -> None:
    """With model.loss=model the output picked must be the loss: nanoGPT's logits are not."""
    with pytest.raises(ConfigError) as info:
        prepare(compose_cfg([*COMMON, *OWN, "model.output=0"]), profile=False)
    message = str(info.value)
    assert info.value.key == "model.output" and "[4, 16, 64]" in message and "model.output=1" in message, message


def test_the_last_position_only_is_refused_before_any_rank(tmp_path) -> None:
    """nanoGPT called without targets returns the last position's logits, [4, 1, 64], where the
    next-token targets are [4, 16]: `python train.py` refuses it, naming both shapes and the fix,
    and starts no rank (it used to fail on rank 1: "Expected input batch_size (4) to match target
    batch_size (64)")."""
    from tests.test_cli import train

    run = tmp_path / "run"
    proc = train([*COMMON, *NANOGPT, "model.output=0"], run)
    assert proc.returncode == 2, proc.stderr[-3000:]
    error = proc.stderr
    assert error.startswith("error (config error): Invalid config `model.loss`: causal_lm cannot score"), error
    assert "output [4, 1, 64]" in error and "targets [4, 16]" in error and "model.loss=model" in error, error
    assert "every position" in error and "\n" not in error.strip()
    assert not (run / "logs").exists() and not (run / "metrics.json").exists()


@pytest.mark.parametrize("fails", ["build", "run"])
def test_a_reference_that_cannot_run_is_an_error_not_a_skip(monkeypatch, fails: str) -> None:
    """The unsplit module failing to build or run on the CPU refuses the run under check_split=auto
    (and always), saying why and that check_split=false turns the check off; false skips it."""
    cfg = compose_cfg([*COMMON, *OWN])
    prepared = prepare(cfg)
    args = (prepared.spec, prepared.plan, prepared.model)

    built = split_compare.built_for_real

    def cuda_only(*args, **kwargs):
        raise RuntimeError("needs CUDA")

    def reference(spec):
        if fails == "build":
            cuda_only()
        model = built(spec)
        model.inner.forward = cuda_only  # a kernel this machine lacks
        return model

    monkeypatch.setattr(split_compare, "built_for_real", reference)
    for setting in ("auto", "always", "true"):
        with pytest.raises(ConfigError) as info:
            check_split(compose_cfg([*COMMON, *OWN, f"check_split={setting}"]), *args)
        message = str(info.value)
        assert info.value.key == "check_split" and ("cannot be built" if fails == "build" else "cannot run") in message
        assert "RuntimeError: needs CUDA" in message and "check_split=false" in message, message
    assert check_split(compose_cfg([*COMMON, *OWN, "check_split=false"]), *args) == "check_split: skipped: check_split=never"
