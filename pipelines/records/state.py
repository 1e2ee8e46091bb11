"""All or nothing: the completion record of a build folder, written last, read first.

A job that writes a build folder ``D`` (``build``, ``backfill``, the daily jobs,
``forget``) marks itself running when it starts and, when every table it writes is
committed, writes ``D/_userwise/complete.json`` last (write to a temporary file, then
one rename)::

    {"format_version": 1, "job": "build", "detail": {...}, "finished_at": "...",
     "tables": {"requests": 3, "events": 3, "history": 1, "samples": 2, "quarantine": 3, ...}}

``tables`` are the Delta versions of the complete state. Readers (``preshard``,
``expand``, ``publish``) call :func:`complete_state` and read every table at its
recorded version (Delta time travel), so while a job runs they keep reading the
previous complete state, and a job killed half-way is never read: its partial commits
sit above the recorded versions. A folder with no record, or whose last job died before
finishing, is refused with one line naming the job to run again.

A rerun of the killed job replaces what it had written (every write is a Delta
replaceWhere or MERGE keyed by its dates) and then writes the record.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import re

from userwise import schemas as S
from userwise.pipelines.errors import UserwiseError
from userwise.pipelines.records import folder, writer_lock
from userwise.pipelines.runtime import storage

FORMAT_VERSION = S.COMPLETE_FORMAT
_LOG_ENTRY = re.compile(r"^(\d{20})\.json$")


class IncompleteError(UserwiseError):
    """The build folder holds no complete state to read."""


record_path = folder.complete_json
running_path = folder.running_json


def delta_version(path: str) -> int | None:
    """Newest committed version of a Delta table, from its log (no Spark, no JVM); None if absent.

    Every commit ``N`` leaves ``_delta_log/<N, 20 digits>.json`` (log cleanup only
    removes entries older than the newest checkpoint), so the largest name is
    the table's version.
    """
    found = [int(m.group(1)) for n in storage.listdir(storage.join(path, "_delta_log"))
             if (m := _LOG_ENTRY.match(n))]
    return max(found) if found else None


def table_versions(output: str) -> dict[str, int]:
    """The current Delta version of each table of the build folder that exists."""
    out = {}
    for t in S.BUILD_TABLES:
        v = delta_version(storage.join(storage.absolute(output), t))
        if v is not None:
            out[t] = v
    return out


def write_json(path: str, obj: dict) -> None:
    """Write ``obj`` to ``path`` (a local path or a URL) atomically: a temporary file, one rename."""
    storage.write_bytes(path, json.dumps(obj, indent=1, sort_keys=True).encode())


def _read(path: str) -> dict | None:
    data = storage.read_bytes(path)
    if data is None:
        return None
    try:
        return json.loads(data)
    except ValueError as e:
        raise IncompleteError(f"{path} is not valid JSON ({e}); run the last job again") from None


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def describe(job: str, detail: dict | None) -> str:
    args = " ".join(f"--{k.rstrip('_').replace('_', '-')} {v}" for k, v in (detail or {}).items() if v is not None)
    return f"`userwise {job}{' ' + args if args else ''}`"


def begin(output: str, job: str, **detail) -> None:
    """Mark ``job`` running on ``output`` (before its first write)."""
    write_json(running_path(output), {"job": job, "detail": detail, "pid": os.getpid(), "started_at": _now()})


def finish(output: str, job: str, **detail) -> dict:
    """Record the tables' versions as the folder's complete state (after the job's last commit)."""
    rec = {"format_version": FORMAT_VERSION, "job": job, "detail": detail, "finished_at": _now(),
           "tables": table_versions(output)}
    write_json(record_path(output), rec)
    running = _read(running_path(output))
    if running is not None and running.get("pid") == os.getpid():
        storage.remove(running_path(output))
    return rec


@contextlib.contextmanager
def job(output: str, name: str, **detail):
    """Run the body as job ``name`` on ``output``: marked running first, recorded complete
    only when the body returns (an exception or a kill leaves the running mark, which
    readers report)."""
    begin(output, name, **detail)
    yield
    finish(output, name, **detail)


def complete_state(output: str) -> dict:
    """The folder's complete state for a reader: the record, with ``tables`` to read at.

    Raises :class:`IncompleteError` (one line, naming what to run) when there is none,
    or when the last job died before finishing.
    """
    rec = _read(record_path(output))
    running = _read(running_path(output))
    if running is not None and not writer_lock.live_writer(output):
        raise IncompleteError(
            f"{output}: {describe(running['job'], running.get('detail'))} started {running.get('started_at')} "
            "and did not finish; run it again (its partial writes are replaced), then retry")
    if rec is None:
        if running is not None:
            raise IncompleteError(
                f"{output}: {describe(running['job'], running.get('detail'))} is still running and no earlier "
                "build finished; wait for it, then retry")
        raise IncompleteError(f"{output} holds no finished build (no _userwise/complete.json): "
                              "run `userwise build` into it first")
    if rec.get("format_version") != FORMAT_VERSION:
        raise IncompleteError(f"{record_path(output)} has format {rec.get('format_version')}, this reader "
                              f"understands {FORMAT_VERSION}: rebuild with this version of userwise")
    return rec


def version_of(output: str, table: str) -> int:
    """The version of ``table`` in the folder's complete state."""
    rec = complete_state(output)
    if table not in rec["tables"]:
        raise IncompleteError(f"{output}: the finished {describe(rec['job'], rec.get('detail'))} wrote no "
                              f"{table} table; build it first")
    return int(rec["tables"][table])
