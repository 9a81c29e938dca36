"""Pictures and traces of a pipeline step: a PNG Gantt chart and a Chrome/Perfetto trace.

Why: a timeline shows at a glance where a rank waits, and putting the measured run next to the
simulated one shows where the cost model is wrong. Events use the simulator's format: dicts with
`rank` (int), `action` (str, e.g. "0F1"), `kind` (str), `start_s`/`end_s` (float seconds); `mb`
is optional (parsed from `action` when missing).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from pipelaunch.pipeline.core.ir import COMM_KINDS, DP_KINDS, Action

if TYPE_CHECKING:
    import matplotlib.pyplot as plt


def _pyplot():
    """matplotlib's pyplot on the file-only Agg backend, imported on the first drawing: a command
    or rank that draws nothing does not pay for it (half a second)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt

#: Slice colours by action kind; communication is drawn thin and grey.
COLORS = {
    "F": "#4C72B0",
    "B": "#DD8452",
    "I": "#C44E52",
    "W": "#55A868",
    "R": "#8172B3",
}
COMM_COLOR = "#9E9E9E"
#: resolution of the saved PNG
SAVE_DPI = 110
#: inches around the panels: left (before the rank labels), right, top (figure title, legend, panel
#: title), bottom (time axis), between two panels (the upper one's time axis, the lower one's title)
MARGINS_IN = (0.25, 0.2, 0.75, 0.55, 0.95)
#: inches per character of a rank label (10 pt)
LABEL_CHAR_IN = 0.085
#: below this many pixels per bar on average on the busiest rank (the white edges, 0.6 px a side,
#: would wash the colours out), ranks are drawn as rows of pixels
MIN_BAR_PX = 4
#: drawn as communication: P2P and the data-parallel collectives
_COMM = {k.value for k in COMM_KINDS | DP_KINDS}


def _mb_of(event: dict) -> int | None:
    if "mb" in event and event["mb"] is not None:
        return int(event["mb"])
    try:
        return Action.parse(str(event["action"])).mb
    except ValueError:
        return None


def _draw_panel(ax: plt.Axes, events: Sequence[dict], title: str, t0: float) -> None:
    """One row per rank: bars where each can be told apart, else rows of pixels (a pp=64 step of
    256 micro-batches has 32k-100k actions on ~1200 pixel columns)."""
    # One collection per (rank, kind), not one bar per action; one pass over the events.
    bars: dict[tuple[int, str], list[tuple[float, float]]] = {}
    end = 0.0
    for e in events:
        start, stop = float(e["start_s"]) - t0, float(e["end_s"]) - t0
        bars.setdefault((int(e["rank"]), str(e["kind"])), []).append((start, stop - start))
        if stop > end:
            end = stop
    end = end or 1.0
    ranks = sorted({rank for rank, _ in bars}) or [0]
    columns = _columns(ax)
    busiest = max((sum(len(v) for (r, _), v in bars.items() if r == rank) for rank in ranks), default=0)
    if busiest * MIN_BAR_PX > columns:
        _raster_bars(ax, bars, end * 1.01, columns)
    else:
        _vector_bars(ax, events, bars, t0, end / 90)
    ax.set_yticks(ranks)
    ax.set_yticklabels([f"rank {r}" for r in ranks])
    ax.set_ylim(max(ranks) + 0.6, min(ranks) - 0.6)  # rank 0 on top
    ax.set_xlim(0, end * 1.01)
    ax.set_xlabel("time (s)")
    ax.set_title(title, fontsize=10, loc="left")
    ax.grid(axis="x", alpha=0.3)


def _vector_bars(ax: plt.Axes, events: Sequence[dict], bars: dict[tuple[int, str], list[tuple[float, float]]],
                 t0: float, min_label_width: float) -> None:
    """Every action a bar with a white edge, and its micro-batch written where the bar is wide
    enough (`min_label_width`, in seconds per character) to read it."""
    for e in events:
        start, stop, kind = float(e["start_s"]) - t0, float(e["end_s"]) - t0, str(e["kind"])
        mb = _mb_of(e) if kind not in _COMM else None
        if mb is not None and stop - start >= min_label_width * len(str(mb)):
            ax.text((start + stop) / 2, int(e["rank"]), str(mb), ha="center", va="center", fontsize=7, color="white")
    for (row, kind), spans in bars.items():
        if kind in _COMM:
            ax.broken_barh(spans, (row + 0.33, 0.1), facecolors=COMM_COLOR, linewidth=0)
        else:
            ax.broken_barh(spans, (row - 0.36, 0.72), facecolors=COLORS.get(kind, "#333333"), edgecolors="white",
                           linewidth=0.4)


def _columns(ax: plt.Axes) -> int:
    """The axes' width in pixels at the figure's saving resolution."""
    fig = ax.get_figure()
    return max(1, round(ax.get_position().width * fig.get_figwidth() * SAVE_DPI))


