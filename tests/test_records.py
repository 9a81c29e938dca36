"""The typed records a run is described by: PlanMeta's sub-records keep plan.json's format (and
read the plan.json of earlier versions), and a model spec answers what a sample counts for."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from hydra.utils import instantiate

from pipelaunch.launcher.validate import prepare
from pipelaunch.pipeline.core.plan import Plan, PlanMeta
from pipelaunch.pipeline.core.plan_records import MachineFacts, PartitionSummary, SearchSummary
from tests.harness import FAST, compose_cfg

#: plan.json's `meta` keys, in the order it has always written them
META_KEYS = [
    "remat", "partitioner", "partition", "precision", "zero", "dp_shard", "reshard", "device_type", "bucket_bytes",
    "stage_units", "profiled", "optimizer_states", "memory_cap", "reserve_bytes",
    "remat_stages", "stage_tensors", "model_param_bytes", "rank_slots", "optimizer_s_per_byte",
    "optimizer_temporaries", "stage_largest_param_bytes", "link_latency_s", "action_overhead_s", "cost_source", "dp_link",
    "stage_replicated_param_bytes", "stage_expert_param_bytes", "stage_exchange_s", "stage_forward_s",
    "stage_backward_s", "stage_backward_input_s", "stage_backward_weight_s", "stage_workspace_bytes",
    "stage_weight_stash_bytes", "stage_loss_activation_bytes", "recompute", "selective", "stage_recompute_s",
    "stage_recompute_region_bytes", "device_memory", "prediction", "search",
]


def test_a_searched_plan_round_trips_through_plan_json_with_its_format(tmp_path: Path) -> None:
    plan = prepare(compose_cfg([*FAST, "pp=2", "plan=auto", "plan.microbatches=[2,4]", "mode=plan"])).plan
    meta = plan.meta
    assert isinstance(meta.partition, PartitionSummary) and isinstance(meta.search, SearchSummary)
    assert meta.search.chosen["microbatches"] == plan.microbatches
    assert [d.rank for d in meta.device_memory] == [0, 1] and meta.prediction.step_time_s > 0
    plan.write(tmp_path / "plan.json")
    text = (tmp_path / "plan.json").read_text()
    written = json.loads(text)["meta"]
    assert list(written) == META_KEYS
    assert written["partition"] == asdict(meta.partition) and written["rank_slots"] == meta.machine.rank_slots
    assert list(written["search"])[:3] == ["chosen", "why", "seconds"]
    back = Plan.read(tmp_path / "plan.json")
    assert back.meta == meta
    back.write(tmp_path / "again.json")
    assert (tmp_path / "again.json").read_text() == text


def test_an_older_plan_meta_loads_with_unknown_keys_dropped() -> None:
    old = {"partition": {"bottleneck_s": 2.0, "stage_in_flight": [2, 1], "method": "gone"}, "rank_slots": 1.5,
           "action_overhead_s": 1e-4, "device_memory": [{"rank": 0, "params": 1.0, "grads": 1.0, "optimizer": 2.0,
                                                         "activations": 3.0, "total": 7.0}], "no_such_key": 1}
    meta = PlanMeta.from_json(old)
    assert meta.partition.stage_in_flight == [2, 1] and meta.partition.bottleneck_s == 2.0
    assert meta.machine == MachineFacts(rank_slots=1.5, action_overhead_s=1e-4)
    assert meta.device_memory[0].total == 7.0 and meta.device_memory[0].update == 0.0
    assert meta.search is None and meta.prediction is None
    assert PlanMeta.from_json({}).to_json()["partition"] == {}  # a plan without a partition, as before


def test_a_sample_counts_its_tokens_for_a_language_model_and_once_for_an_image() -> None:
    lm = instantiate(compose_cfg(FAST).model)
    assert lm.tokens_per_sample == 8 and lm.throughput_unit == "tokens" and lm.takes_tokens  # FAST: seq_len=8
    image = instantiate(compose_cfg(["model=resnet", "data=images"]).model)
    assert image.tokens_per_sample == 1 and image.throughput_unit == "samples" and not image.takes_tokens
