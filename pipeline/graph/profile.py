"""Measure per-node (or per-block) forward time, backward time and memory, with an on-disk cache.

Why measure each node's backward instead of assuming backward = 2 x forward: the ratio varies a lot
between ops (an embedding's backward is a scatter, a LayerNorm's is cheaper than a matmul's), and the
partitioner's balance is only as good as these numbers. Each node's op is re-run in isolation on the
inputs it saw during one real forward pass, with autograd on, and its backward is timed on its own.

Activation bytes are the tensors autograd saves for backward (seen through saved_tensors_hooks),
excluding parameters. A tensor saved by two consumer nodes is counted by both: a small overestimate
that keeps the numbers per-node and additive.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import networkx as nx
import torch
from torch import fx, nn

from pipeline.graph.trace import COMPUTE_OPS, TracedModel

PROFILE_FIELDS = ("forward_s", "backward_s", "activation_bytes", "output_bytes", "param_bytes")
MIN_TIME_S = 1e-7  # a measured op never reports zero: it at least paid the Python call


@dataclass
class BlockCost:
    """Measured cost of one block of a sequential ModelSpec (the last block includes the loss)."""

    name: str
    forward_s: float
    backward_s: float
    activation_bytes: int
    output_bytes: int
    param_bytes: int


# ---------------------------------------------------------------------------------------------- cache


def cache_dir() -> Path:
    """Where profiles live: $PIPELAUNCH_CACHE or ~/.cache/pipelaunch/profiles."""
    env = os.environ.get("PIPELAUNCH_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "pipelaunch" / "profiles"


def _describe_inputs(inputs: Sequence[Any]) -> list[Any]:
    out: list[Any] = []
    for x in inputs:
        if isinstance(x, torch.Tensor):
            out.append([list(x.shape), str(x.dtype)])
        elif isinstance(x, (list, tuple)):
            out.append(_describe_inputs(x))
        else:
            out.append(repr(x))
    return out


def profile_key(model_config: Mapping[str, Any], inputs: Sequence[Any], device: str | torch.device) -> str:
    """Hash of (model config, micro-batch input shapes/dtypes, device, torch version)."""
    payload = {
        "model": model_config,
        "inputs": _describe_inputs(inputs),
        "device": str(device),
        "torch": torch.__version__,
    }
    blob = json.dumps(payload, sort_keys=True, default=repr)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def load_cached(key: str) -> dict[str, Any] | None:
    """The cached profile for `key`, or None (a corrupt file counts as a miss)."""
    path = cache_dir() / f"{key}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def save_cached(key: str, data: dict[str, Any]) -> Path:
    """Write atomically, so concurrent sweep jobs never read half a file."""
    directory = cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{key}.json"
    tmp = directory / f".{key}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    tmp.replace(path)
    return path


# ------------------------------------------------------------------------------------------- timing


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _leafify(value: Any) -> Any:
    """Detached copies of recorded inputs; floating tensors require grad so input-gradients are timed."""
    if isinstance(value, torch.Tensor):
        t = value.detach()
        if t.is_floating_point() or t.is_complex():
            t.requires_grad_(True)
        return t
    if isinstance(value, (list, tuple)):
        if not _tensors(value) or hasattr(value, "_fields") or isinstance(value, torch.Size):
            return value
        return type(value)(_leafify(v) for v in value)
    if isinstance(value, dict):
        return {k: _leafify(v) for k, v in value.items()}
    return value


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def measure_op(
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    params: Sequence[torch.Tensor],
    device: torch.device,
    repeats: int,
) -> dict[str, float]:
    """Like `_measure`, degrading gracefully for ops autograd refuses (in-place ops on leaves)."""
    try:
        return _measure(fn, args, kwargs, params, device, repeats, True)
    except RuntimeError:
        return _measure(fn, args, kwargs, params, device, repeats, False)


def _measure(
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    params: Sequence[torch.Tensor],
    device: torch.device,
    repeats: int,
    input_grads: bool,
) -> dict[str, float]:
    """Median forward and backward seconds of `fn(*args, **kwargs)`, and its saved/output bytes."""
    param_ptrs = {p.data_ptr() for p in params}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.data_ptr() not in param_ptrs:
            saved[t.data_ptr()] = max(saved.get(t.data_ptr(), 0), _nbytes(t))
        return t

    leaf_args = _leafify(list(args)) if input_grads else list(args)
    leaf_kwargs = _leafify(dict(kwargs)) if input_grads else dict(kwargs)
    grad_inputs = [t for t in _tensors([leaf_args, leaf_kwargs]) if t.requires_grad]
    grad_params = [p for p in params if p.requires_grad]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*leaf_args, **leaf_kwargs)  # also the warm-up run
    outs = [t for t in _tensors(out) if t.requires_grad]
    output_bytes = sum(_nbytes(t) for t in _tensors(out))
    differentiable = bool(outs) and bool(grad_inputs or grad_params)
    grads = [torch.ones_like(t) for t in outs]
    if differentiable:
        torch.autograd.backward(outs, grads, inputs=grad_inputs + grad_params)

    fwd: list[float] = []
    bwd: list[float] = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        out = fn(*leaf_args, **leaf_kwargs)
        _sync(device)
        fwd.append(time.perf_counter() - t0)
        if differentiable:
            outs = [t for t in _tensors(out) if t.requires_grad]
            t0 = time.perf_counter()
            torch.autograd.backward(outs, grads, inputs=grad_inputs + grad_params)
            _sync(device)
            bwd.append(time.perf_counter() - t0)
    for t in grad_inputs + grad_params:
        t.grad = None
    return {
        "forward_s": max(statistics.median(fwd), MIN_TIME_S),
        "backward_s": max(statistics.median(bwd), MIN_TIME_S) if bwd else 0.0,
        "activation_bytes": int(sum(saved.values())),
        "output_bytes": int(output_bytes),
    }


class _Recorder(fx.Interpreter):
    """Runs the graph once and remembers every compute node's concrete args and kwargs."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.records: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {}

    def run_node(self, n: fx.Node) -> Any:
        if n.op in COMPUTE_OPS:
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            self.records[n.name] = (args, kwargs)
        return super().run_node(n)


