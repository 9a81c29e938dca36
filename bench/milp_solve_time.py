"""How long the MILP partitioner takes on big synthetic DAGs, and how close it gets to the bound.

Why synthetic: traced real models of 10^4 nodes are slow to build on CPU; a layered random DAG with
skips has the same shape of problem (fan-in, fan-out, long edges). Run: `python bench/milp_solve_time.py`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipelaunch.pipeline.planner.partition import balanced, milp_partition  # noqa: E402
from tests.synthetic import synthetic_dag  # noqa: E402  (made-up cost graphs live with the tests)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[500, 2000, 10000])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--time-limit", type=float, default=5.0)
    parser.add_argument("--max-nodes", type=int, default=200)
    parser.add_argument("--bandwidth", type=float, default=1e9, help="bytes/s between stages")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    header = (
        f"{'nodes':>6} {'edges':>6} {'coarse':>6} {'solve_s':>8} {'total_s':>8} {'status':>6} "
        f"{'milp/LB':>8} {'bal/LB':>8} {'bal_s':>6} {'chosen':>8}"
    )
    print(
        f"stages={args.stages} time_limit={args.time_limit}s max_nodes={args.max_nodes} bandwidth={args.bandwidth:g}"
    )
    print(header)
    for n in args.sizes:
        g = synthetic_dag(n, seed=args.seed, skip_prob=0.2)
        t0 = time.perf_counter()
        b = balanced(g, args.stages, bandwidth=args.bandwidth)
        bal_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        m = milp_partition(
            g, args.stages, bandwidth=args.bandwidth, time_limit=args.time_limit, max_nodes=args.max_nodes
        )
        total = time.perf_counter() - t0
        lb = m.lower_bound_s
        print(
            f"{n:>6} {g.number_of_edges():>6} {m.info.get('coarse_nodes', '-'):>6} "
            f"{m.info.get('solve_s', float('nan')):>8.2f} {total:>8.2f} {m.info.get('status', '-'):>6} "
            f"{m.bottleneck_s / lb:>8.4f} {b.bottleneck_s / lb:>8.4f} {bal_s:>6.2f} {m.info.get('chosen', m.method):>8}"
        )


if __name__ == "__main__":
    main()
