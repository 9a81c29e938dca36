"""A model's costs computed, not measured: each operator a forward and backward run on meta tensors
priced by a roofline on a hardware file (`pipeline/core/hardware.py`).

Why: the profile times the layers on the machine that plans, so it cannot price a GPU cluster from
a laptop, nor a model too big to build. On meta tensors every operator still runs (its shapes, no
data), so each one's FLOPs (torch's own formulas, `torch.utils.flop_counter`) and the bytes it
reads and writes are known; on a device, an operator takes the longer of its FLOPs over the
matmul rate and its bytes over the memory bandwidth the file gives (both at their efficiencies),
plus a launch. Views move nothing and cost nothing.

What it does not see: kernel fusion (a compiled or fused kernel moves fewer bytes than its
operators), attention kernels that never materialise the scores (on meta, attention runs the
operators its CPU path decomposes into, which may read the scores' bytes), and overlap between
kernels. bench/analytic_layer.py holds its predictions against one GPT block measured on an H200.

    python -m pipelaunch.pipeline.planner.measure.analytic --hardware h100_sxm --hidden 8192 --heads 64 --batch 2

prices one decoder block of the project's GPT (bf16, fp32 master weights) on a hardware file.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn import functional as F  # noqa: N812
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from pipelaunch.pipeline.compute.selective import kept
from pipelaunch.pipeline.core.hardware import Hardware

aten = torch.ops.aten
#: operators that only re-describe their input's memory (no kernel, no bytes moved)
VIEWS = {aten.view, aten._unsafe_view, aten.t, aten.transpose, aten.permute, aten.expand, aten.alias, aten.detach,
         aten.slice, aten.select, aten.unsqueeze, aten.squeeze, aten.as_strided, aten.split, aten.split_with_sizes,
         aten.unbind, aten.chunk, aten.reshape, aten.lift_fresh, aten.empty, aten.empty_like, aten.zeros_like,
         aten.ones_like, aten.new_empty, aten.empty_strided, aten.new_empty_strided}
DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_bytes(v) for v in value)
    if isinstance(value, dict):
        return sum(_bytes(v) for v in value.values())
    return 0


@dataclass
class Roofline:
    """What the operators of one pass cost on a device: FLOPs, bytes, seconds, kernels."""

    flops: float = 0.0
    bytes: float = 0.0
    seconds: float = 0.0
    kernels: int = 0
    #: what the selective recomputation policy keeps (its kept operators' outputs) and the seconds
    #: of the operators it would rerun (pipeline/compute/selective.py)
    kept_bytes: float = 0.0
    rerun_seconds: float = 0.0


class _Priced(TorchDispatchMode):
    def __init__(self, hw: Hardware, matmul_dtype: str | None, tf32: bool) -> None:
        super().__init__()
        self.hw, self.matmul_dtype, self.tf32 = hw, matmul_dtype, tf32
        self.total = Roofline()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        if packet in VIEWS:
            return out
        flops = float(flop_registry[packet](*args, **kwargs, out_val=out)) if packet in flop_registry else 0.0
        seconds = self.kernel(flops, _bytes(args) + _bytes(kwargs) + _bytes(out), self._dtype(out))
        if kept(packet):
            self.total.kept_bytes += _bytes(out)
        else:
            self.total.rerun_seconds += seconds
        return out

    def kernel(self, flops: float, nbytes: float, dtype: str | torch.dtype, work: float = 1.0) -> float:
        """One kernel: the longer of its FLOPs (`work` of them done) at the matmul rate and its bytes
        at the memory rate, plus a launch (its seconds, returned)."""
        if isinstance(dtype, torch.dtype):
            dtype = self.matmul_dtype or DTYPES.get(dtype, "fp32")
        seconds = nbytes / self.hw.bytes_per_s()
        if flops:
            seconds = max(seconds, work * flops / self.hw.matmul_flops(dtype))
        self.total.flops += flops
        self.total.bytes += nbytes
        self.total.seconds += seconds + self.hw.launch_s
        self.total.kernels += 1
        return seconds + self.hw.launch_s

    def _dtype(self, out) -> str:
        tensor = out if isinstance(out, torch.Tensor) else next((t for t in out if isinstance(t, torch.Tensor)), None)
        dtype = DTYPES.get(tensor.dtype, "fp32") if tensor is not None else "fp32"
        if self.matmul_dtype is not None:
            return self.matmul_dtype
        return "tf32" if dtype == "fp32" and self.tf32 else dtype


#: the pricing passes running (innermost last)
_ACTIVE: list[_Priced] = []


class _FusedAttention(torch.autograd.Function):
    """Scaled dot-product attention as a GPU runs it: one fused kernel each way (FlashAttention),
    reading q, k, v (and the output's gradient) and writing the output (the input gradients), never
    the scores. Its FLOPs are torch's count for the fused kernel; a causal mask skips half the work
    (the time), not the count."""

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, mode: _Priced, mask_bytes: int = 0):
        ctx.save_for_backward(q, k, v)
        ctx.causal, ctx.mask_bytes = causal, mask_bytes
        out = q.new_empty((*q.shape[:-1], v.shape[-1]))
        flops = 4.0 * q.shape[:-2].numel() * q.shape[-2] * k.shape[-2] * q.shape[-1]
        mode.kernel(flops, _bytes((q, k, v, out)) + mask_bytes, out.dtype, 0.5 if causal else 1.0)
        # the selective policy keeps a fused kernel's output and its log-sum-exp (fp32, per query)
        mode.total.kept_bytes += _bytes(out) + 4 * q.shape[:-1].numel()
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v = ctx.saved_tensors
        flops = 2.5 * 4.0 * q.shape[:-2].numel() * q.shape[-2] * k.shape[-2] * q.shape[-1]
        if _ACTIVE:  # the backward is priced by the pass running it, not the forward's
            _ACTIVE[-1].kernel(flops, 2 * _bytes((q, k, v)) + 2 * _bytes(grad) + ctx.mask_bytes, grad.dtype,
                               0.5 if ctx.causal else 1.0)
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None, None, None


class _FuseAttention(TorchFunctionMode):
    """Routes `F.scaled_dot_product_attention` to `_FusedAttention` while pricing."""

    def __init__(self, mode: _Priced) -> None:
        super().__init__()
        self.mode = mode

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in ATTENTION and 3 <= len(args) <= 6:
            # (q, k, v, attn_mask, dropout_p, is_causal), positional or by name (an exported
            # graph passes them positionally). An explicit mask (a packed-document mask) runs the
            # memory-efficient kernel: it reads the mask and does the whole square of work;
            # is_causal skips half of it
            named = dict(zip(("attn_mask", "dropout_p", "is_causal"), args[3:], strict=False)) | kwargs
            mask = named.get("attn_mask")
            causal = bool(named.get("is_causal", False)) and mask is None
            with torch._C.DisableTorchFunction():
                return _FusedAttention.apply(*args[:3], causal, self.mode, _bytes(mask))
        return func(*args, **kwargs)


#: scaled dot-product attention as a model calls it, or as an exported graph records it
ATTENTION = (F.scaled_dot_product_attention, aten.scaled_dot_product_attention.default)


def price(run: Callable[[], object], hw: Hardware, matmul_dtype: str | None = None, tf32: bool = False,
          mode: _Priced | None = None) -> Roofline:
    """The roofline cost of everything `run` computes (on meta tensors: shapes only); attention
    priced as one fused kernel."""
    mode = mode or _Priced(hw, matmul_dtype, tf32)
    _ACTIVE.append(mode)
    try:
        with mode, _FuseAttention(mode):
            run()
    finally:
        _ACTIVE.pop()
    return mode.total


def forward_backward(module: torch.nn.Module, args: tuple[torch.Tensor, ...], hw: Hardware,
                     matmul_dtype: str | None = None, master_weights: bool = False) -> tuple[Roofline, Roofline]:
    """A module's forward and backward on meta, each priced: `module` and `args` on the meta
    device, in the dtypes the run computes in. `master_weights`: the parameters are fp32 under a
    bf16 autocast (precision=bf16): each forward casts every weight (reads 4 bytes, writes 2 a
    parameter) and each backward casts its gradient back (reads 2, writes 4), priced as one
    memory-bound kernel each way."""
    inputs = [a.detach().requires_grad_(a.is_floating_point()) for a in args]
    holder: dict = {}
    for p in module.parameters():  # a gradient left by an earlier pass would add an accumulation
        p.grad = None

    def forward() -> None:
        holder["out"] = module(*inputs)

    fwd = price(forward, hw, matmul_dtype)
    out = holder["out"]
    out = out if isinstance(out, torch.Tensor) else next(t for t in out if isinstance(t, torch.Tensor))
    grad = torch.empty_like(out)
    bwd = price(lambda: out.backward(grad), hw, matmul_dtype)
    for p in module.parameters():
        p.grad = None
    if master_weights:
        count = sum(p.numel() for p in module.parameters() if p.dim() > 1)  # autocast casts matmul weights
        for total in (fwd, bwd):
            seconds = 6.0 * count / hw.bytes_per_s()
            total.bytes += 6.0 * count
            total.seconds += seconds + hw.launch_s
            total.kernels += 1
    return fwd, bwd


def main(argv: list[str] | None = None) -> int:
    """One GPT decoder block's forward and backward priced on a hardware file."""
    import argparse
    import sys

    from pipelaunch.models.gpt import DecoderBlock
    from pipelaunch.pipeline.core.errors import ConfigError
    from pipelaunch.pipeline.core.hardware import load_hardware

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--hardware", default="h100_sxm", help="conf/hardware/<name>.yaml")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--batch", type=int, default=1, help="sequences per micro-batch")
    parser.add_argument("--seq", type=int, default=2048)
    args = parser.parse_args(argv)
    try:
        hw = load_hardware(args.hardware)
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2
    with torch.device("meta"):
        block = DecoderBlock(args.hidden, args.heads).to(torch.bfloat16)
        x = torch.empty(args.batch, args.seq, args.hidden, dtype=torch.bfloat16)
    fwd, bwd = forward_backward(block, (x,), hw, master_weights=True)
    for what, total in (("forward", fwd), ("backward", bwd)):
        print(f"{what:8s} {total.seconds * 1e3:8.2f} ms  {total.flops / 1e12:7.2f} TFLOP  "
              f"{total.flops / total.seconds / 1e12:6.0f} TFLOP/s  {total.bytes / 1e9:6.2f} GB  {total.kernels} kernels")
    print(hw.source)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
