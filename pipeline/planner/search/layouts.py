"""`plan.devices`: the (pp, dp) layouts `plan=auto` compares, with what each layout lets it try.

Why here and not in validation: which micro-batch counts and sharding levels a layout allows
depends on its dp (each replica's share of the batch; zero > 0 needs replicas to shard over), so
a layout the batch or the sharding settings rule out is left out of the search, with the reason,
rather than refusing the run; only when every layout is ruled out is it a config error.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from pipelaunch.pipeline.core.config import TrainConfig
from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.planner.search.choose import microbatch_counts, zero_levels


@dataclass(frozen=True)
class Layout:
    """One (pp, dp) the search tries, and the micro-batch counts and sharding levels it allows.
    `pp`, `dp` None: the configured ones (no `plan.devices`)."""

    pp: int | None
    dp: int | None
    counts: list[int]
    zeros: list[int | None]
    #: the tensor-parallel degree under plan.devices (None: the configured tp)
    tp: int | None = None
    #: the expert-parallel degree under plan.devices on a model with routed experts (None: the
    #: configured ep)
    ep: int | None = None
    #: the context-parallel degree under plan.devices on a model that splits its positions (None:
    #: the configured cp)
    cp: int | None = None


def layouts(cfg: TrainConfig, tps: Sequence[int] = (1,), experts: int = 0,
            cps: Sequence[int] | None = None) -> list[Layout]:
    """The layouts of the search: the configured pp and dp (errors raised as before), or every
    pp x dp x tp x cp == plan.devices, tp among `tps`, cp among `cps` (None: the configured cp,
    not a layout axis), whose dp the batch and the sharding settings allow, pp from 1 up; on a
    model with `experts` routed experts each at every expert-parallel degree it allows
    (`expert_degrees`). A pp larger than the model has blocks for stays in: its candidates fail
    to plan, as any do."""
    space = cfg.plan
    if space.devices is None:
        return [Layout(None, None, microbatch_counts(cfg.pp, cfg.dp, cfg.batch_size, cfg.microbatches,
                                                     space.microbatches), zero_levels(space.zero, cfg.dp))]
    found, skipped = [], []
    for cp in (cps or [cfg.cp]):
        for tp in tps:
            if space.devices % (tp * cp):
                continue
            pipelines = space.devices // (tp * cp)  # each pipeline rank takes tp x cp devices
            for pp in (d for d in range(1, pipelines + 1) if pipelines % d == 0):
                _one_layout(cfg, pp, pipelines // pp, tp, cp if cps else None, experts, found, skipped)
    if not found:
        raise ConfigError("plan.devices", f"no layout pp x dp = {space.devices} can run this config: "
                                          + "; ".join(skipped))
    return found


def _one_layout(cfg: TrainConfig, pp: int, dp: int, tp: int, cp: int | None, experts: int,
                found: list[Layout], skipped: list[str]) -> None:
    """The layout (pp, dp, tp, cp) appended to `found` (at each expert-parallel degree on a model
    with routed experts), or why it cannot run to `skipped`."""
    text = f"pp={pp} dp={dp}{f' tp={tp}' if tp > 1 else ''}{f' cp={cp}' if cp and cp > 1 else ''}"
    try:
        if tp > 1 and cfg.dp_shard is not None:
            raise ConfigError("dp_shard", "hybrid sharding of tensor-parallel slices is not supported yet")
        lay = replace(_layout(cfg, pp, dp), tp=tp, cp=cp)
    except ConfigError as err:
        skipped.append(f"{text}: {str(err).removeprefix('Invalid config ')}")
        return
    if not experts:
        found.append(lay)
        return
    for ep in expert_degrees(cfg, experts, dp):
        try:
            found.append(replace(lay, ep=ep, zeros=_expert_levels(cfg, lay.zeros, dp, ep)))
        except ConfigError as err:
            skipped.append(f"{text} ep={ep}: {str(err).removeprefix('Invalid config ')}")


def _layout(cfg: TrainConfig, pp: int, dp: int) -> Layout:
    """The layout (pp, dp) of plan.devices, or a ConfigError saying why it cannot run."""
    if cfg.batch_size % dp:
        raise ConfigError("batch_size", f"batch_size={cfg.batch_size} does not split over {dp} replicas")
    zeros = _levels(cfg, dp)
    if cfg.dp_shard is not None and dp % cfg.dp_shard:
        raise ConfigError("dp_shard", f"dp_shard={cfg.dp_shard} does not divide dp={dp}")
    return Layout(pp, dp, microbatch_counts(pp, dp, cfg.batch_size, cfg.microbatches, cfg.plan.microbatches,
                                            smallest=True), zeros)


def _levels(cfg: TrainConfig, dp: int) -> list[int | None]:
    """The sharding levels dp replicas allow: `plan.zero`'s (above 0 only with dp >= 2), or the
    configured `zero`."""
    wanted = cfg.plan.zero
    if wanted is None:
        if cfg.zero and dp < 2:
            raise ConfigError("zero", f"zero={cfg.zero} needs dp >= 2")
        return [None]
    zero_levels(wanted, 2)  # the list itself is valid whatever dp is
    levels = [z for z in wanted if dp >= 2 or not z]
    if not levels:
        raise ConfigError("plan.zero", f"levels {sorted(set(wanted))} need dp >= 2")
    return zero_levels(levels, dp)


def expert_degrees(cfg: TrainConfig, experts: int, dp: int) -> list[int]:
    """The expert-parallel degrees a layout of `dp` replicas tries (at any tp) on a model with `experts`
    routed experts: `plan.ep`'s (null: every power of two up to min(dp, experts)), those dividing
    both dp (ep folds over the replicas) and the experts (each rank holds experts / ep of every
    layer), at every tp (the experts' layers are whole on each tp rank: runtime/experts.py)."""
    wanted = cfg.plan.ep
    if wanted is not None:
        bad = [e for e in wanted if isinstance(e, bool) or not isinstance(e, int) or e < 1 or experts % e]
        if bad or not wanted:
            raise ConfigError("plan.ep", f"got {list(wanted)!r}; valid: a list of expert-parallel degrees dividing "
                                         f"the model's {experts} routed experts, e.g. [1, 8, 64], or null")
        pool = sorted(set(wanted))
    else:
        pool = [1 << i for i in range(min(dp, experts).bit_length())]
    return [e for e in pool if dp % e == 0 and experts % e == 0]


def _expert_levels(cfg: TrainConfig, zeros: list[int | None], dp: int, ep: int) -> list[int | None]:
    """The sharding levels a layout keeps at `ep`: every one. At ep = dp each rank's experts have no
    other replica (held whole), at ep = 1 they are sharded as every parameter is, and for
    1 < ep < dp levels above 0 shard them over their dp / ep expert replicas (Megatron's and
    DeepSeek-V3's distributed optimizer), which the planner prices and the runtime runs
    (docs/sharding.md "Experts")."""
    return zeros


#: under the default degrees a cp rank keeps at least this many positions of a sequence: Llama 3
#: 405B ran cp=16 at 131,072 tokens (8,192 a rank) and none at 8,192; below it attention is a small
#: share of a block and the ring's rotations, which the planner prices in line (not hidden), are
#: short transfers of small blocks (at 8,192 tokens plan.cp=[1,2,4,8] prices tp=4 cp=2 4% ahead
#: of tp=8 cp=1: bench/RESULTS.md)
MIN_POSITIONS = 8192
#: the largest cp the default degrees try
MAX_CP = 32


def cp_degrees(cfg: TrainConfig, seq_len: int | None, refusal: str | None) -> list[int] | None:
    """The context-parallel degrees of a `plan.devices` search (None: no such search, the
    configured cp): `plan.cp`'s, or by default under mode=plan every power of two up to MAX_CP whose
    2 x cp chunks divide the `seq_len` positions, leaving each rank MIN_POSITIONS or more, and that
    divides the devices (cp=1 alone for a model that cannot split its positions: `refusal` says why). A search
    that trains keeps the configured cp: the ranks build the model at it."""
    devices, wanted = cfg.plan.devices, cfg.plan.cp
    if devices is None:
        return None
    if wanted is not None:
        bad = [c for c in wanted if isinstance(c, bool) or not isinstance(c, int) or c < 1 or devices % c]
        if bad or not wanted:
            raise ConfigError("plan.cp", f"got {list(wanted)!r}; valid: a list of context-parallel degrees dividing "
                                         f"plan.devices={devices}, e.g. [1, 2, 4], or null")
        split = sorted({c for c in wanted if c > 1})
        if split and refusal:
            raise ConfigError("plan.cp", f"cp={split[0]} splits every sequence along its positions, and {refusal}; "
                                         "set plan.cp=[1] or null")
        uneven = [c for c in split if seq_len is None or seq_len % (2 * c)]
        if uneven:
            raise ConfigError("plan.cp", f"cp={uneven[0]} cuts each sequence into {2 * uneven[0]} chunks (a head and "
                                         f"a tail per rank), and model.seq_len={seq_len} does not divide; list "
                                         "degrees whose 2 x cp divides the sequence")
        if cfg.mode != "plan" and sorted(set(wanted)) != [cfg.cp]:
            raise ConfigError("plan.cp", f"a search that trains keeps the configured cp={cfg.cp} (the ranks build the "
                                         "model at it); search plan.cp under mode=plan and run the winner's command, "
                                         f"or set plan.cp=[{cfg.cp}]")
        return sorted(set(wanted))
    if cfg.mode != "plan" or refusal or not seq_len:
        return [cfg.cp]
    return [c for c in (1 << i for i in range(MAX_CP.bit_length()))
            if c == 1 or (seq_len % (2 * c) == 0 and seq_len // c >= MIN_POSITIONS and devices % c == 0)]
