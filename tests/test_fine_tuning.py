"""Documents as users have them (#46), first part: fine-tuning on prompt/response examples whose
lengths differ tenfold, the loss on the response tokens only (data=chat).

One loss for the global batch: whatever the micro-batch count (1, 4, 8) and the replicas (dp 1,
2), the step's loss and gradient are one process's on the whole global batch, the sum of the
scored tokens' losses over their count (token-weighted), for a user's own module scored by
pipelaunch (loss=causal_lm) and for a transformers Llama computing its own loss
(model.loss=model model.labels=targets). The references are the users' own models, built as
their authors build them (`torch.manual_seed(seed); model = factory()`), run on the whole batch
with the run's optimizer, the loss written out here: nothing of pipelaunch's loss code.

Before this, each micro-batch's mean was divided by micro-batches x replicas: a micro-batch of
one short example weighed as much as one of a long example, so these runs failed (m=1 dp=1
aside) by far more than the tolerance.

And bad input, refused before any rank starts, naming the config key: a jsonl line without the
named field (its line number), a window shorter than the longest example, a micro-batch with no
scored token, a model's own loss that cannot weigh the masked targets.
"""

from __future__ import annotations

import json
import random
from itertools import pairwise
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from torch import nn

from pipelaunch.launcher.validate import prepare
from pipelaunch.pipeline.core.errors import ConfigError
from tests.harness import compose_cfg, merge_state, run_jobs
from tests.reference import train_by_hand

VOCAB = 320  # the test tokenizer's 300 ids, rounded up
SEQ = 48  # the longest example is 45 tokens
COMMON = ["batch_size=16", "steps=2", "warmup_steps=0", "optimizer=sgd", "optimizer.lr=0.5", "timeout_s=120",
          "threads=1", "pp=2", "scheduler=gpipe", f"model.seq_len={SEQ}"]
MODULE = ["model=module", "model.module._target_=tests.test_fine_tuning.tiny_lm", f"model.vocab_size={VOCAB}"]
LLAMA = ["model=hf_llama_tiny", f"model.config.vocab_size={VOCAB}", "model.loss=model", "model.labels=targets"]
#: (microbatches, dp): the default suite's cover 1, 4 and 8 micro-batches and 1 and 2 replicas, -m slow the rest
LAYOUTS = [(1, 1), (8, 1), (4, 2)]
MORE_LAYOUTS = [(4, 1), (1, 2), (8, 2)]


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


def tiny_lm(vocab_size: int = VOCAB, dim: int = 32, layers: int = 4) -> nn.Module:
    """A user's own language model (the README's shape)."""
    return nn.Sequential(nn.Embedding(vocab_size, dim), *[Block(dim) for _ in range(layers)], nn.LayerNorm(dim),
                         nn.Linear(dim, vocab_size))


WORDS = "the quick brown fox jumps over lazy dog document times then sleeps".split()


def write_examples(path: Path, count: int = 40, seed: int = 0) -> Path:
    """Prompt/response pairs, responses of 1 to 20 words: 3 to 35 scored tokens per example."""
    rng = random.Random(seed)
    lines = []
    for i in range(count):
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 4)))
        response = " ".join(rng.choice(WORDS) for _ in range(rng.choice([1, 2, 12, 20])))
        lines.append(json.dumps({"prompt": f"Q{i}: {prompt}?", "response": response}))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> list[str]:
    from tests.corpora import make_tokenizer

    root = tmp_path_factory.mktemp("chat")
    make_tokenizer(root / "tok")
    return ["data=chat", f"data.files=[{write_examples(root / 'train.jsonl')}]", f"data.tokenizer={root / 'tok'}"]


def token_weighted(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The sum of the scored tokens' cross-entropies over their count (targets -100 unscored)."""
    flat = logits.reshape(-1, logits.shape[-1]).float()
    return nn.functional.cross_entropy(flat, targets.reshape(-1), ignore_index=-100, reduction="sum") / (
        targets != -100).sum()


def user_script(cfg, model: nn.Module, logits_of) -> dict:
    """One process on the whole global batch: the token-weighted loss, the run's optimizer."""
    data = instantiate(cfg.data)

    def step_loss(m: nn.Module, step: int) -> torch.Tensor:
        x, y = data.batch(step, cfg.batch_size)
        return token_weighted(logits_of(m, x), y)

    return train_by_hand(cfg, model, step_loss)


def module_reference(cfg) -> dict:
    torch.manual_seed(cfg.seed)
    return user_script(cfg, tiny_lm(), lambda m, x: m(x))


def llama_reference(cfg) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**cfg.model["config"])
    config.attention_dropout = 0.0
    torch.manual_seed(cfg.seed)
    model = AutoModelForCausalLM.from_config(config)
    return user_script(cfg, model, lambda m, x: m(x).logits)


