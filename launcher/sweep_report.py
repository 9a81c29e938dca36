"""At the end of a multirun: one comparison table (and chart) over every job of the sweep.

A Hydra callback, so it runs once in the launching process after all jobs, whichever launcher
ran them. The keys that vary across the sweep's jobs become the table's columns and the chart's
labels; keys every job shares are said once above the table. Failed jobs are listed with their
error instead of being dropped (the app records a failed job in its own metrics.json, so the
sweep always reaches this point).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from hydra.experimental.callback import Callback
from omegaconf import DictConfig


def job_overrides(job_dir: Path) -> dict[str, str]:
    """The job's own command-line overrides, key -> value (Hydra records them per job)."""
    recorded = job_dir / ".hydra" / "overrides.yaml"
    items = yaml.safe_load(recorded.read_text()) if recorded.is_file() else []
    out = {}
    for item in items or []:
        key, _, value = str(item).partition("=")
        out[key.lstrip("+~")] = value
    return out


def collect(sweep_dir: Path) -> list[dict[str, Any]]:
    """One row per job directory holding a metrics.json, in job order."""
    rows = []
    for metrics_path in sorted(sweep_dir.glob("*/metrics.json"), key=lambda p: _job_num(p.parent.name)):
        m = json.loads(metrics_path.read_text())
        job_dir = metrics_path.parent
        row: dict[str, Any] = {"job": _job_num(job_dir.name), "dir": job_dir.name, "overrides": job_overrides(job_dir)}
        if m.get("status") == "failed":
            rows.append({**row, "status": "failed", "error": m.get("error", "")})
            continue
        ranks = sorted(m.get("ranks", []), key=lambda r: r.get("rank", 0))
        rows.append({
            **row,
            "status": "ok",
            "schedule": m.get("schedule"),
            "tokens_per_s": m.get("tokens_per_s"),
            "step_time_s": m.get("step_time_s"),
            "predicted_step_time_s": m.get("predicted_step_time_s"),
            "final_loss": (m.get("losses") or [None])[-1],
            "peak_memory_bytes_per_rank": [r.get("peak_memory_bytes", 0) for r in ranks],
            "bubble": max((r.get("bubble", 0.0) for r in ranks), default=0.0),
        })
    return rows


def _job_num(name: str) -> int:
    head = name.split("_", 1)[0]
    return int(head) if head.isdigit() else 1 << 30


def varying_keys(rows: list[dict[str, Any]]) -> list[str]:
    """Override keys whose value is not the same in every job, in the order they first appear."""
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r["overrides"] if k not in keys]
    return [k for k in keys if len({r["overrides"].get(k) for r in rows}) > 1]


def label(row: dict[str, Any], varying: list[str], sep: str = ", ") -> str:
    return sep.join(f"{k}={row['overrides'].get(k, '-')}" for k in varying) or f"job {row['job']}"


def markdown(rows: list[dict[str, Any]]) -> str:
    varying = varying_keys(rows)
    shared = {k: v for k, v in rows[0]["overrides"].items() if k not in varying} if rows else {}
    lines = [f"common to every job: {', '.join(f'{k}={v}' for k, v in shared.items()) or '(nothing)'}", ""]
    head = ["job", *varying, "tokens/s", "step ms", "predicted ms", "predicted / measured", "max bubble",
            "peak MB per rank", "final loss"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * (1 + len(varying)) + "---:|" * (len(head) - 1 - len(varying))]
    ok = [r for r in rows if r["status"] == "ok"]
    best = max(ok, key=lambda r: r["tokens_per_s"] or 0.0)["job"] if ok else None
    for r in rows:
        cells = [f"{r['job']}{' **best**' if r['job'] == best else ''}", *(r["overrides"].get(k, "-") for k in varying)]
        if r["status"] != "ok":
            lines.append("| " + " | ".join([*cells, f"failed: {' '.join(r['error'].split())[:100]}"]
                                           + [""] * (len(head) - len(cells) - 1)) + " |")
            continue
        measured, predicted = r["step_time_s"], r["predicted_step_time_s"]
        peaks = " / ".join(f"{b / 2**20:.0f}" for b in r["peak_memory_bytes_per_rank"])
        cells += [f"{r['tokens_per_s']:.0f}", f"{measured * 1e3:.1f}",
                  f"{predicted * 1e3:.1f}" if predicted else "-",
                  f"{predicted / measured:.2f}" if predicted and measured else "-",
                  f"{r['bubble']:.1%}", peaks, f"{r['final_loss']:.4f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def bar_chart(rows: list[dict[str, Any]], path: Path) -> None:
    """Step time measured beside predicted, and the largest peak memory of a rank, per job,
    each bar labelled by the keys that vary."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["status"] == "ok"]
    if not ok:
        return
    varying = varying_keys(rows)
    # values only, one line per varying key (the axis says which key is which line)
    names = ["\n".join(r["overrides"].get(k, "-") for k in varying) or f"job {r['job']}" for r in ok]
    x = range(len(ok))
    fig, (time_ax, mem_ax) = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(ok) + 3), 4.5))
    time_ax.bar([i - 0.2 for i in x], [r["step_time_s"] * 1e3 for r in ok], 0.4, label="measured", color="#4c72b0")
    time_ax.bar([i + 0.2 for i in x], [(r["predicted_step_time_s"] or 0) * 1e3 for r in ok], 0.4,
                label="predicted", color="#dd8452")
    time_ax.set_ylabel("step time, ms (median)")
    time_ax.legend()
    mem_ax.bar(list(x), [max(r["peak_memory_bytes_per_rank"] or [0]) / 2**20 for r in ok], 0.6, color="#55a868")
    mem_ax.set_ylabel("peak memory of the fullest rank, MB")
    for ax in (time_ax, mem_ax):
        ax.set_xticks(list(x), names, fontsize=8, rotation=0 if len(ok) <= 6 else 45)
        ax.set_xlabel(" / ".join(varying))
    fig.suptitle(f"sweep over {', '.join(varying) or 'one configuration'}")
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
