"""A 70B-class Llama at pp=8 dp=8, simulated: each device's peak and the step, with a stage as one
sharding unit (before #43) and with one unit per block, per sharding level.

    python bench/block_units.py                        # 50 GB/s per GPU between the replicas (400 Gb/s NICs)
    python bench/block_units.py --bandwidth 450e9      # the replicas inside one node (NVLink)
    python bench/block_units.py --schedule zbv --microbatches 32

Why: with a stage as one FSDP unit, zero=3 gathers the whole stage for its compute and zero >= 2
reduce-scatters its whole gradients at once, so at the moment that counts a rank holds its stage
unsharded: for a 70B model at pp=8 about 8.8B parameters. Cut into blocks (pipeline/graph/units.py),
a rank holds one or two of them. Priced by the planner's own models: the memory model
(predict/memory.py `device_memory`, `Sharding.window`) on the simulator's activation peak, and the
collectives inside the compute actions (predict/data_parallel.py) on the simulated step.

The profile is analytic (no hardware here), from the model's published shape, Llama-3-70B: 80
layers, hidden 8192, MLP 28672, 64 query and 8 key/value heads, vocabulary 128256, untied embedding
and head; sequences of 4096 tokens, one per micro-batch. Per block 855.6M parameters; a layer's
forward 2 x params x tokens + 2 x tokens^2 x hidden (causal attention) FLOPs at `--flops` achieved
(default 400e12: about 40% of an H100's dense bf16 peak), its input-gradient and weight-gradient
halves as long again each; the head 2 x 1.05B x tokens. Activations per layer and micro-batch:
34 x tokens x hidden bytes (Megatron's count for bf16 with flash attention), which at pp=8 does not
fit 80 GB without recomputation: every stage recomputes (remat=full: only its input is held between
forward and backward, the recompute costs a forward). AdamW (two fp32 states), bf16 compute with fp32
master weights and reductions (FSDP2's policy); `memory.reserve_bytes` 0.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipelaunch.launcher.config import group_configs  # noqa: E402
from pipelaunch.launcher.plugins import build_plugin  # noqa: E402
from pipelaunch.pipeline.core.plan_records import UnitCost  # noqa: E402
from pipelaunch.pipeline.planner.passes.data_parallel import place_data_parallel  # noqa: E402
from pipelaunch.pipeline.planner.placement import placement_for  # noqa: E402
from pipelaunch.pipeline.planner.predict.data_parallel import Collectives, Sharded, data_parallel_step  # noqa: E402
from pipelaunch.pipeline.planner.predict.memory import Sharding, device_memory  # noqa: E402
from pipelaunch.pipeline.planner.predict.simulate import CostModel, simulate  # noqa: E402
from pipelaunch.pipeline.planner.schedules import build_schedule  # noqa: E402

GB = 1e9
LAYERS, HIDDEN, MLP, HEADS, KV_HEADS, VOCAB, TOKENS = 80, 8192, 28672, 64, 8, 128256, 4096


def layer_params() -> float:
    kv = HIDDEN * HIDDEN // HEADS * KV_HEADS
    return 2 * HIDDEN * HIDDEN + 2 * kv + 3 * HIDDEN * MLP + 2 * HIDDEN


def stage_units(pp: int, flops: float) -> list[list[UnitCost]]:
    """Per stage its blocks (fp32 bytes of the shards' basis) with their analytic times."""
    per = LAYERS // pp
    f_layer = (2 * layer_params() * TOKENS + 2 * TOKENS * TOKENS * HIDDEN) / flops
    layer = UnitCost("layer", 4 * layer_params(), f_layer, 2 * f_layer, f_layer, f_layer)
    embed = UnitCost("embed_tokens", 4.0 * VOCAB * HIDDEN, 1e-4, 2e-4, 1e-4, 1e-4)
    f_head = 2 * VOCAB * HIDDEN * TOKENS / flops
    head = UnitCost("norm+lm_head", 4.0 * (VOCAB * HIDDEN + HIDDEN), f_head, 2 * f_head, f_head, f_head)
    stages = [[UnitCost(f"layers.{s * per + k}", *_fields(layer)) for k in range(per)] for s in range(pp)]
    stages[0].insert(0, embed)
    stages[-1].append(head)
    return stages


def _fields(u: UnitCost) -> tuple:
    return u.param_bytes, u.forward_s, u.backward_s, u.backward_input_s, u.backward_weight_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pp", type=int, default=8)
    parser.add_argument("--dp", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=16)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--flops", type=float, default=400e12, help="achieved FLOP/s per GPU")
    parser.add_argument("--bandwidth", type=float, default=50e9, help="bytes/s per GPU on the replicas' links")
    parser.add_argument("--latency", type=float, default=10e-6, help="seconds per ring hop")
    args = parser.parse_args()
    gen = build_plugin("scheduler", group_configs("scheduler")[args.schedule], args.schedule)()
    placement = placement_for(gen, args.pp)
    n = len(placement)
    units = stage_units(n, args.flops)
    schedule = build_schedule(gen, placement, args.microbatches, remat="stage")
    act = 34.0 * TOKENS * HIDDEN * (LAYERS // n)
    cost = CostModel([sum(u.forward_s for u in us) for us in units],
                     [sum(u.backward_input_s for u in us) for us in units],
                     [sum(u.backward_weight_s for u in us) for us in units],
                     activation_bytes=[act] * n, input_bytes=[2.0 * TOKENS * HIDDEN] * n,
                     output_bytes=[2.0 * TOKENS * HIDDEN] * n, latency_s=args.latency, bandwidth_bytes_per_s=args.bandwidth)
    result = simulate(schedule, cost)
    stage_bytes = [sum(u.param_bytes for u in us) for us in units]
    links = Collectives(args.dp, args.latency, args.bandwidth)
    print(f"Llama-3-70B-class ({(LAYERS * layer_params() + 2 * VOCAB * HIDDEN) / 1e9:.1f}B parameters), "
          f"pp={args.pp} dp={args.dp}, {args.schedule}, {args.microbatches} micro-batches of {TOKENS} tokens, "
          f"remat=full, bf16 compute, AdamW; {args.flops / 1e12:.0f} TFLOP/s, {args.bandwidth / 1e9:.0f} GB/s between "
          f"replicas; a stage holds {max(stage_bytes) / 4 / 1e9:.2f}B parameters, a block {layer_params() / 1e9:.2f}B")
    print(f"compute-only step (simulated): {result.makespan_s:.2f} s; activations at the peak "
          f"{max(result.peak_activation_bytes) / GB:.1f} GB\n")
    print("| level | units | fullest device, GB (params + grads + optim + activations + gathered) | step s |")
    print("|---|---|---|---:|")
    for zero, reshard in ((1, "use"), (2, "use"), (3, "use"), (3, "run")):
        for label, cut in (("stage", [[UnitCost("stage", b, 1.0, 1.0, 1.0, 1.0)] for b in stage_bytes]),
                           ("block", units)):
            sharding = Sharding(zero, args.dp, "bf16", reshard, keeps_reduce_input=True)
            devices = device_memory(stage_bytes, placement, result.peak_activation_bytes, 2, sharding=sharding,
                                    units=[([u.param_bytes for u in us], 0.0) for us in cut])
            full = max(devices, key=lambda d: d.total)
            placed = place_data_parallel(schedule, zero, args.dp)
            spans = simulate(placed, cost, memory=False).compute_spans
            priced = data_parallel_step(placed, spans, Sharded(zero, cut, reshard, sharding.compute_bytes), None, links)
            step = max(e[-1][1] + g + t for e, g, t in zip(spans, priced.gather_s, priced.tail_s, strict=True))
            parts = " + ".join(f"{x / GB:.1f}" for x in (full.params, full.grads, full.optimizer, full.activations,
                                                           full.gathered))
            name = f"zero={zero}" + (f" reshard={reshard}" if zero == 3 else "")
            print(f"| {name} | {label} | {full.total / GB:.1f} ({parts}) | {step:.2f} |")


if __name__ == "__main__":
    main()
