"""Hardware facts as one typed record: what an analytic prediction knows about a device and its
links, read from `conf/hardware/<name>.yaml` (datasheet values with their sources, or a file
`python -m pipelaunch.pipeline.planner.measure.calibrate` wrote on the device itself).

Why a record and not loose numbers: every prediction must say where its figures came from (a
datasheet, a calibration on a date), and the same facts feed the roofline of each traced node,
the links a collective crosses and the memory a device holds.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from pipelaunch.pipeline.core.errors import ConfigError

#: where the hardware files live
HARDWARE_DIR = Path(__file__).resolve().parents[2] / "conf" / "hardware"


@dataclass(frozen=True)
class Link:
    """A link class: bytes per second per device and direction, and the latency of one message."""

    name: str
    bandwidth: float
    latency_s: float


@dataclass(frozen=True)
class Hardware:
    """One device kind and the node it sits in."""

    name: str
    device_name: str
    devices_per_node: int
    memory_bytes: float
    #: HBM bytes per second (the datasheet's)
    memory_bandwidth: float
    #: dense peak FLOP/s per dtype (bf16, fp16, tf32, fp32)
    peak_flops: Mapping[str, float]
    #: the fraction of the peak a large matmul reaches, per dtype
    matmul_efficiency: Mapping[str, float]
    #: the fraction of the bandwidth a memory-bound op reaches
    memory_efficiency: float
    #: the floor under any kernel (a launch)
    launch_s: float
    intra_node: Link
    inter_node: Link
    #: what a device holds beyond the model's tensors (CUDA context, NCCL buffers, allocator slack)
    reserve_bytes: float = 0.0
    sources: Mapping[str, str] = field(default_factory=dict)
    #: "<device>, <date>" when the efficiencies were measured on the device; None: datasheet only
    calibrated: str | None = None
    #: the figures the run set apart from its file (`hardware.memory_bytes=1e13` on the command
    #: line), as `key=value`: a prediction says it was made on them
    overrides: tuple[str, ...] = ()

    def matmul_flops(self, dtype: str) -> float:
        """FLOP/s a large matmul in `dtype` reaches: the peak times its efficiency."""
        if dtype not in self.peak_flops:
            raise ConfigError("hardware", f"{self.name} lists no peak for {dtype}; its file gives "
                                          f"{', '.join(self.peak_flops)}")
        return self.peak_flops[dtype] * self.matmul_efficiency.get(dtype, 1.0)

    def bytes_per_s(self) -> float:
        """Bytes per second a memory-bound op moves."""
        return self.memory_bandwidth * self.memory_efficiency

    def links(self, pp: int, dp: int, tp: int) -> tuple[Link, Link]:
        """(pipeline link, data-parallel link) of a layout, its ranks numbered as the launcher
        numbers them (`runtime/context.py`): tp fastest (inside a node), then pp, then dp. A
        pipeline spans pp x tp consecutive devices: its hops stay on NVLink while that fits in a
        node, else one crosses the network and paces the pipeline. A replica's ring strides over
        pipelines: inside a node only when the whole job fits in one."""
        pp_link = self.intra_node if pp * tp <= self.devices_per_node else self.inter_node
        dp_link = self.intra_node if pp * tp * dp <= self.devices_per_node else self.inter_node
        return pp_link, dp_link

    def ep_link(self, pp: int, tp: int, ep: int) -> Link:
        """The link an ep group's all-to-alls cross: its ranks are replicas of one pipeline rank,
        pp x tp devices apart (pipeline/core/layout.py), inside a node while pp x tp x ep fit."""
        return self.intra_node if pp * tp * ep <= self.devices_per_node else self.inter_node

    @property
    def source(self) -> str:
        """Where the figures come from, as a prediction names it."""
        if self.calibrated:
            text = f"hardware={self.name}: datasheet peaks, efficiencies calibrated on {self.calibrated}"
        else:
            text = f"hardware={self.name}: datasheet values, efficiencies assumed (conf/hardware/{self.name}.yaml)"
        if self.overrides:
            text += f"; set on the command line: {', '.join(self.overrides)}"
        return text


def _number(data: Mapping, key: str, name: str, low: float = 0.0) -> float:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= low:
        raise ConfigError("hardware", f"conf/hardware/{name}.yaml: `{key}` is {value!r}; valid: a number > {low}")
    return float(value)


def _link(data: Mapping, key: str, name: str) -> Link:
    link = data.get(key)
    if not isinstance(link, Mapping):
        raise ConfigError("hardware", f"conf/hardware/{name}.yaml: `{key}` is missing; valid: {{name, bandwidth "
                                      "(bytes/s per device and direction), latency_s}")
    return Link(str(link.get("name", key)), _number(link, "bandwidth", name), _number(link, "latency_s", name))


def hardware_from_dict(data: Mapping, name: str) -> Hardware:
    """The record from a hardware file's contents, each fact checked (a clear error naming the
    file and key, never a wrong prediction)."""
    peaks = data.get("peak_flops")
    if not isinstance(peaks, Mapping) or not peaks:
        raise ConfigError("hardware", f"conf/hardware/{name}.yaml: `peak_flops` is missing; valid: {{bf16: ..., "
                                      "fp32: ...}} in FLOP/s")
    efficiency = data.get("efficiency") or {}
    matmul = efficiency.get("matmul") or {}
    for dtype, value in matmul.items():
        if not isinstance(value, (int, float)) or not 0 < value <= 1:
            raise ConfigError("hardware", f"conf/hardware/{name}.yaml: efficiency.matmul.{dtype} is {value!r}; "
                                          "valid: a fraction in (0, 1]")
    memory = efficiency.get("memory", 1.0)
    if not isinstance(memory, (int, float)) or not 0 < memory <= 1:
        raise ConfigError("hardware", f"conf/hardware/{name}.yaml: efficiency.memory is {memory!r}; valid: a "
                                      "fraction in (0, 1]")
    calibration = data.get("calibration") or {}
    calibrated = f"{calibration['device']}, {calibration['date']}" if calibration.get("date") else None
    return Hardware(
        name=str(data.get("name", name)), device_name=str(data.get("device_name", name)),
        devices_per_node=int(_number(data, "devices_per_node", name)),
        memory_bytes=_number(data, "memory_bytes", name), memory_bandwidth=_number(data, "memory_bandwidth", name),
        peak_flops={str(k): _number(peaks, k, name) for k in peaks},
        matmul_efficiency={str(k): float(v) for k, v in matmul.items()}, memory_efficiency=float(memory),
        launch_s=float(efficiency.get("launch_s", 0.0)),
        intra_node=_link(data, "intra_node", name), inter_node=_link(data, "inter_node", name),
        reserve_bytes=_number(data, "reserve_bytes", name, low=-1.0) if "reserve_bytes" in data else 0.0,
        sources={str(k): str(v) for k, v in (data.get("sources") or {}).items()}, calibrated=calibrated)


#: `hardware=local` (the default): no file of figures; this machine is measured (the profile)
LOCAL = "local"


def known_hardware() -> list[str]:
    """The hardware files with figures (every conf/hardware file but `local`)."""
    return sorted(p.stem for p in HARDWARE_DIR.glob("*.yaml") if p.stem != LOCAL)


def configured_hardware(config: Mapping) -> Hardware | None:
    """The run's `hardware` group as a record, None for `hardware=local` (the planner measures
    this machine instead)."""
    name = str(config.get("name", LOCAL))
    if name == LOCAL:
        return None
    hw = hardware_from_dict(config, name)
    return replace(hw, overrides=tuple(_changed(config, name)))


def _changed(config: Mapping, name: str) -> list[str]:
    """The figures of `config` that differ from conf/hardware/<name>.yaml's, as `key=value`
    (nested keys dotted); none where the file is not ours (a user's own hardware file)."""
    from omegaconf import OmegaConf

    path = HARDWARE_DIR / f"{name}.yaml"
    if not path.exists():
        return []
    base = OmegaConf.to_container(OmegaConf.load(path), resolve=True)

    def leaves(data: Mapping, prefix: str = "") -> dict[str, object]:
        out: dict[str, object] = {}
        for key, value in data.items():
            if key == "sources":
                continue
            if isinstance(value, Mapping):
                out.update(leaves(value, f"{prefix}{key}."))
            else:
                out[f"{prefix}{key}"] = value
        return out

    given, filed = leaves(config), leaves(base)
    return [f"{key}={given[key]}" for key in sorted(given) if key in filed and given[key] != filed[key]] + \
        [f"{key}={given[key]}" for key in sorted(given) if key not in filed]


def load_hardware(name: str) -> Hardware:
    """`conf/hardware/<name>.yaml` as a record; refused, naming the valid ones, when there is none."""
    from omegaconf import OmegaConf

    path = HARDWARE_DIR / f"{name}.yaml"
    if not path.exists():
        raise ConfigError("hardware", f"no hardware file {name!r} (conf/hardware/{name}.yaml); valid: "
                                      f"{', '.join(known_hardware())}, or your own file there")
    return hardware_from_dict(OmegaConf.to_container(OmegaConf.load(path), resolve=True), name)
