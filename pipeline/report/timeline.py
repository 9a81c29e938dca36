"""Pictures and traces of a pipeline step: a PNG Gantt chart and a Chrome/Perfetto trace.

Why: a timeline shows at a glance where a rank waits, and putting the measured run next to the
simulated one shows where the cost model is wrong. Events use the simulator's format: dicts with
`rank` (int), `action` (str, e.g. "0F1"), `kind` (str), `start_s`/`end_s` (float seconds); `stage`
and `mb` are optional (parsed from `action` when missing); `lane` is optional: "dp" for the
data-parallel collectives (UNSHARD, RESHARD, REDUCE_GRAD; events of those kinds go there without it),
which run on their own stream and are drawn on their own lane under their rank's row (and put on
their own thread of the trace).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

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
#: the data-parallel collectives' colours and legend labels, on each rank's dp lane
DP_COLORS = {"UNSHARD": "#17BECF", "REDUCE_GRAD": "#8C564B", "RESHARD": "#C7C7C7", "A2A": "#E377C2"}
#: A2A: an expert layer's all-to-all on the ep group, from its issue to its wait's end (ep > 1, CPU
#: ranks' host clock): under moe.overlap, drawn beside the other action of its pair computing
DP_LABELS = {"UNSHARD": "gather", "REDUCE_GRAD": "reduce", "RESHARD": "reshard", "A2A": "all-to-all"}
#: a dp lane's height, in compute rows (a compute row is 1), and its bars' half height
DP_ROW = 0.45
DP_BAR = 0.15
#: how much white a multi-stage rank's later stages' bars mix into their kind's colour
STAGE_LIGHTEN = 0.4
#: trace thread of rank r's data-parallel collectives: DP_TID + r (its compute runs on thread r)
DP_TID = 100_000
#: drawn as a thin grey strip under a rank's compute: the P2P messages
_COMM = {k.value for k in COMM_KINDS}
#: drawn on the rank's dp lane: the data-parallel collectives
_DP = {k.value for k in DP_KINDS}

#: (rank, lane ("" or "dp"), kind, stage (compute only, else None)) -> its (start, duration) spans
_Bars = dict[tuple[int, str, str, int | None], list[tuple[float, float]]]


def _is_dp(event: dict) -> bool:
    return event.get("lane") == "dp" or str(event["kind"]) in _DP


def _action_field(event: dict, name: str) -> int | None:
    """The event's `stage` or `mb`: given, or read from its action ("3F1": stage 3, micro-batch 1)."""
    if event.get(name) is not None:
        return int(event[name])
    try:
        return getattr(Action.parse(str(event["action"])), name)
    except ValueError:
        return None


def _mb_of(event: dict) -> int | None:
    return _action_field(event, "mb")


def _stage_of(event: dict) -> int | None:
    return _action_field(event, "stage")


class _Rows:
    """Where a panel's rows lie: rank r's compute row centred at `compute[r]` (r itself when no
    rank above it has a dp lane), its dp lane (if it has collectives) centred at `lane[r]`, right
    under it; `stages[r]`: the stages whose compute rank r runs, in order."""

    def __init__(self, bars: _Bars) -> None:
        ranks = sorted({rank for rank, *_ in bars}) or [0]
        dp_ranks = {rank for rank, lane, *_ in bars if lane == "dp"}
        self.compute: dict[int, float] = {}
        self.lane: dict[int, float] = {}
        shift = 0.0
        for rank in ranks:
            self.compute[rank] = rank + shift
            if rank in dp_ranks:
                self.lane[rank] = rank + shift + 0.5 + DP_ROW / 2
                shift += DP_ROW
        stages: dict[int, set[int]] = {}
        for rank, _, _, stage in bars:
            if stage is not None:
                stages.setdefault(rank, set()).add(stage)
        self.stages = {rank: sorted(s) for rank, s in stages.items()}

    def multi_stage(self, rank: int) -> bool:
        return len(self.stages.get(rank, ())) > 1

    def ticks(self) -> tuple[list[float], list[str]]:
        rows = [(y, f"rank {r}") for r, y in self.compute.items()] + [(y, f"rank {r} dp") for r, y in self.lane.items()]
        rows.sort()
        return [y for y, _ in rows], [label for _, label in rows]

    def limits(self) -> tuple[float, float]:
        """(bottom, top) of the y axis: rank 0 on top."""
        bottom = max(self.compute.values()) + 0.6
        if self.lane:
            bottom = max(bottom, max(self.lane.values()) + DP_ROW / 2 + 0.1)
        return bottom, min(self.compute.values()) - 0.6


