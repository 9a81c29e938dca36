"""Measure per-node (or per-block) forward time, backward time and memory, with an on-disk cache.

Why measure each node's backward instead of assuming backward = 2 x forward: the ratio varies a lot
between ops (an embedding's backward is a scatter, a LayerNorm's is cheaper than a matmul's), and the
partitioner's balance is only as good as these numbers. Each node's op is re-run in isolation on the
inputs it saw during one real forward pass, with autograd on, and its backward is timed on its own.

Why the timings come from several passes over the graph rather than back-to-back repeats of each node:
a shared machine slows down in bursts that last longer than one node's repeats. Timed back to back,
a burst lands on every sample of one node (in one profile an LM head's backward measured 12% dear);
timed in passes, it lands on one pass, and the median over passes leaves it out.

Why copies of one layer share one timing: a decoder's eight identical blocks measured 48-66 ms
each in one profile (the first two dearest) and their order changed from one profile to the next,
so the balanced split, and with it the schedule plan=auto picks, changed between a first run and
a second. Nodes whose cost cannot differ (the same module structure and settings, or the same
operator, on inputs and weights of the same shapes, strides and dtypes: `_signature`) pool every
pass's samples, and each gets the median of the pool: eight copies give eight times the samples.

The model may live on the meta device: each node runs on real inputs with only the module it calls
materialised for it, so profiling never holds the model's weights.

Activation bytes are the tensors autograd saves for backward (seen through saved_tensors_hooks),
excluding parameters. A tensor saved by two consumer nodes is counted by both: a small overestimate
that keeps the numbers per-node and additive.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import networkx as nx
import torch
from torch import fx, nn

from pipelaunch.pipeline.compute.backward import WeightGradStash, backward_input, backward_weight
from pipelaunch.pipeline.compute.selective import recompute_share
from pipelaunch.pipeline.graph.derived import sent_bytes
from pipelaunch.pipeline.graph.trace import COMPUTE_OPS, TracedModel, retarget

#: what is timed per node: forward, fused backward, and the runtime's split backward (I, then W)
TIMES = ("forward_s", "backward_s", "backward_input_s", "backward_weight_s")
#: beside the times and bytes, what the selective policy keeps of a node's outputs and the share of
#: its forward it reruns (`pipeline/compute/selective.py`; the planner's remat=selective)
PROFILE_FIELDS = (*TIMES, "activation_bytes", "output_bytes", "stash_bytes", "loss_activation_bytes", "param_bytes",
                  "selective_kept_bytes", "selective_share")
MIN_TIME_S = 1e-7  # a measured op never reports zero: it at least paid the Python call
PASSES = 3  # passes over the graph that share a node's timed repeats
_LOSS = "\0loss"  # the loss's own entry while passes are pooled (no graph node has this name)


# ---------------------------------------------------------------------------------------------- cache


def cache_dir() -> Path:
    """Where profiles live: $PIPELAUNCH_CACHE or ~/.cache/pipelaunch/profiles."""
    env = os.environ.get("PIPELAUNCH_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "pipelaunch" / "profiles"


def device_label(device: str | torch.device) -> str:
    """The device a profile's timings belong to: `cpu`, or a GPU by its model name
    (`cuda:NVIDIA H100 80GB HBM3`), whatever its index, so that a profile taken on one GPU of a
    node serves the others and a profile from another GPU model is never reused. Asking a GPU its
    name initialises CUDA: call it only where the profile runs on that GPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return device.type if device.index is None else str(device)


def profile_key(model_config: Mapping[str, Any], inputs: Sequence[Any], device: str | torch.device) -> str:
    """Hash of (model config, micro-batch input shapes/dtypes, device (a GPU by its name:
    `device_label`), torch version, how it was timed)."""
    payload = {
        "passes": PASSES,
        "cache": "evicted",
        "copies": "pooled",
        "fields": "selective",
        "saved": "parameter-storages",
        "model": model_config,
        "inputs": _layout(list(inputs)),
        "device": device_label(device),
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
    """Write atomically, so concurrent sweep jobs never read half a file. `key` may name a
    subdirectory of the cache ("optimizer/<hash>")."""
    path = cache_dir() / f"{key}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp")
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


