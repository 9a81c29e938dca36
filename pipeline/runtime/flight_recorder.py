"""Hangs on NCCL: the settings that end a stuck NCCL operation and record where every rank was,
and the reader of those records for the launcher's "where each rank was" report.

On gloo a stuck receive blocks the host, the heartbeat (`heartbeat.py`) names the action it is
on, and the wait raises after `timeout_s`. On NCCL a wait does not block the host (it only orders
the GPU's streams): the host runs ahead of the GPU, so the heartbeat names the action the host
got to, not the operation the GPU is stuck in, and a stuck operation ends only when torch's
watchdog thread sees it pass the process group's timeout and aborts the process. What shows
which operation each rank was really in is torch's flight recorder: a ring buffer, per process, of
the last collectives and P2P operations with their peers, sizes and state (scheduled, started,
completed), which the watchdog writes to `<prefix><rank>` (a pickle of plain dicts and lists)
when it times out. The launcher gives its ranks:

- `TORCH_NCCL_ASYNC_ERROR_HANDLING=1`: on a timeout or NCCL error the watchdog aborts the
  communicators and ends the process, so torch elastic stops the job instead of it hanging;
- `TORCH_NCCL_TRACE_BUFFER_SIZE` (`TORCH_FR_BUFFER_SIZE` in newer torch): the flight recorder
  keeps that many entries;
- `TORCH_NCCL_DUMP_ON_TIMEOUT=1` and `TORCH_NCCL_DEBUG_INFO_TEMP_FILE` (`TORCH_FR_DUMP_TEMP_FILE`):
  on a timeout every rank writes its record to `<run dir>/logs/nccl_trace_rank_<rank>`.

The timeout itself is `timeout_s`, passed to `init_process_group` (pipeline/runtime/rank.py).
`where_ranks` turns the dumps into one line per rank:
`recv from rank 1, [4, 8, 32] Float (P2P #3), started, not completed`.
"""

from __future__ import annotations

import ast
import io
import os
import pickle
import re
from pathlib import Path
from typing import Any

#: file name prefix of the dumps, inside the run's logs directory
DUMP_PREFIX = "nccl_trace_rank_"
#: flight recorder entries kept per process (each a few hundred bytes)
BUFFER_ENTRIES = 2000

_STATES = {"scheduled": "enqueued, not started", "started": "started, not completed", "completed": "completed"}


def dump_prefix(log_dir: str | Path) -> str:
    """Where a run's ranks write their flight recorder dumps: `<log_dir>/nccl_trace_rank_<rank>`."""
    return str(Path(log_dir) / DUMP_PREFIX)


def nccl_environment(log_dir: str | Path) -> dict[str, str]:
    """The environment a rank on NCCL gets (both the current variable names and the older
    `TORCH_NCCL_*` ones torch still reads; a value already set by the user is theirs to keep, see
    `apply_nccl_environment`)."""
    prefix = dump_prefix(log_dir)
    return {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "TORCH_NCCL_TRACE_BUFFER_SIZE": str(BUFFER_ENTRIES),
        "TORCH_FR_BUFFER_SIZE": str(BUFFER_ENTRIES),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix,
        "TORCH_FR_DUMP_TEMP_FILE": prefix,
    }


def apply_nccl_environment(log_dir: str | Path, environ: dict | None = None) -> dict[str, str]:
    """Set `nccl_environment` in this process where the user has not set a variable already
    (before `init_process_group`: ProcessGroupNCCL reads them when it is built); returns what it
    set. Creates the logs directory the dumps go to."""
    environ = os.environ if environ is None else environ
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    added = {}
    for name, value in nccl_environment(log_dir).items():
        if name not in environ:
            environ[name] = added[name] = value
    return added


class _PlainUnpickler(pickle.Unpickler):
    """Dumps hold dicts, lists, strings and numbers only: anything that names a class or function
    is refused, so reading a dump never runs code."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"a flight recorder dump does not name {module}.{name}")


def read_dump(path: str | Path) -> dict:
    """One rank's dump: {"version", "pg_config", "pg_status", "entries": [...]}."""
    return _PlainUnpickler(io.BytesIO(Path(path).read_bytes())).load()


