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

Data-parallel sharding (`zero`, `Sharding`; docs/sharding.md "What each level holds"): with P the
parameter bytes of a rank's stages, R of them held by several stages (tied weights: replicated at
every level, counted whole), S = P - R the sharded part, k the optimizer's states per parameter,
d = dp at zero >= 1 (1 at zero=0), own = S/d + R::

    level   params      grads       optimizer   gathered (in the backward phase)
    0       P           P           kP          0
    1       P           P           k own       a unit's reduce-scatter input
    2       P           own         k own       a unit's gradients and their reduce-scatter input
    3       own         own         k own       two units and the root gathered, a unit's gradients

The gathered column is a stage's units (pipeline/graph/units.py: a block each), not the stage:
`Sharding.window` spells it out per level and `reshard`, for the stage whose window is largest,
beside the last reduce-scatter input each other stage of the rank keeps on a GPU at zero >= 2 (FSDP2's
`reduce_scatter_states`, until the stage's next reduction; at zero=1 a stage reduces once, at its
last backward, and the runtime drops the input there; on a CPU gloo has finished with it and the
runtime drops it at once). At zero=1
and 2 the parameters are gathered whole for the step; in fp32 the runtime returns the shards'
memory meanwhile (FSDP2 keeps a shard beside its gathered parameter: S/d more) and refills them from
the whole ones at the release. Under precision=bf16 the gathered parameters and the gradients
autograd computes are bf16 copies (half the bytes: `Sharding.compute_bytes`) and the reduce-scatter
input fp32; the params column then counts the fp32 shards beside the bf16 whole, S/d + c S + R (P at
dp=2, less from there: 2.25 bytes a parameter at dp=16).

