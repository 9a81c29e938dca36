"""The typed config of a run: what `python train.py ...` composes, as one object.

Hydra composes `conf/` against `TrainConfig` (registered in its ConfigStore by
`pipelaunch.launcher.config`), so a value of the wrong type or outside an Enum is refused at composition,
naming the key. The composed config becomes a `TrainConfig` instance (`OmegaConf.to_object`) that
flows unchanged through the launcher, the planner and every rank: nothing writes into it. Each
default is stated here once.

Plug-in groups (`model`, `data`, `scheduler`, `partitioner`, `placement`, `optimizer`,
`lr_scheduler`, `logger`) stay open mappings here: each option names its callable (by its import
path) and carries that callable's own arguments. Only the launcher reads them: it builds each into
a typed plug-in once (`pipelaunch.pipeline.core.plugins`), which is what the planner and the ranks
use. The fixed-shape groups (`memory`, `plan`, `eval`,
`checkpoint`, `debug`) are typed here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional, Union

from omegaconf import MISSING, OmegaConf

from pipelaunch.pipeline.core.errors import ConfigError

#: one option of a plug-in group as written: the callable's import path and its own arguments
PluginConfig = Mapping[str, Any]


class Choice(str, Enum):
    """An enum-like key: compares equal to its value and prints as it (`device=cuda`)."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class Device(Choice):
    auto = "auto"  # cuda where CUDA is available, else cpu
    cpu = "cpu"
    cuda = "cuda"


class Remat(Choice):
    """Activation recomputation (pipeline/planner/passes/remat.py, docs/planner.md "Recomputation")."""

    none = "none"
    selective = "selective"  # every block keeps its matmuls' outputs, reruns the attention core and elementwise work
    full = "full"  # every block keeps only its inputs and reruns its forward inside its backward
    stage = "stage"  # every stage keeps only its inputs and reruns whole before its backward (R actions)
    auto = "auto"  # under a memory cap: each block none, selective or full, the cheapest that fits


class Reshard(Choice):
    """zero=3: when a block's gathered parameters are released (docs/sharding.md "Units")."""

    use = "use"  # after each forward or backward of the block: one block (and the next) gathered
    run = "run"  # after the stage's run of consecutive actions: fewer gathers, the stage whole


class Mode(Choice):
    train = "train"
    plan = "plan"  # dry run: plan, simulate, draw; no ranks


class Precision(Choice):
    fp32 = "fp32"
    bf16 = "bf16"  # autocast for compute; weights, gradients and optimizer state stay fp32


class HostAllocator(Choice):
    retain = "retain"  # keep freed host memory for reuse: no page faults on every new activation
    system = "system"


class CpuAffinity(Choice):
    auto = "auto"  # bind each local rank to its own `threads` cores when they cover all ranks
    none = "none"


class CheckSplit(Choice):
    """Whether the launcher runs every rank's stages against the unsplit module before spawning.
    `true` and `false` (booleans to Hydra) are spellings of `always` and `never` (`check_split`)."""

    auto = "auto"  # when the model's parameters and buffers take at most 1 GiB (launcher/split_check.py)
    always = "always"
    never = "never"


def check_split_value(value: bool | str) -> str:
    """`check_split` as one of CheckSplit's values (a plain string, which compares equal to its
    member): `true` is `always`, `false` is `never`. Why not an Enum key: Hydra reads
    `check_split=false` as a boolean, which OmegaConf refuses for an Enum."""
    if isinstance(value, bool):
        return (CheckSplit.always if value else CheckSplit.never).value
    if value in CheckSplit.__members__:
        return CheckSplit[value].value
    raise ConfigError("check_split", f"got {value!r}; valid: auto, always, never, true (always), false (never)")


class InitWeights(Choice):
    """Where a run's initial weights come from (launcher/initial_weights.py)."""

    auto = "auto"  # constructor when the model's parameters and buffers take at most init.max_bytes
    constructor = "constructor"  # torch.manual_seed(seed); factory(), built once per node, read by name
    by_name = "by_name"  # each rank initialises its own stages' tensors by (seed, name): no full build


class Objective(Choice):
    """What a run returns to a Hydra sweeper, in metrics.json's unit."""

    tokens_per_s = "tokens_per_s"  # maximised
    step_time_s = "step_time_s"  # minimised, as are the two below
    loss = "loss"  # the final training loss
    eval_loss = "eval_loss"  # the last held-out loss; needs eval.every > 0


#: the direction a sweeper optimises each objective in
OBJECTIVE_DIRECTION = {"tokens_per_s": "maximize", "step_time_s": "minimize", "loss": "minimize",
                       "eval_loss": "minimize"}