def _draw_panel(ax: plt.Axes, events: Sequence[dict], title: str, t0: float) -> None:
    """One row per rank, and a thinner one under it for a rank's data-parallel collectives: bars
    where each can be told apart, else rows of pixels (a pp=64 step of 256 micro-batches has
    32k-100k actions on ~1200 pixel columns)."""
    # One collection per (rank, lane, kind, stage), not one bar per action; one pass over the events.
    bars: _Bars = {}
    end = 0.0
    for e in events:
        start, stop = float(e["start_s"]) - t0, float(e["end_s"]) - t0
        rank, kind = int(e["rank"]), str(e["kind"])
        if _is_dp(e):
            key = (rank, "dp", kind, None)
        elif kind in _COMM:
            key = (rank, "", kind, None)
        else:
            key = (rank, "", kind, _stage_of(e))
        bars.setdefault(key, []).append((start, stop - start))
        if stop > end:
            end = stop
    end = end or 1.0
    rows = _Rows(bars)
    columns = _columns(ax)
    per_row: dict[tuple[int, str], int] = {}
    for (rank, lane, _, _), spans in bars.items():
        per_row[rank, lane] = per_row.get((rank, lane), 0) + len(spans)
    busiest = max(per_row.values(), default=0)
    if busiest * MIN_BAR_PX > columns:
        _raster_bars(ax, bars, rows, end * 1.01, columns)
    else:
        _vector_bars(ax, events, bars, rows, t0, end / 90)
    ticks, labels = rows.ticks()
    ax.set_yticks(ticks)
    ax.set_yticklabels(labels)
    ax.set_ylim(*rows.limits())  # rank 0 on top
    ax.set_xlim(0, end * 1.01)
    ax.set_xlabel("time (s)")
    ax.set_title(title, fontsize=10, loc="left")
    ax.grid(axis="x", alpha=0.3)


def _bar_label(event: dict, rows: _Rows, width: float, min_label_width: float) -> str | None:
    """What a compute bar of `width` seconds says, if anything fits (`min_label_width` seconds per
    character): its micro-batch, after its stage ("s3:1") on a rank that runs more than one stage
    (a V or interleaved schedule's; where that does not fit, the micro-batch alone: the bar's
    shade still tells the stage)."""
    mb = _mb_of(event)
    if mb is None:
        return None
    texts = [str(mb)]
    if rows.multi_stage(int(event["rank"])):
        stage = _stage_of(event)
        if stage is not None:
            texts.insert(0, f"s{stage}:{mb}")
    return next((text for text in texts if width >= min_label_width * len(text)), None)


def _lighter(color: str, amount: float) -> tuple[float, float, float]:
    from matplotlib.colors import to_rgb
    return tuple(c + (1.0 - c) * amount for c in to_rgb(color))


