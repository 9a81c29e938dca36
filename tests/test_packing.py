"""Documents as users have them (#46), second part: packed documents (`data.packing=documents`).

A window of the token stream holds several documents; each is trained on as if alone: its own
positions from 0, attention within it, and no target across a document boundary. The yardstick is
independent of the packing code: the plain, unpacked model (`torch.manual_seed(seed); model =
factory()`) run on each document segment of each window on its own (the window split by hand at
the end-of-document ids, positions from 0), the loss token-weighted over the global batch, the
run's optimizer. Pipelines of every schedule family (1f1b, zbv, interleaved_1f1b, a V schedule),
pp=2 and pp=4, dp=2 zero=1, must give its losses, step-0 gradients and final weights within 1e-5.
The unmasked loss (whole windows through the plain model) differs: the mask matters.

And bad input, refused before any rank starts, naming the config key.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hydra.utils import instantiate
from torch import nn

from pipelaunch.launcher.validate import prepare
from pipelaunch.pipeline.core.errors import ConfigError
from tests.harness import compose_cfg, merge_state, run_jobs
from tests.reference import train_by_hand

EOD = 0
VOCAB = 64
RUN = ["model.seq_len=16", f"model.vocab_size={VOCAB}", "batch_size=16", "steps=3", "warmup_steps=0", "optimizer=sgd",
       "optimizer.lr=0.5", "timeout_s=120", "threads=1", "microbatches=4"]
COMMON = ["model.dim=32", "model.layers=6", *RUN]
#: (what, overrides): the default suite runs the first two, -m slow every one
LAYOUTS = [
    ("pp=2 1f1b", ["pp=2", "scheduler=1f1b"]),
    ("pp=2 zbv", ["pp=2", "scheduler=zbv"]),
]
MORE_LAYOUTS = [
    ("pp=2 dp=2 zero=1 zbv", ["pp=2", "dp=2", "zero=1", "scheduler=zbv"]),
    ("pp=4 dp=2 zero=1 zbv", ["pp=4", "dp=2", "zero=1", "scheduler=zbv"]),
    ("pp=4 1f1b", ["pp=4", "scheduler=1f1b"]),
    ("pp=2 interleaved_1f1b", ["pp=2", "scheduler=interleaved_1f1b"]),
    ("pp=4 interleaved_1f1b", ["pp=4", "scheduler=interleaved_1f1b"]),
    ("pp=2 v_half", ["pp=2", "scheduler=v_half"]),
    ("pp=2 dp=2 zero=1 1f1b", ["pp=2", "dp=2", "zero=1", "scheduler=1f1b"]),
    ("pp=4 dp=2 zero=1 interleaved_1f1b", ["pp=4", "dp=2", "zero=1", "scheduler=interleaved_1f1b"]),
]


def write_documents(path: Path, count: int = 400, seed: int = 0) -> Path:
    """Documents of 1 to 30 ids (1..63), each ended by EOD: a 16-token window holds one to many."""
    rng = np.random.default_rng(seed)
    ids: list[int] = []
    for _ in range(count):
        ids += [*rng.integers(1, VOCAB, int(rng.choice([1, 2, 4, 7, 12, 30]))).tolist(), EOD]
    np.array(ids, dtype=np.uint16).tofile(path)
    return path


@pytest.fixture(scope="module")
def documents(tmp_path_factory) -> list[str]:
    path = write_documents(tmp_path_factory.mktemp("packing") / "docs.bin")
    return ["data=tokens", f"data.path={path}", "data.packing=documents", f"data.eod_id={EOD}"]


def per_document(model: nn.Module, x: torch.Tensor, y: torch.Tensor, logits_of=None) -> tuple[torch.Tensor, int]:
    """(sum of the scored tokens' cross-entropies, their count) of windows x, y [n, t], each
    document segment run through the plain model on its own: a segment ends after each EOD (whose
    target, the next document's first id, is not scored) or at the window's end."""
    total, count = torch.zeros(()), 0
    for row_x, row_y in zip(x.tolist(), y.tolist(), strict=True):
        start = 0
        for end in range(len(row_x)):
            if row_x[end] != EOD and end != len(row_x) - 1:
                continue
            seg_x, seg_y = row_x[start:end + 1], list(row_y[start:end + 1])
            if row_x[end] == EOD:
                seg_y[-1] = -100
            logits = (logits_of or (lambda m, ids: m(ids)))(model, torch.tensor([seg_x]))[0]
            total = total + nn.functional.cross_entropy(logits, torch.tensor(seg_y), ignore_index=-100,
                                                        reduction="sum")
            count += sum(t != -100 for t in seg_y)
            start = end + 1
    return total, count


def unpacked_windows(cfg, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The run's windows of `step`: their ids as the data draws them (whole documents, padding after)
    and their next-token targets, checked here to be the next ids but after an EOD; the reference
    segments and masks them itself."""
    x, y, _ = instantiate(cfg.data).batch(step, cfg.batch_size)
    assert torch.equal(y[:, :-1], x[:, 1:].masked_fill(x[:, :-1] == EOD, -100))
    return x, y


def plain_gpt(cfg) -> nn.Module:
    """The project's GPT as its factory builds it unpacked: `torch.manual_seed(seed); factory()`."""
    plain = compose_cfg([*COMMON, "data=tokens", f"data.path={cfg.data['path']}"])
    torch.manual_seed(cfg.seed)
    return instantiate(plain.model).build()


def plain_llama(cfg) -> nn.Module:
    """transformers' Llama as its users build it: `torch.manual_seed(seed); from_config(config)`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**cfg.model["config"])
    config.attention_dropout = 0.0
    torch.manual_seed(cfg.seed)
    return AutoModelForCausalLM.from_config(config)


def reference(cfg, build=plain_gpt, logits_of=None) -> dict:
    """The plain model (no packing) trained per document on the global batch, the run's optimizer;
    and step 0's loss and gradients on whole windows, unmasked."""
    logits = logits_of or (lambda m, ids: m(ids))

    def step_loss(model: nn.Module, step: int) -> torch.Tensor:
        total, count = per_document(model, *unpacked_windows(cfg, step), logits)
        return total / count

    def unmasked(model: nn.Module) -> tuple[float, dict]:  # whole windows, document ends' targets left
        x, y = unpacked_windows(cfg, 0)                     # out too: only the mask differs
        y_masked = y.masked_fill(x == EOD, -100)
        whole = nn.functional.cross_entropy(logits(model, x).reshape(-1, VOCAB), y_masked.reshape(-1), ignore_index=-100)
        whole.backward()
        return float(whole.detach()), {n: p.grad.detach().clone() for n, p in model.named_parameters()}

    out = train_by_hand(cfg, build(cfg), step_loss, unmasked)
    return {**out, "unmasked": out["probed"]}


def assert_close(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], what: str, rel: float = 1e-5) -> None:
    """Each tensor within `rel` of the reference relative to its norm, or to 1e-3 of the largest
    norm for one that is zero in exact arithmetic (a key bias under softmax: rounding noise)."""
    assert set(got) == set(ref), f"{what}: names differ: {sorted(set(got) ^ set(ref))}"
    floor = 1e-3 * max(float(r.norm()) for r in ref.values())
    for name, r in ref.items():
        err = float((got[name] - r).norm()) / max(float(r.norm()), floor)
        assert err <= rel, f"{what}: {name} differs from the per-document reference by {err:.2e} (relative)"


def check_layouts(documents: list[str], layouts: list[tuple[str, list[str]]], tmp_path: Path,
                  model: tuple[str, ...] = tuple(COMMON), build=plain_gpt, logits_of=None, prefix: str = "") -> None:
    """Runs of each layout against the per-document reference (`build`: the plain model)."""
    cfgs = {what: compose_cfg([*model, *documents, *over]) for what, over in layouts}
    runs = {}
    for world in sorted({c.world_size for c in cfgs.values()}):
        keys = [k for k, c in cfgs.items() if c.world_size == world]
        runs.update(zip(keys, run_jobs([cfgs[k] for k in keys], tmp_path / f"w{world}"), strict=True))
    expected = reference(next(iter(cfgs.values())), build, logits_of)
    # the mask matters: whole windows through the plain model score otherwise, over 10x the
    # tolerance in the loss (at step 0 the model guesses near uniformly: about 1e-3 relative) and
    # far more in the gradients
    unmasked_loss, unmasked_grads = expected["unmasked"]
    assert abs(unmasked_loss - expected["losses"][0]) > 1e-4 * expected["losses"][0], unmasked_loss
    with pytest.raises(AssertionError, match="differs"):
        assert_close(unmasked_grads, expected["grads"], "unmasked", rel=1e-2)
    for what, ranks in runs.items():
        assert ranks[0].losses == pytest.approx(expected["losses"], rel=1e-5), what
        for d in range(cfgs[what].dp):
            grads = {n.removeprefix(prefix): g for n, g in merge_state(ranks, "grads_step0", d).items()}
            params = {n.removeprefix(prefix): p for n, p in merge_state(ranks, "params_final", d).items()}
            assert_close(grads, expected["grads"], f"{what} replica {d} step-0 grads")
            assert_close(params, expected["params"], f"{what} replica {d} weights")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", LAYOUTS, ids=[w for w, _ in LAYOUTS])
def test_packed_gpt_trains_as_each_document_alone(documents, tmp_path, layout) -> None:
    """The project's GPT on packed documents (the default suite's two layouts)."""
    check_layouts(documents, [layout], tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_packed_gpt_on_every_schedule_family(documents, tmp_path) -> None:
    """The same on the rest of the matrix: pp=2 and 4, 1f1b, zbv, interleaved_1f1b, v_half, dp=2 zero=1."""
    check_layouts(documents, MORE_LAYOUTS, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_stream_packed_gpt_trains_as_each_piece_alone(documents, tmp_path) -> None:
    """data.packing=stream: the windows cut from the stream, each document piece trained alone."""
    check_layouts([*documents, "data.packing=stream"], [LAYOUTS[0]], tmp_path)


@pytest.mark.timeout(600)
def test_packed_gpt_under_tensor_parallelism_trains_as_each_document_alone(documents, tmp_path) -> None:
    """pp=2 tp=2 with sequence parallelism: every tp rank reads the same position ids, its heads'
    attention confined to each document, the sequence-parallel regions cut along the positions."""
    check_layouts(documents, [("pp=2 tp=2 sequence_parallel 1f1b",
                               ["pp=2", "tp=2", "sequence_parallel=true", "scheduler=1f1b"])], tmp_path)


LLAMA = ("model=hf_llama_tiny", f"model.config.vocab_size={VOCAB}", *RUN)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("attention", ["sdpa", pytest.param("eager", marks=pytest.mark.slow)])
def test_packed_llama_trains_as_each_document_alone(documents, tmp_path, attention) -> None:
    """transformers' Llama on packed documents (pp=2 1f1b): given the position ids alone, its packed
    path confines attention and restarts the rotary positions per document, in sdpa and eager."""
    check_layouts(documents, [LAYOUTS[0]], tmp_path, (*LLAMA, f"+model.config.attn_implementation={attention}"),
                  plain_llama, lambda m, ids: m(ids).logits, "model.")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_packed_llama_under_tensor_parallelism_trains_as_each_document_alone(documents, tmp_path) -> None:
    """transformers' Llama at pp=2 tp=2 on packed documents, its tp plan's slices given the ids."""
    check_layouts(documents, [("pp=2 tp=2 1f1b", ["pp=2", "tp=2", "scheduler=1f1b"])], tmp_path, LLAMA, plain_llama,
                  lambda m, ids: m(ids).logits, "model.")


@pytest.mark.slow  # the default suite checks the rewrite (tests/test_context_parallel_models.py) and the kernels
@pytest.mark.timeout(600)
def test_packed_llama_trains_as_each_document_alone_under_context_parallelism(documents, tmp_path) -> None:
    """transformers' Llama on packed documents at pp=2 cp=2 (#57): the document mask it builds from
    the position ids is replaced in its graph by the ids themselves, so the ring finds each
    token's document on every rank; its rotary positions are the data's, per document."""
    check_layouts(documents, [("pp=2 cp=2 ring", ["pp=2", "cp=2", "scheduler=1f1b"])], tmp_path, LLAMA, plain_llama,
                  lambda m, ids: m(ids).logits, "model.")


# ---- the GPT's document mask ----------------------------------------------------------------------
def test_flex_document_mask_equals_the_boolean_mask() -> None:
    """The CUDA path's FlexAttention document BlockMask (run here in its eager form) computes what
    the CPU path's boolean block-diagonal mask does."""
    import warnings

    from pipelaunch.models.gpt import document_attention, flex_document_attention
    from pipelaunch.models.spec import segments

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 16, 8, generator=gen) for _ in range(3))
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1], [*range(8), *range(7), 0]])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex_attention warns that it is not compiled
        flex = flex_document_attention(q, k, v, segments(pos))
    torch.testing.assert_close(flex, document_attention(q, k, v, pos, 0.0), rtol=1e-5, atol=1e-6)


