"""Each rank holds its own stages, and the launcher holds no weights: peak memory per rank beside
its stages' parameter bytes and the whole model's, for a GPT of about 400M parameters at pp=4.

    python bench/memory_by_stage.py            # chain and tied-embedding variants, 2 SGD steps each
    python bench/memory_by_stage.py --variants chain --steps 1

Each variant is one `python train.py ...` (real ranks, gloo, CPU). A rank's peak is its process's
peak resident memory less torch's code pages (`metrics.json` ranks[].peak_memory_bytes); the launcher's is `launcher_peak_memory_bytes`.
A bare process that has imported torch and the project is measured too: every peak includes it.
With SGD (no momentum) a rank holds its parameters, their gradients, and the activations of its
in-flight micro-batches; the table prints parameters x 2 as the floor a rank cannot go under.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20

#: about 405M parameters: 24 blocks of dim 1024 (12.6M each), embeddings and head of 50304 x 1024
MODEL = ["model.vocab_size=50304", "model.dim=1024", "model.layers=24", "model.heads=16", "model.seq_len=128"]
RUN = ["data=synthetic", "pp=4", "dp=1", "scheduler=1f1b", "partitioner=uniform", "optimizer=sgd", "optimizer.lr=0.01",
       "batch_size=8", "microbatches=4", "warmup_steps=0", "threads=0", "timeout_s=900", "log_every=1"]
VARIANTS = {"chain": [], "tied": ["+model.tie_embeddings=true"]}


def baseline_rss() -> int:
    """Peak memory, measured as a rank measures it, of a process that imported what a rank imports."""
    code = ("import torch, pipelaunch.pipeline.runtime.rank, pipelaunch.pipeline.runtime.trainer; "
            "from pipelaunch.pipeline.compute.memory import peak_memory_bytes; print(peak_memory_bytes(torch.device('cpu')))")
    return int(subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip())


def run_variant(name: str, steps: int, out: Path) -> dict:
    run_dir = out / name
    cmd = [sys.executable, "train.py", *MODEL, *RUN, *VARIANTS[name], f"steps={steps}", f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
    metrics = json.loads((run_dir / "metrics.json").read_text())
    plan = json.loads((run_dir / "plan.json").read_text())
    return {"metrics": metrics, "plan": plan}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    base = baseline_rss()
    print(f"bare rank process (torch + project imported): {base / MIB:.0f} MiB peak")
    with tempfile.TemporaryDirectory(prefix="membench_") as tmp:
        for name in args.variants:
            res = run_variant(name, args.steps, Path(tmp))
            m, plan = res["metrics"], res["plan"]
            params = plan["meta"]["partition"]["stage_param_bytes"]
            whole = plan["meta"]["model_param_bytes"]
            print(f"\n{name}: model {whole / MIB:.0f} MiB of parameters ({whole / 4 / 1e6:.0f}M fp32), "
                  f"launcher peak {m['launcher_peak_memory_bytes'] / MIB:.0f} MiB, "
                  f"final loss {m['losses'][-1]:.3f}")
            print(f"{'rank':>4} {'stage params MiB':>16} {'x2 (+grads)':>11} {'peak MiB':>12} "
                  f"{'peak - bare':>11} {'of model':>8}  blocks")
            for r in sorted(m["ranks"], key=lambda r: r["rank"]):
                (stage,) = r["stages"]
                p = params[stage]
                extra = r["peak_memory_bytes"] - base
                blocks = plan["stages"][stage]["blocks"]
                print(f"{r['rank']:>4} {p / MIB:>16.0f} {2 * p / MIB:>11.0f} {r['peak_memory_bytes'] / MIB:>12.0f} "
                      f"{extra / MIB:>11.0f} {extra / whole:>8.0%}  {blocks[0]}..{blocks[-1]}")
    print(f"\n(peak RSS of this script: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB)")


if __name__ == "__main__":
    main()