def _node_callable(gm: fx.GraphModule, node: fx.Node) -> tuple[Callable[..., Any], list[torch.Tensor]]:
    if node.op == "call_module":
        sub = gm.get_submodule(node.target)
        return sub, list(sub.parameters())
    if node.op == "call_method":
        return (lambda self_, *a, **k: getattr(self_, node.target)(*a, **k)), []
    return node.target, []


def _graph_params(gm: fx.GraphModule, node: fx.Node) -> list[torch.Tensor]:
    """Parameters reaching a node through get_attr inputs (they must stay leaves, not copies)."""
    out = []
    for inp in node.all_input_nodes:
        if inp.op == "get_attr":
            obj: Any = gm
            for part in inp.target.split("."):
                obj = getattr(obj, part)
            if isinstance(obj, torch.Tensor):
                out.append(obj)
    return out


def _apply(graph: nx.DiGraph, nodes: Mapping[str, Mapping[str, Any]]) -> None:
    for name, values in nodes.items():
        if name in graph:
            graph.nodes[name].update({k: values[k] for k in PROFILE_FIELDS if k in values})
    for u, v in graph.edges:
        graph.edges[u, v]["bytes"] = graph.nodes[u]["output_bytes"]


def profile_graph(
    traced: TracedModel,
    example_inputs: Any,
    device: str | torch.device = "cpu",
    repeats: int = 5,
    model_config: Mapping[str, Any] | None = None,
    use_cache: bool = True,
) -> None:
    """Annotate every cost-graph node with forward_s, backward_s, activation/output/param bytes.

    `example_inputs` is one micro-batch. With `model_config` (the config dict that built the model)
    the result is cached under `cache_dir()`, so a sweep profiles each model/shape/device once;
    `traced.graph.graph["profile_cached"]` says whether this call was a cache hit.
    """
    device = torch.device(device)
    args = example_inputs if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    key = profile_key(model_config, args, device) if model_config is not None else None
    if key and use_cache:
        cached = load_cached(key)
        if cached is not None and set(cached.get("nodes", {})) == set(traced.graph.nodes):
            _apply(traced.graph, cached["nodes"])
            traced.graph.graph["profile_cached"] = True
            return

    gm = traced.gm
    first = next(iter(gm.parameters()), None)
    if first is not None and first.device != device:
        import copy

        gm = copy.deepcopy(gm).to(device)
    args = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
    recorder = _Recorder(gm)
    with torch.no_grad():
        recorder.run(*args)

    by_name = {n.name: n for n in gm.graph.nodes}
    results: dict[str, dict[str, Any]] = {}
    for name in traced.graph.nodes:
        node = by_name[name]
        fn, params = _node_callable(gm, node)
        params = params + _graph_params(gm, node)
        rec_args, rec_kwargs = recorder.records[name]
        stats: dict[str, Any] = measure_op(fn, rec_args, rec_kwargs, params, device, repeats)
        stats["param_bytes"] = traced.graph.nodes[name]["param_bytes"]
        results[name] = stats
    _apply(traced.graph, results)
    traced.graph.graph["profile_cached"] = False
    if key and use_cache:
        save_cached(key, {"nodes": results, "torch": torch.__version__, "device": str(device)})


