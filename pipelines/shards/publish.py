"""Publish a pre-sharded set: move it into place, then write the published marker last.

Layout (``S`` = the shard root, ``D`` = the build folder)::

    S/_staging/incremental/<window_end>/    preshard writes here (manifest.json last)
    S/incremental/<window_end>/             the published set (moved in whole)
    S/incremental/<window_end>/_PUBLISHED.json
    S/pretrain/<as_of>/ ... _PUBLISHED.json
    D/_userwise/published/incremental/<date>.json   the day's record (same content)
    D/_userwise/published/pretrain/<as_of>.json

``window_end`` is the exclusive end of the window that ends with the
processed day ``date`` (``date + 1``). The marker says::

    {"format_version": 1, "kind": "incremental", "date": "2026-01-04",
     "window_start": "2026-01-04", "window_end": "2026-01-05", "window_days": 1,
     "tables": {"requests": 7, "events": 7, "history": 12, "history_log": 4, "samples": 9, ...},
     "shards": {"root": "/abs/S/incremental/2026-01-05", "manifest_sha256": "...", "rows": 120,
                "sets": ["incremental/2026-01-05"]} | null,
     "published_at": "2026-01-05T00:03:12Z"}

``tables`` are the Delta versions of the build folder's tables when the day
was published: reading them with ``versionAsOf`` gives exactly what the
shards were cut from. A day is published when its record exists and, when it
has shards, the set's manifest still has the recorded checksum.

Why the staging folder: a retried or forced preshard never writes into a set
that readers may be using; the swap is two renames on a local or POSIX
shared filesystem. (On an object store, copy the set and rely on the marker:
readers must only read sets whose ``_PUBLISHED.json`` exists.)

    python -m userwise.pipelines.shards.publish --output D --shards S --date 2026-01-04 [--window-days N]
    python -m userwise.pipelines.shards.publish --output D --shards S --kind pretrain --as-of 2026-02-01
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shutil
import sys
from pathlib import Path

from userwise.pipelines.errors import ShardError, UserwiseError
from userwise.pipelines.shards import manifest as mf

FORMAT_VERSION = 1
MARKER = "_PUBLISHED.json"
TABLES = ("requests", "events", "history", "history_log", "samples", "quarantine")
_LOG_ENTRY = re.compile(r"^(\d{20})\.json$")


def _d(x) -> dt.date:
    return x if isinstance(x, dt.date) else dt.date.fromisoformat(str(x))


def window_of(date, window_days: int = 1) -> tuple[dt.date, dt.date]:
    """[start, end) of the window that ends with the processed day ``date``."""
    end = _d(date) + dt.timedelta(days=1)
    return end - dt.timedelta(days=window_days), end


def set_key(kind: str, date=None, as_of=None) -> str:
    """The set's folder under S: ``incremental/<date+1>`` or ``pretrain/<as_of>``."""
    if kind == "incremental":
        return f"incremental/{window_of(date)[1].isoformat()}"
    if kind == "pretrain":
        return f"pretrain/{_d(as_of).isoformat()}"
    raise UserwiseError(f"kind {kind!r} is not 'incremental' or 'pretrain'")


def staging_root(shards: str, key: str) -> str:
    return os.path.join(os.path.abspath(shards), "_staging", key)


def set_root(shards: str, key: str) -> str:
    return os.path.join(os.path.abspath(shards), key)


def record_path(output: str, kind: str, key_date) -> str:
    return os.path.join(os.path.abspath(output), "_userwise", "published", kind, f"{_d(key_date).isoformat()}.json")


def delta_version(path: str) -> int | None:
    """Newest committed version of a Delta table, from its log (no Spark, no JVM); None if absent.

    Every commit ``N`` leaves ``_delta_log/<N, 20 digits>.json`` (log cleanup only
    removes entries older than the newest checkpoint), so the largest name is
    the table's version.
    """
    log = Path(path) / "_delta_log"
    if not log.is_dir():
        return None
    found = [int(m.group(1)) for n in os.listdir(log) if (m := _LOG_ENTRY.match(n))]
    return max(found) if found else None


def table_versions(output: str) -> dict[str, int]:
    out = {}
    for t in TABLES:
        v = delta_version(os.path.join(os.path.abspath(output), t))
        if v is not None:
            out[t] = v
    return out


