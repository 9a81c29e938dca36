"""Attention over a cp group, by the ring (pipeline/compute/ring_attention.py) and by all-to-all
over heads (ulysses_attention.py), on real gloo ranks: each
rank's output and the gradients of its queries, keys and values are those of
`scaled_dot_product_attention` over the whole sequence, causal, with packed documents, and
without a mask, with grouped-query keys (the ring moves their own heads) and with values of
another head size; the head-tail positions balance the causal work."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipelaunch.pipeline.compute.ring_attention import balanced_positions
from tests.harness import run_probe

PROBE = """
import sys, torch, torch.distributed as dist
from pipelaunch.pipeline.compute.ring_attention import balanced_positions, ring_attention
from pipelaunch.pipeline.compute.ulysses_attention import ulysses_attention
rank, cp, store, method = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
attend = ring_attention if method == "ring" else ulysses_attention
dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=cp)
group = dist.new_group(list(range(cp)))
B, H, T, D = 2, 6, 24, 8
worst = 0.0
for case in ("causal", "documents", "full", "grouped", "values"):
    if case == "grouped" and method == "alltoall" and 3 % cp:
        continue  # the all-to-all splits the key heads too: its caller repeats them (context_parallel)
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(B, H, T, D, generator=g) for _ in range(4))
    if case == "grouped":  # grouped-query attention: 3 key/value heads, each read by 2 query heads
        k, v = k[:, :3].contiguous(), v[:, :3].contiguous()
    if case == "values":  # DeepSeek-V3's attention: values of another head size than the keys'
        v, dout = (torch.randn(B, H, T, 12, generator=g) for _ in range(2))
    doc = torch.tensor([[0] * 5 + [1] * 11 + [2] * 8, [0] * 13 + [1] * 11])
    causal = case != "full"
    mask = torch.ones(T, T, dtype=torch.bool).tril() if causal else torch.ones(T, T, dtype=torch.bool)
    if case == "documents":
        mask = mask & (doc[:, :, None] == doc[:, None, :])
    mask = mask if mask.dim() == 3 else mask.expand(B, T, T)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = torch.nn.functional.scaled_dot_product_attention(*full, attn_mask=mask[:, None], enable_gqa=case == "grouped")
    ref.backward(dout)
    pos = balanced_positions(T, cp, rank)
    mine = [t[:, :, pos].clone().requires_grad_() for t in (q, k, v)]
    out = attend(*mine, pos, group, causal=causal, doc=doc[:, pos] if case == "documents" else None)
    out.backward(dout[:, :, pos])
    pairs = [(out, ref[:, :, pos])] + [(m.grad, f.grad[:, :, pos]) for m, f in zip(mine, full)]
    for got, want in pairs:
        worst = max(worst, float((got - want).abs().max() / want.abs().max()))
print(worst)
dist.destroy_process_group()
"""


def test_the_head_tail_balance_gives_each_rank_two_chunks_and_equal_causal_work() -> None:
    parts = [balanced_positions(16, 4, r) for r in range(4)]
    assert torch.equal(torch.sort(torch.cat(parts)).values, torch.arange(16))
    assert parts[1].tolist() == [2, 3, 12, 13]
    assert len({int((p[:, None] >= torch.arange(16)[None]).sum()) for p in parts}) == 1  # keys each scores
    with pytest.raises(ValueError, match="2 x cp"):
        balanced_positions(12, 4, 0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("method", "cp"), [("ring", 2), ("ring", 3), ("alltoall", 2), ("alltoall", 3)])
def test_cp_attention_is_scaled_dot_product_attention_over_the_whole_sequence(method: str, cp: int,
                                                                             tmp_path: Path) -> None:
    """Both methods, on 2 and 3 ranks (6 heads: the all-to-all splits them)."""
    worst = max(float(out.split()[-1]) for out in run_probe(PROBE, cp, tmp_path, method))
    assert worst < 1e-5, worst
