"""What one device holds at the schedule's peak, the quantity `memory.cap_bytes` caps.

A device (a pipeline rank) holds the parameters of all its stages, a gradient of the same size
for each, the optimizer's state (tensors per parameter by optimizer type: AdamW two, SGD with
momentum one, plain SGD none), and the activations its stages keep for their backward at the
busiest moment of the step, which the simulator finds by playing the schedule (a V or
interleaved rank holds two stages' micro-batches at once). A stage that recomputes chosen
modules (per-layer remat) also needs, during a backward, the activations of the one region it is
recomputing: the largest such region is added. So is the backward's workspace: while a node's
backward runs, the gradients of its saved tensors exist beside them (the largest node of the
device's stages is priced, e.g. an LM head's logits and their gradient), and a reserve for what
the process holds beyond the model's tensors once it trains (kernel scratch buffers, the autograd
thread's allocator arena, communication buffers: `memory.reserve_bytes`, measured about 50 MiB a
rank on this project's CPU runs).

After the backward the activations are gone, and the update holds its own temporaries: the
data-parallel all-reduce's flat copy of the gradients (dp > 1), then the optimizer step's
(`UpdateMemory`). A device's peak is the larger of the two phases above its parameters, gradients
and optimizer state: with many small micro-batches the update can be the larger.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.core.plan_records import MIB, DeviceMemory


@dataclass(frozen=True)
class UpdateMemory:
    """What prices the update's temporaries: per stage its largest parameter tensor (bytes), the
    optimizer's temporaries per byte (of the largest tensor, of all the rank's parameters:
    `optimizer_costs.optimizer_temporaries`), and the data-parallel degree (dp > 1 all-reduces the
    gradients through one flat copy of them)."""

    largest_param_bytes: Sequence[float] | None = None
    temporaries: tuple[float, float] = (0.0, 0.0)
    dp: int = 1

    def bytes(self, params: float, largest: float) -> float:
        per_largest, per_all = self.temporaries
        return max(per_largest * largest + per_all * params, params if self.dp > 1 else 0.0)


def device_memory(
    stage_param_bytes: Sequence[float],
    placement: Sequence[int],
    activation_peak: Sequence[float],
    states_per_param: int,
    recompute_bytes: Sequence[float] | None = None,
    workspace_bytes: Sequence[float] | None = None,
    reserve_bytes: float = 0.0,
    update: UpdateMemory | None = None,
) -> list[DeviceMemory]:
    """Per rank: the parameters of its stages (a parameter two of its stages share counts twice:
    a slight over-estimate), as much again in gradients, `states_per_param` times as much in
    optimizer state, the simulated activation peak, the largest region it recomputes, the largest
    backward workspace of its stages (per stage: its largest node's activations), the reserve,
    and the update's temporaries."""
    pp = max(placement) + 1
    params = [0.0] * pp
    for stage, rank in enumerate(placement):
        params[rank] += float(stage_param_bytes[stage])
    regions = list(recompute_bytes) if recompute_bytes is not None else [0.0] * len(placement)
    spaces = list(workspace_bytes) if workspace_bytes is not None else [0.0] * len(placement)

    def largest(values: list[float], rank: int) -> float:
        return max((float(values[s]) for s, rr in enumerate(placement) if rr == rank), default=0.0)

    update = update or UpdateMemory()
    tensors = list(update.largest_param_bytes) if update.largest_param_bytes else [0.0] * len(placement)
    return [DeviceMemory(r, params[r], params[r], states_per_param * params[r], float(activation_peak[r]),
                         largest(regions, r), largest(spaces, r), float(reserve_bytes),
                         update.bytes(params[r], largest(tensors, r)))
            for r in range(pp)]


def over_budget(devices: Sequence[DeviceMemory], cap: float | None) -> list[DeviceMemory]:
    """The devices whose predicted peak exceeds `cap` (none without a cap)."""
    return [] if cap is None else [d for d in devices if d.total > cap]


def budget_message(devices: Sequence[DeviceMemory], cap: float) -> str:
    """`rank 1 needs 41.2 MiB (params ... MiB) over the 40.0 MiB cap`, for each device over it."""
    return "; ".join(f"rank {d.rank} needs {d.total / MIB:.1f} MiB ({d.breakdown()}), over the "
                     f"{cap / MIB:.1f} MiB cap by {(d.total - cap) / MIB:.1f} MiB" for d in devices)


class BudgetExceeded(ConfigError):
    """A plan whose predicted peak on some device is over `memory.cap_bytes`; carries the devices
    and, when there is one, the prediction (the search lists the candidate with its step time)."""

    def __init__(self, devices: Sequence[DeviceMemory], cap: float, remedies: str, prediction: Any = None) -> None:
        self.devices, self.cap, self.prediction = list(devices), cap, prediction
        super().__init__("memory.cap_bytes", f"{budget_message(devices, cap)}. {remedies}")
