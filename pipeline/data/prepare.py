"""Tokenize local documents once into the `data=tokens` format (a flat file of token ids).

    python -m pipelaunch.pipeline.data.prepare corpus/*.jsonl --tokenizer tok/ --out train.bin
    python train.py data=tokens data.path=train.bin data.dtype=uint16 ...

Documents are read with `datasets` (json, jsonl, parquet, text), tokenized with the local
tokenizer (each followed by its end-of-sequence token, as `data=hf` does) and streamed to disk
slice by slice under a progress bar, so the corpus never has to fit in memory. uint16 when the
vocabulary fits in it, else uint32.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm

from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.data.hf import load_documents, load_tokenizer, token_batches, tokenize


def token_dtype(vocab: int, asked: str = "auto") -> str:
    """The narrowest dtype that holds every id of a `vocab`-sized vocabulary (or `asked`)."""
    fits16 = vocab <= np.iinfo(np.uint16).max + 1
    if asked == "auto":
        return "uint16" if fits16 else "uint32"
    if asked not in ("uint16", "uint32"):
        raise ConfigError("--dtype", f"got {asked!r}; valid: auto, uint16, uint32")
    if asked == "uint16" and not fits16:
        raise ConfigError("--dtype", f"uint16 cannot hold the ids of a {vocab}-token vocabulary; use uint32")
    return asked


def prepare(files: list[str], tokenizer: str, out: str, text_key: str = "text", fmt: str | None = None,
            dtype: str = "auto", num_proc: int | None = None, cache_dir: str | None = None) -> dict:
    """Write the token file; returns what was written (path, dtype, documents, tokens, vocabulary)."""
    tok = load_tokenizer(tokenizer, "--tokenizer")
    kind = token_dtype(len(tok), dtype)
    docs = load_documents(files, fmt, text_key, cache_dir, "files")
    tokenized = tokenize(docs, tok, text_key, num_proc)
    target = Path(out)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")  # the file appears complete or not at all
    tokens = 0
    with partial.open("wb") as f, tqdm(total=len(tokenized), unit="doc", desc=f"writing {target.name}") as bar:
        for rows, ids in token_batches(tokenized):
            ids.astype(kind).tofile(f)
            tokens += len(ids)
            bar.update(rows)
            bar.set_postfix(tokens=tokens)
    partial.replace(target)
    return {"path": str(target), "dtype": kind, "documents": len(tokenized), "tokens": tokens, "vocab": len(tok)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipelaunch.pipeline.data.prepare", description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", help="json, jsonl, parquet or text files (one kind)")
    parser.add_argument("--tokenizer", required=True, help="a directory written by a tokenizer's save_pretrained")
    parser.add_argument("--out", required=True, help="the token file to write, e.g. train.bin")
    parser.add_argument("--text-key", default="text", help="the column holding each document (json, parquet)")
    parser.add_argument("--format", default=None, choices=["json", "parquet", "text"],
                        help="the files' format when their suffix does not say")
    parser.add_argument("--dtype", default="auto", help="auto | uint16 | uint32")
    parser.add_argument("--num-proc", type=int, default=None, help="tokenizer processes (datasets.map)")
    parser.add_argument("--cache-dir", default=None, help="where datasets caches the parsed files")
    args = parser.parse_args(argv)
    try:
        done = prepare(args.files, args.tokenizer, args.out, args.text_key, args.format, args.dtype,
                       args.num_proc, args.cache_dir)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {done['tokens']} tokens of {done['documents']} documents to {done['path']} ({done['dtype']}, "
          f"vocabulary {done['vocab']})\ntrain on it with: python train.py data=tokens data.path={done['path']} "
          f"data.dtype={done['dtype']} model.vocab_size=<at least {done['vocab']}>")
    return 0


if __name__ == "__main__":
    sys.exit(main())
