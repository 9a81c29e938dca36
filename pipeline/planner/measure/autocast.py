"""The dtype of every traced value under mixed precision, without running anything.

Under `precision=bf16` each stage runs under `torch.autocast`, and what crosses a stage boundary is
whatever autocast produced there: bf16 after a matmul, fp32 after a residual add of an fp32 stream,
depending on the op and on the device's autocast policy. The receiving rank must allocate the
buffer with that dtype before the message arrives, so the plan records it. The traced graph is
run once on fake tensors (no memory, no compute) that live on the run's device type, under the
same autocast, and each node's output dtype is read off.

This runs in the launcher before any rank exists, and in every rank torchrun or SLURM started
before it picks its GPU, so it must never touch a GPU: no CUDA context may open on GPU 0 (or any
GPU but a rank's own). Two torch defaults would open one there: `torch.autocast("cuda", bfloat16)`
asks the current GPU whether it supports bf16, and a fake tensor on `cuda` may create a real
one-element tensor on that device the first time (`fake_tensor.init_gpu_context`, for autograd's
sake, where torch's check of the accelerator matches; this pass runs under no_grad). Autocast's
policy is chosen by the dispatch key of the tensors' device type, not by a device, so the pass
keeps the fake tensors on `cuda:0` (CUDA's policy: softmax and layer_norm in fp32, matmuls in bf16)
but skips that first real tensor, keeps torch from making constants on the device (as
FakeTensorMode does where no GPU exists), and switches autocast on with the flags
`torch.autocast.__enter__` itself sets, without the GPU query. Whether the GPU supports bf16 is
the rank's business, where autocast runs for real.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import fx, nn
from torch._subclasses import fake_tensor
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from pipelaunch.pipeline.graph.trace import RepeatedOutputs, TracedModel, retarget


def _fake(t: torch.Tensor, mode: FakeTensorMode, device: torch.device) -> torch.Tensor:
    fake = FakeTensor(mode, t if t.device.type == "meta" else t.to("meta"), device)
    return nn.Parameter(fake, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else fake


class _DtypeRecorder(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.dtypes: dict[str, torch.dtype] = {}
        self._repeats = RepeatedOutputs()  # a copy of a block gives its twin's dtypes (runs under no_grad)

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        return self._repeats.call(self.fetch_attr(target), lambda *a, **k: super(_DtypeRecorder, self).call_module(
            target, a, k), args, kwargs)

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        if isinstance(out, torch.Tensor):
            self.dtypes[n.name] = out.dtype
        return out


class _DevicelessFakeMode(FakeTensorMode):
    """FakeTensorMode as it behaves where no GPU exists: constants (`torch.tensor(..., device=x.device)`
    in a forward) are made on the CPU and faked, never materialised on the GPU."""

    @property
    def avoid_device_init(self) -> bool:
        return True


@contextmanager
def _no_gpu_context() -> Iterator[None]:
    """Fake tensors on a GPU device without the real tensor torch makes on it for each new fake
    device (`fake_tensor.init_gpu_context`: it only matters for autograd, and this pass runs under
    no_grad)."""
    saved = fake_tensor.init_gpu_context
    fake_tensor.init_gpu_context = lambda device: None
    try:
        yield
    finally:
        fake_tensor.init_gpu_context = saved


class _GuardedOnMeta(TorchFunctionMode):
    """Tensor methods whose Python binding takes a device guard on the tensor's device
    (`x[rows]`, `x[1:3]`, `~mask`: a mixture of experts' routing) cannot run on a fake `cuda`
    tensor where torch is built without CUDA: such a call is run again on meta copies of its
    arguments and its outputs put back on `device`. Those methods do not change a dtype under
    autocast, so the meta run gives the dtype the GPU would."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's signature
        kwargs = kwargs or {}
        try:
            return func(*args, **kwargs)
        except RuntimeError as err:
            if "not linked with support for cuda" not in str(err):
                raise

        def meta(v: Any) -> Any:
            return v.to("meta") if isinstance(v, torch.Tensor) and v.device.type == "cuda" else v

        out = func(*tree_map(meta, args), **tree_map(meta, kwargs))
        return tree_map(lambda v: v.to(self.device) if isinstance(v, torch.Tensor) and v.device.type == "meta" else v,
                        out)


@contextmanager
def _autocast_policy(device_type: str, dtype: torch.dtype) -> Iterator[None]:
    """`torch.autocast(device_type, dtype)` for the ops of this thread, set through the same flags
    its __enter__ sets, without its device checks: for CUDA with bf16 those ask the current GPU
    whether it supports bf16, which opens a CUDA context on it."""
    prev = (torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type),
            torch.is_autocast_cache_enabled())
    torch.set_autocast_enabled(device_type, True)
    torch.set_autocast_dtype(device_type, dtype)
    torch.autocast_increment_nesting()
    torch.set_autocast_cache_enabled(False)  # fake tensors: nothing worth caching
    try:
        yield
    finally:
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
        torch.set_autocast_enabled(device_type, prev[0])
        torch.set_autocast_dtype(device_type, prev[1])
        torch.set_autocast_cache_enabled(prev[2])


def autocast_dtypes(traced: TracedModel, args: Any, device: torch.device, dtype: torch.dtype) -> dict[str, torch.dtype]:
    """Node name -> the dtype its output has when the model runs under autocast(device, dtype).
    Runs on fake tensors only and never initialises CUDA, whatever `device` is."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)  # any index: only the type chooses the policy, none is touched
    gm = copy.deepcopy(traced.gm)
    retarget(gm, device)
    with _no_gpu_context():
        mode = _DevicelessFakeMode(allow_non_fake_inputs=True)
        for module in gm.modules():
            for store in (module._parameters, module._buffers):
                for key, t in list(store.items()):
                    if t is not None:
                        store[key] = _fake(t, mode, device)
            for key, value in list(vars(module).items()):  # constants an export trace keeps as attributes
                if isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor):
                    setattr(module, key, _fake(value, mode, device))
        args = (args,) if isinstance(args, torch.Tensor) else tuple(args)
        fake_args = tuple(_fake(a, mode, device) if isinstance(a, torch.Tensor) else a for a in args)
        recorder = _DtypeRecorder(gm)
        guarded = _GuardedOnMeta(device) if device.type == "cuda" else contextlib.nullcontext()
        with mode, guarded, torch.no_grad(), _autocast_policy(device.type, dtype):
            recorder.run(*fake_args)
    return recorder.dtypes


def cached_autocast_dtypes(traced: TracedModel, args: Any, cuda: bool, dtype: torch.dtype | None,
                           micro_batch_size: int) -> dict[str, torch.dtype] | None:
    """`autocast_dtypes` once per traced model, run device type, dtype and size (kept in its
    graph: a search plans many candidates on each, and running the model on fake tensors took 60%
    of a cluster search's time); None without mixed precision."""
    if dtype is None:
        return None
    known = traced.graph.graph.setdefault("autocast_dtypes", {})
    key = (cuda, str(dtype), micro_batch_size)
    if key not in known:
        known[key] = autocast_dtypes(traced, args, torch.device("cuda" if cuda else "cpu"), dtype)
    return known[key]
