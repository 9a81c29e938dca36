"""Weighted mixtures of corpora (`data.blend`, #58).

Each sample's corpus is a pure function of (seed, global sample index) (pipeline/data/blend.py), and
its window the one that corpus alone would read as that sample: the realised shares match the
weights within 1% over 10,000 samples, from any first sample (a resumed run); the global batch,
and the share of it each replica takes, is the same whatever the layout; a run trains on it with
its shares in metrics.json; bad blends are refused before any rank starts, naming data.blend.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pipelaunch.launcher.validate import prepare
from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.data.blend import choose, parse_blend, shares
from pipelaunch.pipeline.data.tokens import TokenFile
from pipelaunch.pipeline.runtime.trainer import replica_microbatches
from tests.corpora import token_documents, write_token_file
from tests.harness import compose_cfg, run_jobs

EOD, VOCAB = 0, 64
RUN = ["model.seq_len=16", f"model.vocab_size={VOCAB}", "model.dim=32", "model.layers=4", "batch_size=16", "steps=3",
       "warmup_steps=0", "optimizer=sgd", "optimizer.lr=0.5", "timeout_s=120", "threads=1", "microbatches=4"]


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> tuple[Path, Path]:
    """Two token files of different documents: web's ids 1..31, code's 32..63 (each sample's
    corpus can be told from its ids)."""
    root = tmp_path_factory.mktemp("blend")
    web = [[i % 31 + 1 for i in d[:-1]] + [EOD] for d in token_documents(300, VOCAB, EOD, seed=1)]
    code = [[i % 31 + 32 for i in d[:-1]] + [EOD] for d in token_documents(300, VOCAB, EOD, seed=2)]
    return write_token_file(root / "web.bin", web), write_token_file(root / "code.bin", code)


def _blend(web: Path, code: Path, **kw) -> TokenFile:
    return TokenFile(path=None, seq_len=16, blend=[{"path": str(web), "weight": 0.3}, {"path": str(code), "weight": 0.7}],
                     **kw)


@pytest.mark.parametrize("first", [0, 123_457, 10**12])
def test_realised_shares_are_the_weights_within_one_percent_over_10000_samples(first) -> None:
    got = shares(0, [0.3, 0.7], first, 10_000)
    assert sum(got) == 10_000 and abs(got[0] / 10_000 - 0.3) < 0.01, got
    three = shares(7, [0.5, 0.3, 0.2], first, 10_000)
    assert np.allclose(np.array(three) / 10_000, [0.5, 0.3, 0.2], atol=0.01), three


def test_a_samples_corpus_is_a_pure_function_of_the_seed_and_its_index() -> None:
    samples = np.arange(5_000, dtype=np.int64)
    whole = choose(0, [0.3, 0.7], samples)
    shuffled = np.random.default_rng(0).permutation(samples)
    assert np.array_equal(choose(0, [0.3, 0.7], shuffled), whole[shuffled])  # any subset, any order
    assert np.array_equal(np.concatenate([choose(0, [0.3, 0.7], c) for c in np.split(samples, 10)]), whole)
    assert not np.array_equal(choose(1, [0.3, 0.7], samples), whole)  # another seed, another sequence


def test_each_sample_is_its_corpus_own_sample(corpora) -> None:
    web, code = corpora
    blend = _blend(web, code, packing="documents", eod_id=EOD)
    alone = [TokenFile(path=str(p), seq_len=16, packing="documents", eod_id=EOD) for p in (web, code)]
    inputs = blend.batch(3, 32)[0]
    chosen = choose(0, [0.3, 0.7], np.arange(3 * 32, 4 * 32))
    for row, k, i in zip(inputs, chosen, range(3 * 32, 4 * 32), strict=True):
        assert torch.equal(row, alone[k].batch(i, 1)[0][0])
        ids = row[row != EOD]  # (padding and document ends are EOD in both)
        assert bool(((ids > 31) if k else (ids < 32)).all())


def test_every_layout_and_a_resumed_run_read_the_same_samples(corpora) -> None:
    """pp=2 dp=2 and pp=4 (dp=1): the global batch of a step is the same, and the replicas' shares
    (the trainer's own cut) put together are it; a source built anew at step 5 (a resumed run's)
    draws what the uninterrupted one draws."""
    web, code = corpora
    first, resumed = _blend(web, code), _blend(web, code)
    straight = [first.batch(step, 16)[0] for step in range(8)]
    for step in range(5, 8):
        assert torch.equal(resumed.batch(step, 16)[0], straight[step])
    cpu = torch.device("cpu")
    for step, batch in enumerate(straight):
        pp4 = replica_microbatches(batch, 0, 1, 4, cpu)
        pp2dp2 = [mb for r in range(2) for mb in replica_microbatches(batch, r, 2, 2, cpu)]
        assert torch.equal(torch.cat(pp4), torch.cat(pp2dp2)), step


@pytest.mark.timeout(300)
def test_a_blend_trains_alike_on_two_layouts_with_its_shares_in_the_history(corpora, tmp_path) -> None:
    web, code = corpora
    blend = [f"data.blend=[{{path:{web},weight:0.3}},{{path:{code},weight:0.7}}]", "data=tokens"]
    cfgs = [compose_cfg([*RUN, *blend, "pp=2"]), compose_cfg([*RUN, *blend, "pp=1", "dp=2"])]
    pp2, dp2 = run_jobs(cfgs, tmp_path)
    assert pp2[0].losses == pytest.approx(dp2[0].losses, rel=1e-5)
    got = pp2[0].history.data_blend
    assert got["corpora"] == [str(web), str(code)] and got["weights"] == pytest.approx([0.3, 0.7])
    assert got["samples"] == shares(0, [0.3, 0.7], 0, 48) and sum(got["samples"]) == 48
    assert got["shares"] == pytest.approx([n / 48 for n in got["samples"]])
    assert dp2[0].history.data_blend == got


def test_megatrons_flat_form_is_the_same_blend(corpora) -> None:
    web, code = corpora
    flat = TokenFile(path=None, seq_len=16, blend=[3, str(web), 7, str(code)])
    assert torch.equal(flat.batch(2, 16)[0], _blend(web, code).batch(2, 16)[0])
    assert [c.weight for c in parse_blend([3, "a", 7, "b"])] == pytest.approx([0.3, 0.7])


def test_bad_blends_are_refused_before_any_rank_starts_naming_the_key(corpora, tmp_path) -> None:
    web, code = corpora
    cases = [
        ([f"data.blend=[{{path:{web},weight:0}},{{path:{code},weight:1}}]"], "data.blend", "not a positive number"),
        ([f"data.blend=[{{path:{web},weight:-0.3}},{{path:{code},weight:1.3}}]"], "data.blend", "not a positive"),
        ([f"data.blend=[0.3,{web},0.7]"], "data.blend", "even number"),
        ([f"data.blend=[1e308,{web},1e308,{code}]"], "data.blend", "the weights sum to inf"),
        ([f"data.blend=[inf,{web},1,{code}]"], "data.blend", "not a positive number"),
        ([f"data.blend=[{web},0.3,{code},0.7]"], "data.blend", "not a path"),
        ([f"data.blend=[{{path:{web},weight:1,share:2}}]"], "data.blend", "unknown share"),
        ([f"data.blend=[{{path:{web}}}]"], "data.blend", "{path: <corpus>, weight: <w>}"),
        ([f"data.blend=[1,{tmp_path / 'gone.bin'}]"], "data.blend", "gone.bin: "),
        ([f"data.blend=[1,{web}]", f"data.path={code}"], "data.path", "beside data.blend"),
        (["data.blend=[]"], "data.blend", "a list of corpora"),
        ([f"data.blend=[1,{tmp_path / 'gone'}]", "data=indexed"], "data.blend", "does not exist"),
    ]
    for overrides, key, words in cases:
        with pytest.raises(ConfigError) as err:
            group = [] if any(o.startswith("data=") for o in overrides) else ["data=tokens"]
            prepare(compose_cfg([*RUN, "pp=2", *group, *overrides]))
        assert err.value.key == key and words in str(err.value), (overrides, str(err.value))
        assert "\n" not in str(err.value)


@pytest.mark.timeout(300)
def test_a_resumed_blend_run_continues_the_same_sequence(corpora, tmp_path) -> None:
    """4 steps straight against 2 then 2 resumed from the checkpoint: the same losses after the
    resume, the same final weights (check_resumed), and the same shares in metrics.json."""
    from tests.test_cli import metrics
    from tests.test_long_runs import check_resumed

    web, code = corpora
    args = [*RUN, "data=tokens", f"data.blend=[0.3,{web},0.7,{code}]", "data.packing=documents", f"data.eod_id={EOD}",
            "pp=2", "steps=4", "checkpoint.every=2"]
    check_resumed(args, args, tmp_path, at=2, steps=4)
    straight, resumed = metrics(tmp_path / "firstrun"), metrics(tmp_path / "thenrun")
    assert resumed["data_blend"] == straight["data_blend"]
    assert straight["data_blend"]["samples"] == shares(0, [0.3, 0.7], 0, 4 * 16)


def test_each_corpus_of_a_blend_draws_its_held_out_windows_from_its_own_val_path(corpora) -> None:
    web, code = corpora
    blend = TokenFile(path=None, seq_len=16, blend=[{"path": str(web), "weight": 0.3, "val_path": str(code)},
                                                    {"path": str(code), "weight": 0.7}])
    alone = [TokenFile(path=str(web), seq_len=16, val_path=str(code)), TokenFile(path=str(code), seq_len=16)]
    rows = blend.val_batch(2, 16)[0]
    for row, k, i in zip(rows, choose(0, [0.3, 0.7], np.arange(32, 48)), range(32, 48), strict=True):
        assert torch.equal(row, alone[k].val_batch(i, 1)[0][0])