def read_dumps(prefix: str | Path, since: float | None = None) -> dict[int, dict]:
    """Every rank's dump under `prefix` (`<prefix><rank>`, possibly with a suffix), keyed by
    global rank; the newest per rank, only files written at or after `since` (a time.time()), and
    unreadable files skipped (a rank may die while writing)."""
    prefix = Path(prefix)
    pattern = re.compile(re.escape(prefix.name) + r"(\d+)(\D.*)?")
    found: dict[int, tuple[float, dict]] = {}
    if not prefix.parent.is_dir():
        return {}
    for path in prefix.parent.iterdir():
        match = pattern.fullmatch(path.name)
        if not match or not path.is_file():
            continue
        mtime = path.stat().st_mtime
        if since is not None and mtime < since:
            continue
        try:
            dump = read_dump(path)
        except (OSError, EOFError, pickle.UnpicklingError, ValueError, TypeError, AttributeError):
            continue
        rank = int(match.group(1))
        if not isinstance(dump, dict) or (rank in found and found[rank][0] > mtime):
            continue
        found[rank] = (mtime, dump)
    return {rank: dump for rank, (_, dump) in sorted(found.items())}


def _group_ranks(dump: dict, entry: dict) -> list[int] | None:
    """The global ranks of the entry's process group, sorted (group rank i is the i-th), from the
    dump's pg_config; None when the dump does not say."""
    group = entry.get("process_group") or ("", "")
    config = (dump.get("pg_config") or {}).get(group[0]) or {}
    ranks = config.get("ranks")
    if isinstance(ranks, str):
        try:
            ranks = ast.literal_eval(ranks)
        except (ValueError, SyntaxError):
            return None
    return sorted(ranks) if isinstance(ranks, (list, tuple)) and ranks else None


def _global(ranks: list[int] | None, group_rank: int) -> int:
    return ranks[group_rank] if ranks is not None and 0 <= group_rank < len(ranks) else group_rank


def _sizes(sizes: Any, dtypes: Any) -> str:
    sizes, dtypes = list(sizes or []), list(dtypes or [])
    parts = [f"{list(s)}{' ' + str(dtypes[i]) if i < len(dtypes) else ''}" for i, s in enumerate(sizes[:3])]
    return ", ".join(parts) + (f" (+{len(sizes) - 3} more)" if len(sizes) > 3 else "")


def describe_entry(dump: dict, entry: dict) -> str:
    """`recv from rank 1, [4, 8, 32] Float (P2P #3), started, not completed`: the operation, its
    peer or group in global ranks, what it moved, its sequence number and state."""
    name = str(entry.get("profiling_name", "?"))
    op = name.split(":", 1)[-1]
    kind, _, arrow = op.partition(" ")
    ranks = _group_ranks(dump, entry)
    group = entry.get("process_group") or ("", "")
    if kind == "send" and "->" in arrow:
        what = f"send to rank {_global(ranks, int(arrow.split('->')[1]))}"
        sizes = _sizes(entry.get("input_sizes"), entry.get("input_dtypes"))
    elif kind == "recv" and "<-" in arrow:
        what = f"recv from rank {_global(ranks, int(arrow.split('<-')[1]))}"
        sizes = _sizes(entry.get("output_sizes"), entry.get("output_dtypes"))
    elif kind == "coalesced" and entry.get("is_p2p"):
        what = "a batch of P2P sends/receives (batch_isend_irecv)"
        sizes = _sizes(entry.get("input_sizes"), entry.get("input_dtypes"))
    else:
        desc = group[1] if len(group) > 1 and group[1] not in ("undefined", "") else None
        where = f" over ranks {ranks}" if ranks is not None else ""
        what = f"{kind}{where}{f' (group {desc})' if desc else ''}"
        sizes = _sizes(entry.get("input_sizes"), entry.get("input_dtypes"))
    p2p = bool(entry.get("is_p2p")) or kind in ("send", "recv")
    seq = entry.get("p2p_seq_id") if p2p else entry.get("collective_seq_id")
    number = f"{'P2P' if p2p else 'collective'} #{seq}" if seq is not None else ""
    state = _STATES.get(str(entry.get("state")), str(entry.get("state")))
    return what + (f", {sizes}" if sizes else "") + (f" ({number})" if number else "") + f", {state}"


def where_rank_was(dump: dict) -> str:
    """What this rank's NCCL work was stuck on: the first recorded operation that had not
    completed (and how many more were queued behind it), else the last one, completed."""
    entries = [e for e in dump.get("entries") or [] if isinstance(e, dict)]
    if not entries:
        return "no NCCL operation recorded"
    entries.sort(key=lambda e: e.get("record_id", 0))
    pending = [e for e in entries if e.get("state") != "completed"]
    if pending:
        more = len(pending) - 1
        return describe_entry(dump, pending[0]) + (f"; {more} more queued behind it" if more else "")
    return f"every recorded NCCL operation completed, the last: {describe_entry(dump, entries[-1])}"


def where_ranks(prefix: str | Path, since: float | None = None) -> dict[int, str]:
    """Global rank -> `where_rank_was` for every dump under `prefix`."""
    return {rank: where_rank_was(dump) for rank, dump in read_dumps(prefix, since).items()}
