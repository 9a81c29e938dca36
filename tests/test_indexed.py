"""Megatron's indexed corpora (`data=indexed`, #58) and the cached document index of a token file.

The yardstick is megatron-core itself (a dev dependency): corpora written by its own
IndexedDatasetBuilder train here exactly as the same documents in a flat token file, and what
`python -m pipelaunch.pipeline.data.prepare --out-format indexed` writes reads back through its
IndexedDataset. Then: the documents come from the index (no scan), a token file's document index is
scanned once and cached beside it, and bad input is refused before any rank starts, naming the key.
"""

from __future__ import annotations

import errno
import os
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from pipelaunch.launcher.validate import prepare
from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.data import tokens as tokens_module
from pipelaunch.pipeline.data.indexed import IndexedCorpus, IndexedWriter, read_index
from pipelaunch.pipeline.data.tokens import TokenFile
from tests.corpora import token_documents, write_megatron_corpus, write_token_file
from tests.harness import compose_cfg, run_jobs

with warnings.catch_warnings():  # megatron-core says Transformer Engine and Apex are absent
    warnings.simplefilter("ignore")
    indexed_dataset = pytest.importorskip("megatron.core.datasets.indexed_dataset",
                                          reason="megatron-core (the dev extra) writes and reads the reference corpora")

EOD, VOCAB = 0, 64
RUN = ["model.seq_len=16", f"model.vocab_size={VOCAB}", "model.dim=32", "model.layers=4", "batch_size=16", "steps=3",
       "warmup_steps=0", "optimizer=sgd", "optimizer.lr=0.5", "timeout_s=120", "threads=1", "microbatches=4"]


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> dict[str, Path]:
    """The same documents as a megatron-core corpus (uint16 and int32) and as a token file."""
    root = tmp_path_factory.mktemp("indexed")
    docs = token_documents(400, VOCAB, EOD)
    return {"megatron": write_megatron_corpus(root / "web", docs), "tokens": write_token_file(root / "web.bin.flat", docs),
            "megatron32": write_megatron_corpus(root / "web32", docs, "int32"), "root": root}


@pytest.mark.timeout(300)
def test_a_megatron_corpus_trains_with_packing_exactly_as_its_documents_in_a_token_file(corpora, tmp_path) -> None:
    packed = ["pp=2", "data.packing=documents", f"data.eod_id={EOD}"]
    cfgs = [compose_cfg([*RUN, *packed, "data=indexed", f"data.path={corpora['megatron']}"]),
            compose_cfg([*RUN, *packed, "data=tokens", f"data.path={corpora['tokens']}"])]
    indexed, flat = run_jobs(cfgs, tmp_path)
    assert len(indexed[0].losses) == 3
    assert indexed[0].losses == pytest.approx(flat[0].losses, abs=1e-6, rel=0)


@pytest.mark.parametrize("packing", ["none", "documents", "stream"])
@pytest.mark.parametrize("corpus", ["megatron", "megatron32"])
def test_every_packing_mode_reads_what_the_token_file_reads(corpora, packing, corpus) -> None:
    eod = None if packing == "none" else EOD
    indexed = IndexedCorpus(path=str(corpora[corpus]), seq_len=16, packing=packing, eod_id=eod)
    flat = TokenFile(path=str(corpora["tokens"]), seq_len=16, packing=packing, eod_id=eod)
    for step in (0, 5):
        for a, b in zip(indexed.batch(step, 8), flat.batch(step, 8), strict=True):
            assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a.keys() == b.keys()
        assert indexed.padded_tokens(step, 8) == flat.padded_tokens(step, 8)
    assert torch.equal(indexed.val_batch(1, 4)[0], flat.val_batch(1, 4)[0])


def test_the_documents_come_from_the_index_without_a_scan(corpora, monkeypatch) -> None:
    def no_scan(*_):
        raise AssertionError("the token stream was scanned")

    monkeypatch.setattr(tokens_module, "document_starts", no_scan)
    corpus = IndexedCorpus(path=str(corpora["megatron"]), seq_len=16, packing="documents", eod_id=EOD)
    index = indexed_dataset.IndexedDataset(str(corpora["megatron"]))
    ours = read_index(str(corpora["megatron"]))
    assert np.array_equal(ours.lengths, index.sequence_lengths)
    assert np.array_equal(ours.documents, index.document_indices)
    assert ours.dtype == index.index.dtype
    assert len(corpus.batch(0, 4)[0]) == 4


def test_what_we_write_reads_back_through_megatron_core(tmp_path) -> None:
    docs = token_documents(300, 70000, 7, seed=3)  # ids past uint16: int32, as Megatron writes them
    writer = IndexedWriter(tmp_path / "ours", "int32")
    writer.add(np.concatenate([np.array(d) for d in docs[:100]]), [len(d) for d in docs[:100]])
    writer.add(np.concatenate([np.array(d) for d in docs[100:]]), [len(d) for d in docs[100:]])
    writer.close()
    read = indexed_dataset.IndexedDataset(str(tmp_path / "ours"))
    assert len(read) == len(docs) and read.index.dtype == np.int32
    assert all(np.array_equal(read[i], d) for i, d in enumerate(docs))
    assert np.array_equal(read.document_indices, np.arange(len(docs) + 1))
    assert not list(tmp_path.glob("*.partial"))


