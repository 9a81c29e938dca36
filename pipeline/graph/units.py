"""The units of a stage: the groups of its parameters gathered, released and reduced together.

Why per block, not per stage: a stage that is one unit holds its whole parameters (zero=3) and its
whole gradients (zero >= 2) unsharded while any part of it computes, so sharding lowers what a
rank holds between steps but not the peak that decides whether a model fits. Cut into one unit per
block (a transformer layer, a U-Net block), a rank gathers one block ahead of its use and releases
it after, and reduces each block's gradients as soon as the backward has finished them, as
torchtitan's per-block `fully_shard` and Megatron's gradient buckets do.

The rule, on the stage's graph (one rule for the planner, which prices the units, and the rank,
which runs them; docs/sharding.md "Units"):

1. A parameter's key is its name up to its outermost numbered component: `model.layers.3`,
   `transformer.h.0`, `down_blocks.1`, or a chain's `layer3` (a name numbered in itself). A name
   without one is keyed by the module holding it (`model.embed_tokens`, `lm_head`, `head.norm`).
2. A parameter the stage reads at two places with another key's parameters read in between (a
   weight tied inside one stage, a module called twice) cannot be gathered for one span: it goes
   to the stage's root unit, gathered for each of the stage's compute actions as a whole.
3. Keys whose spans (first to last node reading them, in the graph's order) overlap are one unit:
   a unit is gathered for one contiguous span of the forward, and one node's parameters are
   never split between two units.
4. A unit holding less than a quarter of the stage's largest one joins a neighbour in the order
   of use (the one whose name shares the longest prefix with it, the next on a tie): a collective
   has a fixed cost (a hop of latency per replica), and a LayerNorm alone is not worth one.
5. Tied parameters (held by several stages, `Plan.shared_params`) are in no unit: every level
   keeps them whole.
6. With `bucket_bytes` (the config's `dp_bucket_bytes`, DDP's `bucket_cap_mb`), consecutive units
   join until one holds at least that many bytes: fewer, larger collectives; a size above the
   stage's makes the stage one unit.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from torch import fx, nn

#: a module name numbered in itself: `layer3`, `block12` (a chain of blocks)
NUMBERED = re.compile(r"([A-Za-z_]+?)(\d+)")
#: a unit under this share of the stage's largest joins a neighbour (rule 4)
MIN_UNIT_SHARE = 0.25


@dataclass(frozen=True)
class Unit:
    """One unit of a stage: its parameters (names inside the stage's module), the span of graph
    positions that read them, and their bytes."""

    name: str
    params: tuple[str, ...]
    first: int
    last: int
    nbytes: float


@dataclass(frozen=True)
class StageUnits:
    """A stage's units in the order its forward reaches them, and the root unit's parameters (rule 2)."""

    units: tuple[Unit, ...]
    root: tuple[str, ...] = ()
    root_bytes: float = 0.0

    @property
    def largest(self) -> float:
        """The bytes of the largest unit (the root counts as one)."""
        return max([u.nbytes for u in self.units] + [self.root_bytes], default=0.0)


def unit_key(name: str) -> str:
    """Rule 1: the parameter's name up to its outermost numbered component, else its module's name."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if (part.isdigit() and i > 0) or NUMBERED.fullmatch(part):
            return ".".join(parts[: i + 1])
    return ".".join(parts[:-1]) or name


def node_param_uses(gm: fx.GraphModule, nodes: Iterable[fx.Node] | None = None) -> list[tuple[str, set[str]]]:
    """Per node of `gm` (or of `nodes`, in that order): the parameter names it reads. A `get_attr`
    of a parameter or of a module reads those; a `call_module` its module's; every node the
    parameters of the `get_attr` nodes it takes (the tensor-parallel lookup is a module given its
    weight) (a parameter a node reads is read again where it is
    used, as an export trace reads its weights by `get_attr`)."""
    def params_of(target: str) -> set[str]:
        obj = _resolve(gm, target)
        if isinstance(obj, nn.Parameter):
            return {target}
        if isinstance(obj, nn.Module):
            return {f"{target}.{n}" for n, _ in obj.named_parameters(remove_duplicate=False)}
        return set()

    cache: dict[str, set[str]] = {}
    out = []
    for node in (gm.graph.nodes if nodes is None else nodes):
        used = set()
        if node.op in ("get_attr", "call_module"):
            used = set(cache.setdefault(str(node.target), params_of(str(node.target))))
        if node.op in ("call_function", "call_method", "call_module"):  # a module may take a weight too
            used |= set().union(*(cache.setdefault(str(a.target), params_of(str(a.target)))
                                  for a in node.all_input_nodes if a.op == "get_attr"))
        out.append((node.name, used))
    return out


def _resolve(gm: nn.Module, target: str) -> object:
    obj: object = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def stage_units(uses: Sequence[tuple[str, set[str]]], param_bytes: Mapping[str, float],
                excluded: Iterable[str] = (), canonical: Mapping[str, str] | None = None,
                bucket_bytes: float | None = None) -> StageUnits:
    """The units of one stage (the module's rules) from its nodes' parameter uses in graph order
    (`node_param_uses`), each parameter's bytes, and the parameters in no unit (tied). Names are
    the stage's own; `canonical` maps an alias to the model's name (a tied copy), which excludes it
    and keys it; `bucket_bytes`: rule 6."""
    canonical = canonical or {}
    skip = set(excluded)
    positions: dict[str, list[int]] = {}  # by the model's own name: a tied copy's reads are its owner's
    names: dict[str, list[str]] = {}  # the model's name -> the stage's names for it
    for pos, (_, used) in enumerate(uses):
        for name in used:
            own = canonical.get(name, name)
            if own in skip:
                continue
            positions.setdefault(own, []).append(pos)
            if name not in names.setdefault(own, []):
                names[own].append(name)
    key_of = {p: unit_key(p) for p in positions}
    by_key: dict[str, list[int]] = {}
    for p, where in positions.items():
        by_key.setdefault(key_of[p], []).extend(where)
    # rule 2: a parameter with another key's reads between two of its own goes to the root
    root = sorted(p for p, where in positions.items()
                  if any(key != key_of[p] and any(min(where) < x < max(where) for x in xs)
                         for key, xs in by_key.items()))
    spans: dict[str, list[int]] = {}
    members: dict[str, list[str]] = {}
    for p, where in positions.items():
        if p in root:
            continue
        span = spans.setdefault(key_of[p], [min(where), max(where)])
        span[0], span[1] = min(span[0], min(where)), max(span[1], max(where))
        members.setdefault(key_of[p], []).append(p)

    def size(params: Iterable[str]) -> float:
        return float(sum(param_bytes.get(names[p][0], 0.0) for p in params))

    groups = _merge_overlapping([(span[0], span[1], [key]) for key, span in spans.items()])
    units = [Unit("+".join(keys), tuple(sorted(n for k in keys for p in members[k] for n in names[p])), first, last,
                  size(p for k in keys for p in members[k]))
             for first, last, keys in groups]
    units = _fill_buckets(_merge_small(units), bucket_bytes)
    return StageUnits(tuple(units), tuple(n for p in root for n in names[p]), size(root))


def _merge_overlapping(spans: list[tuple[int, int, list[str]]]) -> list[tuple[int, int, list[str]]]:
    """Rule 3: spans sorted by start, those that overlap joined."""
    out: list[tuple[int, int, list[str]]] = []
    for first, last, keys in sorted(spans):
        if out and first <= out[-1][1]:
            a, b, ks = out[-1]
            out[-1] = (a, max(b, last), ks + keys)
        else:
            out.append((first, last, list(keys)))
    return out


def _merge_small(units: list[Unit]) -> list[Unit]:
    """Rule 4: the smallest unit under MIN_UNIT_SHARE of the largest joins the neighbour sharing the
    longest name prefix with it (the next one on a tie), until none is that small."""
    units = list(units)
    while len(units) > 1:
        floor = MIN_UNIT_SHARE * max(u.nbytes for u in units)
        small = [i for i, u in enumerate(units) if u.nbytes < floor]
        if not small:
            break
        i = min(small, key=lambda k: (units[k].nbytes, k))
        neighbours = [j for j in (i + 1, i - 1) if 0 <= j < len(units)]
        j = max(neighbours, key=lambda k: (_shared_prefix(units[i].name, units[k].name), k > i))
        a, b = sorted((i, j))
        units[a:b + 1] = [_join(units[a], units[b])]
    return units


def _fill_buckets(units: list[Unit], bucket_bytes: float | None) -> list[Unit]:
    """Rule 6: consecutive units joined until each holds at least `bucket_bytes` (the last may hold less)."""
    if not bucket_bytes:
        return units
    out: list[Unit] = []
    for unit in units:
        if out and out[-1].nbytes < bucket_bytes:
            out[-1] = _join(out[-1], unit)
        else:
            out.append(unit)
    return out


def _shared_prefix(a: str, b: str) -> int:
    """How many leading dotted components two unit names share."""
    n = 0
    for x, y in zip(a.split("."), b.split("."), strict=False):
        if x != y:
            break
        n += 1
    return n


def _join(a: Unit, b: Unit) -> Unit:
    return Unit(f"{a.name}+{b.name}", tuple(sorted(a.params + b.params)), min(a.first, b.first),
                max(a.last, b.last), a.nbytes + b.nbytes)
