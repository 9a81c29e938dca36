"""Local corpora for the data tests: a byte-level BPE tokenizer trained here (no hub) and
documents written as jsonl, parquet or plain text."""

from __future__ import annotations

import json
from pathlib import Path

DOCS = [f"document {i}: the quick brown fox jumps over the lazy dog {i * 7} times, then sleeps." for i in range(120)]


def make_tokenizer(directory: Path, vocab: int = 300) -> int:
    """Train a small byte-level BPE on DOCS and save it with save_pretrained; returns its size."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(DOCS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")
    fast.save_pretrained(directory)
    return len(fast)


def write_docs(path: Path, docs: list[str] = DOCS) -> Path:
    """`docs` in the format `path`'s suffix names (.jsonl, .json, .parquet, .txt)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": docs, "id": list(range(len(docs)))}), path)
    elif path.suffix in (".jsonl", ".json"):
        path.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)))
    else:
        path.write_text("\n".join(docs) + "\n")
    return path


def token_documents(count: int = 400, vocab: int = 64, eod: int = 0, seed: int = 0) -> list[list[int]]:
    """`count` documents of 1 to 30 ids in 1..vocab-1, each ended by `eod` (as Megatron's
    preprocess_data.py --append-eod ends them): a 16-token window holds one to many."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [[*rng.integers(1, vocab, int(rng.choice([1, 2, 4, 7, 12, 30]))).tolist(), eod] for _ in range(count)]


def write_token_file(path: Path, documents: list[list[int]], dtype: str = "uint16") -> Path:
    """The documents back to back in a flat token file (data=tokens)."""
    import numpy as np

    np.array([i for d in documents for i in d], dtype=dtype).tofile(path)
    return path


def write_megatron_corpus(prefix: Path, documents: list[list[int]], dtype: str = "uint16") -> Path:
    """The documents as Megatron's indexed corpus, written by megatron-core's own
    IndexedDatasetBuilder (one sequence per document); returns the prefix."""
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=getattr(np, dtype))
    for doc in documents:
        builder.add_item(torch.tensor(doc))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return prefix