@pytest.mark.timeout(120)
def test_prepare_writes_an_indexed_corpus_megatron_core_reads(tmp_path) -> None:
    """`prepare --out-format indexed` writes what `--out-format tokens` writes, with an index."""
    from pipelaunch.pipeline.data.prepare import main
    from tests.corpora import make_tokenizer, write_docs

    make_tokenizer(tmp_path / "tok")
    files = [str(write_docs(tmp_path / "a.jsonl"))]
    common = ["--tokenizer", str(tmp_path / "tok"), "--cache-dir", str(tmp_path / "cache")]
    assert main([*files, *common, "--out", str(tmp_path / "flat.bin")]) == 0
    assert main([*files, *common, "--out", str(tmp_path / "docs"), "--out-format", "indexed"]) == 0
    read = indexed_dataset.IndexedDataset(str(tmp_path / "docs"))
    flat = np.fromfile(tmp_path / "flat.bin", dtype=np.uint16)
    assert len(read) == 120 and np.array_equal(np.concatenate([read[i] for i in range(len(read))]), flat)
    assert all(read[i][-1] == 1 for i in range(len(read)))  # each document ended by <eos> (id 1)


def test_a_token_files_document_index_is_scanned_once_and_cached(tmp_path, monkeypatch) -> None:
    path = write_token_file(tmp_path / "train.bin", token_documents(400, VOCAB, EOD))
    scans = []
    scan = tokens_module.document_starts
    monkeypatch.setattr(tokens_module, "document_starts", lambda *a: scans.append(a) or scan(*a))
    first = TokenFile(path=str(path), seq_len=16, packing="documents", eod_id=EOD)
    cached = list(tmp_path.glob("train.bin.docs-eod0-*.npy"))
    assert len(scans) == 1 and len(cached) == 1
    stat = path.stat()
    assert cached[0].name == f"train.bin.docs-eod0-{stat.st_size}-{stat.st_mtime_ns}.npy"
    second = TokenFile(path=str(path), seq_len=16, packing="documents", eod_id=EOD)  # a second start, another rank
    assert len(scans) == 1
    assert torch.equal(first.batch(2, 8)[0], second.batch(2, 8)[0])
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # the file changed: scanned again
    TokenFile(path=str(path), seq_len=16, packing="documents", eod_id=EOD)
    assert len(scans) == 2 and [p.name for p in tmp_path.glob("train.bin.docs-*")] != [cached[0].name]
    assert len(list(tmp_path.glob("train.bin.docs-*"))) == 1  # the stale one removed, no temporary left


def test_a_read_only_directory_computes_the_index_in_memory_and_says_so_once(tmp_path, monkeypatch, capsys) -> None:
    path = write_token_file(tmp_path / "train.bin", token_documents(50, VOCAB, EOD))

    def read_only(*_):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tokens_module.os, "replace", read_only)
    monkeypatch.setattr(tokens_module, "_READ_ONLY", set())
    for _ in range(2):
        source = TokenFile(path=str(path), seq_len=16, packing="documents", eod_id=EOD)
        assert len(source.batch(0, 4)[0]) == 4
    assert capsys.readouterr().err.count("cannot cache the document index") == 1
    assert not list(tmp_path.glob("train.bin.docs-*.npy"))


def _refusal(overrides: list[str]) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        prepare(compose_cfg([*RUN, "pp=2", *overrides]))
    assert "Traceback" not in str(err.value) and "\n" not in str(err.value)
    return err.value


def test_bad_corpora_are_refused_before_any_rank_starts_naming_the_key(corpora, tmp_path) -> None:
    prefix = str(corpora["megatron"])
    (tmp_path / "lone.bin").write_bytes(b"\0" * 64)
    (tmp_path / "bad.bin").write_bytes(b"\0" * 64)
    (tmp_path / "bad.idx").write_bytes(b"NOTANIDX" * 8)
    (tmp_path / "short.bin").write_bytes(b"\0" * 62)  # another corpus's index: it describes more
    (tmp_path / "short.idx").write_bytes(Path(f"{prefix}.idx").read_bytes())
    floats = bytearray(Path(f"{prefix}.idx").read_bytes())
    floats[17] = 6  # the dtype code: float64 (megatron-core's DType), no token ids
    (tmp_path / "floats.idx").write_bytes(bytes(floats))
    (tmp_path / "floats.bin").write_bytes(Path(f"{prefix}.bin").read_bytes())
    cases = [
        (["data=indexed", f"data.path={tmp_path / 'lone'}"], "data.path", "lone.idx' does not exist"),
        (["data=indexed", f"data.path={prefix}.bin"], "data.path", f"data.path={prefix}"),
        (["data=indexed", f"data.path={tmp_path / 'bad'}"], "data.path", "not a Megatron index"),
        (["data=indexed", f"data.path={tmp_path / 'short'}"], "data.path", "its index describes"),
        (["data=indexed", f"data.path={tmp_path / 'floats'}"], "data.path", "float64 values, not token ids"),
        (["data=indexed", f"data.path={prefix}", "data.packing=documents", "data.eod_id=5"], "data.eod_id",
         "--append-eod"),
        (["data=indexed", f"data.path={prefix}", "data.dtype=int32"], "data.dtype", "uint16"),
        (["data=indexed"], "data.path", "is not set"),
    ]
    for overrides, key, words in cases:
        err = _refusal(overrides)
        assert err.key == key and words in str(err), (overrides, str(err))


def test_the_window_starts_index_is_the_array_it_replaces() -> None:
    """`Pieces` (O(documents)) gives every entry `chunks_of` (O(tokens / window)) would hold."""
    from pipelaunch.pipeline.data.packing import Pieces, chunks_of

    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 60, 500)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    for window in (1, 7, 17, 200):
        array, index = chunks_of(starts, int(lengths.sum()), window), Pieces.of(starts, int(lengths.sum()), window)
        assert len(index) == len(array) and [index[k] for k in range(len(array))] == array.tolist()
