"""What every partitioner returns, and the one cost model all of them are judged by.

Why one `evaluate`: uniform, balanced, MILP and manual splits are only comparable if the same function
prices them. A stage's time is the forward + backward time of its nodes plus the time to send every
value it produces to each later stage that reads it (a skip from stage 0 to stage 3 is one direct
send, counted once per distinct consumer stage; a value computed from the inputs alone is rebuilt by
its readers, not sent: `graph.derived.sent_bytes`). A stage's memory is its parameters (a tied parameter
counted once per stage that holds it) plus its activations times the micro-batches it keeps in flight.

Cost-graph contract (what `pipelaunch.pipeline.graph` produces): a networkx DiGraph whose nodes carry
`forward_s`, `backward_s`, `activation_bytes`, `output_bytes` and optionally `params` (canonical
parameter names; sizes in `graph.graph["param_sizes"]`) or `param_bytes`, and `order` (a topological
position). Missing numbers count as zero.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import networkx as nx

from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.graph.assignment import validate_assignment
from pipelaunch.pipeline.graph.derived import sent_bytes

DEFAULT_BANDWIDTH = 10e9  # bytes/s; a placeholder until the launcher passes a measured link speed
MEMORY_KEY = "memory.cap_bytes"
STAGES_KEY = "pp"


@dataclass
class Partition:
    """A node -> stage assignment and what it costs, stage by stage."""

    assignment: dict[str, int]
    num_stages: int
    stage_compute_s: list[float]
    stage_comm_bytes: list[int]
    stage_comm_s: list[float]
    stage_time_s: list[float]
    stage_param_bytes: list[int]
    stage_activation_bytes: list[int]
    stage_memory_bytes: list[int]
    bottleneck_s: float
    lower_bound_s: float
    method: str = ""
    info: dict[str, Any] = field(default_factory=dict)
    #: micro-batches each stage holds at once (their inputs at least), as priced in stage_memory_bytes
    stage_in_flight: list[int] = field(default_factory=list)
    #: of those, how many hold full activations (fewer on a stage that recomputes them)
    stage_full_in_flight: list[int] = field(default_factory=list)
    #: bytes of the values a stage receives per micro-batch (what a recomputing stage keeps)
    stage_input_bytes: list[int] = field(default_factory=list)
    #: stages that recompute their forward in the backward to fit the memory cap (remat=auto)
    remat_stages: list[int] = field(default_factory=list)

    def reprice(self, held: Sequence[int], full: Sequence[int], remat_stages: Sequence[int]) -> None:
        """Re-price the stages' memory for the counts of another order of the schedule."""
        self.stage_in_flight, self.stage_full_in_flight, self.remat_stages = list(held), list(full), list(remat_stages)
        self.stage_memory_bytes = stage_memory(self.stage_param_bytes, self.stage_activation_bytes,
                                               self.stage_input_bytes, held, full, remat_stages)

    def stages(self) -> list[list[str]]:
        """Node names of each stage, in assignment (insertion) order."""
        out: list[list[str]] = [[] for _ in range(self.num_stages)]
        for node, s in self.assignment.items():
            out[s].append(node)
        return out

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable view, for plan.json."""
        return asdict(self)


@dataclass(frozen=True)
class PartitionRequest:
    """What a split is priced by, the same for every partitioner (see `pipelaunch.pipeline.planner.partition.plugins`).

    `in_flight[s]`: micro-batches stage s holds at once under the schedule; `memory_cap`: bytes per
    stage (None: no budget); `remat_in_flight[s]`: how many of them hold full activations on a stage
    that recomputes (None: no stage may); `remat_all`: every stage recomputes (remat=full)."""

    bandwidth: float
    in_flight: list[int]
    memory_cap: float | None = None
    remat_in_flight: list[int] | None = None
    remat_all: bool = False

    def pricing(self) -> dict[str, Any]:
        """Keyword arguments of `evaluate`."""
        return {"bandwidth": self.bandwidth, "in_flight": self.in_flight, "memory_cap": self.memory_cap,
                "remat_in_flight": self.remat_in_flight, "remat_all": self.remat_all}


def stage_memory(
    param_bytes: Sequence[int],
    activation_bytes: Sequence[int],
    input_bytes: Sequence[int],
    held: Sequence[int],
    full: Sequence[int],
    remat_stages: Sequence[int] = (),
) -> list[int]:
    """What a stage holds: its parameters, the activations of the micro-batches holding them in
    full, and on a recomputing stage the inputs of every micro-batch it holds."""
    remat = set(remat_stages)
    return [p + a * f + (i * h if s in remat else 0)
            for s, (p, a, i, h, f) in enumerate(zip(param_bytes, activation_bytes, input_bytes, held, full,
                                                    strict=True))]


def node_cost(graph: nx.DiGraph, node: str) -> float:
    """Forward plus backward seconds of one node."""
    d = graph.nodes[node]
    return float(d.get("forward_s", 0.0)) + float(d.get("backward_s", 0.0))


def topo_order(graph: nx.DiGraph) -> list[str]:
    """The graph's own program order when nodes carry `order`, else a deterministic topological sort."""
    nodes = list(graph.nodes)
    if nodes and all("order" in graph.nodes[n] for n in nodes):
        ordered = sorted(nodes, key=lambda n: graph.nodes[n]["order"])
        pos = {n: i for i, n in enumerate(ordered)}
        if all(pos[u] < pos[v] for u, v in graph.edges):
            return ordered
    index = {n: i for i, n in enumerate(nodes)}
    return list(nx.lexicographical_topological_sort(graph, key=lambda n: index[n]))


