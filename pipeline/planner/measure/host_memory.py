"""Refuse a profile this machine cannot hold, before it starts, with the figure and the way out.

Why: `hardware=local` measures each layer on real tensors here. The profiler holds one leaf at a
time, but that leaf with its gradients and the micro-batch's activations can exceed the host's
memory (a Llama-70B-sized config reached 23.6 GB and was killed by the kernel with no message).
The estimates are read off the meta trace (no byte allocated), against the memory the kernel says
is available: the model's weights and gradients (a model that cannot train here is not profiled
here: profiling every layer of a 70B model on a CPU would take hours even where each fits), then
the largest node's parameters three times (the weights, their gradients, the initialiser's
temporary) plus its output four times (the output, its gradient, what autograd saves, the input
gradient).
"""

from __future__ import annotations

import os

from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.graph.trace import TracedModel

GIB = 2**30


def available_bytes() -> float | None:
    """What the kernel says a new allocation can take (MemAvailable), None where it does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def profile_bytes(traced: TracedModel) -> tuple[float, str]:
    """The host bytes profiling `traced` needs at its peak (see the module's docstring), and the
    node that sets it."""
    nodes = traced.graph.nodes
    if not nodes:
        return 0.0, ""
    params = max(nodes, key=lambda n: float(nodes[n].get("param_bytes", 0)))
    output = max(nodes, key=lambda n: float(nodes[n].get("output_bytes", 0)))
    need = 3.0 * float(nodes[params].get("param_bytes", 0)) + 4.0 * float(nodes[output].get("output_bytes", 0))
    return need, params if nodes[params].get("param_bytes", 0) else output


def check_host_memory(traced: list[TracedModel], sizes: list[int], available: float | None = None,
                      tp: int = 1) -> None:
    """Refuse (ConfigError on `hardware`) when profiling any of `traced` (one per micro-batch size
    of `sizes`; under `tp`, one tp rank's share of the model) would not fit in the host's available
    memory."""
    available = available_bytes() if available is None else available
    if available is None or not traced:
        return
    weights = tp * float(sum(traced[0].graph.graph.get("param_sizes", {}).values()))
    if 2 * weights > available:  # the ranks' weights and gradients alone: it cannot train here
        raise ConfigError(
            "hardware",
            f"hardware=local plans a run on this machine, and this model's weights and their gradients alone take "
            f"{2 * weights / GIB:.1f} GiB, more than the {available / GIB:.1f} GiB this machine has available; "
            "plan it for the GPUs it will train on instead (hardware=h100_sxm, a100_80gb, h200, b200 or your own "
            "conf/hardware file: priced on meta, nothing allocated)")
    for t, size in zip(traced, sizes, strict=True):
        need, node = profile_bytes(t)
        if need > available:
            raise ConfigError(
                "hardware",
                f"hardware=local measures each layer here, and profiling this model at a micro-batch of {size} "
                f"needs about {need / GIB:.1f} GiB (its largest layer, {node}: weights, gradients and activations), "
                f"more than the {available / GIB:.1f} GiB this machine has available; price it on a GPU's figures "
                "instead (hardware=h100_sxm, a100_80gb, h200, b200 or your own conf/hardware file: nothing is "
                "allocated), or profile a smaller micro-batch (a larger microbatches, a smaller batch_size)")
