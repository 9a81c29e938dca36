"""The profile of a traced model computed on a hardware file instead of measured here: every
node's forward, backward and split backward (I, W) priced by the roofline of `analytic.py`, its
saved and output bytes counted, all on meta tensors.

Why: `hardware=<gpu>` plans a cluster from a laptop. The measured profile runs each layer on this
machine's CPU (it cannot price an H100, and a 70B model's layers do not fit here); on the meta
device every operator still runs with its shapes, so its FLOPs, the bytes it moves and the
tensors autograd saves are known without a byte of weights. The fields are the measured
profile's (`profile.PROFILE_FIELDS`), so the partitioners, the schedules, the simulator and the
memory model read them unchanged; the graph says where they came from
(`graph.graph["profile_source"]`).

What it models of a GPU: attention as one fused kernel (FlashAttention), autocast's weight
casts under bf16 (master weights in fp32), each kernel's launch; not kernel fusion beyond that,
nor overlap between kernels (bench/analytic_layer.py holds it against a measured H200 block).
Copies of one layer (equal `profile._signature`) are priced once.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx, nn

from pipelaunch.pipeline.compute.backward import WeightGradStash, backward_input, backward_weight
from pipelaunch.pipeline.core.hardware import Hardware
from pipelaunch.pipeline.graph.trace import COMPUTE_OPS, RepeatedOutputs, fresh_like
from pipelaunch.pipeline.planner.measure.analytic import price
from pipelaunch.pipeline.planner.measure.profile import (
    _LOSS,
    MIN_TIME_S,
    ProfileJob,
    _fetch,
    _leafify,
    _Measuring,
    _nbytes,
    _node_callable,
    _Op,
    _requiring_grad,
    _signature,
    _tensors,
    stash_gradients,
)

META = torch.device("meta")


def _lowered(value: Any, dtype: torch.dtype | None) -> Any:
    """`value` with its floating-point tensors in `dtype` (the dtype a bf16 run computes in)."""
    if dtype is None:
        return value
    if isinstance(value, torch.Tensor):
        if not value.is_floating_point():
            return value
        out = value.detach().to(dtype)
        return nn.Parameter(out, requires_grad=value.requires_grad) if isinstance(value, nn.Parameter) else out
    if isinstance(value, (list, tuple)):
        return type(value)(_lowered(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _lowered(v, dtype) for k, v in value.items()}
    return value


def _inputs(value: Any, input_grads: bool = True) -> Any:
    """`profile._leafify`, but a parameter passed as an argument stays itself: meta tensors have no
    addresses, so what autograd saves of it is known as a weight by its identity. Without
    `input_grads`, the other tensors are passed as they are (an in-place op on its input)."""
    if isinstance(value, nn.Parameter):
        return value
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields") and not isinstance(value, torch.Size) \
            and any(isinstance(v, nn.Parameter) for v in _tensors(value)):
        return type(value)(_inputs(v, input_grads) for v in value)
    if isinstance(value, dict):
        return {k: _inputs(v, input_grads) for k, v in value.items()}
    return _leafify(value) if input_grads else value


def _kept_bytes(stash: WeightGradStash) -> int:
    """What a split backward keeps from I to W, each tensor once (by identity: meta tensors have no
    addresses)."""
    return sum({id(g): _nbytes(g) for g in stash_gradients(stash)}.values())


def price_op(fn: Callable[..., Any], args: Sequence[Any], kwargs: dict, params: Sequence[torch.Tensor],
             hw: Hardware, matmul_dtype: str | None, cast_weights: bool = False) -> dict[str, Any]:
    """One node's profile fields, priced: forward, fused backward, the runtime's split backward
    (I, then W), the bytes autograd saves (parameters excluded), its outputs' bytes and what W
    keeps. `cast_weights`: autocast casts each matmul weight every forward (fp32 master weights
    under bf16) and its gradient back every backward: one memory-bound kernel each way. An op
    autograd refuses on leaf inputs (in place: Mixtral's router renormalising its top-k weights
    with `/=`) is priced on its inputs as given, as the measured profile does (`measure_op`)."""
    try:
        return _price_op(fn, args, kwargs, params, hw, matmul_dtype, cast_weights, True)
    except RuntimeError:
        return _price_op(fn, args, kwargs, params, hw, matmul_dtype, cast_weights, False)


def _price_op(fn: Callable[..., Any], args: Sequence[Any], kwargs: dict, params: Sequence[torch.Tensor],
              hw: Hardware, matmul_dtype: str | None, cast_weights: bool, input_grads: bool) -> dict[str, Any]:
    op = _Op(fn, _inputs(list(args), input_grads), _inputs(dict(kwargs), input_grads), params, META, None)
    param_ids = {id(p) for p in params}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        # meta tensors have no addresses: a view is known by its base (a weight's transpose is the
        # weight; q, k and v's three views of one input are one tensor)
        base = t._base if t._base is not None else t
        if id(base) not in param_ids:
            saved[id(base)] = _nbytes(base)
        return t

    held: dict[str, Any] = {}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward = price(lambda: held.__setitem__("out", op()), hw, matmul_dtype)
    outs = _requiring_grad(held["out"])
    output_bytes = sum(_nbytes(t) for t in _tensors(held["out"]))
    result = {"activation_bytes": int(sum(saved.values())), "output_bytes": int(output_bytes), "stash_bytes": 0,
              "selective_kept_bytes": int(forward.kept_bytes),
              "selective_share": forward.rerun_seconds / forward.seconds if forward.seconds > 0 else 1.0}
    count = sum(p.numel() for p in params if p.dim() > 1) if cast_weights else 0
    cast_s = 6.0 * count / hw.bytes_per_s() + hw.launch_s if count else 0.0
    times = {"forward_s": forward.seconds + cast_s, "backward_s": 0.0, "backward_input_s": 0.0,
             "backward_weight_s": 0.0}
    backward = None
    if outs and (op.grad_inputs or op.grad_params):
        grads = [torch.empty_like(t) for t in outs]
        backward = price(lambda: op.backward(outs, grads), hw, matmul_dtype)
        times["backward_s"] = backward.seconds + cast_s
        # a fresh graph for the split backward, built as the priced forward built its own (attention
        # as the fused kernel: outside `price` it is the decomposition, whose backward reads the
        # scores); what this forward costs is not counted again
        price(lambda: held.__setitem__("again", op()), hw, matmul_dtype)
        outs = _requiring_grad(held.pop("again"))
        split = price(lambda: held.__setitem__("stash", backward_input(outs, grads, op.leaves, op.grad_params)[1]),
                      hw, matmul_dtype)
        stash = held.pop("stash")
        result["stash_bytes"] = _kept_bytes(stash) if op.grad_params else 0
        weight = price(lambda: backward_weight(stash), hw, matmul_dtype)
        times["backward_input_s"] = split.seconds
        times["backward_weight_s"] = weight.seconds + cast_s
    for t in op.grad_inputs + op.grad_params:
        t.grad = None
    times = {k: max(v, MIN_TIME_S) if v else 0.0 for k, v in times.items()}
    flops = forward.flops + (backward.flops if backward is not None else 0.0)
    return {**times, **result, "flops": flops, "samples": {k: [v] for k, v in times.items()}}


class _AnalyticRunner(fx.Interpreter):
    """Runs a meta graph node by node, pricing each compute node on `hw` (copies priced once)."""

    def __init__(self, gm: fx.GraphModule, hw: Hardware, dtype: torch.dtype | None) -> None:
        super().__init__(gm)
        self.hw, self.dtype = hw, dtype
        self.matmul_dtype = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype) if dtype else None
        self.results: dict[str, dict[str, Any]] = {}
        self.signatures: dict[str, str] = {}
        self._priced: dict[str, dict[str, Any]] = {}
        self._repeats = RepeatedOutputs()  # a copy of a block passes its twin's output on
        #: an operator's output per signature: an 80-layer graph's copies (5.7k aten ops) each ran
        #: its meta kernel, half of pricing it; views are always run (they share their input's storage)
        self._outputs: dict[str, Any] = {}

    def run_node(self, n: fx.Node) -> Any:
        if n.op == "get_attr":
            return _fetch(self.module, n.target)
        if n.op not in COMPUTE_OPS:
            return super().run_node(n)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        module = self.module.get_submodule(n.target) if n.op == "call_module" else None
        fn, params = _node_callable(self.module, n, module)
        params = params + [a for a in _tensors([args, kwargs]) if isinstance(a, nn.Parameter)]
        sig = self.signatures[n.name] = _signature(n, fn, module, args, kwargs, params)
        if sig not in self._priced:
            self._priced[sig] = self._price(n, module, args, kwargs)
        self.results[n.name] = copy.deepcopy(self._priced[sig])
        if module is None and sig in self._outputs:  # an operator's copy: its twin's output, fresh
            return torch.utils._pytree.tree_map(fresh_like, self._outputs[sig])
        with torch.no_grad():
            out = fn(*args, **kwargs) if module is None else self._repeats.call(module, fn, args, kwargs)
        if module is None and all(_owned(v) for v in torch.utils._pytree.tree_leaves(out)):
            self._outputs[sig] = out
        return out

    def _price(self, n: fx.Node, module: nn.Module | None, args: Any, kwargs: Any) -> dict[str, Any]:
        """The node priced in the dtype the run computes in (a copy of its module on meta)."""
        if module is not None and self.dtype is not None:
            module = copy.deepcopy(module).to(self.dtype)
        fn, params = _node_callable(self.module, n, module)
        args, kwargs = _lowered(args, self.dtype), _lowered(kwargs, self.dtype)
        params = params + [a for a in _tensors([args, kwargs]) if isinstance(a, nn.Parameter)]
        return price_op(fn, args, kwargs, params, self.hw, self.matmul_dtype, cast_weights=self.dtype is not None)


def _owned(value: Any) -> bool:
    """A value a copy of its node may be handed afresh: a plain value, or a tensor owning its
    storage from the start (not a view of an input, whose storage it would share)."""
    if isinstance(value, torch.Tensor):
        return not value._is_view() and value.storage_offset() == 0
    return value is None or isinstance(value, (int, float, bool, torch.dtype, torch.device))


class _Pricing(_Measuring):
    """A job priced on a hardware file: one pass, nothing cached (pricing is deterministic and
    takes a fraction of a second per distinct layer)."""

    def __init__(self, job: ProfileJob, hw: Hardware, dtype: torch.dtype | None) -> None:
        super().__init__(job, META, use_cache=False)
        self.hw, self.dtype = hw, dtype

    def run_pass(self, repeats: int = 1, seed: int = 0, evict: Any = None) -> None:
        runner = _AnalyticRunner(self.job.traced.gm, self.hw, self.dtype)
        value = next(iter(_tensors(runner.run(*self.args))), None)
        if self.loss_of is not None and value is not None:
            loss_of = self.loss_of
            results = price_op(lambda x: loss_of(x.float()) if self.dtype else loss_of(x), (_lowered(value, self.dtype),),
                               {}, [], self.hw, runner.matmul_dtype)
            runner.results[_LOSS] = results
        self.runs.append(runner.results)
        self.signatures = self.signatures or runner.signatures
        #: the model's FLOPs per micro-batch, forward and backward (what MFU counts)
        self.flops = sum(float(r.get("flops", 0.0)) for r in runner.results.values())


def price_graphs(jobs: Sequence[ProfileJob], hw: Hardware, dtype: torch.dtype | None = None) -> None:
    """Annotate every job's graph with its profile priced on `hw` (the fields `profile_graphs`
    measures), computing in `dtype` (bf16 under precision=bf16; None: as traced)."""
    for job in jobs:
        pricing = _Pricing(job, hw, dtype)
        pricing.start()
        pricing.run_pass()
        pricing.finish()
        job.traced.graph.graph["profile_source"] = hw.source
        job.traced.graph.graph["model_flops"] = pricing.flops