#: the simulator's default link: seconds per message, bytes per second
LINK_LATENCY_S = 5e-5
LINK_BANDWIDTH = 1e9


@dataclass
class EvalConfig:
    #: a forward-only pass over held-out batches every this many steps (and after the last); 0 = never
    every: int = 0
    #: held-out batches per evaluation (each a full global batch of `batch_size` sequences)
    batches: int = 2


@dataclass
class CheckpointConfig:
    #: save every this many steps and at the end of the run; 0 = no checkpoints
    every: int = 0
    #: complete checkpoints kept (the oldest are deleted); 0 = keep all
    keep: int = 3
    #: where step_<N>/ directories go; null = <run dir>/checkpoints (the launcher fills it in)
    dir: str | None = None


@dataclass
class InitConfig:
    """`init.*`: the weights a run starts from (pretrained weights and checkpoints override them)."""

    weights: InitWeights = InitWeights.auto
    #: init.weights=auto builds the model on the CPU when its parameters and buffers take at most
    #: this many bytes (16 GiB: 4 billion fp32 parameters), else initialises by name
    max_bytes: float = 16 * 2**30


@dataclass
class DebugConfig:
    """Fault injection, for testing the launcher's failure handling (never set in real runs)."""

    #: this global rank kills itself with SIGKILL at the start of step `kill_step`
    kill_rank: int | None = None
    kill_step: int | None = None
    #: this global rank stops answering (sleeps for good) at the start of step `hang_step`
    hang_rank: int | None = None
    hang_step: int | None = None
    #: log each rank's P2P posting order (first training step and first evaluation) and check, at
    #: the end, that every pair's k-th messages complement each other, as NCCL needs (tags are 0)
    record_p2p: bool = False


@dataclass
class MoEConfig:
    """Mixtures of experts: expert parallelism (ep > 1), token dropping, the routers' bias update
    (docs/moe.md)."""

    #: DualPipeV's overlap: a forward and the backward of another stage beside it run as a pair,
    #: each one's all-to-alls in flight while the other computes (runtime/overlap.py); false: one
    #: action at a time, for comparison
    overlap: bool = True
    #: token dropping as GShard and Switch do (model=gpt): each expert takes at most
    #: ceil(capacity_factor x tokens x top_k / experts) of a layer's routed slots per micro-batch,
    #: first choices before second ones, earlier tokens first; null: dropless
    capacity_factor: Optional[float] = None  # noqa: UP045 - OmegaConf reads typing.Optional
    #: DeepSeek-V3's auxiliary-loss-free balancing (model=gpt with model.router=sigmoid, transformers'
    #: DeepSeek-V3's gates): after each
    #: optimizer step every expert's routing correction bias moves by this much, down if the expert
    #: got more than the mean tokens per expert over the step's global batch, up if fewer
    #: (DeepSeek-V3 trains with 0.001); null or 0: the bias is never moved
    bias_update_rate: Optional[float] = None  # noqa: UP045 - OmegaConf reads typing.Optional


@dataclass
class MemoryConfig:
    """`memory=unlimited|budget`: the per-device budget the planner fits the plan under."""

    #: bytes one device may hold (parameters, gradients, optimizer state, activations); null = no cap
    cap_bytes: float | None = None
    #: what a rank holds beyond the model's tensors (runtime, allocator slack), set aside from the cap
    reserve_bytes: float = 50e6