At zero >= 1 the update holds no flat all-reduce copy and the optimizer's temporaries scale with
the shard (of the largest tensor, largest/d; of all, own). The step's collectives are priced by
`predict.data_parallel`. A partitioner pricing one stage alone on its device counts each parameter
byte `Sharding.stage_factor` times (`fit.budget.device_view`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.core.plan_records import MIB, DeviceMemory
from pipelaunch.pipeline.core.precision import PRECISIONS


@dataclass(frozen=True)
class Sharding:
    """The data-parallel sharding level (`zero`, 0..3, ZeRO's vocabulary) over `dp` replicas: what
    a device holds of its stages' parameters, gradients and optimizer state (the module's table),
    and what a stage holds unsharded while its blocks compute (`window`). The one formula the
    prediction and the partitioners' cap both price."""

    zero: int = 0
    dp: int = 1
    #: `precision`: under bf16, FSDP2 gathers and computes with bf16 copies of the parameters
    #: (runtime/sharding.py `mixed_precision`) while shards, states and reductions stay fp32
    precision: str = "fp32"
    #: zero=3: when a unit's gathered parameters are released (`use` or `run`)
    reshard: str = "use"
    #: the device keeps each stage's last reduce-scatter input until its next (FSDP2 on a GPU,
    #: so that its allocator does not reuse it while the reduce stream reads it); on a CPU gloo's
    #: reduce-scatter has returned and the runtime drops it
    keeps_reduce_input: bool = False

    @property
    def compute_bytes(self) -> float:
        """A gathered parameter's (or its unreduced gradient's) bytes per byte of its fp32 shard."""
        dtype = PRECISIONS[self.precision]
        return 1.0 if dtype is None else dtype.itemsize / 4.0

    @property
    def degree(self) -> int:
        """How many replicas share a sharded tensor: dp at zero >= 1, else 1."""
        return max(1, int(self.dp)) if self.zero > 0 else 1

    def held(self, sharded: float, replicated: float, states: int) -> tuple[float, float, float]:
        """(params, grads, optimizer) bytes a device holds through the step for `sharded` parameter
        bytes it shares with the other replicas and `replicated` ones it keeps whole (tied). At
        zero=1 and 2 the parameters are gathered whole for the step: in fp32 the shards' memory is
        returned meanwhile (runtime/sharding.py); under bf16 the fp32 shards stay beside the bf16
        whole, S/d + c S (the fp32 whole at dp=2, 2.25 bytes a parameter at dp=16)."""
        whole = sharded + replicated
        own = sharded / self.degree + replicated
        c = self.compute_bytes
        gathered = sharded / self.degree + c * sharded + replicated if c < 1 and self.degree > 1 else whole
        return (own if self.zero >= 3 else gathered if self.zero >= 1 else whole, own if self.zero >= 2 else whole,
                states * (own if self.zero >= 1 else whole))

    def window(self, units: Sequence[float], root: float = 0.0) -> float:
        """What one stage holds unsharded at the fullest moment of its backward, beside the shards
        (docs/sharding.md "Units"), for its units' sharded bytes and its root unit's. With U1 and U2
        the largest two units, R the root, c the compute dtype's bytes per fp32 byte and k one unit's
        kept reduce-scatter input where the device keeps it:

        - zero=1: the last backward's reduce-scatter input of a unit (fp32) and the kept one: U1 + k;
        - zero=2: a unit's gradients and their reduce-scatter input, the kept one, the root's
          gradients: c U1 + U1 + k + c R;
        - zero=3, reshard=use: the unit computing, the next one prefetched and the root gathered,
          the unit's and the root's gradients, and the kept input or, once the unit is released,
          its reduce-scatter input: c (U1 + U2 + R) + c (U1 + R) + max(k, U1 - c U1);
        - zero=3, reshard=run: the whole stage gathered (S = the units and the root), a unit's
          gradients and their reduce-scatter input: c S + c (U1 + R) + U1."""
        if self.degree <= 1 or self.zero == 0:
            return 0.0
        c = self.compute_bytes
        sizes = sorted((float(u) for u in units), reverse=True) + [0.0, 0.0]
        u1, u2, root = sizes[0], sizes[1], float(root)
        kept = u1 if self.keeps_reduce_input else 0.0
        if self.zero == 1:
            return u1 + kept
        if self.zero == 2:
            return c * u1 + u1 + kept + c * root
        if self.reshard == "run":
            return c * (sum(units) + root) + c * (u1 + root) + u1
        return c * (u1 + u2 + root) + c * (u1 + root) + max(kept, u1 - c * u1)

    def kept(self, units: Sequence[float]) -> float:
        """What a stage keeps between its reductions while the rank's other stages compute: its
        last reduce-scatter input (one unit's, on a device that keeps it) at zero >= 2, which
        reduces after every micro-batch. At zero=1 nothing: its one reduction of the step ends its
        last backward, where the runtime waits for it and drops the input (runtime/sharding.py
        `finish_backward`)."""
        if self.degree <= 1 or self.zero < 2 or not self.keeps_reduce_input:
            return 0.0
        return max((float(u) for u in units), default=0.0)

    def gathered(self, stages: Sequence[tuple[Sequence[float], float]]) -> float:
        """What a device holds unsharded in the backward phase: the fullest `window` of its stages
        (`stages`: each stage's (units, root)), beside the kept reduce-scatter inputs of the others."""
        if not stages or self.degree <= 1 or self.zero == 0:
            return 0.0
        windows = [self.window(units, root) for units, root in stages]
        kept = [self.kept(units) for units, _ in stages]
        fullest = max(range(len(stages)), key=windows.__getitem__)
        return windows[fullest] + sum(k for i, k in enumerate(kept) if i != fullest)

    def stage_factor(self, states: int) -> float:
        """Bytes per parameter byte of a stage alone on its device (the partitioners' view, before
        the split and so its units exist): what it holds through the step, and at zero=3 with
        reshard=run its whole parameters gathered. A unit's window is a few blocks, priced once
        the split exists (`device_memory`)."""
        run = self.compute_bytes if self.zero == 3 and self.reshard == "run" and self.degree > 1 else 0.0
        return sum(self.held(1.0, 0.0, states)) + run


@dataclass(frozen=True)
class UpdateMemory:
    """What prices the update's temporaries: per stage its largest parameter tensor (bytes), the
    optimizer's temporaries per byte (of the largest tensor, of all the rank's parameters:
    `optimizer_costs.optimizer_temporaries`), and the data-parallel degree (dp > 1 all-reduces the
    gradients through one flat copy of them, unless they are sharded)."""

    largest_param_bytes: Sequence[float] | None = None
    temporaries: tuple[float, float] = (0.0, 0.0)
    dp: int = 1

    def bytes(self, params: float, largest: float, shard: int = 1) -> float:
        """For `params` bytes the optimizer steps (a shard of them when `shard` > 1: no flat copy,
        the largest tensor's temporaries scaled by 1/shard)."""
        per_largest, per_all = self.temporaries
        flat = params if self.dp > 1 and shard == 1 else 0.0
        return max(per_largest * largest / shard + per_all * params, flat)


def rank_param_bytes(stage_param_bytes: Sequence[float], placement: Sequence[int]) -> list[float]:
    """Per pipeline rank, the parameter bytes of its stages (a tensor two of them share, twice)."""
    params = [0.0] * (max(placement) + 1)
    for stage, rank in enumerate(placement):
        params[rank] += float(stage_param_bytes[stage])
    return params


def device_memory(
    stage_param_bytes: Sequence[float],
    placement: Sequence[int],
    activation_peak: Sequence[float],
    states_per_param: int,
    recompute_bytes: Sequence[float] | None = None,
    workspace_bytes: Sequence[float] | None = None,
    reserve_bytes: float = 0.0,
    update: UpdateMemory | None = None,
    sharding: Sharding | None = None,
    replicated_bytes: Sequence[float] | None = None,
    units: Sequence[tuple[Sequence[float], float]] | None = None,
    expert_bytes: Sequence[float] | None = None,
    expert_replicas: int = 1,
) -> list[DeviceMemory]:
    """Per rank: the parameters of its stages (a parameter two of its stages share counts twice:
    a slight over-estimate), their gradients and `states_per_param` times their bytes in optimizer
    state as `sharding` leaves them (`replicated_bytes`, per stage: its tied parameters, never
    sharded), what its stages hold unsharded while their units compute (`units`, per stage: its
    units' sharded bytes and its root unit's; by default the stage as one unit), the simulated
    activation peak, the largest region it recomputes, the largest backward workspace of its stages
    (per stage: its largest node's activations), the reserve, and the update's temporaries.
    `expert_bytes` (per stage, under ep > 1: its share of one ep rank's routed experts) are held as
    `sharding` holds the rest, over the `expert_replicas` (dp / ep) ranks holding the same experts
    in place of all dp: whole at ep = dp, as the runtime holds them."""
    sharding = sharding or Sharding()
    n = len(placement)
    whole = rank_param_bytes(stage_param_bytes, placement)
    replicated = rank_param_bytes(replicated_bytes if replicated_bytes is not None else [0.0] * n, placement)
    experts = rank_param_bytes(expert_bytes if expert_bytes is not None else [0.0] * n, placement)
    by_replicas = replace(sharding, dp=max(1, expert_replicas))
    sharded = [float(stage_param_bytes[s]) - (float(replicated_bytes[s]) if replicated_bytes is not None else 0.0)
               - (float(expert_bytes[s]) if expert_bytes is not None else 0.0) for s in range(n)]
    stage_units = list(units) if units is not None else [([sharded[s]], 0.0) for s in range(n)]
    regions = list(recompute_bytes) if recompute_bytes is not None else [0.0] * n
    spaces = list(workspace_bytes) if workspace_bytes is not None else [0.0] * n

    def largest(values: Sequence[float], rank: int) -> float:
        return max((float(values[s]) for s, rr in enumerate(placement) if rr == rank), default=0.0)

    update = update or UpdateMemory()
    tensors = list(update.largest_param_bytes) if update.largest_param_bytes else [0.0] * n
    out = []
    for r in range(len(whole)):
        rest = whole[r] - replicated[r] - experts[r]
        params, grads, optimizer = (a + b for a, b in zip(sharding.held(rest, replicated[r], states_per_param),
                                                          by_replicas.held(experts[r], 0.0, states_per_param),
                                                          strict=True))
        # the bytes the optimizer steps
        stepped = sharding.held(rest, replicated[r], 1)[2] + by_replicas.held(experts[r], 0.0, 1)[2]
        mine = [stage_units[s] for s, rr in enumerate(placement) if rr == r]
        out.append(DeviceMemory(r, params, grads, optimizer, float(activation_peak[r]), largest(regions, r),
                                largest(spaces, r), float(reserve_bytes),
                                update.bytes(stepped, largest(tensors, r), sharding.degree),
                                sharding.gathered(mine)))
    return out


def over_budget(devices: Sequence[DeviceMemory], cap: float | None) -> list[DeviceMemory]:
    """The devices whose predicted peak exceeds `cap` (none without a cap)."""
    return [] if cap is None else [d for d in devices if d.total > cap]


def budget_message(devices: Sequence[DeviceMemory], cap: float) -> str:
    """`rank 1 needs 41.2 MiB (params ... MiB) over the 40.0 MiB cap`, for each device over it (the
    three fullest, and how many more, when more than four are)."""
    shown = list(devices) if len(devices) <= 4 else sorted(devices, key=lambda d: -d.total)[:3]
    text = "; ".join(f"rank {d.rank} needs {d.total / MIB:.1f} MiB ({d.breakdown()}), over the "
                     f"{cap / MIB:.1f} MiB cap by {(d.total - cap) / MIB:.1f} MiB" for d in shown)
    return text if len(shown) == len(devices) else f"{text}; and {len(devices) - len(shown)} more ranks over it"


class BudgetExceeded(ConfigError):
    """A plan whose predicted peak on some device is over `memory.cap_bytes`; carries the devices
    and, when there is one, the prediction (the search lists the candidate with its step time)."""

    def __init__(self, devices: Sequence[DeviceMemory], cap: float, remedies: str, prediction: Any = None) -> None:
        self.devices, self.cap, self.prediction = list(devices), cap, prediction
        super().__init__("memory.cap_bytes", f"{budget_message(devices, cap)}. {remedies}")
