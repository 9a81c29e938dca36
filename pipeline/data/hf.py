"""`data=hf`: documents in local files (json, jsonl, parquet or plain text) read with
`datasets.load_dataset`, tokenized by the tokenizer saved in a local directory
(`transformers.AutoTokenizer`), each document followed by the tokenizer's end-of-sequence token,
and packed into consecutive windows of seq_len + 1 tokens.

Sample i of the run (the global sample index) is window `perm_e[i mod n]` of the packed corpus,
where e = i div n is the epoch and perm_e a permutation drawn from (seed, e): every window is seen
once per epoch, and any (pp, dp) or a resumed run reads the same global batch at a given step.
Tokenization is cached by `datasets` (keyed by the files and the tokenizer), so the ranks reuse
what the launcher tokenized while validating; for corpora too large to tokenize per run,
`python -m pipelaunch.pipeline.data.prepare` writes the `data=tokens` format once.

`data.packing=documents` cuts the documents in order into windows of whole documents, padded after
the last that fits (a longer one split; `stream`: consecutive windows of the stream, documents
split at their edges, nothing padded): positions and attention per document
(`pipelaunch.pipeline.data.packing`), the documents ending with `data.eod_id` (null: the
tokenizer's end-of-sequence, appended to each).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.data.packing import Batch, Windows, check_packing, greedy_windows
from pipelaunch.pipeline.graph.init import name_seed

#: file suffix -> the `datasets` builder that reads it
FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text", ".text": "text"}


def offline() -> None:
    """Never reach a hub: the files and the tokenizer are local by contract."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def load_tokenizer(path: str, key: str = "data.tokenizer") -> Any:
    """`AutoTokenizer.from_pretrained` on a local directory, or a ConfigError naming `key`."""
    offline()
    if not path or not Path(path).is_dir():
        raise ConfigError(key, f"{path!r} is not a directory; give the directory a tokenizer was saved to with "
                               "save_pretrained (tokenizer.json / tokenizer_config.json); nothing is downloaded")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # transformers raises OSError, ValueError or KeyError depending on what is missing
        raise ConfigError(key, f"no tokenizer could be loaded from {path}: {exc}") from None


def data_format(files: list[str], fmt: str | None, key: str = "data.files") -> str:
    """The `datasets` builder for `files`: `fmt` if given, else from their common suffix."""
    if fmt is not None:
        if fmt not in set(FORMATS.values()):
            raise ConfigError("data.format", f"got {fmt!r}; valid: {', '.join(sorted(set(FORMATS.values())))} or null "
                                             "(taken from the files' suffix)")
        return fmt
    found = {FORMATS.get(Path(f).suffix.lower()) for f in files}
    if None in found or len(found) != 1:
        suffixes = sorted({Path(f).suffix or "(none)" for f in files})
        raise ConfigError(key, f"cannot tell the format from the suffixes {', '.join(suffixes)}: use files of one "
                               f"kind ({', '.join(FORMATS)}) or set data.format=json|parquet|text")
    return found.pop()


def load_documents(files: list[str], fmt: str | None, text_key: str, cache_dir: str | None,
                   key: str = "data.files") -> Any:
    """The documents of `files` as a `datasets.Dataset` holding column `text_key`."""
    offline()
    if isinstance(files, str):
        files = [files]
    if not files:
        raise ConfigError(key, "no files given; e.g. data.files=[/data/train.jsonl]")
    missing = [f for f in files if not Path(f).is_file()]
    if missing:
        raise ConfigError(key, f"{', '.join(map(repr, missing))} does not exist (local json, jsonl, parquet or "
                               "text files; nothing is downloaded)")
    import datasets

    builder = data_format(list(files), fmt, key)
    try:
        dataset = datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train",
                                        cache_dir=cache_dir)
    except Exception as exc:  # a malformed file: pyarrow or datasets says why
        raise ConfigError(key, f"datasets could not read {', '.join(map(str, files))} as {builder}: {exc}") from None
    if text_key not in dataset.column_names:
        raise ConfigError("data.text_key", f"{text_key!r} is not a column of {files[0]}; its columns are "
                                           f"{', '.join(dataset.column_names)}")
    return dataset


def tokenize(dataset: Any, tokenizer: Any, text_key: str, num_proc: int | None = None,
             eod_id: int | None = None) -> Any:
    """Each document's token ids followed by end-of-sequence (`eod_id`, else the tokenizer's when it
    has one), as a dataset with one column `input_ids`. `datasets` caches the result by fingerprint."""
    end = eod_id if eod_id is not None else tokenizer.eos_token_id
    eos = [end] if end is not None else []

    def encode(batch: dict[str, list]) -> dict[str, list]:
        return {"input_ids": [ids + eos for ids in tokenizer(batch[text_key])["input_ids"]]}

    return dataset.map(encode, batched=True, remove_columns=dataset.column_names, num_proc=num_proc,
                       desc="tokenizing")


