"""plan.devices searches cp beside pp x dp x tp: at a long sequence under a tight memory cap it
proposes cp > 1, at a short one cp = 1, and `why` names the degree; bad `plan.cp` values are
refused naming the key; the gradients' reduction is priced over dp x cp; mode=plan prices tp
beside cp (each tp rank's heads). Every plan here is priced
on a hardware file, on meta (nothing runs), on a tiny model."""

from __future__ import annotations

import pytest

from pipelaunch.launcher.validate import prepare
from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.planner.measure.context import attention_share
from tests.harness import compose_cfg

#: a tiny gpt priced on an H100 file, with almost nothing set aside so that a tiny cap binds
TINY = ["mode=plan", "model=gpt", "model.dim=64", "model.heads=4", "model.layers=2", "model.vocab_size=64",
        "batch_size=4", "hardware=h100_sxm", "hardware.reserve_bytes=1e6", "memory.reserve_bytes=1e6",
        "precision=bf16", "eval.every=0"]
SEARCH = [*TINY, "plan=auto", "plan.devices=4", "plan.tp=[1]", "plan.cp=[1,2]", "plan.schedulers=[1f1b]",
          "plan.partitioners=[uniform]", "plan.remat=[none]", "memory.cap_bytes=60e6"]


def test_a_long_sequence_under_a_tight_cap_gets_cp_and_a_short_one_does_not() -> None:
    long = prepare(compose_cfg([*SEARCH, "model.seq_len=8192"]))
    win = long.search.winner.candidate
    assert win.cp == 2 and win.devices == 4 and long.plan.cp == 2
    assert {o.candidate.cp for o in long.search.outcomes} == {1, 2}
    why = long.search.why()
    assert "cp=2 (each sequence over 2 ranks" in why and "cp=1 is over the device memory" in why
    assert "cp=2" in win.label and " cp " in long.search.table().splitlines()[0]
    assert long.spec.input_shape == (4096,)  # the plan's model is the one at the chosen cp
    short = prepare(compose_cfg([*SEARCH, "model.seq_len=256"]))
    assert short.search.winner.candidate.cp == 1 and short.plan.cp == 1
    assert "cp=1 (each sequence whole on a rank" in short.search.why()
    assert "faster than cp=2" in short.search.why()


def test_the_default_degrees_follow_the_sequence() -> None:
    from pipelaunch.pipeline.planner.search.layouts import cp_degrees

    cfg = compose_cfg([*TINY, "plan=auto", "plan.devices=64", "model.seq_len=128"])
    assert cp_degrees(cfg, 8192, None) == [1]  # a rank keeps 8192 positions at least
    assert cp_degrees(cfg, 16384, None) == [1, 2]
    assert cp_degrees(cfg, 131072, None) == [1, 2, 4, 8, 16]
    assert cp_degrees(cfg, 2 ** 20, None) == [1, 2, 4, 8, 16, 32]
    assert cp_degrees(cfg, 131072, "it cannot") == [1]
    trains = compose_cfg([*TINY, "mode=train", "plan=auto", "plan.devices=64", "model.seq_len=128"])
    assert cp_degrees(trains, 131072, None) == [1]  # a search that trains keeps the configured cp


@pytest.mark.parametrize(("value", "says"), [
    ("[0]", "valid: a list of context-parallel degrees dividing plan.devices=4"),
    ("[3]", "valid: a list of context-parallel degrees dividing plan.devices=4"),
    ("[]", "valid: a list of context-parallel degrees"),
    ("[4]", "model.seq_len=12 does not divide"),
])
def test_bad_plan_cp_is_refused_naming_the_key(value: str, says: str) -> None:
    with pytest.raises(ConfigError) as err:
        prepare(compose_cfg([*SEARCH, "model.seq_len=12", f"plan.cp={value}"]))
    assert err.value.key == "plan.cp" and says in str(err.value) and "\n" not in str(err.value)


def test_plan_cp_on_a_model_that_cannot_split_its_positions_is_refused() -> None:
    with pytest.raises(ConfigError) as err:
        prepare(compose_cfg(["mode=plan", "model=mlp", "hardware=h100_sxm", "plan=auto", "plan.devices=4",
                             "plan.cp=[1,2]", "plan.schedulers=[1f1b]", "plan.partitioners=[uniform]"]))
    assert err.value.key == "plan.cp" and "does not run attention over a cp group" in str(err.value)


def _reductions(prepared) -> float:
    """Seconds of the replicas' gradient collectives the prediction priced, over every rank."""
    events = prepared.prediction.collective_events
    assert events
    return sum(e["end_s"] - e["start_s"] for e in events)


