"""plan.devices: plan=auto also chooses the layout, every pp x dp == plan.devices, and the run
(dry or trained) takes the chosen one; the configured pp and dp are not used."""

from __future__ import annotations

import json

import pytest

from pipelaunch.launcher.app import dry_run, run
from pipelaunch.launcher.validate import prepare
from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.core.plan import Plan
from tests.harness import FAST, compose_cfg
from tests.test_cli import train

#: one schedule, split and remat: the layouts and the micro-batch counts are what vary
NARROW = [*FAST, "plan=auto", "plan.schedulers=[1f1b]", "plan.partitioners=[uniform]", "plan.remat=[none]",
          "mode=plan", "plan.tp=[1]"]


def _layout(outcome) -> tuple[int, int]:
    return outcome.candidate.pp, outcome.candidate.dp


def test_every_layout_of_the_devices_is_compared_and_the_plan_takes_the_chosen_one(tmp_path) -> None:
    # pp=4 dp=2 as configured: ignored, plan.devices lays out 4 ranks
    prepared = prepare(compose_cfg([*NARROW, "plan.devices=4", "plan.microbatches=[4]", "pp=4", "dp=2"]))
    result = prepared.search
    assert {_layout(o) for o in result.outcomes} == {(1, 4), (2, 2), (4, 1)}
    assert {_layout(o) for o in result.ranked} == {(1, 4), (2, 2), (4, 1)}  # 6 blocks: each can be planned
    win, plan = result.winner, prepared.plan
    assert (plan.pp, plan.dp) == _layout(win) and plan.pp * plan.dp == 4
    assert plan.micro_batch_size == 16 // (plan.dp * 4)
    assert plan.meta.search.chosen["pp"] == plan.pp and plan.meta.search.chosen["dp"] == plan.dp
    assert f"pp={plan.pp} dp={plan.dp}" in win.candidate.label
    table, why = result.table(), result.why()
    assert " pp  dp " in table.splitlines()[0]
    assert "plan.devices=4 compared the layouts pp=1 dp=4, pp=2 dp=2, pp=4 dp=1" in why
    assert "the configured pp and dp are not used" in why
    summary = dry_run(prepared, tmp_path)
    stored = Plan.read(tmp_path / "plan.json")
    assert (stored.pp, stored.dp) == (plan.pp, plan.dp)
    assert summary["plan_search"]["winner"]["pp"] == plan.pp and summary["plan_search"]["winner"]["dp"] == plan.dp
    assert json.loads((tmp_path / "prediction.json").read_text())["plan_search"]["chosen"]["dp"] == plan.dp


def test_layouts_the_batch_or_the_model_rule_out_are_left_out_or_listed_with_their_reason() -> None:
    """16 devices, a batch of 16 and a model of 8 blocks (embed, 6 layers, head): dp=16's replica
    of one sequence splits into no count listed (left out); pp=16 has too few blocks (listed)."""
    result = prepare(compose_cfg([*NARROW, "plan.devices=16", "plan.microbatches=[2,16]"])).search
    assert {_layout(o) for o in result.outcomes} == {(2, 8), (4, 4), (8, 2), (16, 1)}
    assert {c.microbatches for c in (o.candidate for o in result.outcomes) if c.pp == 16} == {2, 16}
    assert any("graph nodes" in (o.error or "") for o in result.failed if o.candidate.pp == 16)
    # 1f1b runs fewer micro-batches than stages: every layout but pp=16 plans with 2 of them
    assert {_layout(o) for o in result.ranked if o.candidate.microbatches == 2} == {(2, 8), (4, 4), (8, 2)}
    assert _layout(result.winner) != (16, 1)
    assert "pp=16 dp=1: none of its candidates could be planned" in result.why()


#: a model whose weights and Adam states outweigh the reserve: more stages, less on each device
BIG = [*NARROW, "model.dim=128", "model.layers=8", "optimizer=adamw", "plan.devices=4", "plan.microbatches=[4]",
       "memory=budget"]


def test_under_a_cap_only_more_stages_fit_the_search_takes_them() -> None:
    free = prepare(compose_cfg([*BIG, "memory.cap_bytes=1e12"])).search
    peak = {_layout(o): o.prediction.peak_bytes for o in free.ranked}
    assert peak[(4, 1)] < peak[(2, 2)] < peak[(1, 4)]
    cap = (peak[(4, 1)] + peak[(2, 2)]) / 2
    capped = prepare(compose_cfg([*BIG, f"memory.cap_bytes={cap}"]))
    result = capped.search
    assert [_layout(o) for o in result.ranked] == [(4, 1)]
    assert {_layout(o) for o in result.excluded} == {(1, 4), (2, 2)}
    assert (capped.plan.pp, capped.plan.dp) == (4, 1)
    assert "pp=2 dp=2: none of its candidates fits the budget" in result.why()