def assert_close(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], what: str, rel: float = 1e-6) -> None:
    """Each tensor within `rel` of the reference, relative to its norm."""
    assert set(got) == set(ref), f"{what}: names differ: {sorted(set(got) ^ set(ref))}"
    for name, r in ref.items():
        err = float((got[name] - r).norm()) / max(float(r.norm()), 1e-12)
        assert err <= rel, f"{what}: {name} differs from one process on the global batch by {err:.2e} (relative)"


def check_layouts(overrides: list[str], reference, prefix: str, layouts: list[tuple[int, int]],
                  tmp_path: Path) -> None:
    """Runs of each (microbatches, dp) in `layouts`, one spawn per dp, against `reference`."""
    cfgs = {(m, dp): compose_cfg([*COMMON, *overrides, f"microbatches={m}", f"dp={dp}"]) for m, dp in layouts}
    runs = {}
    for dp in sorted({dp for _, dp in layouts}):
        keys = [k for k in cfgs if k[1] == dp]
        runs.update(zip(keys, run_jobs([cfgs[k] for k in keys], tmp_path / f"dp{dp}"), strict=True))
    expected = reference(next(iter(cfgs.values())))
    for (m, dp), ranks in runs.items():
        what = f"microbatches={m} dp={dp}"
        assert ranks[0].losses == pytest.approx(expected["losses"], rel=1e-6), what
        for d in range(dp):
            grads = {n.removeprefix(prefix): g for n, g in merge_state(ranks, "grads_step0", d).items()}
            params = {n.removeprefix(prefix): p for n, p in merge_state(ranks, "params_final", d).items()}
            assert_close(grads, expected["grads"], f"{what} replica {d} step-0 gradients")
            assert_close(params, expected["params"], f"{what} replica {d} weights after {cfgs[m, dp].steps} steps")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layouts", [LAYOUTS, pytest.param(MORE_LAYOUTS, marks=pytest.mark.slow)],
                         ids=["default", "more"])
def test_module_fine_tunes_token_weighted_whatever_the_microbatches(corpus, tmp_path, layouts) -> None:
    """A user's module, pipelaunch's causal_lm loss: loss, step-0 gradients and final weights of
    every replica within 1e-6 of one process's token-weighted run on the global batch, for 1, 4
    and 8 micro-batches and 1 and 2 replicas (pp=2, gpipe)."""
    check_layouts([*MODULE, *corpus], module_reference, "inner.", layouts, tmp_path)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layouts", [[(4, 2)], pytest.param([(1, 1), (8, 1), *MORE_LAYOUTS], marks=pytest.mark.slow)],
                         ids=["default", "more"])
def test_llama_own_loss_fine_tunes_token_weighted_whatever_the_microbatches(corpus, tmp_path, layouts) -> None:
    """transformers' Llama computing its own loss on the data's masked targets (model.loss=model
    model.labels=targets): the same, against the Llama run on the whole batch by hand. The default
    suite runs 4 micro-batches on each of 2 replicas (the weighting across both, which the module
    above checks at every count); -m slow every other layout."""
    check_layouts([*LLAMA, *corpus], llama_reference, "model.", layouts, tmp_path)


# ---- packed examples (data.packing=documents) -------------------------------------------------------
GPT = ["model=gpt", f"model.vocab_size={VOCAB}", "model.layers=4", "model.dim=32", "model.heads=2",
       "model.dropout=0.0"]


