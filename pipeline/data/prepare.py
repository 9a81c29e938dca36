"""Tokenize local documents once into the `data=tokens` format (a flat file of token ids), or with
`--out-format indexed` into Megatron's indexed corpus (`<out>.bin` + `<out>.idx`, `data=indexed`).

    python -m pipelaunch.pipeline.data.prepare corpus/*.jsonl --tokenizer tok/ --out train.bin
    python train.py data=tokens data.path=train.bin data.dtype=uint16 ...
    python -m pipelaunch.pipeline.data.prepare corpus/*.jsonl --tokenizer tok/ --out web --out-format indexed
    python train.py data=indexed data.path=web ...

Documents are read with `datasets` (json, jsonl, parquet, text), tokenized with the local
tokenizer (each followed by its end-of-sequence token, as `data=hf` does) and streamed to disk
slice by slice under a progress bar, so the corpus never has to fit in memory. uint16 when the
vocabulary fits in it, else uint32.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.data.hf import load_documents, load_tokenizer, tokenize
from pipelaunch.pipeline.data.indexed import IndexedWriter

#: what --out-format writes: a flat token file, or Megatron's .bin + .idx pair
OUT_FORMATS = ("tokens", "indexed")


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


def document_batches(tokenized: Any, rows: int = 10_000) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(token ids flattened, each document's length) for successive slices of a tokenized dataset,
    read from its Arrow table without building Python lists."""
    import pyarrow.compute as pc

    for batch in tokenized.data.to_batches(max_chunksize=rows):
        column = batch.column("input_ids")
        yield pc.list_flatten(column).to_numpy(), pc.list_value_length(column).to_numpy()


def prepare(files: list[str], tokenizer: str, out: str, text_key: str = "text", fmt: str | None = None,
            dtype: str = "auto", num_proc: int | None = None, cache_dir: str | None = None,
            out_format: str = "tokens") -> dict:
    """Write the token file (or the indexed corpus `out`.bin + `out`.idx); returns what was
    written (path, dtype, documents, tokens, vocabulary, format)."""
    if out_format not in OUT_FORMATS:
        raise ConfigError("--out-format", f"got {out_format!r}; valid: {', '.join(OUT_FORMATS)}")
    tok = load_tokenizer(tokenizer, "--tokenizer")
    kind = token_dtype(len(tok), dtype)
    if out_format == "indexed" and kind == "uint32":
        kind = "int32"  # Megatron's index has no uint32: int32, as its preprocess_data.py writes
    docs = load_documents(files, fmt, text_key, cache_dir, "files")
    tokenized = tokenize(docs, tok, text_key, num_proc)
    target = Path(out)
    target.parent.mkdir(parents=True, exist_ok=True)
    writer = IndexedWriter(target, kind) if out_format == "indexed" else None
    partial = target.with_name(target.name + ".partial")  # the file appears complete or not at all
    tokens = 0
    with (partial.open("wb") if writer is None else nullcontext()) as f, \
            tqdm(total=len(tokenized), unit="doc", desc=f"writing {target.name}") as bar:
        for ids, lengths in document_batches(tokenized):
            if writer is None:
                ids.astype(kind).tofile(f)
            else:
                writer.add(ids, lengths)
            tokens += len(ids)
            bar.update(len(lengths))
            bar.set_postfix(tokens=tokens)
    if writer is None:
        partial.replace(target)
    else:
        writer.close()
    return {"path": str(target), "dtype": kind, "documents": len(tokenized), "tokens": tokens, "vocab": len(tok),
            "format": out_format}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipelaunch.pipeline.data.prepare", description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", help="json, jsonl, parquet or text files (one kind)")
    parser.add_argument("--tokenizer", required=True, help="a directory written by a tokenizer's save_pretrained")
    parser.add_argument("--out", required=True, help="the token file to write, e.g. train.bin (indexed: the "
                                                     "prefix, e.g. web writes web.bin and web.idx)")
    parser.add_argument("--out-format", default="tokens", choices=OUT_FORMATS,
                        help="tokens: a flat file of ids (data=tokens); indexed: Megatron's .bin + .idx (data=indexed)")
    parser.add_argument("--text-key", default="text", help="the column holding each document (json, parquet)")
    parser.add_argument("--format", default=None, choices=["json", "parquet", "text"],
                        help="the files' format when their suffix does not say")
    parser.add_argument("--dtype", default="auto", help="auto | uint16 | uint32")
    parser.add_argument("--num-proc", type=int, default=None, help="tokenizer processes (datasets.map)")
    parser.add_argument("--cache-dir", default=None, help="where datasets caches the parsed files")
    args = parser.parse_args(argv)
    try:
        done = prepare(args.files, args.tokenizer, args.out, args.text_key, args.format, args.dtype,
                       args.num_proc, args.cache_dir, args.out_format)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    where, how = ((f"{done['path']}.bin and {done['path']}.idx", f"data=indexed data.path={done['path']}")
                  if done["format"] == "indexed" else (done["path"], f"data=tokens data.path={done['path']} "
                                                                      f"data.dtype={done['dtype']}"))
    print(f"wrote {done['tokens']} tokens of {done['documents']} documents to {where} ({done['dtype']}, "
          f"vocabulary {done['vocab']})\ntrain on it with: python train.py {how} "
          f"model.vocab_size=<at least {done['vocab']}>")
    return 0


if __name__ == "__main__":
    sys.exit(main())