@pytest.mark.parametrize(("args", "match"), [
    (["plan=auto", "plan.devices=0"], "plan.devices.*integer >= 1"),
    (["plan.devices=4"], "plan.devices.*only plan=auto"),
    (["plan=auto", "plan.devices=3", "zero=1", "dp=2", "dp_shard=2"], "dp_shard.*plan.devices=3"),
    (["plan=auto", "plan.devices=1", "zero=1", "dp=2"], "plan.devices.*no layout.*zero=1 needs dp >= 2"),
])
def test_bad_devices_are_refused_naming_the_key(args: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        prepare(compose_cfg([*FAST, "mode=plan", *args]), profile=False)


def test_the_configured_layout_does_not_refuse_a_run_the_devices_lay_out() -> None:
    """dp=3 does not split a batch of 16 into 4 micro-batches each: no matter under plan.devices;
    zero=1 rules out the layout without replicas."""
    plan = prepare(compose_cfg([*NARROW, "plan.devices=2", "dp=3", "pp=1", "zero=1", "plan.microbatches=[2]"]),
                   profile=False).plan
    assert (plan.pp, plan.dp) == (1, 2)  # zero=1 leaves only the layout with replicas


def test_joined_ranks_must_be_as_many_as_the_devices(tmp_path, monkeypatch) -> None:
    for key, value in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(key, value)
    cfg = compose_cfg([*FAST, "plan=auto", "plan.devices=4"])
    with pytest.raises(ConfigError, match="plan.devices=4 .* WORLD_SIZE=2"):
        run(cfg, tmp_path)


@pytest.mark.timeout(300)
def test_a_run_trains_on_the_layout_the_search_chose(tmp_path) -> None:
    """Through the launcher: pp=2 dp=2 as configured would be 4 ranks; plan.devices=2 spawns 2."""
    args = [a for a in NARROW if a not in ("mode=plan", "steps=3")]
    proc = train([*args, "plan.devices=2", "plan.microbatches=[4]", "pp=2", "dp=2", "steps=2"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    plan = Plan.read(tmp_path / "plan.json")
    chosen = metrics["plan_search"]["chosen"]
    assert (chosen["pp"], chosen["dp"]) == (plan.pp, plan.dp) and plan.pp * plan.dp == 2
    assert len(metrics["ranks"]) == 2 and len(metrics["losses"]) == 2
    assert all(loss == loss for loss in metrics["losses"])  # finite, trained
    assert f"pp={plan.pp} dp={plan.dp} microbatches=4" in proc.stdout


def test_the_devices_are_also_laid_out_with_tensor_parallelism() -> None:
    """plan.devices=8 with plan.tp left null compares tp = 1, 2, 4 and 8 (every divisor of the
    devices up to a node's 8 that divides the model's heads and vocabulary), each at every pp x dp
    it allows; a tp layout is planned at its own shapes (its parameters per device a tp-th), and
    `why` names the layouts compared, tp included."""
    result = prepare(compose_cfg([*NARROW[:-1], "model.heads=8", "plan.devices=8", "plan.microbatches=[8]"])).search
    tps = {o.candidate.tp for o in result.outcomes}
    assert tps == {1, 2, 4, 8}
    assert all(o.candidate.pp * o.candidate.dp * o.candidate.tp == 8 for o in result.outcomes)
    at_pp4 = {o.candidate.tp: o for o in result.ranked if o.candidate.pp == 4}  # dp=2 tp=1 and dp=1 tp=2
    whole, split = at_pp4[1].prediction, at_pp4[2].prediction
    assert split.plan.tp == 2 and split.plan.tp_modules and whole.plan.tp == 1
    assert split.devices[0].params == pytest.approx(whole.devices[0].params / 2, rel=0.05)
    why = result.why()
    assert "pp=4 dp=1 tp=2" in why and "pp=1 dp=1 tp=8" in why
    assert "tp=" in result.table().splitlines()[0] or " tp " in result.table().splitlines()[0]
    with pytest.raises(ConfigError, match="plan.tp"):
        prepare(compose_cfg([*NARROW[:-1], "plan.devices=8", "plan.tp=[3]"]))
