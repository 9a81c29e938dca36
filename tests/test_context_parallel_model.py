"""model=gpt with `model.attention=context` (pipeline/compute/context_parallel.py) on real gloo
ranks, each holding its head-tail share of every sequence's positions: the token-summed loss and
the gradients, summed over the cp ranks, are the whole model's in one process, by the ring and by
the all-to-all, on one sequence per row and on packed documents. Outside cp the model computes
what model.attention=sdpa computes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipelaunch.models.gpt import gpt
from tests.harness import run_probe

PROBE = """
import sys, torch, torch.distributed as dist
from pipelaunch.models.gpt import gpt
from pipelaunch.pipeline.compute import context_parallel as cpx
rank, cp, store, method = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=cp)
group = dist.new_group(list(range(cp)))
worst = 0.0
for packing in ("none", "documents"):
    spec = gpt(vocab_size=64, dim=32, layers=2, heads=4, seq_len=24, attention="context", data_packing=packing)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (2, 25), generator=g)
    x, y = ids[:, :-1], ids[:, 1:]
    position_ids = torch.cat([torch.arange(7), torch.arange(17)]).expand(2, 24) if packing == "documents" else None
    args = (x,) if position_ids is None else (x, position_ids)
    full = spec.build_full(0)
    logits = full(*args)
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), y.reshape(-1), reduction="sum") / y.numel()
    ref.backward()
    model = spec.build_full(0)
    cpx.activate(cpx.ContextParallel(group, method))
    pos = cpx.positions(x[:, :24 // cp])
    local = (x[:, pos],) if position_ids is None else (x[:, pos], position_ids[:, pos])
    loss = torch.nn.functional.cross_entropy(model(*local).reshape(-1, 64), y[:, pos].reshape(-1),
                                             reduction="sum") / y.numel()
    loss.backward()
    cpx.activate(None)
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    worst = max(worst, float((total - ref.detach()).abs() / ref.detach().abs()))
    # a key bias's gradient is zero in exact arithmetic (softmax ignores a shift of a query's every
    # score): measured against 1e-3 of the largest gradient, as tests/harness.py measures
    floor = 1e-3 * max(float(r.grad.norm()) for r in full.parameters())
    for (name, p), (_, r) in zip(model.named_parameters(), full.named_parameters()):
        grad = p.grad.clone()
        dist.all_reduce(grad, group=group)
        worst = max(worst, float((grad - r.grad).norm()) / max(float(r.grad.norm()), floor))
print(worst)
dist.destroy_process_group()
"""


def test_outside_cp_the_context_attention_is_sdpas() -> None:
    """The same weights, inputs and outputs as model.attention=sdpa (and with packed documents)."""
    for packing in ("none", "documents"):
        a = gpt(vocab_size=64, dim=32, layers=2, heads=4, seq_len=16, attention="context", data_packing=packing)
        b = gpt(vocab_size=64, dim=32, layers=2, heads=4, seq_len=16, data_packing=packing)
        x = torch.randint(0, 64, (2, 16))
        args = (x,) if packing == "none" else (x, torch.cat([torch.arange(5), torch.arange(11)]).expand(2, 16))
        torch.testing.assert_close(a.build_full(0)(*args), b.build_full(0)(*args), rtol=1e-6, atol=1e-6)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("method", "cp"), [("ring", 2), ("alltoall", 2), ("ring", 3)])
def test_a_cp_ranks_share_of_the_sequence_trains_as_the_whole_model(method: str, cp: int, tmp_path: Path) -> None:
    worst = max(float(out.split()[-1]) for out in run_probe(PROBE, cp, tmp_path, method))
    assert worst < 1e-5, worst