def per_example(model: nn.Module, x: torch.Tensor, y: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(sum of the scored tokens' cross-entropies, their count) of packed windows, each example (a
    run of positions from 0) through the plain model on its own."""
    total, count = torch.zeros(()), 0
    for row_x, row_y, row_p in zip(x.tolist(), y.tolist(), positions.tolist(), strict=True):
        starts = [i for i, p in enumerate(row_p) if p == 0] + [len(row_p)]
        for a, b in zip(starts, starts[1:], strict=False):
            seg_y = torch.tensor(row_y[a:b])
            if (seg_y == -100).all():  # the padding after the last example
                continue
            logits = model(torch.tensor([row_x[a:b]]))[0]
            total = total + nn.functional.cross_entropy(logits, seg_y, ignore_index=-100, reduction="sum")
            count += int((seg_y != -100).sum())
    return total, count


def packed_reference(cfg) -> dict:
    """The plain GPT (`torch.manual_seed(seed); factory()`, no packing) on each example of the run's
    packed windows alone, token-weighted over the global batch; and step 0's gradients on whole windows."""
    plain = compose_cfg([*(o for o in COMMON if not o.startswith("model.seq_len=")), *GPT,
                         f"model.seq_len={cfg.model['seq_len']}", "data=chat", f"data.files={list(cfg.data['files'])}",
                         f"data.tokenizer={cfg.data['tokenizer']}"])
    torch.manual_seed(cfg.seed)
    model = instantiate(plain.model).build()
    data = instantiate(cfg.data)

    def step_loss(m: nn.Module, step: int) -> torch.Tensor:
        x, y, fields = data.batch(step, cfg.batch_size)
        total, count = per_example(m, x, y, fields["position_ids"])
        return total / count

    def whole_windows(m: nn.Module) -> dict:  # the examples attending to each other: other gradients
        x, y, _ = data.batch(0, cfg.batch_size)
        token_weighted(m(x), y).backward()
        return {n: p.grad.detach().clone() for n, p in m.named_parameters()}

    out = train_by_hand(cfg, model, step_loss, whole_windows)
    return {**out, "whole": out["probed"]}


@pytest.mark.timeout(600)
def test_packed_examples_train_as_each_example_alone(corpus, tmp_path) -> None:
    """data=chat data.packing=documents: whole examples packed into each window, each with its own
    positions and attention, its response scored. pp=2 zbv and pp=2 dp=2 zero=1 1f1b give the plain
    model's run on each example alone (1e-5), and the window's examples attending to each other
    would give another loss: the mask matters."""
    window = [o for o in COMMON if not o.startswith("model.seq_len=")] + ["model.seq_len=96"]  # 2-5 examples each
    from tests.test_packing import assert_close as packed_close

    packed = [*window, *GPT, *corpus, "data.packing=documents", "batch_size=8", "microbatches=4"]
    cfgs = {"pp=2 zbv": compose_cfg([*packed, "pp=2", "scheduler=zbv"]),
            "pp=2 dp=2 zero=1 1f1b": compose_cfg([*packed, "pp=2", "dp=2", "zero=1", "scheduler=1f1b"])}
    runs = {label: run_jobs([cfg], tmp_path / label.replace(" ", "_"))[0] for label, cfg in cfgs.items()}
    expected = packed_reference(cfgs["pp=2 zbv"])
    x, y, fields = instantiate(cfgs["pp=2 zbv"].data).batch(0, 8)
    examples = sum(bool((row_y[a:b] != -100).any()) for row_y, row_p in zip(y, fields["position_ids"], strict=True)
                   for a, b in pairwise([*(row_p == 0).nonzero().flatten().tolist(), len(row_p)]))
    assert examples >= 2 * len(x), f"{examples} examples in {len(x)} windows: they should hold several each"
    unmasked = sum(float((expected["whole"][n] - g).norm()) for n, g in expected["grads"].items())
    assert unmasked > 1e-2 * sum(float(g.norm()) for g in expected["grads"].values()), "the mask should matter"
    for label, ranks in runs.items():
        assert ranks[0].losses == pytest.approx(expected["losses"], rel=1e-5), label
        for d in range(cfgs[label].dp):
            grads = {n.removeprefix("model."): g for n, g in merge_state(ranks, "grads_step0", d).items()}
            params = {n.removeprefix("model."): p for n, p in merge_state(ranks, "params_final", d).items()}
            # (a key bias's gradient is zero in exact arithmetic: held to a floor, as in test_packing)
            packed_close(grads, expected["grads"], f"{label} replica {d} step-0 gradients")
            packed_close(params, expected["params"], f"{label} replica {d} final weights")


# ---- what the data gives -------------------------------------------------------------------------
def test_targets_score_the_response_tokens_only(corpus) -> None:
    """Each sample is the prompt's tokens, the response's and end-of-sequence, padded; its targets
    are the next tokens where they belong to the response, -100 on the prompt and the padding."""
    from transformers import AutoTokenizer

    cfg = compose_cfg([*COMMON, *MODULE, *corpus])
    data = instantiate(cfg.data)
    tok = AutoTokenizer.from_pretrained(cfg.data["tokenizer"])
    records = [json.loads(line) for line in Path(cfg.data["files"][0]).read_text().splitlines()]
    by_tokens = {}
    for r in records:
        prompt, response = tok(r["prompt"])["input_ids"], tok(r["response"], add_special_tokens=False)["input_ids"]
        by_tokens[tuple(prompt + response + [tok.eos_token_id])] = len(prompt)
    x, y = data.batch(0, 16)
    assert x.shape == y.shape == (16, SEQ)
    padding = 0
    for row_x, row_y in zip(x, y, strict=True):
        length = int((row_y != -100).nonzero().max()) + 2  # the last scored target is end-of-sequence
        padding += SEQ - (length - 1)
        ids = tuple(row_x[:length - 1].tolist()) + (int(row_y[length - 2]),)
        prompt = by_tokens[ids]
        assert (row_y[:prompt - 1] == -100).all() and (row_y[length - 1:] == -100).all()
        assert row_y[prompt - 1:length - 1].tolist() == list(ids[prompt:])
    lengths = torch.tensor([len(k) for k in by_tokens])
    scored = torch.tensor([len(k) - p for k, p in by_tokens.items()])
    assert int(scored.max()) >= 10 * int(scored.min())  # examples differ tenfold in what they score
    assert data.padded_tokens(0, 16) == padding  # the padding share metrics.json reports
    assert int(lengths.max()) <= SEQ + 1


def test_messages_go_through_the_chat_template(tmp_path) -> None:
    """data.messages_key: the conversation rendered by the tokenizer's own chat template, the
    loss on the last (assistant) message's tokens."""
    from transformers import AutoTokenizer

    from pipelaunch.pipeline.data.chat import ChatExamples
    from tests.corpora import make_tokenizer

    make_tokenizer(tmp_path / "tok")
    tok = AutoTokenizer.from_pretrained(tmp_path / "tok")
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant: {% endif %}")
    tok.save_pretrained(tmp_path / "tok")
    conversation = [{"role": "user", "content": "the quick fox"}, {"role": "assistant", "content": "jumps"}]
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": conversation}) + "\n")
    data = ChatExamples(files=[str(path)], tokenizer=str(tmp_path / "tok"), seq_len=32, messages_key="messages")
    x, y = data.batch(0, 1)
    full = tok.apply_chat_template(conversation, return_dict=False)
    assert x[0, :len(full) - 1].tolist() == full[:-1]
    scored = (y[0] != -100).nonzero().flatten()
    # the assistant's message, byte-level (Ġ a space, Ċ a newline), its first word's space merged in
    assert "".join(tok.convert_ids_to_tokens(y[0, scored].tolist())) == "\u0120jumps\u010a"
    assert scored.tolist() == list(range(int(scored[0]), len(full) - 1))  # the last tokens, then padding


# ---- bad input, before any rank -----------------------------------------------------------------
def _refusal(overrides: list[str]) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        prepare(compose_cfg(overrides))
    return err.value


def test_a_line_without_the_named_field_is_refused_with_its_number(corpus, tmp_path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a", "response": "b"}\n\n{"prompt": "a", "answer": "b"}\n')
    err = _refusal([*COMMON, *MODULE, *corpus, f"data.files=[{path}]"])
    assert err.key == "data.response_key" and "line 3" in str(err) and "'answer'" in str(err), err


def test_a_window_shorter_than_the_longest_example_is_refused(corpus) -> None:
    err = _refusal([*[o for o in COMMON if not o.startswith("model.seq_len")], *MODULE, *corpus, "model.seq_len=16"])
    assert err.key == "model.seq_len" and "data.truncate=true" in str(err) and "model.seq_len=4" in str(err), err


def test_a_microbatch_without_a_scored_token_is_refused(corpus, tmp_path) -> None:
    """Truncated to a 16-token window, examples with long prompts keep no response token: alone in
    a micro-batch of one (microbatches=8, dp=2), that micro-batch would train on nothing."""
    path = tmp_path / "long_prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": " ".join(WORDS * (i % 2 * 3 + 1)), "response": "dog"}) + "\n"
                            for i in range(16)))
    overrides = [*[o for o in COMMON if not o.startswith("model.seq_len")], *MODULE, *corpus,
                 f"data.files=[{path}]", "model.seq_len=16", "data.truncate=true", "dp=2", "microbatches=8"]
    err = _refusal(overrides)
    assert err.key == "microbatches" and "holds no scored token" in str(err), err


@pytest.mark.parametrize(("model", "key", "says"), [
    (["model=module", "model.module._target_=tests.zoo.nanogpt", f"model.vocab_size={VOCAB}", "model.loss=model"],
     "model.loss", "model.loss=causal_lm"),
    (["model=hf_llama_tiny", f"model.config.vocab_size={VOCAB}", "model.loss=model"], "model.labels",
     "model.labels=targets"),
])
def test_an_own_loss_that_cannot_weigh_masked_targets_is_refused(corpus, model, key, says) -> None:
    err = _refusal([*COMMON, *model, *corpus])
    assert err.key == key and says in str(err), err
