"""Partition quality on measured costs: gpt_bench's shape with 4 blocks (hundreds of operators),
traced to operator level and profiled on this machine (5 repeats), cut into 4 stages. balanced
and milp must land within 8% of the lower bound max(total / stages, slowest node) (measured
1.02-1.05x: the rest is how finely the op chain can be cut, which moves with the timing noise of
single ops), milp never above balanced; uniform is reported for comparison."""

from __future__ import annotations

import torch

from pipelaunch.models.gpt import gpt
from pipelaunch.pipeline.graph.trace import trace_model
from pipelaunch.pipeline.planner.measure.profile import profile_graph
from pipelaunch.pipeline.planner.partition import balanced, milp_partition, uniform
from tests.harness import ROOT, use_stored_profile

STORED = ROOT / "tests" / "data" / "validation-cache"


def test_balanced_and_milp_near_lower_bound_on_profiled_gpt_bench(capsys, monkeypatch, tmp_path) -> None:
    """On a stored profile of gpt_bench (4 blocks, measured on a quiet machine with one thread):
    the partitioners' quality, not this machine's timing noise, is what is checked (a profile
    measured under load has put balanced's optimal contiguous split at 1.10x the bound, a bound
    no split need reach)."""
    use_stored_profile(monkeypatch, tmp_path / "cache", STORED / "gpt-bench4-profile.json",
                       STORED / "sgd-temporaries.json")
    spec = gpt(vocab_size=4096, dim=256, layers=4, heads=4, seq_len=128, name="gpt_bench")
    tokens = torch.randint(0, 4096, (4, 128))
    traced = trace_model(spec.build_full(0), tokens)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        profile_graph(traced, (tokens,), repeats=5, model_config={"name": "gpt_bench", "micro_batch": 4, "threads": 1})
    finally:
        torch.set_num_threads(threads)
    results = {f.__name__: f(traced.graph, 4) for f in (uniform, balanced, milp_partition)}
    with capsys.disabled():
        for name, p in results.items():
            print(f"\n{name:>15}: bottleneck {p.bottleneck_s * 1e3:.2f} ms = {p.bottleneck_s / p.lower_bound_s:.3f} x bound")
    for name in ("balanced", "milp_partition"):
        assert results[name].bottleneck_s <= 1.08 * results[name].lower_bound_s, name
    assert results["milp_partition"].bottleneck_s <= results["balanced"].bottleneck_s * (1 + 1e-9)
    assert results["balanced"].bottleneck_s <= results["uniform"].bottleneck_s
