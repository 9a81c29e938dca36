"""`data.blend`: several corpora mixed by weight, as Megatron-LM's `--data-path 0.3 web 0.7 code`
(megatron-core's BlendedDataset), on `data=tokens` (token files) and `data=indexed` (`.bin` +
`.idx` prefixes).

Written as a list of corpora, `data.blend=[{path: web, weight: 0.3}, {path: code, weight: 0.7}]`
(each may name its own `val_path`), or Megatron's flat list `data.blend=[0.3,web,0.7,code]`. The
weights are shares of the samples, normalised to sum to 1 (`[3,web,7,code]` is the same blend).

Which corpus global sample i comes from is a pure function of (seed, i): the i-th point of a
golden-ratio (Weyl) sequence started at a seeded offset, `u_i = offset + i * 2^64/phi mod 2^64`,
falls in one corpus's slice of [0, 2^64) (`choose`). Unlike a seeded draw, the sequence is
equidistributed: any run of n consecutive samples holds each corpus's share to within O(log n)
samples (Megatron's largest-deficit rule has the same balance, but sample i needs every sample
before it; here a resumed run or a replica computes its own samples directly). The sample is then
corpus c's own sample i, the window `data.path=c` alone would read as sample i, so every layout
and a resumed run read the same data. Windows are drawn with replacement, as data=tokens always
draws them: a corpus smaller than its share of the run is read again (wrapped), never exhausted.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.graph.init import name_seed

#: 2^64 / phi, odd: the Weyl sequence's step (Knuth's multiplicative-hashing constant)
GOLDEN = 0x9E3779B97F4A7C15
EXAMPLE = "data.blend=[{path: web, weight: 0.3}, {path: code, weight: 0.7}] or data.blend=[0.3,web,0.7,code]"


class Source(Protocol):
    """What a blend mixes: data=tokens' TokenFile (data=indexed's IndexedCorpus), which builds the
    Mixture of its `blend` (not imported here: tokens.py imports this module)."""

    path: str | None
    val_path: str | None
    seq_len: int
    seed: int
    blend: Any

    def single(self, path: str, val_path: str | None) -> Source: ...

    def windows(self, samples: np.ndarray, held_out: bool = False) -> tuple[np.ndarray, np.ndarray]: ...

    def check_vocabulary(self, model_vocab: int) -> None: ...


@dataclass(frozen=True)
class Corpus:
    """One corpus of a blend: its path (a token file, or an indexed corpus's prefix), its
    normalised share of the samples and its held-out file (None: held-out windows from `path`)."""

    path: str
    weight: float
    val_path: str | None = None


def _plain(value: Any) -> Any:
    """An OmegaConf list or dict (what Hydra hands over) as plain Python containers."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def _entries(blend: Any) -> list[tuple[Any, Any, Any]]:
    """(path, weight, val_path) of each corpus, from either spelling (module docstring)."""
    blend = _plain(blend)
    if isinstance(blend, (str, bytes)) or not isinstance(blend, Sequence) or not blend:
        raise ConfigError("data.blend", f"got {blend!r}; valid: a list of corpora with weights, e.g. {EXAMPLE}")
    if all(isinstance(e, dict) for e in blend):
        for e in blend:
            unknown = sorted(set(e) - {"path", "weight", "val_path"})
            if unknown or "path" not in e or "weight" not in e:
                raise ConfigError("data.blend", f"entry {e!r}: each corpus is {{path: <corpus>, weight: <w>}} (and "
                                                f"optionally val_path){'; unknown ' + ', '.join(unknown) if unknown else ''}")
        return [(e["path"], e["weight"], e.get("val_path")) for e in blend]
    if len(blend) % 2 or any(isinstance(e, dict) for e in blend):
        raise ConfigError("data.blend", f"got {blend!r}: Megatron's flat form alternates weight and path "
                                        f"(an even number of items); e.g. {EXAMPLE}")
    return [(blend[i + 1], blend[i], None) for i in range(0, len(blend), 2)]


def parse_blend(blend: Any) -> list[Corpus]:
    """The corpora of `data.blend`, weights normalised; a ConfigError naming data.blend for a
    missing path, a weight that is not a positive finite number, or a blend of nothing."""
    corpora = []
    for path, weight, val_path in _entries(blend):
        if not isinstance(path, str) or not path:
            raise ConfigError("data.blend", f"path {path!r} is not a path (a weight where a path belongs?); e.g. {EXAMPLE}")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight <= 0:
            raise ConfigError("data.blend", f"corpus {path}: weight {weight!r} is not a positive number; each weight "
                                            "is the corpus's share of the samples (normalised to sum to 1)")
        if val_path is not None and not isinstance(val_path, str):
            raise ConfigError("data.blend", f"corpus {path}: val_path {val_path!r} is not a path")
        corpora.append(Corpus(path, float(weight), val_path))
    total = sum(c.weight for c in corpora)
    if not math.isfinite(total):
        raise ConfigError("data.blend", f"the weights sum to {total}: give shares, e.g. 0.3 and 0.7")
    return [Corpus(c.path, c.weight / total, c.val_path) for c in corpora]


def choose(seed: int, weights: Sequence[float], samples: np.ndarray) -> np.ndarray:
    """The corpus of each global sample index in `samples`: where the Weyl sequence's point falls
    among the weights' slices of [0, 2^64) (module docstring). A pure function of its arguments."""
    offset = np.uint64(name_seed(seed, "blend") % (1 << 64))
    points = offset + np.asarray(samples, dtype=np.uint64) * np.uint64(GOLDEN)  # wraps modulo 2^64
    edges = np.array([min(int(c * 2.0 ** 64), (1 << 64) - 1) for c in np.cumsum(weights)[:-1]], dtype=np.uint64)
    return np.searchsorted(edges, points, side="right")


def shares(seed: int, weights: Sequence[float], first: int, count: int) -> list[int]:
    """How many of global samples first .. first + count - 1 each corpus gives."""
    chosen = np.concatenate([choose(seed, weights, np.arange(s, min(s + (1 << 22), first + count), dtype=np.int64))
                             for s in range(first, first + count, 1 << 22)] or [np.zeros(0, dtype=np.int64)])
    return np.bincount(chosen, minlength=len(weights)).astype(int).tolist()


def _open(source: Source, corpus: Corpus) -> Source:
    """`source`'s settings on `corpus` alone; its refusal (a missing file, a short corpus, a wrong
    end-of-document id) named under data.blend, with the corpus."""
    try:
        return source.single(corpus.path, corpus.val_path)
    except ConfigError as err:
        if err.key not in ("data.path", "data.val_path"):
            raise
        said = str(err).split(": ", 1)[-1]
        raise ConfigError("data.blend", f"corpus {corpus.path}{' (its val_path)' if err.key == 'data.val_path' else ''}: "
                                        f"{said}") from None


@dataclass
class Mixture:
    """A blend's corpora, each a source of its own (the blend's settings on one corpus)."""

    corpora: list[Corpus]
    parts: list[Source]
    seed: int

    @classmethod
    def of(cls, source: Source) -> Mixture:
        """The mixture `source.blend` names, each corpus opened (and checked) as `source` would."""
        for key, value in (("data.path", source.path), ("data.val_path", source.val_path)):
            if value is not None:
                raise ConfigError(key, f"is {value!r} beside data.blend: a blend names its corpora (and each its "
                                       f"val_path) itself; set {key}=null, or drop data.blend to read {value} alone")
        corpora = parse_blend(source.blend)
        return cls(corpora, [_open(source, c) for c in corpora], source.seed)

    @property
    def weights(self) -> list[float]:
        return [c.weight for c in self.corpora]

    def windows(self, samples: np.ndarray, held_out: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Each sample's window from its corpus (`choose`), as that corpus alone draws it."""
        chosen = choose(self.seed, self.weights, samples)
        rows = np.zeros((len(samples), self.parts[0].seq_len + 1), dtype=np.int64)
        used = np.zeros(len(samples), dtype=np.int64)
        for k, part in enumerate(self.parts):
            mine = chosen == k
            if mine.any():
                rows[mine], used[mine] = part.windows(samples[mine], held_out)
        return rows, used

    def check_vocabulary(self, model_vocab: int) -> None:
        for part in self.parts:
            part.check_vocabulary(model_vocab)

    def metrics(self, first: int, count: int) -> dict:
        """metrics.json's `data_blend` for global samples first .. first + count - 1: each corpus's
        path, normalised weight, samples and realised share."""
        counts = shares(self.seed, self.weights, first, count)
        total = max(1, sum(counts))
        return {"corpora": [c.path for c in self.corpora], "weights": self.weights, "samples": counts,
                "shares": [n / total for n in counts]}