# ------------------------------------------------------------------------------------ block profile


def _example_input(spec: Any, batch: int, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    shape = (batch, *spec.input_shape)
    if spec.input_dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(device=device, dtype=spec.input_dtype)
    high = int(spec.meta.get("vocab_size", 2))
    return torch.randint(0, high, shape, generator=gen).to(device=device, dtype=spec.input_dtype)


def _example_target(spec: Any, batch: int, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    shape = (batch, *spec.target_shape)
    if spec.target_dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(device=device, dtype=spec.target_dtype)
    high = int(spec.meta.get("vocab_size", spec.meta.get("num_classes", 2)))
    return torch.randint(0, high, shape, generator=gen).to(device=device, dtype=spec.target_dtype)


def profile_blocks(
    spec: Any,
    micro_batch_size: int,
    seed: int = 0,
    device: str | torch.device = "cpu",
    repeats: int = 5,
    model_config: Mapping[str, Any] | None = None,
    use_cache: bool = True,
) -> list[BlockCost]:
    """Per-block costs of a sequential `models.base.ModelSpec`, one micro-batch, cached like nodes.

    The loss is measured as part of the last block, because that is the stage that pays for it.
    """
    device = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    x = _example_input(spec, micro_batch_size, device, gen)
    target = _example_target(spec, micro_batch_size, device, gen)
    config = (
        dict(model_config)
        if model_config is not None
        else {
            "name": spec.name,
            "blocks": spec.block_names,
            "meta": spec.meta,
            "input_shape": list(spec.input_shape),
        }
    )
    key = profile_key({"blocks": config}, [x, target], device)
    if use_cache:
        cached = load_cached(key)
        if cached is not None and [b["name"] for b in cached.get("blocks", [])] == spec.block_names:
            return [BlockCost(**b) for b in cached["blocks"]]

    model = spec.build_full(seed, device)
    costs: list[BlockCost] = []
    names = spec.block_names
    for i, name in enumerate(names):
        block = getattr(model, name)
        params = list(block.parameters())
        fn: Callable[..., Any] = block
        if i == len(names) - 1:

            def fn(inp: torch.Tensor, _block: nn.Module = block) -> torch.Tensor:
                return spec.loss_fn(_block(inp), target)

        stats = measure_op(fn, (x,), {}, params, device, repeats)
        costs.append(
            BlockCost(
                name=name,
                forward_s=stats["forward_s"],
                backward_s=stats["backward_s"],
                activation_bytes=stats["activation_bytes"],
                output_bytes=stats["output_bytes"],
                param_bytes=sum(_nbytes(p) for p in params),
            )
        )
        with torch.no_grad():
            x = block(x)
    if use_cache:
        save_cached(key, {"blocks": [asdict(c) for c in costs]})
    return costs


def chain_graph(blocks: Sequence[BlockCost]) -> nx.DiGraph:
    """A cost graph that is a simple chain of blocks, usable by every partitioner."""
    g = nx.DiGraph()
    sizes: dict[str, int] = {}
    for i, b in enumerate(blocks):
        g.add_node(
            b.name,
            op="block",
            target=b.name,
            module=b.name,
            params=[b.name] if b.param_bytes else [],
            order=i,
            **{k: getattr(b, k) for k in PROFILE_FIELDS},
        )
        if b.param_bytes:
            sizes[b.name] = b.param_bytes
        if i:
            prev = blocks[i - 1]
            g.add_edge(prev.name, b.name, bytes=prev.output_bytes)
    g.graph["param_sizes"] = sizes
    g.graph["outputs"] = [blocks[-1].name] if blocks else []
    return g