def _raster_bars(ax: plt.Axes, bars: dict[tuple[int, str], list[tuple[float, float]]], span: float,
                 columns: int) -> None:
    """Each rank's bars as one row of `columns` pixels over [0, span]: a pixel takes each kind's
    colour in proportion to the time that kind covers of it, white for the rest, as anti-aliased
    vector bars would show it without their edges (narrower than a pixel, the edges would paint
    the row white). Bars stay at the rows and heights `_vector_bars` gives them."""
    rows: dict[int, dict[str, list[tuple[float, float]]]] = {}
    for (row, kind), spans in bars.items():
        rows.setdefault(row, {})[kind] = spans
    scale = columns / span
    for row, kinds in rows.items():
        compute = {k: v for k, v in kinds.items() if k not in _COMM}
        comm = [s for k, v in kinds.items() if k in _COMM for s in v]
        if compute:
            pixels = _blend({COLORS.get(k, "#333333"): _coverage(v, scale, columns) for k, v in compute.items()})
            ax.imshow(pixels, extent=(0, span, row + 0.36, row - 0.36), aspect="auto", interpolation="nearest")
        if comm:
            pixels = _blend({COMM_COLOR: _coverage(comm, scale, columns)})
            ax.imshow(pixels, extent=(0, span, row + 0.43, row + 0.33), aspect="auto", interpolation="nearest")


def _coverage(spans: list[tuple[float, float]], scale: float, columns: int) -> np.ndarray:
    """Per pixel column, the share of it that (start, duration) spans cover, at `scale` pixels per
    second; overlapping spans count once each (capped at a full pixel)."""
    arr = np.asarray(spans, dtype=float).reshape(-1, 2)
    lo = np.clip(arr[:, 0] * scale, 0.0, columns)
    hi = np.clip((arr[:, 0] + arr[:, 1]) * scale, 0.0, columns)
    # covered length up to x is a sum of ramps; its value at each column edge, differenced
    edges = np.arange(columns + 1, dtype=float)
    covered = _ramps(np.sort(lo), edges) - _ramps(np.sort(hi), edges)
    return np.clip(np.diff(covered), 0.0, 1.0)


def _ramps(points: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """sum over `points` p (sorted) of max(0, x - p), at every x of `edges`."""
    count = np.searchsorted(points, edges, side="right")
    before = np.concatenate(([0.0], np.cumsum(points)))
    return count * edges - before[count]


def _blend(coverage: dict[str, np.ndarray]) -> np.ndarray:
    """One row of RGB pixels: each colour weighted by its coverage over a white background."""
    from matplotlib.colors import to_rgb
    total = np.zeros_like(next(iter(coverage.values())))
    pixels = np.zeros((total.size, 3))
    for color, share in coverage.items():
        pixels += share[:, None] * np.asarray(to_rgb(color))
        total += share
    pixels += np.clip(1.0 - total, 0.0, 1.0)[:, None]
    return np.clip(pixels, 0.0, 1.0)[None, :, :]


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
    extents = [_extent(events) for _, events in panels]
    num_ranks = max(last_rank for *_, last_rank, _ in extents) + 1
    height = sum(1.0 + 0.35 * num_ranks for _ in panels) + 0.8
    plt = _pyplot()
    from matplotlib.patches import Patch

    fig, axes = plt.subplots(len(panels), 1, figsize=(12, height), squeeze=False)
    _set_margins(fig, len(panels), f"rank {num_ranks - 1}")
    for ax, (label, events), (t0, t1, _, _) in zip(axes[:, 0], panels, extents, strict=True):
        panel_title = f"{label}: {t1 - t0:.4g} s" if len(panels) > 1 else f"{t1 - t0:.4g} s"
        _draw_panel(ax, events, panel_title, t0)
    kinds = set().union(*(kinds for *_, kinds in extents))
    handles = [Patch(color=c, label=k) for k, c in COLORS.items() if k in kinds]
    if kinds & _COMM:
        handles.append(Patch(color=COMM_COLOR, label="comm"))
    if handles:
        fig.legend(handles=handles, loc="upper right", ncol=len(handles), fontsize=8, frameon=False)
    fig.suptitle(title, x=0.01, y=1 - 0.1 / height, ha="left", va="top", fontsize=11)
    fig.savefig(path, dpi=SAVE_DPI)
    plt.close(fig)
    return str(path)


def _extent(events: Sequence[dict]) -> tuple[float, float, int, set[str]]:
    """One pass over a panel's events: its first start, its last end, its last rank and its kinds
    ((0, 0, 0, none) for no events)."""
    if not events:
        return 0.0, 0.0, 0, set()
    first, last, last_rank, kinds = math.inf, -math.inf, 0, set()
    for e in events:
        start, end, rank = float(e["start_s"]), float(e["end_s"]), int(e["rank"])
        if start < first:
            first = start
        if end > last:
            last = end
        if rank > last_rank:
            last_rank = rank
        kinds.add(str(e["kind"]))
    return first, last, last_rank, kinds


def _set_margins(fig: plt.Figure, panels: int, widest_label: str) -> None:
    """Room around the panels, in inches (MARGINS_IN), set before anything is drawn: the raster
    rows then get the axes' final width in pixels, and no layout pass measures every tick label
    (tight_layout did, twice: a third of a 64-rank drawing). The left margin fits the longest
    rank label."""
    width, height = fig.get_figwidth(), fig.get_figheight()
    left, right, top, bottom, between = MARGINS_IN
    left += LABEL_CHAR_IN * len(widest_label)
    axes_height = (height - top - bottom - between * (panels - 1)) / panels
    fig.subplots_adjust(left=left / width, right=1 - right / width, top=1 - top / height, bottom=bottom / height,
                        hspace=between / axes_height)


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
