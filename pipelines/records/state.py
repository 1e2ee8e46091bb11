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
from userwise.pipelines.errors import IncompleteError
from userwise.pipelines.records import folder, writer_lock
from userwise.pipelines.runtime import storage

FORMAT_VERSION = S.COMPLETE_FORMAT
_LOG_ENTRY = re.compile(r"^(\d{20})\.json$")


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


def table_versions(build_dir: str) -> dict[str, int]:
    """The current Delta version of each table of the build folder that exists."""
    out = {}
    for t in S.BUILD_TABLES:
        v = delta_version(storage.join(storage.absolute(build_dir), t))
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


def rerun_args(job: str, build_dir: str, detail: dict | None) -> list[str]:
    """The command line (``userwise`` excluded) that runs ``job`` on ``build_dir`` again:
    ``detail`` is what the job recorded (:func:`begin`), keyed by the command's option names
    (``config``, ``input``, ``as_of``, ``incremental_days``, ``from_`` for ``--from``, ...): a
    value None or False is left out, True is a bare flag, a list repeats the flag. A job
    whose config was not read from a file records ``config`` None and gets ``--config C.yaml``."""
    detail = dict(detail or {})
    argv = [job]
    if "config" in detail or job in _CONFIG_JOBS:
        argv += ["--config", detail.pop("config", None) or "C.yaml"]
    argv += ["--build-dir", build_dir]
    for k, v in detail.items():
        flag = "--" + k.rstrip("_").replace("_", "-")
        if v is None or v is False:
            continue
        if v is True:
            argv.append(flag)
        elif isinstance(v, (list, tuple)):
            for x in v:
                argv += [flag, str(x)]
        else:
            argv += [flag, str(v)]
    return argv


# the jobs whose command takes --config (every job that writes a build folder but forget)
_CONFIG_JOBS = frozenset({"build", "requests", "history", "window", "pretrain", "backfill"})


def describe(job: str, build_dir: str, detail: dict | None) -> str:
    """The command that runs ``job`` on ``build_dir`` again, quoted for a shell, between backticks."""
    import shlex

    return "`userwise " + shlex.join(rerun_args(job, build_dir, detail)) + "`"


def begin(build_dir: str, job: str, **detail) -> None:
    """Mark ``job`` running on ``build_dir`` (before its first write)."""
    write_json(running_path(build_dir), {"job": job, "detail": detail, "pid": os.getpid(), "started_at": _now()})


def finish(build_dir: str, job: str, **detail) -> dict:
    """Record the tables' versions as the folder's complete state (after the job's last commit)."""
    rec = {"format_version": FORMAT_VERSION, "job": job, "detail": detail, "finished_at": _now(),
           "tables": table_versions(build_dir)}
    write_json(record_path(build_dir), rec)
    running = _read(running_path(build_dir))
    if running is not None and running.get("pid") == os.getpid():
        storage.remove(running_path(build_dir))
    return rec


@contextlib.contextmanager
def job(build_dir: str, name: str, **detail):
    """Run the body as job ``name`` on ``build_dir``: marked running first, recorded complete
    only when the body returns (an exception or a kill leaves the running mark, which
    readers report)."""
    begin(build_dir, name, **detail)
    yield
    finish(build_dir, name, **detail)


def complete_state(build_dir: str) -> dict:
    """The folder's complete state for a reader: the record, with ``tables`` to read at.

    Raises :class:`IncompleteError` (one line, naming what to run) when there is none,
    or when the last job died before finishing.
    """
    rec = _read(record_path(build_dir))
    running = _read(running_path(build_dir))
    if running is not None and not writer_lock.live_writer(build_dir):
        raise IncompleteError(
            f"{build_dir}: {describe(running['job'], build_dir, running.get('detail'))} started {running.get('started_at')} "
            "and did not finish; run it again (its partial writes are replaced), then retry")
    if rec is None:
        if running is not None:
            raise IncompleteError(
                f"{build_dir}: {describe(running['job'], build_dir, running.get('detail'))} is still running and no earlier "
                "build finished; wait for it, then retry")
        raise IncompleteError(f"{build_dir} holds no finished build (no _userwise/complete.json): "
                              "run `userwise build` into it first")
    if rec.get("format_version") != FORMAT_VERSION:
        raise IncompleteError(f"{record_path(build_dir)} has format {rec.get('format_version')}, this reader "
                              f"understands {FORMAT_VERSION}: rebuild with this version of userwise")
    return rec


def version_of(build_dir: str, table: str) -> int:
    """The version of ``table`` in the folder's complete state."""
    rec = complete_state(build_dir)
    if table not in rec["tables"]:
        raise IncompleteError(f"{build_dir}: the finished {describe(rec['job'], build_dir, rec.get('detail'))} wrote no "
                              f"{table} table; build it first")
    return int(rec["tables"][table])