def _vector_bars(ax: plt.Axes, events: Sequence[dict], bars: _Bars, rows: _Rows, t0: float,
                 min_label_width: float) -> None:
    """Every action a bar with a white edge, and its micro-batch written where the bar is wide
    enough (`min_label_width`, in seconds per character) to read it; a multi-stage rank's later
    stages lighter. Collectives on the rank's dp lane, by kind."""
    for e in events:
        kind = str(e["kind"])
        if kind in _COMM or _is_dp(e):
            continue
        start, stop = float(e["start_s"]) - t0, float(e["end_s"]) - t0
        text = _bar_label(e, rows, stop - start, min_label_width)
        if text is not None:
            ax.text((start + stop) / 2, rows.compute[int(e["rank"])], text, ha="center", va="center", fontsize=7,
                    color="white")
    for (rank, lane, kind, stage), spans in bars.items():
        if lane == "dp":
            ax.broken_barh(spans, (rows.lane[rank] - DP_BAR, 2 * DP_BAR), facecolors=DP_COLORS.get(kind, COMM_COLOR),
                           edgecolors="white", linewidth=0.3)
            continue
        row = rows.compute[rank]
        if kind in _COMM:
            ax.broken_barh(spans, (row + 0.33, 0.1), facecolors=COMM_COLOR, linewidth=0)
        else:
            color = COLORS.get(kind, "#333333")
            if stage is not None and rows.multi_stage(rank) and rows.stages[rank].index(stage) > 0:
                color = _lighter(color, STAGE_LIGHTEN)
            ax.broken_barh(spans, (row - 0.36, 0.72), facecolors=color, edgecolors="white", linewidth=0.4)


def _columns(ax: plt.Axes) -> int:
    """The axes' width in pixels at the figure's saving resolution."""
    fig = ax.get_figure()
    return max(1, round(ax.get_position().width * fig.get_figwidth() * SAVE_DPI))


def _raster_bars(ax: plt.Axes, bars: _Bars, rows: _Rows, span: float, columns: int) -> None:
    """Each rank's bars as one row of `columns` pixels over [0, span]: a pixel takes each kind's
    colour in proportion to the time that kind covers of it, white for the rest, as anti-aliased
    vector bars would show it without their edges (narrower than a pixel, the edges would paint
    the row white). Bars stay at the rows and heights `_vector_bars` gives them (a rank's stages
    in one colour per kind)."""
    by_rank: dict[int, dict[tuple[str, str], list[tuple[float, float]]]] = {}
    for (rank, lane, kind, _), spans in bars.items():
        by_rank.setdefault(rank, {}).setdefault((lane, kind), []).extend(spans)
    scale = columns / span
    for rank, kinds in by_rank.items():
        row = rows.compute[rank]
        compute = {k: v for (lane, k), v in kinds.items() if not lane and k not in _COMM}
        comm = [s for (lane, k), v in kinds.items() if not lane and k in _COMM for s in v]
        dp = {k: v for (lane, k), v in kinds.items() if lane == "dp"}
        if compute:
            pixels = _blend({COLORS.get(k, "#333333"): _coverage(v, scale, columns) for k, v in compute.items()})
            ax.imshow(pixels, extent=(0, span, row + 0.36, row - 0.36), aspect="auto", interpolation="nearest")
        if comm:
            pixels = _blend({COMM_COLOR: _coverage(comm, scale, columns)})
            ax.imshow(pixels, extent=(0, span, row + 0.43, row + 0.33), aspect="auto", interpolation="nearest")
        if dp:
            lane_row = rows.lane[rank]
            by_color: dict[str, list[tuple[float, float]]] = {}
            for k, v in dp.items():
                by_color.setdefault(DP_COLORS.get(k, COMM_COLOR), []).extend(v)
            pixels = _blend({c: _coverage(v, scale, columns) for c, v in by_color.items()})
            ax.imshow(pixels, extent=(0, span, lane_row + DP_BAR, lane_row - DP_BAR), aspect="auto",
                      interpolation="nearest")


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
    """Write a PNG Gantt chart (one row per rank, and a thinner one under it for a rank's
    data-parallel collectives); with `simulated_events`, a second panel below.

    Both panels start at their own first event, so a measured trace in wall-clock seconds and a
    simulated one starting at 0 line up. Returns the path written.
    """
    panels = [("measured", list(measured_events))]
    if simulated_events is not None:
        panels.append(("simulated", list(simulated_events)))
    extents = [_extent(events) for _, events in panels]
    num_ranks = max(e.last_rank for e in extents) + 1
    lanes = max(len(e.dp_ranks) for e in extents)  # the panels share one height
    height = sum(1.0 + 0.35 * (num_ranks + DP_ROW * lanes) for _ in panels) + 0.8
    plt = _pyplot()
    from matplotlib.patches import Patch

    fig, axes = plt.subplots(len(panels), 1, figsize=(12, height), squeeze=False)
    _set_margins(fig, len(panels), f"rank {num_ranks - 1}" + (" dp" if lanes else ""))
    for ax, (label, events), extent in zip(axes[:, 0], panels, extents, strict=True):
        seconds = extent.last - extent.first
        panel_title = f"{label}: {seconds:.4g} s" if len(panels) > 1 else f"{seconds:.4g} s"
        _draw_panel(ax, events, panel_title, extent.first)
    kinds = set().union(*(e.kinds for e in extents))
    dp_kinds = set().union(*(e.dp_kinds for e in extents))
    handles = [Patch(color=c, label=k) for k, c in COLORS.items() if k in kinds]
    if kinds & _COMM:
        handles.append(Patch(color=COMM_COLOR, label="comm"))
    handles += [Patch(color=DP_COLORS[k], label=DP_LABELS[k]) for k in DP_COLORS if k in dp_kinds]
    if handles:
        fig.legend(handles=handles, loc="upper right", ncol=len(handles), fontsize=8, frameon=False)
    fig.suptitle(title, x=0.01, y=1 - 0.1 / height, ha="left", va="top", fontsize=11)
    fig.savefig(path, dpi=SAVE_DPI)
    plt.close(fig)
    return str(path)


