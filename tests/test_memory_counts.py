"""Each rank's predicted activations follow its own schedule (#55): at the moment a rank's memory
peaks, the stage-micro-batches its program has started and not yet finished, each at its stage's
activation bytes (half-freed between a split backward's I and W), and the P2P buffers of that
moment, each its own edge's message. Counted here from the simulated timeline alone, on 8-stage
interleaved 1F1B and ZBV (a V schedule, split backward) plans of a profiled GPT; and the P2P
buffers stay a few messages, never the whole-stage sends that once priced every receive of a
rank (a Llama's stage 0 shipping its masks to every later stage made rank 0 hold ~8 micro-batches'
worth)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipelaunch.launcher.validate import prepare
from pipelaunch.pipeline.planner.predict.simulate import simulate
from tests.harness import FAST, compose_cfg
from tests.test_graph_equivalence import MODELS

GPT = [*FAST, "model.dim=64", "model.layers=8", "model.seq_len=16", "microbatches=8", "batch_size=32"]
PLANS = {"interleaved_1f1b": [*GPT, "scheduler=interleaved_1f1b", "pp=4"], "zbv": [*GPT, "scheduler=zbv", "pp=4"],
         # a U-Net's long skips: stage 0 sends to every later stage, each edge its own message
         "unet skips": [*MODELS["unet"], "scheduler=1f1b", "pp=4", "microbatches=8", "batch_size=32"]}


def _prediction(name: str):
    return prepare(compose_cfg([*PLANS[name], "mode=plan"])).prediction


def _held_at(events: list[dict], rank: int, t: float, cost) -> float:
    """What `rank` holds at `t` by its own timeline: each (stage, micro-batch) whose forward has
    started and whose last backward (B, or W after I) has not ended, at the bytes its phase holds."""
    mine = [e for e in events if e["rank"] == rank]
    held = 0.0
    for key in {(e["stage"], e["mb"]) for e in mine if e["kind"] == "F"}:
        stage = key[0]
        acts = {e["kind"]: e for e in mine if (e["stage"], e["mb"]) == key}
        if acts["F"]["start_s"] > t:
            continue
        last = acts.get("B") or acts.get("W")
        if last is not None and last["end_s"] <= t:
            continue
        full = cost.activation_bytes[stage]
        if "I" in acts and acts["I"]["end_s"] <= t:  # between I and W: what W still needs, and its stash
            full = full - cost.input_grad_freed_bytes[stage] + cost.weight_stash_bytes[stage]
        held += full
    return held


@pytest.mark.parametrize("name", PLANS)
def test_predicted_activations_are_the_live_microbatches_of_the_schedule(name: str) -> None:
    prediction = _prediction(name)
    plan = prediction.plan
    assert plan.pp == 4 and len(plan.stages) == (4 if "unet" in name else 8)
    # without P2P buffers: exactly the live stage-micro-batches at the peak
    n = len(plan.stages)
    quiet = replace(prediction.cost, input_bytes=[0.0] * n, output_bytes=[0.0] * n,
                    edge_bytes=dict.fromkeys(prediction.cost.edge_bytes or {}, (0.0, 0.0)))
    result = simulate(plan.schedule, quiet)
    for rank in range(plan.pp):
        counted = _held_at(result.events, rank, result.peak_time_s[rank], quiet)
        assert result.peak_activation_bytes[rank] == pytest.approx(counted, rel=1e-9), (name, rank)
        assert counted > 0
    # with them: the peak adds at most one message of each edge per micro-batch in flight
    for rank in range(plan.pp):
        stages = {s.index for s in plan.stages if s.rank == rank}
        edges = sum(f + g for (a, b), (f, g) in (prediction.cost.edge_bytes or {}).items() if a in stages or b in stages)
        extra = prediction.result.peak_activation_bytes[rank] - result.peak_activation_bytes[rank]
        assert -1e-6 <= extra <= result.peak_activation_microbatches[rank] * edges + 1e-6, (name, rank, extra, edges)
        assert extra < 0.5 * prediction.result.peak_activation_bytes[rank], (name, rank)
    # the device table's activations are the simulator's peak
    assert [d.activations for d in prediction.devices] == prediction.result.peak_activation_bytes