def test_one_document_per_window_is_the_plain_model(documents) -> None:
    """Position ids 0..t-1 (one document per window): the packed GPT computes the plain one."""
    cfg = compose_cfg([*COMMON, *documents])
    torch.manual_seed(0)
    packed = instantiate(cfg.model).build()
    plain = plain_gpt(cfg)
    x = torch.randint(1, VOCAB, (3, 16))
    torch.testing.assert_close(packed(x, torch.arange(16).expand(3, 16)), plain(x))


# ---- what the data gives -------------------------------------------------------------------------
def test_packed_windows_hold_whole_documents_restart_positions_and_mask_document_ends(documents) -> None:
    """Each window starts where a document starts (or a longer-than-a-window document's piece) and
    holds the file's ids up to the last document end that fits, then padding (EOD, never scored);
    its position ids restart after every EOD, whose target is not scored."""
    cfg = compose_cfg([*COMMON, *documents])
    data = instantiate(cfg.data)
    stream = np.fromfile(cfg.data["path"], dtype=np.uint16).tolist()
    seq_len = cfg.data["seq_len"]
    window, starts, doc = seq_len + 1, set(), 0
    for i, token in enumerate(stream):  # where a window may start, found by hand
        if i == doc or (i - doc) % window == 0:
            starts.add(i)
        if token == EOD:
            doc = i + 1
    x, y, fields = data.batch(1, 16)
    padded = 0
    for row, target, pos in zip(x.tolist(), y.tolist(), fields["position_ids"].tolist(), strict=True):
        full = row + ([target[-1]] if target[-1] != -100 else [])
        kept = len(full)
        while kept and full[kept - 1] == EOD:  # the trailing EODs: the last document's end, then padding
            kept -= 1
        used = min(kept + 1, len(full))
        content = full[:used]
        assert any(stream[s:s + used] == content for s in starts if stream[s] == content[0]), content
        assert all(t == EOD for t in full[used:]), full  # padding after the last whole document
        padded += seq_len - min(used, seq_len)
        expected, p = [], 0
        for token in row:
            expected.append(p)
            p = 0 if token == EOD else p + 1
        assert pos == expected
    assert torch.equal(y == -100, x == EOD)
    assert data.padded_tokens(1, 16) == padded > 0


