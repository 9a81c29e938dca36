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