@dataclass
class PlanConfig:
    """`plan=manual|auto`: whether the planner searches schedule, partition, micro-batches and
    recomputation jointly (auto), and over what (conf/plan/auto.yaml explains each key)."""

    search: bool = False
    #: scheduler options to try; null = every training schedule of the scheduler group
    schedulers: list[str] | None = None
    #: per scheduler option, settings to try each value of (e.g. stages_per_rank: [2, 4])
    variants: dict[str, dict[str, list[Any]]] = field(default_factory=dict)
    #: partitioner options to try (conf/plan/auto.yaml lists them); null = the run's own partitioner
    partitioners: list[str] | None = None
    #: micro-batch counts to try; null = pp, 2pp, 4pp, 8pp and the configured count
    microbatches: list[int] | None = None
    #: remat values to try; null = none and auto (auto only under a memory cap)
    remat: list[Remat] | None = None
    #: data-parallel sharding levels (`zero`) to try; null = the configured level only
    zero: list[int] | None = None
    #: at zero=3, the release points (`reshard`) to try; null = the configured one only
    reshard: list[Reshard] | None = None
    #: candidates predicted within this share of the fastest count as tied
    tie: float = 0.0
    #: devices (ranks) the run has: the search also tries every layout pp x dp == devices (the
    #: configured pp and dp are then ignored); null = the configured pp and dp only
    devices: Optional[int] = None  # noqa: UP045 - OmegaConf reads typing.Optional
    #: under plan.devices, the tensor-parallel degrees tried (each layout pp x dp x tp == devices);
    #: null: every divisor of plan.devices up to a node's 8 devices that divides what the model's
    #: plan splits (tp=1 alone for a model without a plan); without plan.devices, the configured tp
    tp: Optional[list[int]] = None  # noqa: UP045 - OmegaConf reads typing.Optional
    #: under plan.devices on a model with routed experts, the expert-parallel degrees tried (each
    #: dividing the layout's dp and the experts, at tp=1); null: every power of two up to
    #: min(dp, experts) that does; without plan.devices, the configured ep
    ep: Optional[list[int]] = None  # noqa: UP045 - OmegaConf reads typing.Optional
    #: under plan.devices on a model that splits its positions (model=gpt), the context-parallel
    #: degrees tried (each layout pp x dp x tp x cp == devices); null: under mode=plan every power
    #: of two up to 32 whose 2 x cp chunks divide the sequence, each rank keeping 8192 positions or
    #: more (cp=1 alone at 8192 or fewer), in a search that trains the configured cp
    cp: Optional[list[int]] = None  # noqa: UP045 - OmegaConf reads typing.Optional
    #: how many candidates are planned and simulated in full, the most promising by a closed-form
    #: estimate (search/screen.py); null: with a hardware file every one up to 64 candidates, beyond
    #: that until 3 fit; on this machine (hardware=local) every one
    simulate: Optional[int] = None  # noqa: UP045 - OmegaConf reads typing.Optional


