"""Pictures and traces of a pipeline step: a PNG Gantt chart and a Chrome/Perfetto trace.

Why: a timeline shows at a glance where a rank waits, and putting the measured run next to the
simulated one shows where the cost model is wrong. Events use the simulator's format: dicts with
`rank` (int), `action` (str, e.g. "0F1"), `kind` (str), `start_s`/`end_s` (float seconds); `mb`
is optional (parsed from `action` when missing).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from pipeline.core.ir import COMM_KINDS, Action  # noqa: E402

#: Slice colours by action kind; communication is drawn thin and grey.
COLORS = {
    "F": "#4C72B0",
    "B": "#DD8452",
    "I": "#C44E52",
    "W": "#55A868",
    "R": "#8172B3",
}
COMM_COLOR = "#9E9E9E"
_COMM = {k.value for k in COMM_KINDS}


def _mb_of(event: dict) -> int | None:
    if "mb" in event and event["mb"] is not None:
        return int(event["mb"])
    try:
        return Action.parse(str(event["action"])).mb
    except ValueError:
        return None


def _draw_panel(ax: plt.Axes, events: Sequence[dict], title: str, t0: float) -> None:
    ranks = sorted({int(e["rank"]) for e in events}) or [0]
    end = max((float(e["end_s"]) - t0 for e in events), default=1.0) or 1.0
    # A label needs roughly this much time-width to be readable at the figure's size.
    min_label_width = end / 90
    # One collection per (rank, kind), not one bar per action: a pp=64 plan has ~50k actions.
    bars: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for e in events:
        start, stop = float(e["start_s"]) - t0, float(e["end_s"]) - t0
        kind = str(e["kind"])
        row = int(e["rank"])
        bars.setdefault((row, kind), []).append((start, stop - start))
        mb = _mb_of(e)
        if kind not in _COMM and mb is not None and stop - start >= min_label_width * len(str(mb)):
            ax.text((start + stop) / 2, row, str(mb), ha="center", va="center", fontsize=7, color="white")
    for (row, kind), spans in bars.items():
        if kind in _COMM:
            ax.broken_barh(spans, (row + 0.33, 0.1), facecolors=COMM_COLOR, linewidth=0)
        else:
            ax.broken_barh(spans, (row - 0.36, 0.72), facecolors=COLORS.get(kind, "#333333"), edgecolors="white",
                           linewidth=0.4)
    ax.set_yticks(ranks)
    ax.set_yticklabels([f"rank {r}" for r in ranks])
    ax.set_ylim(max(ranks) + 0.6, min(ranks) - 0.6)  # rank 0 on top
    ax.set_xlim(0, end * 1.01)
    ax.set_xlabel("time (s)")
    ax.set_title(title, fontsize=10, loc="left")
    ax.grid(axis="x", alpha=0.3)


def draw_timeline(
    path: str | os.PathLike,
    measured_events: Sequence[dict],
    simulated_events: Sequence[dict] | None = None,
    title: str = "pipeline timeline",
) -> str:
    """Write a PNG Gantt chart (one row per rank); with `simulated_events`, a second panel below.

    Both panels start at their own first event, so a measured trace in wall-clock seconds and a
    simulated one starting at 0 line up. Returns the path written.
    """
    panels = [("measured", list(measured_events))]
    if simulated_events is not None:
        panels.append(("simulated", list(simulated_events)))
    num_ranks = max((int(e["rank"]) for _, evs in panels for e in evs), default=0) + 1
    height = sum(1.0 + 0.35 * num_ranks for _ in panels) + 0.8
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, height), squeeze=False)
    for ax, (label, events) in zip(axes[:, 0], panels, strict=True):
        t0 = min((float(e["start_s"]) for e in events), default=0.0)
        span = max((float(e["end_s"]) for e in events), default=t0) - t0
        panel_title = f"{label}: {span:.4g} s" if len(panels) > 1 else f"{span:.4g} s"
        _draw_panel(ax, events, panel_title, t0)
    kinds = {str(e["kind"]) for _, evs in panels for e in evs}
    handles = [Patch(color=c, label=k) for k, c in COLORS.items() if k in kinds]
    if kinds & _COMM:
        handles.append(Patch(color=COMM_COLOR, label="comm"))
    if handles:
        fig.legend(handles=handles, loc="upper right", ncol=len(handles), fontsize=8, frameon=False)
    fig.suptitle(title, x=0.01, ha="left", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def chrome_trace(events: Sequence[dict]) -> dict:
    """Chrome/Perfetto trace: complete events (ph "X") in microseconds, one thread per rank."""
    trace: list[dict] = []
    for rank in sorted({int(e["rank"]) for e in events}):
        trace.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": rank, "args": {"name": f"rank {rank}"}})
    for e in events:
        args = {k: e[k] for k in ("stage", "mb") if k in e}
        trace.append({
            "name": str(e["action"]),
            "cat": str(e["kind"]),
            "ph": "X",
            "ts": float(e["start_s"]) * 1e6,
            "dur": (float(e["end_s"]) - float(e["start_s"])) * 1e6,
            "pid": 0,
            "tid": int(e["rank"]),
            "args": args,
        })
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def write_chrome_trace(path: str | os.PathLike, events: Sequence[dict]) -> str:
    """Write `chrome_trace(events)` as JSON (open in chrome://tracing or ui.perfetto.dev)."""
    with open(path, "w") as fh:
        json.dump(chrome_trace(events), fh)
    return str(path)
