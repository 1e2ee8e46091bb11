"""The build folder's record of each published set: ``D/_userwise/published/<kind>/<date>.json``.

``publish`` writes a set's record last, after its shards are in place and its marker is
written (the same content as the marker, :mod:`userwise.pipelines.shards.publish`), so a day
counts as published from the moment its record exists; ``backfill`` removes the records of
the days it rebuilds before it writes any table; ``forget`` rewrites the records of the sets
it rebuilt. ``kind`` is ``incremental`` (keyed by the processed day) or ``pretrain`` (keyed by
its as-of date).
"""

from __future__ import annotations

import json

from userwise.pipelines.records import folder
from userwise.pipelines.records.state import write_json
from userwise.pipelines.runtime import storage

path = folder.published_record


def read(build_dir: str, kind: str, key_date) -> dict | None:
    """The record, or None when the set is not published."""
    data = storage.read_bytes(path(build_dir, kind, key_date))
    return None if data is None else json.loads(data)


def write(build_dir: str, kind: str, key_date, rec: dict) -> None:
    write_json(path(build_dir, kind, key_date), rec)


def remove(build_dir: str, kind: str, key_date) -> None:
    storage.remove(path(build_dir, kind, key_date))


def every(build_dir: str):
    """(path, record) of every published set of the folder."""
    for dirpath, _, files in storage.walk(folder.published_dir(build_dir)):
        for n in sorted(files):
            if n.endswith(".json"):
                p = storage.join(dirpath, n)
                yield p, json.loads(storage.read_bytes(p) or b"{}")
