"""What the interleaved training benchmarks share: their round options and the loop that runs
each setting once per round, side by side (remat_modes.py, moe_overlap.py)."""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path


def round_options(parser: argparse.ArgumentParser) -> None:
    """--rounds / --steps / --warmup / --quick and the overrides for every run."""
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="2 rounds x 4 steps, 1 warm-up")
    parser.add_argument("extra", nargs="*", help="more overrides for every run")


def interleaved(args: argparse.Namespace, settings: Sequence[str], run: Callable[..., dict],
                label: Callable[[str], str], prefix: str) -> list[dict[str, dict]]:
    """Each round runs every setting once (`run(setting, steps, warmup, out, extra)`), in order,
    so a ratio between settings comes from runs side by side; a line per round as it ends."""
    if args.quick:
        args.rounds, args.steps, args.warmup = 2, 4, 1
    rounds: list[dict[str, dict]] = []
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        for i in range(args.rounds):
            rounds.append({s: run(s, args.steps, args.warmup, Path(tmp) / f"round{i}", args.extra) for s in settings})
            print(f"round {i + 1}/{args.rounds}: " + ", ".join(f"{label(s)} {r['step_s'] * 1e3:.0f} ms"
                                                               for s, r in rounds[-1].items()), flush=True)
    return rounds
