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
shared filesystem and on HDFS (a folder rename is one name node operation).
``S`` and ``D`` may be URLs (``pipelines/runtime/storage.py``). An object store
(S3, GCS) has no folder rename, and publish relies on none there
(:func:`storage.swap_in`): the old set's marker and manifest are deleted first,
the staged objects are copied in server-side, the manifest and the marker last,
then the day's record. Readers key on those single-object writes: a set is
published when its marker and the record exist and the manifest has the recorded
checksum, and ``stage`` checks every file against that manifest.

    userwise publish --build-dir D --shards S --date 2026-01-04 [--window-days N]
    userwise publish --build-dir D --shards S --kind pretrain --as-of 2026-02-01
"""

from __future__ import annotations

import datetime as dt
import os

import pyarrow.fs as pafs

from userwise.pipelines.errors import ShardError, UserwiseError
from userwise.pipelines.records import published, state
from userwise.pipelines.records.state import write_json
from userwise.pipelines.runtime import storage
from userwise.pipelines.shards import manifest as mf
from userwise.schemas.core import PUBLISHED_FORMAT

FORMAT_VERSION = PUBLISHED_FORMAT
MARKER = "_PUBLISHED.json"


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
    return storage.join(storage.absolute(shards), "_staging", key)


def set_root(shards: str, key: str) -> str:
    return storage.join(storage.absolute(shards), key)


def is_published(build_dir: str, kind: str, key_date, shards: str | None = None) -> bool:
    """True when the record exists and (with shards) its set is in place unchanged."""
    rec = published.read(build_dir, kind, key_date)
    if rec is None:
        return False
    if shards is None:
        return True
    sh = rec.get("shards")
    if not sh:
        return False
    root = set_root(shards, set_key(kind, date=key_date, as_of=key_date))
    man = storage.join(root, mf.MANIFEST)
    return (storage.absolute(sh["root"]) == root and storage.exists(man)
            and storage.exists(storage.join(root, MARKER)) and mf.file_sha256(man) == sh["manifest_sha256"])


def unpublish(build_dir: str, kind: str, key_date, shards: str | None = None) -> None:
    """Remove the day's record (first) and its set's marker: the day reads as not published."""
    published.remove(build_dir, kind, key_date)
    if shards:
        storage.remove(storage.join(set_root(shards, set_key(kind, date=key_date, as_of=key_date)), MARKER))


def _prune(root: str, man: dict) -> None:
    """Delete files a killed earlier attempt left in the staging set that the manifest does not list."""
    keep = {mf.MANIFEST}
    for s in man["shards"]:
        keep.update(p for p, _, _ in mf.shard_files(s))
    fs, base = storage.filesystem(root)
    for i in fs.get_file_info(pafs.FileSelector(base, recursive=True)):
        if i.type == pafs.FileType.File and i.path[len(base):].lstrip("/") not in keep:
            fs.delete_file(i.path)


def move_into_place(staging: str, final: str) -> str:
    """Verify the staged set, swap it into ``final``; returns the manifest's sha256.

    Idempotent for retries: when staging is gone but ``final`` holds a valid set
    (a retry after the swap), it only re-verifies ``final``.
    """
    fs, final_p = storage.filesystem(final)
    parent, name = final_p.rsplit("/", 1)
    if storage.is_dir(staging):
        man = mf.load(staging)
        _prune(staging, man)
        mf.verify(staging, checksums=True)
        fs.create_dir(parent, recursive=True)
        try:
            storage.swap_in(staging, final, f"{final}.old-{os.getpid()}", last=(mf.MANIFEST, MARKER))
        except OSError as e:
            raise ShardError(f"{staging}: could not move the staged set to {final} ({e}); publish again") from None
    elif not storage.exists(storage.join(final, mf.MANIFEST)):
        raise ShardError(f"{staging}: no staged shard set and none published at {final}; "
                         f"pre-shard the set there first (userwise preshard with --shards {staging} and the set's "
                         "--kind and --window)")
    for i in fs.get_file_info(pafs.FileSelector(parent)):
        if i.base_name.startswith(name + ".old-") and i.type == pafs.FileType.Directory:
            _rmtree(final[: len(final) - len(name)] + i.base_name)
    mf.verify(final, checksums=False)
    return mf.file_sha256(storage.join(final, mf.MANIFEST))


def _rmtree(path: str) -> None:
    """Remove an old set after its swap; a failure leaves it for the next publish to remove."""
    try:
        storage.rmtree(path)
    except (OSError, RuntimeError):
        pass


def publish(build_dir: str, *, kind: str = "incremental", date=None, as_of=None, shards: str | None = None,
            window_days: int = 1, now: dt.datetime | None = None) -> dict:
    """Publish one day's window (or one pretrain set): shards into place, then the markers."""
    if kind == "incremental" and date is None:
        raise UserwiseError("publish --kind incremental needs --date (the processed UTC day)")
    if kind == "pretrain" and as_of is None:
        raise UserwiseError("publish --kind pretrain needs --as-of")
    key = set_key(kind, date=date, as_of=as_of)
    rec: dict = {"format_version": FORMAT_VERSION, "kind": kind, "tables": state.complete_state(build_dir)["tables"], "shards": None}
    if kind == "incremental":
        ws, we = window_of(date, window_days)
        rec.update(date=_d(date).isoformat(), window_start=ws.isoformat(), window_end=we.isoformat(),
                   window_days=window_days)
    else:
        rec.update(as_of=_d(as_of).isoformat())
    if "samples" not in rec["tables"]:
        raise UserwiseError(f"{storage.join(build_dir, 'samples')}: no samples table; run the window/pretrain job "
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
        write_json(storage.join(set_root(shards, key), MARKER), rec)
    published.write(build_dir, kind, key_date, rec)  # last: the day counts as published from here
    return rec