def test_the_gradients_reduction_is_priced_over_dp_x_cp() -> None:
    """dp=2 cp=2 reduces over 4 ranks as dp=4 does: the same collectives, the same optimizer
    shard (zero=1 over 4); dp=2 alone reduces over 2."""
    common = [*TINY, "model.seq_len=256", "pp=2", "zero=1", "microbatches=2", "scheduler=1f1b", "batch_size=8"]
    both = prepare(compose_cfg([*common, "dp=2", "cp=2"]))
    replicas = prepare(compose_cfg([*common, "dp=4"]))
    fewer = prepare(compose_cfg([*common, "dp=2"]))
    assert _reductions(both) == pytest.approx(_reductions(replicas), rel=1e-9)
    assert _reductions(fewer) < 0.9 * _reductions(replicas)
    optim = [[d.optimizer for d in p.prediction.devices] for p in (both, replicas, fewer)]
    assert optim[0] == pytest.approx(optim[1]) and optim[2][0] == pytest.approx(2 * optim[1][0])


def test_mode_plan_prices_tp_beside_cp_on_each_tp_ranks_heads() -> None:
    common = [*TINY, "model.seq_len=8192", "model.dim=2048", "model.heads=16", "pp=1", "cp=2"]
    plain, split = (prepare(compose_cfg([*common, f"tp={tp}"])) for tp in (1, 2))
    assert split.plan.tp == 2 and split.plan.cp == 2
    # half the heads' attention (and half the rest) a rank, its all-reduces on NVLink
    assert split.prediction.step_s < 0.7 * plain.prediction.step_s


def test_attention_share_reads_the_local_heads_under_tp() -> None:
    cfg = [*TINY, "model.seq_len=256", "pp=1", "cp=2"]
    heads = {}
    for tp in (1, 2):
        prepared = prepare(compose_cfg([*cfg, f"tp={tp}"]))
        traced = prepared_trace(prepared, tp)
        heads[tp] = attention_share(traced, "layer0")[1][0][1]
    assert heads == {1: 4, 2: 2}


def prepared_trace(prepared, tp: int):  # noqa: ANN001, ANN201 - a Prepared, its trace
    """The trace the plan of `prepared` was made on (its micro-batch size, at `tp`)."""
    from pipelaunch.launcher.plugins import build_plugins
    from pipelaunch.pipeline.planner import tensor_parallel_modules
    from pipelaunch.pipeline.planner.measure.traced import TracedModels

    cfg = compose_cfg([*TINY, "model.seq_len=256", "pp=1", "cp=2", f"tp={tp}"])
    plugins = build_plugins(cfg)
    models = TracedModels(prepared.spec, plugins.model, cfg, profile=False)
    models.tp_modules = tensor_parallel_modules(tp, prepared.spec, models)
    return models.structure(prepared.plan.micro_batch_size, tp)


def test_a_transformers_llama_is_searched_at_cp_too() -> None:
    """model=hf: each cp's model is built again at its context_parallel (its trace, and what the
    plan's autocast dtypes are found on, at the rank's 1/cp of the positions)."""
    found = prepare(compose_cfg(["mode=plan", "plan=auto", "plan.devices=4", "model=hf_llama_tiny", "model.seq_len=128",
                                 "hardware=h100_sxm", "precision=bf16", "plan.cp=[1,2]", "plan.tp=[1]", "batch_size=4",
                                 "plan.schedulers=[1f1b]", "plan.partitioners=[uniform]", "plan.remat=[none]"])).search
    assert {o.candidate.cp for o in found.ranked} == {1, 2}
    assert "against the other context-parallel degrees" in found.why()


def test_the_ring_moves_a_grouped_query_models_key_heads() -> None:
    """hf_llama_tiny: 4 query heads, 2 key/value heads; the ring's bytes are priced at the 2."""
    from pipelaunch.launcher.plugins import build_plugins
    from pipelaunch.pipeline.planner.measure.context import attention_calls, exchange_s, kv_heads
    from pipelaunch.pipeline.planner.measure.traced import TracedModels

    cfg = compose_cfg(["mode=plan", "model=hf_llama_tiny", "model.seq_len=128", "cp=2", "pp=1", "batch_size=4"])
    plugins = build_plugins(cfg)
    spec = plugins.model.build()
    traced = TracedModels(spec, plugins.model, cfg, profile=False).structure(1)
    calls = attention_calls(traced)
    assert calls
    found = {(attention_share(traced, n, calls)[1][0][1], kv_heads(traced, n, calls)[0]) for n in calls}
    assert found == {(4, 2)}
    shape, link = (1, 4, 64, 16), (0.0, 1e9)
    assert exchange_s(shape, 2, "ring", link, 2.0, 2)[0] == pytest.approx(exchange_s(shape, 2, "ring", link, 2.0)[0] / 2)
