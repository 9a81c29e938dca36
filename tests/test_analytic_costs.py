"""Operators priced on meta tensors by a roofline on a hardware file (pipeline/planner/measure/analytic.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from pipelaunch.models.gpt import DecoderBlock
from pipelaunch.pipeline.core.hardware import load_hardware
from pipelaunch.pipeline.planner.measure.analytic import forward_backward, price

HW = load_hardware("h100_sxm")


def test_a_matmul_is_priced_at_the_longer_of_its_flops_and_its_bytes():
    with torch.device("meta"):
        big = nn.Linear(4096, 4096, bias=False).to(torch.bfloat16)
        x = torch.empty(8192, 4096, dtype=torch.bfloat16)
        thin = torch.empty(1, 4096, dtype=torch.bfloat16)
    total = price(lambda: big(x), HW)
    flops = 2 * 8192 * 4096 * 4096
    assert total.flops == flops and total.kernels == 1
    assert total.seconds == pytest.approx(flops / HW.matmul_flops("bf16") + HW.launch_s)
    one = price(lambda: big(thin), HW)  # one token: the weight's bytes decide
    weight = 4096 * 4096 * 2
    assert one.seconds == pytest.approx((weight + 2 * 4096 * 2) / HW.bytes_per_s() + HW.launch_s)


def test_a_block_counts_torchs_flops_and_its_backward_is_priced_apart():
    """The forward's FLOPs are those torch's counter gives the same block; attention is one fused
    kernel each way, its backward charged to the backward pass."""
    with torch.device("meta"):
        block = DecoderBlock(256, 4).to(torch.bfloat16)
        x = torch.empty(2, 128, 256, dtype=torch.bfloat16)
    with FlopCounterMode(display=False) as counter:
        block(x)
    fwd, bwd = forward_backward(block, (x,), HW)
    assert fwd.flops == counter.get_total_flops()
    attention = 4.0 * 2 * 4 * 128 * 128 * 64
    assert bwd.flops == pytest.approx(2 * (fwd.flops - attention) + 2.5 * attention, rel=0.02)
    assert 1.5 < bwd.seconds / fwd.seconds < 3
    mixed_f, mixed_b = forward_backward(block, (x,), HW, master_weights=True)
    casts = 6.0 * sum(p.numel() for p in block.parameters() if p.dim() > 1) / HW.bytes_per_s() + HW.launch_s
    assert mixed_f.seconds == pytest.approx(fwd.seconds + casts) and mixed_b.seconds == pytest.approx(bwd.seconds + casts)


def test_the_command_prices_a_block_on_a_named_file(capsys):
    from pipelaunch.pipeline.planner.measure.analytic import main

    assert main(["--hardware", "a100_80gb", "--hidden", "512", "--heads", "8", "--seq", "256"]) == 0
    out = capsys.readouterr().out
    assert "forward" in out and "backward" in out and "hardware=a100_80gb" in out
    assert main(["--hardware", "tpu_v9"]) == 2