class CacheEvictor:
    """Writes a buffer twice the size of the device's last-level cache, so that the op timed next
    finds its weights and inputs in memory, as it does inside a pipeline.

    Why: timed back to back, an op reruns on weights and inputs it just touched. Inside a run,
    other micro-batches and stages pass through the cache between a stage's ops and their
    backward: gpt_bench's stage forwards ran 7-26% above the hot profile in interleaved 1F1B, and
    from 1% below to 12% above the profile evicted before each timed forward and backward. Ops whose
    warm-up takes under `min_s` are timed without it: the write (a few milliseconds) would cost
    more than the cache could change."""

    min_s = 1e-3

    def __init__(self, device: torch.device) -> None:
        self.buffer = torch.empty(2 * last_level_cache_bytes(device) // 4, device=device)

    def __call__(self) -> None:
        self.buffer.fill_(1.0)


def last_level_cache_bytes(device: torch.device) -> int:
    """The device's largest cache (a CPU's L3 as sysfs reports it, a GPU's L2); 32 MiB if unknown."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).L2_cache_size)
    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = path.read_text().strip()
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        try:
            sizes.append(int(text.rstrip("KMG")) * scale)
        except ValueError:
            continue
    return max(sizes, default=32 * 2**20)


def measure_op(
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    params: Sequence[torch.Tensor],
    device: torch.device,
    repeats: int,
    evict: CacheEvictor | None = None,
) -> dict[str, Any]:
    """Like `_measure`, degrading gracefully for ops autograd refuses (in-place ops on leaves)."""
    try:
        return _measure(fn, args, kwargs, params, device, repeats, True, evict)
    except RuntimeError:
        return _measure(fn, args, kwargs, params, device, repeats, False, evict)


class _Op:
    """One op ready to time: its call on detached inputs, what its backward differentiates, and the
    cache eviction before each timed run (dropped for ops too quick for it to matter)."""

    def __init__(
        self,
        fn: Callable[..., Any],
        args: list[Any],
        kwargs: dict[str, Any],
        params: Sequence[torch.Tensor],
        device: torch.device,
        evict: CacheEvictor | None,
    ) -> None:
        self.fn, self.args, self.kwargs, self.device, self.evict = fn, args, kwargs, device, evict
        self.grad_inputs = [t for t in _tensors([args, kwargs]) if t.requires_grad]
        self.grad_params = [p for p in params if p.requires_grad]
        self.leaves = {str(i): x for i, x in enumerate(self.grad_inputs)}

    def __call__(self) -> Any:
        return self.fn(*self.args, **self.kwargs)

    def cold(self) -> None:
        if self.evict is not None:
            self.evict()
            _sync(self.device)

    def backward(self, outs: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        torch.autograd.backward(outs, grads, inputs=self.grad_inputs + self.grad_params)


def _requiring_grad(out: Any) -> list[torch.Tensor]:
    return [t for t in _tensors(out) if t.requires_grad]


def _warm_up(op: _Op, params: Sequence[torch.Tensor]) -> tuple[Any, int]:
    """The first, untimed run: its output and the bytes autograd saves for backward (parameters
    excluded, and views of them: a 3-D expert tensor's slice `w[e]` starts past its storage's
    first byte); the op's eviction is dropped when this run took under `CacheEvictor.min_s`."""
    param_storages = {p.untyped_storage().data_ptr() for p in params}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in param_storages:
            saved[t.data_ptr()] = max(saved.get(t.data_ptr(), 0), _nbytes(t))
        return t

    t0 = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = op()
    _sync(op.device)
    if op.evict is not None and time.perf_counter() - t0 < op.evict.min_s:
        op.evict = None
    return out, int(sum(saved.values()))


def _time_forward(op: _Op) -> tuple[Any, float]:
    op.cold()
    _sync(op.device)
    t0 = time.perf_counter()
    out = op()
    _sync(op.device)
    return out, time.perf_counter() - t0


def _time_split_backward(op: _Op, outs: list[torch.Tensor], grads: list[torch.Tensor]) -> tuple[float, float, int]:
    """Seconds of the runtime's I and W steps, and the bytes W keeps between them (untimed)."""
    t0 = time.perf_counter()
    _, weight_stash = backward_input(outs, grads, op.leaves, op.grad_params)
    _sync(op.device)
    input_s = time.perf_counter() - t0
    kept = _stash_bytes(weight_stash) if op.grad_params else 0
    t0 = time.perf_counter()
    backward_weight(weight_stash)
    _sync(op.device)
    return input_s, time.perf_counter() - t0, kept


def _timed_repeats(op: _Op, grads: list[torch.Tensor] | None, repeats: int) -> tuple[dict[str, list[float]], int]:
    """Every timing of `repeats` runs (`grads` None: forward only) and the bytes a split backward keeps.

    Even repeats time the fused backward (B), odd ones the runtime's split backward (I, then W):
    splitting costs extra work (autograd runs twice; W restarts node by node), 4-7% of a gpt_bench
    stage's backward, which zero-bubble schedules pay on every micro-batch they split."""
    samples: dict[str, list[float]] = {k: [] for k in TIMES}
    kept = 0
    for k in range(max(repeats, 2) if grads is not None else repeats):
        out, forward_s = _time_forward(op)
        samples["forward_s"].append(forward_s)
        if grads is None:
            continue
        outs = _requiring_grad(out)
        op.cold()
        if k % 2 == 0:
            t0 = time.perf_counter()
            op.backward(outs, grads)
            _sync(op.device)
            samples["backward_s"].append(time.perf_counter() - t0)
            continue
        input_s, weight_s, kept = _time_split_backward(op, outs, grads)
        samples["backward_input_s"].append(input_s)
        samples["backward_weight_s"].append(weight_s)
    return samples, kept


def _measure(
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    params: Sequence[torch.Tensor],
    device: torch.device,
    repeats: int,
    input_grads: bool,
    evict: CacheEvictor | None = None,
) -> dict[str, Any]:
    """Median forward and backward seconds of `fn(*args, **kwargs)` (and, under `samples`, every
    timing, for pooling over passes), its saved and output bytes, and what a split backward keeps
    for W."""
    leaf_args = _leafify(list(args)) if input_grads else list(args)
    leaf_kwargs = _leafify(dict(kwargs)) if input_grads else dict(kwargs)
    op = _Op(fn, leaf_args, leaf_kwargs, params, device, evict)
    out, activation_bytes = _warm_up(op, params)
    outs = _requiring_grad(out)
    output_bytes = sum(_nbytes(t) for t in _tensors(out))
    differentiable = bool(outs) and bool(op.grad_inputs or op.grad_params)
    grads = [torch.ones_like(t) for t in outs]
    if differentiable:
        op.backward(outs, grads)  # the warm-up backward
    del out, outs
    policy_kept, share = recompute_share(op)
    samples, kept = _timed_repeats(op, grads if differentiable else None, repeats)
    for t in op.grad_inputs + op.grad_params:
        t.grad = None
    return {
        **_medians(samples),
        "activation_bytes": activation_bytes,
        "output_bytes": int(output_bytes),
        "stash_bytes": int(kept),
        "selective_kept_bytes": int(policy_kept),
        "selective_share": float(share),
        "samples": samples,
    }


def _medians(samples: Mapping[str, Sequence[float]]) -> dict[str, float]:
    """Each timing's median (never below `MIN_TIME_S`); a node with no backward has none."""
    return {k: max(statistics.median(v), MIN_TIME_S) if v else 0.0 for k, v in samples.items()}


def _pool(first: dict[str, Any], samples: Sequence[dict[str, Any]],
          medians: dict[str, float] | None = None) -> dict[str, Any]:
    """One node's result: its first pass's bytes, and the medians of `samples` (every pass's
    results of this node and of its copies; `medians`: those medians, already taken)."""
    if medians is None:
        medians = _medians({k: [t for r in samples for t in r["samples"][k]] for k in TIMES})
    return {**{k: v for k, v in first.items() if k != "samples"}, **medians}


def _pool_copies(runs: Sequence[Mapping[str, dict[str, Any]]], signatures: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """Every node's result from the passes `runs`, its timings pooled with its copies' (nodes of
    equal signature; a node without one, the loss, pools its own passes only). A group's medians
    are taken once, for all its members (80 copies of a decoder layer's op: 80 times fewer)."""
    copies: dict[str, list[str]] = {}
    for name, sig in signatures.items():
        copies.setdefault(sig, []).append(name)
    out = {}
    pooled: dict[str, dict[str, float]] = {}
    for name, first in runs[0].items():
        if name not in signatures:
            out[name] = _pool(first, [r[name] for r in runs])
            continue
        sig = signatures[name]
        if sig not in pooled:
            samples = [r[member] for r in runs for member in copies[sig]]
            pooled[sig] = _medians({k: [t for r in samples for t in r["samples"][k]] for k in TIMES})
        out[name] = _pool(first, [], dict(pooled[sig]))
    return out


def stash_gradients(stash: WeightGradStash) -> list[torch.Tensor]:
    """The gradients the runtime's split backward keeps for W after an op's I: those captured where
    W restarts (compute/backward.py), e.g. a linear layer's output gradient. They sit beside the
    saved activations from I to W, so zero-bubble schedules that defer W hold them too."""
    return [g for _, grads, _ in stash.restarts for g in grads] + [g for g in stash.root_grads if g is not None] \
        + [g for _, g in stash.direct]


def _stash_bytes(stash: WeightGradStash) -> int:
    """The bytes of `stash_gradients`, each storage once."""
    return sum({g.untyped_storage().data_ptr(): g.untyped_storage().nbytes() for g in stash_gradients(stash)}.values())


def _node_callable(gm: fx.GraphModule, node: fx.Node, module: nn.Module | None) -> tuple[Callable[..., Any], list[torch.Tensor]]:
    if node.op == "call_module":
        assert module is not None
        return module, list(module.parameters())
    if node.op == "call_method":
        return (lambda self_, *a, **k: getattr(self_, node.target)(*a, **k)), []
    return node.target, []


def _real_like(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A stand-in for a parameter or buffer read by `get_attr`: only its shape matters for timing."""
    if t.is_floating_point():
        real = torch.randn(t.shape, dtype=t.dtype, device=device) * 0.02
    else:
        real = torch.zeros(t.shape, dtype=t.dtype, device=device)
    return nn.Parameter(real, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else real


def _real_weights(value: Any, device: torch.device) -> Any:
    """`value` with each meta tensor in it (a parameter or buffer a `get_attr` read) made real."""
    if isinstance(value, torch.Tensor):
        return _real_like(value, device) if value.is_meta else value
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields") and not isinstance(value, torch.Size):
        return type(value)(_real_weights(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _real_weights(v, device) for k, v in value.items()}
    return value


def _layout(value: Any) -> Any:
    """What of an input can change an op's cost: a tensor's shape, strides, dtype and whether it
    needs a gradient; anything else by its repr."""
    if isinstance(value, torch.Tensor):
        return [list(value.shape), list(value.stride()), str(value.dtype), value.requires_grad]
    if isinstance(value, (list, tuple)):
        return [_layout(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _layout(v) for k, v in value.items()}
    return repr(value)


def _settings(module: nn.Module) -> list[Any]:
    """The module tree's plain settings that its repr may not show (a str, float, bool or None
    attribute, such as an attention kind). Integers are left out: the layer index a block keeps
    (transformers' `layer_idx`) differs between copies whose work does not."""
    found = []
    for path, sub in module.named_modules():
        for name, value in vars(sub).items():
            if not name.startswith("_") and name != "training" and (value is None or isinstance(value, (str, float, bool))):
                found.append([path, name, value])
    return found


def _signature(n: fx.Node, fn: Callable[..., Any], module: nn.Module | None, args: Any, kwargs: Any,
               params: Sequence[torch.Tensor]) -> str:
    """Nodes with equal signatures do the same work: the same module (class, structure, settings) or
    operator, on inputs and weights laid out alike."""
    what: Any = [type(module).__qualname__, repr(module), _settings(module)] if module is not None \
        else [n.op, str(n.target) if n.op == "call_method" else getattr(fn, "__qualname__", repr(fn))]
    weights = [[list(p.shape), str(p.dtype), p.requires_grad] for p in params]
    return json.dumps([what, _layout([args, kwargs]), weights], default=repr)


class _LeafwiseProfiler(fx.Interpreter):
    """Runs a meta-device graph on one real micro-batch, node by node. Each module a node calls is
    materialised just for that node (a copy, initialised), measured, and dropped; each parameter a
    `get_attr` reads lives until its last reader. So the peak is one leaf's weights plus the
    activations still needed, never the model."""

    def __init__(self, gm: fx.GraphModule, device: torch.device, repeats: int, seed: int,
                 evict: CacheEvictor | None = None) -> None:
        super().__init__(gm)
        self.device, self.repeats, self.seed, self.evict = device, repeats, seed, evict
        self.results: dict[str, dict[str, Any]] = {}
        #: each measured node's `_signature`
        self.signatures: dict[str, str] = {}

    def run_node(self, n: fx.Node) -> Any:
        if n.op == "get_attr":
            # a tensor (left on meta until a node reads it), or a submodule of a higher-order op
            return _fetch(self.module, n.target)
        if n.op not in COMPUTE_OPS:
            return super().run_node(n)
        # the weights this node reads, real for it alone: an export trace reads every parameter
        # at the top of its graph, and made real there they all lived at once (a 2-layer
        # Llama-70B-wide model held 9.3 GB, the whole model; per node, its largest layer's)
        args, kwargs = _real_weights(self.fetch_args_kwargs_from_env(n), self.device)
        module = None
        if n.op == "call_module":
            from pipelaunch.pipeline.graph.materialize import materialize

            module = copy.deepcopy(self.module.get_submodule(n.target))
            materialize(module, self.seed, self.device)
        fn, params = _node_callable(self.module, n, module)
        params = params + [a for a in _tensors([args, kwargs]) if isinstance(a, nn.Parameter)]
        self.signatures[n.name] = _signature(n, fn, module, args, kwargs, params)
        self.results[n.name] = measure_op(fn, args, kwargs, params, self.device, self.repeats, evict=self.evict)
        with torch.no_grad():
            return fn(*args, **kwargs)


def _fetch(gm: nn.Module, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def profiled_nodes(graph: nx.DiGraph) -> dict[str, dict[str, Any]]:
    """Every node's profile fields (what `apply_profile` puts back), e.g. to carry a profile taken
    in another process."""
    return {name: {k: graph.nodes[name][k] for k in PROFILE_FIELDS if k in graph.nodes[name]} for name in graph.nodes}


def apply_profile(graph: nx.DiGraph, nodes: Mapping[str, Mapping[str, Any]]) -> None:
    """Annotate `graph` with a profile taken elsewhere (`profiled_nodes` of the same model traced
    the same way: tracing is deterministic, so the node names match)."""
    if set(nodes) != set(graph.nodes) or not all(set(PROFILE_FIELDS) <= set(v) for v in nodes.values()):
        missing = sorted(set(graph.nodes) ^ set(nodes))
        raise RuntimeError(f"the profile does not fit this graph (nodes differ: {missing[:6]})")
    _apply(graph, nodes)


def _apply(graph: nx.DiGraph, nodes: Mapping[str, Mapping[str, Any]]) -> None:
    for name, values in nodes.items():
        if name in graph:
            graph.nodes[name].update({k: values[k] for k in PROFILE_FIELDS if k in values})
    for u, v in graph.edges:
        graph.edges[u, v]["bytes"] = sent_bytes(graph.nodes[u])


@dataclass
class ProfileJob:
    """One traced graph to measure on one real micro-batch: what `profile_graph` takes, so that
    `profile_graphs` can measure several in shared passes."""

    traced: TracedModel
    example_inputs: Any
    #: the config dict that built the model: the result is cached under `cache_dir()` by it
    model_config: Mapping[str, Any] | None = None
    #: (loss_fn, target): the loss is measured too and charged to the node producing the output
    loss: tuple[Callable[[torch.Tensor, torch.Tensor], torch.Tensor], torch.Tensor] | None = None


class _Measuring:
    """A job under way: its cache key, its inputs on the device, and every pass's results."""

    def __init__(self, job: ProfileJob, device: torch.device, use_cache: bool) -> None:
        self.job, self.device = job, device
        args = job.example_inputs if isinstance(job.example_inputs, (tuple, list)) else (job.example_inputs,)
        self.key = profile_key({"model": job.model_config, "loss": job.loss is not None}, args, device) \
            if job.model_config is not None and use_cache else None
        self.args = args
        self.loss_of: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.runs: list[dict[str, dict[str, Any]]] = []
        #: each node's `_signature` (the same in every pass)
        self.signatures: dict[str, str] = {}

    def from_cache(self) -> bool:
        """Annotate the graph from the on-disk cache, if it holds this job's profile."""
        graph = self.job.traced.graph
        cached = load_cached(self.key) if self.key else None
        if cached is None or set(cached.get("nodes", {})) != set(graph.nodes) \
                or not all(set(PROFILE_FIELDS) <= set(v) for v in cached["nodes"].values()):
            return False
        _apply(graph, cached["nodes"])
        graph.graph["profile_cached"] = True
        return True

    def start(self) -> None:
        self.args = [a.to(self.device) if isinstance(a, torch.Tensor) else a for a in self.args]
        retarget(self.job.traced.gm, self.device)
        if self.job.loss is not None and self.job.traced.graph.graph.get("outputs"):
            loss_fn, target = self.job.loss
            target = target.to(self.device)

            def loss_of(x: torch.Tensor) -> torch.Tensor:
                return loss_fn(x, target)

            self.loss_of = loss_of

    def run_pass(self, repeats: int, seed: int, evict: CacheEvictor) -> None:
        runner = _LeafwiseProfiler(self.job.traced.gm, self.device, repeats, seed, evict=evict)
        value = next(iter(_tensors(runner.run(*self.args))), None)
        if self.loss_of is not None and value is not None:
            runner.results[_LOSS] = measure_op(self.loss_of, (value,), {}, [], self.device, repeats, evict=evict)
        self.runs.append(runner.results)
        self.signatures = self.signatures or runner.signatures

    def finish(self) -> None:
        """Pool the passes, charge the loss to its producer, annotate the graph and cache it."""
        traced = self.job.traced
        results = _pool_copies(self.runs, self.signatures)
        loss_stats = results.pop(_LOSS, None)
        if loss_stats is not None:
            producer = traced.graph.graph["outputs"][0]
            if producer in results:
                for k in ("forward_s", "backward_s", "activation_bytes"):
                    results[producer][k] += loss_stats[k]
                # the loss has no weights: a split backward runs its backward in I
                results[producer]["backward_input_s"] += loss_stats["backward_s"]
                # kept apart too: a split backward frees them at I (compute/backward.py keeps only
                # what lies below the nodes W restarts from)
                results[producer]["loss_activation_bytes"] = loss_stats["activation_bytes"]
        for name in traced.graph.nodes:
            results[name]["param_bytes"] = traced.graph.nodes[name]["param_bytes"]
            results[name].setdefault("loss_activation_bytes", 0)
        _apply(traced.graph, results)
        traced.graph.graph["profile_cached"] = False
        if self.key:
            save_cached(self.key, {"nodes": results, "torch": torch.__version__, "device": device_label(self.device)})


def profile_graphs(jobs: Sequence[ProfileJob], device: str | torch.device = "cpu", repeats: int = 5,
                   use_cache: bool = True, seed: int = 0) -> None:
    """Annotate every job's graph (`profile_graph`), measuring those the cache lacks in shared
    passes: pass k runs over every graph before pass k+1 starts.

    Why together: plan=auto compares micro-batch counts on the profiles of their sizes, and the
    machine's speed drifts between one profile and the next. Measured one after the other, a
    size profiled in a fast minute looked cheaper than it runs; in shared passes a slow minute
    lands on every size alike, and each node's median over the passes leaves it out."""
    device = torch.device(device)
    todo = [m for m in (_Measuring(job, device, use_cache) for job in jobs) if not m.from_cache()]
    if not todo:
        return
    for m in todo:
        m.start()
    passes = max(1, min(PASSES, repeats))
    per_pass = -(-repeats // passes)
    evict = CacheEvictor(device)
    for _ in range(passes):
        for m in todo:
            m.run_pass(per_pass, seed, evict)
    del evict
    for m in todo:
        m.finish()


def profile_graph(
    traced: TracedModel,
    example_inputs: Any,
    device: str | torch.device = "cpu",
    repeats: int = 5,
    model_config: Mapping[str, Any] | None = None,
    use_cache: bool = True,
    loss: tuple[Callable[[torch.Tensor, torch.Tensor], torch.Tensor], torch.Tensor] | None = None,
    seed: int = 0,
) -> None:
    """Annotate every cost-graph node with forward_s, backward_s, activation/output/param bytes.

    `traced` may live on the meta device: each node is measured on real inputs with only the
    module it calls materialised (`_LeafwiseProfiler`). `example_inputs` is one real micro-batch.
    With `loss = (loss_fn, target)` the loss is measured too and charged to the node producing the
    model output, since the last stage pays for it. With `model_config` (the config dict that built
    the model) the result is cached under `cache_dir()`, so a sweep profiles each
    model/shape/device once; `traced.graph.graph["profile_cached"]` says whether this call hit.
    """
    profile_graphs([ProfileJob(traced, example_inputs, model_config, loss)], device, repeats, use_cache, seed)