def test_stream_packing_cuts_the_unpacked_windows_and_splits_documents_at_their_edges(documents) -> None:
    """data.packing=stream (Megatron-LM's reset_attention_mask): the very windows data=tokens cuts
    unpacked, nothing padded, each position's id counting from its segment's start (the window's
    first position, or after an EOD), the EOD's target not scored."""
    from pipelaunch.pipeline.data.tokens import TokenFile

    cfg = compose_cfg([*COMMON, *documents, "data.packing=stream"])
    data = instantiate(cfg.data)
    x, y, fields = data.batch(1, 16)
    raw_x, raw_y = TokenFile(path=cfg.data["path"], seq_len=cfg.data["seq_len"], seed=cfg.seed).batch(1, 16)
    assert torch.equal(x, raw_x) and torch.equal(y, raw_y.masked_fill(raw_x == EOD, -100))
    starts_mid_document = 0
    for row, pos in zip(x.tolist(), fields["position_ids"].tolist(), strict=True):
        expected, p = [], 0
        for token in row:
            expected.append(p)
            p = 0 if token == EOD else p + 1
        assert pos == expected
        starts_mid_document += row[0] != EOD  # most windows start inside a document: split at the edge
    assert data.padded_tokens(1, 16) is None and starts_mid_document > 8
    err = _refusal([*COMMON, "data=chat", "data.files=[x.jsonl]", "data.tokenizer=t", "data.packing=stream"])
    assert err.key == "data.packing" and "whole examples" in str(err), err  # data=chat: never split


