"""At the end of a multirun: one comparison table (and bar chart) over every job of the sweep.

A Hydra callback, so it runs once in the launching process after all jobs, whichever launcher
ran them. Failed jobs are listed with their error instead of being dropped (the app records a
failed job in its own metrics.json, so the sweep always reaches this point).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig


def collect(sweep_dir: Path) -> list[dict[str, Any]]:
    """One row per job directory holding a metrics.json, in job order."""
    rows = []
    for metrics_path in sorted(sweep_dir.glob("*/metrics.json"), key=lambda p: _job_num(p.parent.name)):
        m = json.loads(metrics_path.read_text())
        job = metrics_path.parent.name
        overrides = job.split("_", 1)[1] if "_" in job else job
        if m.get("status") == "failed":
            rows.append({"job": job, "overrides": overrides, "status": "failed", "error": m.get("error", "")})
            continue
        rows.append({
            "job": job,
            "overrides": overrides,
            "status": "ok",
            "schedule": m.get("schedule"),
            "tokens_per_s": m.get("tokens_per_s"),
            "step_time_s": m.get("step_time_s"),
            "predicted_step_time_s": m.get("predicted_step_time_s"),
            "final_loss": (m.get("losses") or [None])[-1],
            "peak_memory_bytes": max((r.get("peak_memory_bytes", 0) for r in m.get("ranks", [])), default=0),
            "bubble": max((r.get("bubble", 0.0) for r in m.get("ranks", [])), default=0.0),
        })
    return rows


def _job_num(name: str) -> int:
    head = name.split("_", 1)[0]
    return int(head) if head.isdigit() else 1 << 30


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| job | overrides | tokens/s | step ms | predicted ms | max bubble | peak MB | final loss |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    ok = [r for r in rows if r["status"] == "ok"]
    best = max(ok, key=lambda r: r["tokens_per_s"] or 0.0)["job"] if ok else None
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['job']} | {r['overrides']} | failed: {r['error'][:80]} | | | | | |")
            continue
        pred = f"{r['predicted_step_time_s'] * 1e3:.1f}" if r["predicted_step_time_s"] else "—"
        mark = " **best**" if r["job"] == best else ""
        lines.append(
            f"| {r['job']}{mark} | {r['overrides']} | {r['tokens_per_s']:.0f} | {r['step_time_s'] * 1e3:.1f} | {pred} "
            f"| {r['bubble']:.1%} | {r['peak_memory_bytes'] / 2**20:.0f} | {r['final_loss']:.4f} |"
        )
    return "\n".join(lines) + "\n"


def bar_chart(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["status"] == "ok"]
    if not ok:
        return
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(ok) + 2), 4))
    ax.bar(range(len(ok)), [r["tokens_per_s"] for r in ok], color="#4c72b0")
    ax.set_xticks(range(len(ok)), [r["overrides"] for r in ok], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("tokens/s (median step)")
    ax.set_title("sweep comparison")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


class SweepReport(Callback):
    """Writes summary.md, summary.json and summary.png into the sweep directory."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        rows = collect(sweep_dir)
        if not rows:
            return
        table = markdown(rows)
        (sweep_dir / "summary.md").write_text(table)
        (sweep_dir / "summary.json").write_text(json.dumps(rows, indent=1))
        bar_chart(rows, sweep_dir / "summary.png")
        print(f"\nsweep summary ({sweep_dir / 'summary.md'}):\n{table}", flush=True)
