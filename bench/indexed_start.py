"""The start cost of a large corpus with and without documents (#58).

    python bench/indexed_start.py               # a 10 GB corpus under /tmp (about 11 GB free needed)
    python bench/indexed_start.py --gb 2        # a smaller one
    python bench/indexed_start.py --train       # also whole `python train.py` 2-step runs

One corpus of uint16 ids (documents of 200-3,000 ids, each ended by id 0) is written once as
Megatron's indexed pair (`corpus.bin` + `corpus.idx`); its `.bin` alone is also a plain token file.
Each figure is a fresh process opening the data source and drawing its first batch of 16 windows
of 2,049 ids (what every rank does at start, `data.build()` then `batch(0)`), the median of
`--rounds`:

- `data=indexed` with `data.packing=none` and with `data.packing=documents` (the documents'
  starts read from the index);
- `data=tokens` on the `.bin` with `data.packing=documents`: the first start (no cache: the file
  scanned for document ends and the cache written beside it) and the second (the cache read).

`--train` adds `--rounds` runs (interleaved) of `python train.py` of 2 steps each (a tiny GPT, pp=2) on the
indexed corpus with and without documents, and on the token file with documents (its cache
read): their wall time, which includes the launcher's scan of the file for ids past the
vocabulary (`check_vocabulary`, every run alike) and, packed, the model's own packed path. The page cache is left as it is (the
corpus was just written: warm), so the figures are CPU costs, not a cold disk's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 1 << 27  # ids per block written (256 MB of uint16)

OPEN = """
import json, sys, time
t0 = time.perf_counter()
from pipelaunch.pipeline.data.{module} import {cls} as Source
t1 = time.perf_counter()
source = Source(path={path!r}, seq_len=2048, packing={packing!r}, eod_id={eod})
t2 = time.perf_counter()
source.batch(0, 16)
t3 = time.perf_counter()
print(json.dumps({{"import_s": t1 - t0, "open_s": t2 - t1, "batch_s": t3 - t2}}))
"""


def write_corpus(prefix: Path, gb: float, seed: int = 0) -> tuple[int, int]:
    """A corpus of about `gb` GB: one block of documents (lengths 200-3,000 ids, random ids, each
    ended by 0) drawn once and written as many times as it takes; returns (tokens, documents)."""
    from pipelaunch.pipeline.data.indexed import IndexedWriter

    rng = np.random.default_rng(seed)
    lengths = rng.integers(200, 3000, BLOCK // 1600).astype(np.int64)
    lengths = lengths[np.cumsum(lengths) <= BLOCK]
    ids = rng.integers(1, 50000, int(lengths.sum()), dtype=np.uint16)
    ids[np.cumsum(lengths) - 1] = 0
    writer = IndexedWriter(prefix, "uint16")
    blocks = max(1, round(gb * 1e9 / ids.nbytes))
    for b in range(blocks):
        writer.add(ids, lengths)
        print(f"  block {b + 1}/{blocks}", end="\r", flush=True)
    writer.close()
    return blocks * len(ids), blocks * len(lengths)


def start(module: str, cls: str, path: str, packing: str) -> dict:
    """A fresh process opening the source and drawing batch 0: its phases' seconds."""
    code = OPEN.format(module=module, cls=cls, path=path, packing=packing, eod=0 if packing != "none" else None)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["process_s"] = time.perf_counter() - t0
    return out


def median(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def train(data: list[str], out: Path) -> float:
    """One 2-step `python train.py` on `data`: its wall time."""
    cmd = [sys.executable, "train.py", *data, "model.seq_len=128", "model.vocab_size=50304", "model.dim=32",
           "model.layers=2", "pp=2", "steps=2", "batch_size=8", "threads=1", f"hydra.run.dir={out}"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=10.0)
    parser.add_argument("--dir", default="/tmp/pipelaunch-indexed-bench")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--train", action="store_true")
    parser.add_argument("--keep", action="store_true", help="keep the corpus (else removed at the end)")
    args = parser.parse_args()
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    prefix = root / "corpus"
    t0 = time.perf_counter()
    tokens, docs = write_corpus(prefix, args.gb) if not Path(f"{prefix}.idx").exists() else (None, None)
    print(f"corpus {prefix}: {Path(f'{prefix}.bin').stat().st_size / 1e9:.2f} GB, tokens {tokens}, documents {docs} "
          f"(written in {time.perf_counter() - t0:.0f} s)")
    rows = {}
    for packing in ("none", "documents"):
        rows[f"indexed packing={packing}"] = median([start("indexed", "IndexedCorpus", str(prefix), packing)
                                                     for _ in range(args.rounds)])
    flat = f"{prefix}.bin"
    for cache in root.glob("corpus.bin.docs-*"):
        cache.unlink()
    rows["tokens packing=documents, first start (scan, cache written)"] = start("tokens", "TokenFile", flat, "documents")
    rows["tokens packing=documents, second start (cache read)"] = median(
        [start("tokens", "TokenFile", flat, "documents") for _ in range(args.rounds)])
    rows["tokens packing=none"] = median([start("tokens", "TokenFile", flat, "none") for _ in range(args.rounds)])
    print("| source | open s | first batch s | process s |\n|---|---:|---:|---:|")
    for what, r in rows.items():
        print(f"| {what} | {r['open_s']:.3f} | {r['batch_s']:.3f} | {r['process_s']:.2f} |")
    if args.train:
        packed = ["data.packing=documents", "data.eod_id=0"]
        runs = {"data=indexed packing=none": ["data=indexed", f"data.path={prefix}"],
                "data=indexed packing=documents": ["data=indexed", f"data.path={prefix}", *packed],
                "data=tokens packing=documents (cached)": ["data=tokens", f"data.path={flat}", *packed]}
        times: dict[str, list[float]] = {what: [] for what in runs}
        for i in range(args.rounds):  # interleaved: the machine's drift falls on every configuration alike
            for what, data in runs.items():
                times[what].append(train(data, root / f"run-{i}"))
        for what, ts in times.items():
            print(f"train.py {what}: median {statistics.median(ts):.1f} s of {', '.join(f'{t:.1f}' for t in ts)}")
    if not args.keep:
        for path in root.glob("corpus*"):
            path.unlink()


if __name__ == "__main__":
    main()
