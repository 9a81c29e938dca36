"""The dtype of every traced value under mixed precision, without running anything.

Under `precision=bf16` each stage runs under `torch.autocast`, and what crosses a stage boundary is
whatever autocast produced there: bf16 after a matmul, fp32 after a residual add of an fp32 stream,
depending on the op and on the device's autocast policy. The receiving rank must allocate the
buffer with that dtype before the message arrives, so the plan records it. The traced graph is
run once on fake tensors (no memory, no compute) that live on the run's device type, under the
same autocast, and each node's output dtype is read off.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from pipeline.graph.trace import TracedModel, retarget


def _fake(t: torch.Tensor, mode: FakeTensorMode, device: torch.device) -> torch.Tensor:
    fake = FakeTensor(mode, t if t.device.type == "meta" else t.to("meta"), device)
    return nn.Parameter(fake, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else fake


class _DtypeRecorder(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.dtypes: dict[str, torch.dtype] = {}

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        if isinstance(out, torch.Tensor):
            self.dtypes[n.name] = out.dtype
        return out


def autocast_dtypes(traced: TracedModel, args: Any, device: torch.device, dtype: torch.dtype) -> dict[str, torch.dtype]:
    """Node name -> the dtype its output has when the model runs under autocast(device, dtype)."""
    gm = copy.deepcopy(traced.gm)
    retarget(gm, device)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
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
    with mode, torch.no_grad(), torch.autocast(device.type, dtype=dtype):
        recorder.run(*fake_args)
    return recorder.dtypes