def test_hf_documents_pack_at_the_tokenizers_end_of_sequence(tmp_path) -> None:
    """data=hf: each document is followed by the tokenizer's end-of-sequence (data.eod_id null), the
    windows' position ids restart after it and its target is not scored."""
    import json

    from pipelaunch.pipeline.data.hf import HFDocuments
    from tests.corpora import make_tokenizer

    make_tokenizer(tmp_path / "tok")
    words = "the quick brown fox jumps over the lazy dog".split()
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": " ".join(words[: 1 + i % 9])}) + "\n" for i in range(60)))
    data = HFDocuments(files=[str(path)], tokenizer=str(tmp_path / "tok"), seq_len=16, packing="documents")
    eos = data._tok.eos_token_id
    x, y, fields = data.batch(0, 8)
    assert (x == eos).any()
    assert torch.equal(y == -100, x == eos)
    for row, pos in zip(x.tolist(), fields["position_ids"].tolist(), strict=True):
        assert all(p == (0 if i == 0 or row[i - 1] == eos else pos[i - 1] + 1) for i, p in enumerate(pos))


class PositionsLM(nn.Module):
    """A user's module taking packed position ids under its own name."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.pos = nn.Embedding(16, 16)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids) + self.pos(pos))


def test_a_module_gets_the_position_ids_by_its_own_keyword(documents) -> None:
    """model.position_ids_arg names the forward's argument; the plan feeds it the data's field."""
    cfg = compose_cfg(["model=module", "model.module._target_=tests.test_packing.PositionsLM",
                       "model.position_ids_arg=pos", *RUN, *documents, "pp=2"])
    prepared = prepare(cfg)
    assert prepared.spec.data_args == ("input", "position_ids")
    assert sorted(prepared.plan.model_inputs.values()) == ["input", "position_ids"]


# ---- bad input, before any rank -----------------------------------------------------------------
def _refusal(overrides: list[str]) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        prepare(compose_cfg(overrides))
    return err.value


def test_packing_without_an_end_of_document_id_is_refused(documents) -> None:
    err = _refusal([*COMMON, *[o for o in documents if not o.startswith("data.eod_id")], "pp=2"])
    assert err.key == "data.eod_id" and "data.eod_id=" in str(err), err


def test_an_attention_that_ignores_packed_positions_here_is_refused(documents) -> None:
    """flash_attention_2 reads packed position ids on CUDA only (transformers itself refuses to
    build it here without its package: the check is called on the spec as if it had)."""
    from pipelaunch.launcher.validate import check_data_fields

    cfg = compose_cfg([*LLAMA, *documents, "pp=2"])
    spec = instantiate(cfg.model)
    assert spec.data_args == ("input", "position_ids")
    check_data_fields(cfg, spec, ("position_ids",))  # sdpa: fine
    spec.meta["attn_implementation"] = "flash_attention_2"
    with pytest.raises(ConfigError) as err:
        check_data_fields(cfg, spec, ("position_ids",))
    assert err.value.key == "model.config.attn_implementation" and "sdpa" in str(err.value), err.value


def test_an_unknown_packing_is_refused(documents) -> None:
    err = _refusal([*COMMON, *documents, "data.packing=greedy", "pp=2"])
    assert err.key == "data.packing" and "documents" in str(err), err


def test_a_module_whose_forward_takes_no_position_ids_is_refused(documents) -> None:
    err = _refusal(["model=module", "model.module._target_=tests.test_fine_tuning.tiny_lm", *RUN, *documents,
                    "pp=2"])
    assert err.key == "model.position_ids_arg" and "position_ids" in str(err), err


def test_math_attention_computes_what_fused_attention_does(documents) -> None:
    """model.attention=math (the scores materialised, as Megatron-LM before fused attention)
    gives the fused path's outputs, causal and within packed documents; the whole GPT too."""
    from pipelaunch.models.gpt import document_attention, math_attention

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 16, 8, generator=gen) for _ in range(3))
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1], [*range(8), *range(7), 0]])
    causal = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(math_attention(q, k, v, 0.0), causal, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(math_attention(q, k, v, 0.0, pos), document_attention(q, k, v, pos, 0.0),
                               rtol=1e-5, atol=1e-6)
    models = []
    for attention in ("sdpa", "math"):
        torch.manual_seed(0)
        models.append(instantiate(compose_cfg([*COMMON, f"model.attention={attention}"]).model).build())
    x = torch.randint(1, VOCAB, (3, 16))
    torch.testing.assert_close(models[1](x), models[0](x), rtol=1e-5, atol=1e-5)
    from pipelaunch.models.gpt import gpt

    with pytest.raises(ConfigError, match="model.attention"):
        gpt(attention="flash")


@pytest.mark.timeout(600)
def test_packed_gpt_trains_as_each_document_alone_under_context_parallelism(documents, tmp_path) -> None:
    """cp=2 (#57): each rank holds a head and a tail chunk of every window, a document crossing
    the chunks is attended across the ranks (its tokens known by their start), by the ring and by
    the all-to-all; the same losses, gradients and weights as each document alone."""
    check_layouts(documents, [("pp=2 cp=2 ring", ["pp=2", "cp=2", "scheduler=1f1b"]),
                              ("pp=1 dp=2 cp=2 alltoall", ["pp=1", "dp=2", "cp=2", "cp_method=alltoall",
                                                           "scheduler=gpipe"])], tmp_path)