@dataclass
class TrainConfig:
    model: dict[str, Any] = MISSING
    data: dict[str, Any] = MISSING
    scheduler: dict[str, Any] = MISSING
    partitioner: dict[str, Any] = MISSING
    placement: dict[str, Any] = MISSING
    optimizer: dict[str, Any] = MISSING
    lr_scheduler: dict[str, Any] = MISSING
    logger: dict[str, Any] = MISSING
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    #: the device the planner prices (`hardware=<name>`, conf/hardware): `local` measures this
    #: machine (the profile); a hardware file's figures price every layer and link analytically
    hardware: dict[str, Any] = field(default_factory=lambda: {"name": "local"})
    plan: PlanConfig = field(default_factory=PlanConfig)
    #: pipeline-parallel degree: ranks per pipeline (not used under plan.devices: the search chooses it)
    pp: int = 2
    #: data-parallel degree: number of pipeline replicas (not used under plan.devices either)
    dp: int = 1
    #: what the dp replicas of a stage shard among themselves (FSDP2 over the replicas): 0 nothing
    #: (each holds everything, gradients all-reduced), 1 the optimizer states, 2 the gradients too,
    #: 3 the parameters too (each block gathered ahead of its use, released after: `reshard`)
    zero: int = 0
    #: under zero >= 1, how many replicas a sharded tensor is split over (a divisor of dp); the
    #: groups of that many replicate one another (hybrid sharding, HSDP: shard within a node,
    #: replicate across nodes). null: all dp replicas
    dp_shard: Optional[int] = None  # noqa: UP045 - OmegaConf reads typing.Optional
    #: at zero=3, when a block's gathered parameters are released: `use` (after each forward or
    #: backward of it, the next block prefetched) or `run` (after the stage's run of consecutive
    #: actions: fewer gathers, the whole stage gathered by the end of its forward)
    reshard: Reshard = Reshard.use
    #: what the replicas' collectives move together at least: consecutive blocks of a stage join
    #: until they hold this many bytes; 0: one per block; more than a stage holds: the stage as one;
    #: null: DDP's 25 MB at zero=0, one per block at zero >= 1 (FSDP's per-block units)
    dp_bucket_bytes: Optional[float] = None  # noqa: UP045 - OmegaConf reads typing.Optional
    #: tensor-parallel degree: each pipeline rank's stages split over this many ranks (consecutive
    #: ranks: one node's GPUs), Megatron-style (the model's own plan: `model.tp_plan`)
    tp: int = 1
    #: expert-parallel degree: each mixture-of-experts layer's routed experts split over this many
    #: replicas (ep divides dp; the ranks holding the same experts reduce their gradients together)
    ep: int = 1
    #: context-parallel degree: every sequence split over this many ranks along its positions (each
    #: a head and a tail chunk: the causal balance), attention over the group (`cp_method`);
    #: pipeline/compute/context_parallel.py. Gradients reduce over dp x cp
    cp: int = 1
    #: how attention crosses the cp ranks: `ring` (keys and values round the ring) or `alltoall`
    #: (DeepSpeed-Ulysses: an all-to-all over heads, which must divide by cp)
    cp_method: str = "ring"
    #: under tp > 1, Megatron's sequence parallelism: between the split regions (norms, dropout,
    #: residual adds, stage boundaries) each tp rank keeps 1/tp of the positions; all-gathers and
    #: reduce-scatters take the place of the all-reduces (pipeline/graph/sequence_parallel.py)
    sequence_parallel: bool = False
    #: micro-batches per step in each replica
    microbatches: int = 4
    #: the global batch (sequences per optimizer step), the same whatever pp and dp are
    batch_size: int = 16
    steps: int = 10
    #: steps excluded from timing (the first ones pay for allocation and warm caches)
    warmup_steps: int = 2
    seed: int = 0
    init: InitConfig = field(default_factory=InitConfig)
    device: Device = Device.auto
    remat: Remat = Remat.none
    mode: Mode = Mode.train
    #: what the run returns to a Hydra sweeper (Optuna, Nevergrad, Ax); a dry run (mode=plan)
    #: returns the planned step_time_s or tokens_per_s; a failed job in a multirun returns what its
    #: sweeper counts as a failed trial (launcher/app.py failed_value)
    objective: Objective = Objective.tokens_per_s
    #: before spawning, run every rank's stages against the unsplit module on one micro-batch and
    #: refuse the run when a tensor differs (launcher/split_check.py); auto: models up to 1 GiB;
    #: also true (always) and false (never), normalised to a CheckSplit value (`check_split_value`)
    check_split: Union[bool, str] = CheckSplit.auto.value  # noqa: UP007 - OmegaConf reads typing.Union
    #: profile and simulate the plan before training even when nothing else needs it, so that the
    #: run reports the predicted step and per-device peak beside the measured ones
    predict: bool = False
    #: print a line every this many steps on rank 0
    log_every: int = 1
    #: seconds any collective or P2P wait may take before the job fails
    timeout_s: int = 120
    #: CPU threads per rank; 0 = cores / local ranks, at least 1
    threads: int = 0
    host_allocator: HostAllocator = HostAllocator.retain
    #: back rank heaps with transparent huge pages (glibc tunable, set for the ranks the launcher spawns)
    huge_pages: bool = True
    cpu_affinity: CpuAffinity = CpuAffinity.auto
    #: clip gradients to this global norm (over every parameter of the model, tied ones once); null = off
    clip_grad_norm: float | None = None
    precision: Precision = Precision.fp32
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    #: none | auto (the latest complete checkpoint under checkpoint.dir) | a step_<N> directory
    resume: str = "none"
    debug: DebugConfig = field(default_factory=DebugConfig)
    #: link model for the simulator's predictions (seconds per message, bytes per second); a
    #: null latency is measured on CPU/gloo once per machine (`pipelaunch.pipeline.planner.measure.overheads`), and is
    #: LINK_LATENCY_S on a GPU
    link_latency_s: float | None = None
    link_bandwidth: float = LINK_BANDWIDTH
    #: the link between the tp ranks of a pipeline rank (one node's: NVLink on GPUs), priced for
    #: tensor parallelism's all-reduces; null: link_latency_s and link_bandwidth
    tp_link_latency_s: float | None = None
    tp_link_bandwidth: float | None = None
    #: the runtime's fixed seconds per compute action, priced by the predictions; null: measured
    #: with the latency on CPU, 0 on a GPU
    action_overhead_s: float | None = None

    def __post_init__(self) -> None:
        self.check_split = check_split_value(self.check_split)

    @property
    def link(self) -> tuple[float, float]:
        """The link model as configured, LINK_LATENCY_S standing for a latency left to measure
        (the Plan carries the one its predictions used: `PlanMeta.link_latency_s`)."""
        return (LINK_LATENCY_S if self.link_latency_s is None else self.link_latency_s), self.link_bandwidth

    @property
    def world_size(self) -> int:
        """The ranks this run starts: pp x dp x cp x tp, or `plan.devices` when plan=auto chooses the layout
        (every layout it tries has that many: the threads per rank and the cores they share
        follow from it before the search has chosen pp and dp)."""
        return self.plan.devices if self.plan.devices is not None else self.pp * self.dp * self.cp * self.tp

    def to_dict(self) -> dict:
        """Plain data (enums as their values): metrics.json's `config`, wandb's run config."""
        return OmegaConf.to_container(OmegaConf.structured(self), enum_to_str=True)
