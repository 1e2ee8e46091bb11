"""The layout of a build folder's records: ``D/_userwise/``, spelled once.

Every file the product keeps beside a build folder's Delta tables lives here::

    D/_userwise/build.json                         what the folder was built from (build_record)
    D/_userwise/complete.json                      the last complete state (state)
    D/_userwise/running.json                       the job running now, or the one that died (state)
    D/_userwise/locks/<name>.lock                  the writer locks (writer_lock)
    D/_userwise/published/<kind>/<date>.json       a published day or pretrain set (published)

``D`` is a local path or a store's URL (:mod:`userwise.pipelines.runtime.storage`).
"""

from __future__ import annotations

import datetime as dt

from userwise.pipelines.runtime import storage

META_DIR = "_userwise"
BUILD_JSON = "build.json"
COMPLETE_JSON = "complete.json"
RUNNING_JSON = "running.json"
LOCKS = "locks"
PUBLISHED = "published"


def meta_dir(build_dir: str) -> str:
    """``D/_userwise`` (absolute for a local path)."""
    return storage.join(storage.absolute(build_dir), META_DIR)


def build_json(build_dir: str) -> str:
    return storage.join(meta_dir(build_dir), BUILD_JSON)


def complete_json(build_dir: str) -> str:
    return storage.join(meta_dir(build_dir), COMPLETE_JSON)


def running_json(build_dir: str) -> str:
    return storage.join(meta_dir(build_dir), RUNNING_JSON)


def locks_dir(build_dir: str) -> str:
    return storage.join(meta_dir(build_dir), LOCKS)


def published_dir(build_dir: str) -> str:
    return storage.join(meta_dir(build_dir), PUBLISHED)


def published_record(build_dir: str, kind: str, key_date) -> str:
    """The record of the published set of ``kind`` keyed by ``key_date`` (the processed day of
    an incremental set, the as-of date of a pretrain set)."""
    d = key_date if isinstance(key_date, dt.date) else dt.date.fromisoformat(str(key_date))
    return storage.join(published_dir(build_dir), kind, f"{d.isoformat()}.json")
