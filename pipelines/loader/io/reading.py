"""Reading shard files: Parquet row groups as Arrow tables, and the threads that read ahead.

A shard file is opened once per process and thread (its footer parsed once; a
``ParquetFile`` is never read from two threads), every page's CRC32 checked as it is read,
its buffers allocated from the pool :func:`read_pool` names; consecutive row groups of one
file are one read call (:func:`read_row_groups`). A process that decodes alone reads the
next buffers on its read-ahead lanes (:class:`ShardFiles`) while it shuffles and cuts the
current one (docs/loader.md, Read-ahead).

Example::

    files = ShardFiles()
    table = read_row_groups(shards, lambda s: files.open(shards.path(s)), [0, 1], columns=None)
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa
import pyarrow.parquet as pq

from userwise.pipelines.errors import ArgumentError, ShardError

__all__ = ["READ_LANES", "READ_AHEAD", "READ_POOLS", "read_pool", "open_parquet", "ShardFiles", "read_row_groups"]

# Buffers a process that decodes alone reads ahead, each on its own thread (a "lane"), while the
# calling thread shuffles and cuts the current one. With one lane the read of the next buffer is
# the whole critical path and leaves part of two cores idle; see docs/loader.md (Read-ahead).
READ_LANES = 2
# Reads in flight (queued to the lanes) while the calling thread works on a buffer: one more than
# the lanes, so that a lane that finishes while the caller is busy starts the next read at once
# instead of waiting for the caller to take its buffer (with READ_LANES in flight, one lane sits idle
# for most of each buffer's shuffle). A process holds up to READ_AHEAD + 1 decoded buffers.
READ_AHEAD = READ_LANES + 1

_POOL_SWAP = threading.Lock()  # open_parquet's swap of the process-wide default pool

# Which allocator the shard readers decode into: "arrow" (Arrow's default pool, mimalloc in
# PyPI's wheels) or "system" (malloc). USERWISE_READ_POOL overrides it: which is faster depends
# on the host (docs/loader.md, Tuning).
READ_POOLS = ("arrow", "system")


def read_pool() -> str:
    """The shard readers' pool for datasets made now: ``USERWISE_READ_POOL``, default "arrow"."""
    name = os.environ.get("USERWISE_READ_POOL", "arrow")
    if name not in READ_POOLS:
        raise ArgumentError(f"USERWISE_READ_POOL={name!r}: use one of {READ_POOLS}")
    return name


def open_parquet(path: str, memory_map: bool = True, pool: str | None = None) -> pq.ParquetFile:
    """A shard file whose reads allocate from ``pool`` (default :func:`read_pool`): "arrow"
    (the process's default pool) or "system" (malloc). A reader takes its pool when it is
    opened, so for "system" the default is swapped only for that moment (under a lock:
    read-ahead lanes open files from their own threads, and two overlapping swaps could leave
    the system pool as the process's default). Every page's CRC32 (preshard writes one) is
    checked as it is read: a corrupt page fails the read, whatever ``verify`` checked before."""
    pool = read_pool() if pool is None else pool
    if "://" in path and not path.startswith("file:"):  # read straight from a store: the slow path
        from userwise.pipelines.loader.io.shards import source

        path, memory_map = source(path), False
    if pool == "arrow":
        return pq.ParquetFile(path, memory_map=memory_map, page_checksum_verification=True)
    if pool != "system":
        raise ArgumentError(f"pool must be one of {READ_POOLS}, got {pool!r}")
    with _POOL_SWAP:
        old = pa.default_memory_pool()
        pa.set_memory_pool(pa.system_memory_pool())
        try:
            return pq.ParquetFile(path, memory_map=memory_map, page_checksum_verification=True)
        finally:
            pa.set_memory_pool(old)


class ShardFiles:
    """One dataset's open shard files (per thread) and read-ahead lanes, in this process: a
    forked worker opens its own, and a pickled copy (a spawned worker) starts with none."""

    def __init__(self):
        self._files: dict = {}
        self._files_pid: int | None = None
        self._lanes: ThreadPoolExecutor | None = None
        self._lanes_pid: int | None = None

    def open(self, path: str, memory_map: bool = True, pool: str | None = None) -> pq.ParquetFile:
        """``path`` opened for this thread (:func:`open_parquet`), kept for the next read."""
        pid = os.getpid()
        if self._files_pid != pid:  # after fork: own handles
            self._files, self._files_pid = {}, pid
        key = (threading.get_ident(), path)
        f = self._files.get(key)
        if f is None:
            f = self._files[key] = open_parquet(path, memory_map, pool)
        return f

    def lanes(self) -> ThreadPoolExecutor:
        """This process's read-ahead lanes, started once (so each keeps its file handles)."""
        pid = os.getpid()
        if self._lanes_pid != pid:  # after fork the parent's threads are gone
            self._lanes = ThreadPoolExecutor(READ_LANES, thread_name_prefix="userwise-read")
            self._lanes_pid = pid
        return self._lanes

    def __getstate__(self):
        return {}

    def __setstate__(self, state):
        self.__init__()


def read_row_groups(shards, open_file: Callable[[int], pq.ParquetFile], rgs, columns, *,
                    use_threads: bool = True) -> pa.Table:
    """Row groups ``rgs`` (the node's global numbers, :class:`~userwise.pipelines.loader.io.shards.NodeShards`)
    as one Arrow table, as read: consecutive row groups of one file in one read call.
    ``open_file(shard)`` gives a shard's open file; a failed read is a :class:`ShardError`
    naming the file."""
    parts, runs = [], []
    for g in rgs:
        s, i = int(shards.rg_shard[g]), int(shards.rg_index[g])
        if runs and runs[-1][0] == s:
            runs[-1][1].append(i)
        else:
            runs.append((s, [i]))
    for s, idx in runs:
        try:
            parts.append(open_file(s).read_row_groups(idx, columns=columns, use_threads=use_threads))
        except Exception as e:  # noqa: BLE001
            why = " ".join(str(e).split())  # e.g. a page whose CRC does not match: a corrupt file
            raise ShardError(f"{shards.path(s)}: row group {idx} unreadable ({why}); re-stage this file") from None
    return parts[0] if len(parts) == 1 else pa.concat_tables(parts)