class _Extent(NamedTuple):
    first: float
    last: float
    last_rank: int
    kinds: set[str]
    dp_kinds: set[str]
    dp_ranks: set[int]


def _extent(events: Sequence[dict]) -> _Extent:
    """One pass over a panel's events: its first start, its last end, its last rank, its kinds,
    and the kinds and ranks of its data-parallel collectives ((0, 0, 0, none...) for no events)."""
    if not events:
        return _Extent(0.0, 0.0, 0, set(), set(), set())
    first, last, last_rank, kinds, dp_kinds, dp_ranks = math.inf, -math.inf, 0, set(), set(), set()
    for e in events:
        start, end, rank = float(e["start_s"]), float(e["end_s"]), int(e["rank"])
        if start < first:
            first = start
        if end > last:
            last = end
        if rank > last_rank:
            last_rank = rank
        kinds.add(str(e["kind"]))
        if _is_dp(e):
            dp_kinds.add(str(e["kind"]))
            dp_ranks.add(rank)
    return _Extent(first, last, last_rank, kinds, dp_kinds, dp_ranks)


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
    """Chrome/Perfetto trace: complete events (ph "X") in microseconds, one thread per rank, and
    one more (DP_TID + rank, "rank r dp") for a rank's data-parallel collectives, sorted under it."""
    trace: list[dict] = []
    ranks = sorted({int(e["rank"]) for e in events})
    dp_ranks = sorted({int(e["rank"]) for e in events if _is_dp(e)})
    for rank in ranks:
        trace.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": rank, "args": {"name": f"rank {rank}"}})
    for rank in dp_ranks:
        trace.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": DP_TID + rank,
                      "args": {"name": f"rank {rank} dp"}})
    if dp_ranks:  # each rank's dp thread right under its compute thread
        for rank in ranks:
            trace.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": rank,
                          "args": {"sort_index": 2 * rank}})
        for rank in dp_ranks:
            trace.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": DP_TID + rank,
                          "args": {"sort_index": 2 * rank + 1}})
    for e in events:
        args = {k: e[k] for k in ("stage", "mb", "lane") if k in e}
        rank = int(e["rank"])
        trace.append({
            "name": str(e["action"]),
            "cat": str(e["kind"]),
            "ph": "X",
            "ts": float(e["start_s"]) * 1e6,
            "dur": (float(e["end_s"]) - float(e["start_s"])) * 1e6,
            "pid": 0,
            "tid": DP_TID + rank if _is_dp(e) else rank,
            "args": args,
        })
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def write_chrome_trace(path: str | os.PathLike, events: Sequence[dict]) -> str:
    """Write `chrome_trace(events)` as JSON (open in chrome://tracing or ui.perfetto.dev)."""
    with open(path, "w") as fh:
        json.dump(chrome_trace(events), fh)
    return str(path)