def _write_json(path: str, obj: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump(obj, fh, indent=1, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def read_record(output: str, kind: str, key_date) -> dict | None:
    p = record_path(output, kind, key_date)
    if not os.path.exists(p):
        return None
    with open(p) as fh:
        return json.load(fh)


def is_published(output: str, kind: str, key_date, shards: str | None = None) -> bool:
    """True when the record exists and (with shards) its set is in place unchanged."""
    rec = read_record(output, kind, key_date)
    if rec is None:
        return False
    if shards is None:
        return True
    sh = rec.get("shards")
    if not sh:
        return False
    root = set_root(shards, set_key(kind, date=key_date, as_of=key_date))
    man = os.path.join(root, mf.MANIFEST)
    return (os.path.abspath(sh["root"]) == root and os.path.exists(man)
            and os.path.exists(os.path.join(root, MARKER)) and mf.file_sha256(man) == sh["manifest_sha256"])


def unpublish(output: str, kind: str, key_date, shards: str | None = None) -> None:
    """Remove the day's record (first) and its set's marker: the day reads as not published."""
    p = record_path(output, kind, key_date)
    if os.path.exists(p):
        os.remove(p)
    if shards:
        m = os.path.join(set_root(shards, set_key(kind, date=key_date, as_of=key_date)), MARKER)
        if os.path.exists(m):
            os.remove(m)


def _prune(root: str, man: dict) -> None:
    """Delete files a killed earlier attempt left in the staging set that the manifest does not list."""
    keep = {mf.MANIFEST}
    for s in man["shards"]:
        keep.update(p for p, _, _ in mf.shard_files(s))
    for dirpath, _, files in os.walk(root):
        for f in files:
            rel = os.path.relpath(os.path.join(dirpath, f), root)
            if rel not in keep:
                os.remove(os.path.join(dirpath, f))


def move_into_place(staging: str, final: str) -> str:
    """Verify the staged set, swap it into ``final``; returns the manifest's sha256.

    Idempotent for retries: when staging is gone but ``final`` holds a valid set
    (a retry after the swap), it only re-verifies ``final``.
    """
    if os.path.isdir(staging):
        man = mf.load(staging)
        _prune(staging, man)
        mf.verify(staging, checksums=True)
        os.makedirs(os.path.dirname(final), exist_ok=True)
        old = f"{final}.old-{os.getpid()}"
        if os.path.exists(final):
            os.rename(final, old)
        os.rename(staging, final)
        shutil.rmtree(old, ignore_errors=True)
    elif not os.path.exists(os.path.join(final, mf.MANIFEST)):
        raise ShardError(f"{staging}: no staged shard set and none published at {final}; "
                         "run `userwise preshard --output " + staging + "` first")
    for leftover in Path(final).parent.glob(Path(final).name + ".old-*"):
        shutil.rmtree(leftover, ignore_errors=True)
    mf.verify(final, checksums=False)
    return mf.file_sha256(os.path.join(final, mf.MANIFEST))


def publish(output: str, *, kind: str = "incremental", date=None, as_of=None, shards: str | None = None,
            window_days: int = 1, now: dt.datetime | None = None) -> dict:
    """Publish one day's window (or one pretrain set): shards into place, then the markers."""
    if kind == "incremental" and date is None:
        raise UserwiseError("publish --kind incremental needs --date (the processed UTC day)")
    if kind == "pretrain" and as_of is None:
        raise UserwiseError("publish --kind pretrain needs --as-of")
    key = set_key(kind, date=date, as_of=as_of)
    rec: dict = {"format_version": FORMAT_VERSION, "kind": kind, "tables": table_versions(output), "shards": None}
    if kind == "incremental":
        ws, we = window_of(date, window_days)
        rec.update(date=_d(date).isoformat(), window_start=ws.isoformat(), window_end=we.isoformat(),
                   window_days=window_days)
    else:
        rec.update(as_of=_d(as_of).isoformat())
    if "samples" not in rec["tables"]:
        raise UserwiseError(f"{os.path.join(output, 'samples')}: no samples table; run the window/pretrain job "
                            "before publishing")
    if shards:
        final = set_root(shards, key)
        sha = move_into_place(staging_root(shards, key), final)
        man = mf.load(final)
        rec["shards"] = {"root": final, "manifest_sha256": sha, "rows": sum(int(s["rows"]) for s in man["shards"]),
                         "sets": [s["id"] for s in man["sets"]],
                         "source_version": man.get("source", {}).get("version")}
    rec["published_at"] = (now or dt.datetime.now(dt.timezone.utc)).strftime("%Y-%m-%dT%H:%M:%SZ")
    key_date = date if kind == "incremental" else as_of
    if shards:
        _write_json(os.path.join(set_root(shards, key), MARKER), rec)
    _write_json(record_path(output, kind, key_date), rec)  # last: the day counts as published from here
    return rec


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="publish", description="publish a pre-sharded set (marker last)")
    p.add_argument("--output", required=True, help="the build folder")
    p.add_argument("--shards", help="shard root S (the set is staged under S/_staging/...)")
    p.add_argument("--kind", choices=["incremental", "pretrain"], default="incremental")
    p.add_argument("--date", help="processed UTC day (incremental)")
    p.add_argument("--as-of", help="pretrain as-of date")
    p.add_argument("--window-days", type=int, default=1)
    p.add_argument("--master", help="ignored (spark-submit passes it; publish needs no Spark)")
    return p


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    try:
        rec = publish(a.output, kind=a.kind, date=a.date, as_of=a.as_of, shards=a.shards,
                      window_days=a.window_days)
    except UserwiseError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(rec, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