def token_batches(tokenized: Any, rows: int = 10_000) -> Iterator[tuple[int, np.ndarray]]:
    """(documents, their token ids flattened) for successive slices of a tokenized dataset, read
    from its Arrow table without building Python lists."""
    import pyarrow.compute as pc

    for batch in tokenized.data.to_batches(max_chunksize=rows):
        yield batch.num_rows, pc.list_flatten(batch.column("input_ids")).to_numpy()


@lru_cache(maxsize=4)
def _epoch_order(seed: int, salt: str, epoch: int, windows: int) -> np.ndarray:
    return np.random.default_rng(name_seed(seed, f"{salt}:epoch{epoch}")).permutation(windows)


@dataclass
class HFDocuments(Windows):
    """Packed windows of tokenized documents (see the module docstring)."""

    files: list[str]
    tokenizer: str
    seq_len: int
    text_key: str = "text"
    format: str | None = None
    val_files: list[str] | None = None
    cache_dir: str | None = None
    num_proc: int | None = None
    seed: int = 0
    kind: str = "tokens"
    #: `none`, or `documents`: windows packed from the documents (data/packing.py)
    packing: str = "none"
    #: the id ending each document (null: the tokenizer's end-of-sequence)
    eod_id: int | None = None
    _tok: Any = field(default=None, init=False, repr=False)
    #: packed: per windows array (by id), the stream's ids in each window
    _used: dict[int, np.ndarray] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self._tok = load_tokenizer(self.tokenizer)
        eod = self.eod_id if self.eod_id is not None else self._tok.eos_token_id
        self.packed = check_packing(self.packing, eod, len(self._tok))
        self.document_end = eod if self.packed else None
        self.whole = self.packing == "documents"
        self._train = self._pack(self.files, "data.files")
        self._val = self._pack(self.val_files, "data.val_files") if self.val_files else None

    def _pack(self, files: list[str], key: str) -> np.ndarray:
        docs = load_documents(files, self.format, self.text_key, self.cache_dir, key)
        ids = [chunk for _, chunk in token_batches(tokenize(docs, self._tok, self.text_key, self.num_proc,
                                                                   self.document_end))]
        flat = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)
        window = self.seq_len + 1
        if len(flat) < window:
            raise ConfigError(key, f"{', '.join(map(str, files))} tokenize to {len(flat)} tokens, fewer than one "
                                   f"window of seq_len + 1 = {window}")
        if self.whole:  # whole documents in each window, padded (data/packing.py)
            rows, used = greedy_windows(flat, self.document_end, window)
            self._used[id(rows)] = used
            return rows
        return flat[: len(flat) // window * window].reshape(-1, window)

    def padded_tokens(self, step: int, batch_size: int) -> int | None:
        """Input positions of batch `step` that are padding (windows of whole documents end with it);
        None otherwise (the windows are the documents' ids throughout)."""
        if not self.whole:
            return None
        picks = self._picks(len(self._train), step * batch_size, batch_size, "hf")
        return self._padding(self._used[id(self._train)][picks], self.seq_len)

    def check_vocabulary(self, model_vocab: int) -> None:
        """Refuse a tokenizer that can produce ids the model cannot embed."""
        if len(self._tok) > model_vocab:
            raise ConfigError("data.tokenizer", f"{self.tokenizer} has {len(self._tok)} tokens, more than the model's "
                                                f"vocabulary of {model_vocab} (model.vocab_size); use the tokenizer "
                                                "the model was trained with, or a model with a larger vocabulary")

    def _picks(self, n: int, first: int, count: int, salt: str) -> list[int]:
        return [_epoch_order(self.seed, salt, i // n, n)[i % n] for i in range(first, first + count)]

    def _rows(self, windows: np.ndarray, first: int, count: int, salt: str) -> torch.Tensor:
        return torch.from_numpy(windows[self._picks(len(windows), first, count, salt)].astype(np.int64))

    def batch(self, step: int, batch_size: int) -> Batch:
        return self._batch(self._rows(self._train, step * batch_size, batch_size, "hf"))

    def val_batch(self, index: int, batch_size: int) -> Batch:
        """Held-out batch `index` (from val_files, or the training windows when there are none)."""
        windows = self._val if self._val is not None else self._train
        return self._batch(self._rows(windows, index * batch_size, batch_size, "val"))
