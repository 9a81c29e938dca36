"""Stage -> pipeline-rank maps: linear, interleaved (round-robin), V, or an explicit list."""

from __future__ import annotations

from collections.abc import Sequence

from pipelaunch.pipeline.core.errors import ConfigError

PLACEMENT_KINDS = ("auto", "linear", "interleaved", "v", "explicit")


def linear(pp: int) -> list[int]:
    """Stage s on rank s: one stage per rank."""
    return list(range(pp))


def interleaved(pp: int, stages_per_rank: int) -> list[int]:
    """Round-robin: stage s on rank s % pp, so each rank holds `stages_per_rank` chunks."""
    return [s % pp for s in range(pp * stages_per_rank)]


def v_shape(pp: int) -> list[int]:
    """Stages 0..p-1 go down the ranks, p..2p-1 come back up: rank r holds r and 2p-1-r."""
    return list(range(pp)) + list(reversed(range(pp)))


def wave(pp: int, waves: int) -> list[int]:
    """Zig-zag over the ranks `waves` times: down 0..p-1, back up p-1..0, down again, ...

    Each rank holds 2 * waves stages; `wave(pp, 1)` is the V placement. Used by Hanayo.
    """
    out: list[int] = []
    for _ in range(waves):
        out.extend(v_shape(pp))
    return out


def from_kind(kind: str, pp: int, stages_per_rank: int = 1) -> list[int]:
    """Build a placement of the named kind (not `auto` or `explicit`)."""
    if kind == "linear":
        if stages_per_rank != 1:
            return interleaved(pp, stages_per_rank)
        return linear(pp)
    if kind == "interleaved":
        return interleaved(pp, stages_per_rank)
    if kind == "v":
        if stages_per_rank > 2:
            if stages_per_rank % 2:
                raise ConfigError(
                    "placement",
                    f"a v (zig-zag) placement holds an even number of stages per rank, got {stages_per_rank}",
                )
            return wave(pp, stages_per_rank // 2)
        return v_shape(pp)
    raise ConfigError("placement", f"unknown placement kind {kind!r}; valid: {', '.join(PLACEMENT_KINDS)}")


def check_explicit(ranks: Sequence[int], pp: int) -> list[int]:
    """Validate a user-given stage -> rank list: every rank in 0..pp-1 used, none outside."""
    ranks = [int(r) for r in ranks]
    bad = [r for r in ranks if not 0 <= r < pp]
    if bad:
        raise ConfigError(
            "placement.ranks",
            f"{list(ranks)} names rank(s) {bad} outside 0..{pp - 1} (pp={pp}); "
            f"each entry is the pipeline rank that holds that stage",
        )
    unused = sorted(set(range(pp)) - set(ranks))
    if unused:
        raise ConfigError(
            "placement.ranks",
            f"{list(ranks)} leaves pipeline rank(s) {unused} without a stage; every rank 0..{pp - 1} "
            f"must hold at least one stage",
        )
    return ranks


def classify(placement: Sequence[int]) -> str:
    """Name the shape of a placement: linear, interleaved, v, or explicit."""
    pp = max(placement) + 1
    placement = list(placement)
    if placement == linear(pp):
        return "linear"
    if len(placement) % pp == 0 and placement == interleaved(pp, len(placement) // pp):
        return "interleaved"
    if placement == v_shape(pp):
        return "v"
    if len(placement) % (2 * pp) == 0 and placement == wave(pp, len(placement) // (2 * pp)):
        return "v"
    return "explicit"


# -- the plug-ins `conf/placement/*.yaml` name: placement(pp, schedule, **options) -> stage ranks --


def placement_for(schedule, pp: int, kind: str | None = None) -> list[int]:
    """The placement of the named kind (the schedule's own `default_placement` for None or "auto"),
    sized to the schedule's stages per rank."""
    if kind in (None, "auto"):
        kind = schedule.default_placement
    return from_kind(kind, pp, schedule.stages_per_rank())


def place_auto(pp: int, schedule) -> list[int]:
    """Whatever the schedule wants: linear for gpipe/1f1b, round-robin for interleaved, V for zbv."""
    return placement_for(schedule, pp)


def place_linear(pp: int, schedule) -> list[int]:
    return from_kind("linear", pp, schedule.stages_per_rank())


def place_interleaved(pp: int, schedule) -> list[int]:
    return from_kind("interleaved", pp, schedule.stages_per_rank())


def place_v(pp: int, schedule) -> list[int]:
    return from_kind("v", pp, schedule.stages_per_rank())


def place_explicit(pp: int, schedule, ranks: Sequence[int] | str | None = None) -> list[int]:
    """The user's own stage -> rank list, e.g. `placement=explicit 'placement.ranks=[0,1,1,0]'`."""
    if not isinstance(ranks, (list, tuple)) or not ranks:
        raise ConfigError("placement.ranks", "placement=explicit needs a list of ranks, e.g. 'placement.ranks=[0,1,1,0]'")
    return check_explicit(ranks, pp)