def in_flight_list(in_flight: int | Sequence[int], num_stages: int) -> list[int]:
    """Micro-batches of activations each stage holds at peak (one int for all, or one per stage)."""
    if isinstance(in_flight, int):
        return [in_flight] * num_stages
    vals = list(in_flight)
    if len(vals) != num_stages:
        raise ConfigError("memory.in_flight", f"needs {num_stages} values (one per stage), got {len(vals)}")
    return vals


def _node_params(graph: nx.DiGraph, node: str) -> dict[str, int]:
    d = graph.nodes[node]
    sizes = graph.graph.get("param_sizes", {})
    names = d.get("params")
    if names:
        return {p: int(sizes.get(p, 0)) for p in names}
    pb = int(d.get("param_bytes", 0))
    return {f"<{node}>": pb} if pb else {}


def lower_bound(graph: nx.DiGraph, num_stages: int) -> float:
    """No split can beat the average stage or the slowest single node."""
    costs = [node_cost(graph, n) for n in graph.nodes]
    return max(sum(costs) / num_stages, max(costs, default=0.0))


def check_stages(graph: nx.DiGraph, num_stages: int) -> None:
    """Every stage needs at least one node."""
    n = graph.number_of_nodes()
    if num_stages < 1 or num_stages > n:
        raise ConfigError(STAGES_KEY, f"needs 1 <= stages <= {n} (nodes in the cost graph), got {num_stages}")


def evaluate(
    graph: nx.DiGraph,
    assignment: Mapping[str, int],
    num_stages: int,
    bandwidth: float = DEFAULT_BANDWIDTH,
    in_flight: int | Sequence[int] = 1,
    method: str = "",
    validate: bool = True,
    remat_in_flight: Sequence[int] | None = None,
    memory_cap: float | None = None,
    remat_all: bool = False,
) -> Partition:
    """Price any assignment with the shared cost model (see the module docstring).

    With `remat_in_flight` a stage over `memory_cap` (remat=auto), or every stage with `remat_all`
    (remat=full), recomputes its forward in the backward: it then holds full activations for
    remat_in_flight[s] micro-batches and only the inputs of the rest, and pays its forward time
    once more per micro-batch."""
    if validate:
        validate_assignment(graph, assignment, num_stages)
    k = num_stages
    compute = [0.0] * k
    forward = [0.0] * k
    act = [0] * k
    inputs = [0] * k
    params: list[dict[str, int]] = [{} for _ in range(k)]
    comm = [0] * k
    for n in graph.nodes:
        s = assignment[n]
        d = graph.nodes[n]
        compute[s] += node_cost(graph, n)
        forward[s] += float(d.get("forward_s", 0.0))
        act[s] += int(d.get("activation_bytes", 0))
        params[s].update(_node_params(graph, n))
        later = {assignment[v] for v in graph.successors(n) if assignment[v] > s}
        comm[s] += sent_bytes(d) * len(later)
        for t in later:
            inputs[t] += sent_bytes(d)
    flights = in_flight_list(in_flight, k)
    pbytes = [sum(p.values()) for p in params]
    plain = stage_memory(pbytes, act, inputs, flights, flights)
    if remat_in_flight is None:
        remat = []
    elif remat_all:
        remat = list(range(k))
    else:
        remat = [s for s in range(k) if memory_cap is not None and plain[s] > memory_cap]
    full = [remat_in_flight[s] if s in remat else flights[s] for s in range(k)]
    for s in remat:
        compute[s] += forward[s]
    comm_s = [b / bandwidth if bandwidth and bandwidth != float("inf") else 0.0 for b in comm]
    times = [c + t for c, t in zip(compute, comm_s, strict=True)]
    mem = stage_memory(pbytes, act, inputs, flights, full, remat)
    return Partition(
        assignment=dict(assignment),
        num_stages=k,
        stage_compute_s=compute,
        stage_comm_bytes=comm,
        stage_comm_s=comm_s,
        stage_time_s=times,
        stage_param_bytes=pbytes,
        stage_activation_bytes=act,
        stage_memory_bytes=mem,
        bottleneck_s=max(times),
        lower_bound_s=lower_bound(graph, k),
        method=method,
        stage_in_flight=flights,
        stage_full_in_flight=full,
        stage_input_bytes=inputs,
        remat_stages=remat,
    )


def memory_error(min_cap: float, cap: float, detail: str = "", recomputing: bool = False) -> ConfigError:
    """The error for a cap no split can meet; it states the smallest cap that would fit (with
    `recomputing`, recomputation was already counted in it). The cap is a device's: a stage alone
    must fit in it, priced as the partitioner sees it (parameters with their gradients and
    optimizer state, and the activations of its in-flight micro-batches)."""
    extra = f" {detail}" if detail else ""
    remedies = "or use more stages" if recomputing else "use more stages, or recompute activations (remat=auto)"
    return ConfigError(
        MEMORY_KEY,
        f"no split fits in {int(cap)} bytes per device: the smallest cap that fits is {int(min_cap)} bytes "
        f"({min_cap / 2**20:.2f} MiB for a stage on its own: parameters, their gradients and optimizer state, "
        f"and its in-flight activations).{extra} Raise `{MEMORY_KEY}`, {remedies}.",
    )


def assignment_from_order(order: Sequence[str], starts: Sequence[int]) -> dict[str, int]:
    """Contiguous stages of `order`; `starts[s]` is the position where stage s begins (starts[0] == 0)."""
    out: dict[str, int] = {}
    bounds = [*starts, len(order)]
    for s in range(len(starts)):
        for n in order[bounds[s] : bounds[s + 1]]:
            out[n] = s
    return out
