"""Copy one node's shards onto local disk: parallel, verified, resumable.

``userwise stage --shards S --node k --staged /nvme/x [--workers 8]``

- ``S`` is a local path or any URL that pyarrow.fs or fsspec opens (hdfs://,
  s3://, gs://, ...). The manifest must be there (else the set is incomplete)
  and of this code's format version.
- Every file is written as ``<name>.part``, hashed while it streams, and
  renamed to its name only when its size and sha256 match the manifest; a
  Parquet shard must also carry the manifest's schema fingerprint and format
  version. A mismatch is refused with the file named.
- Resume: files already at their final name are re-hashed (a local read) and
  kept when they match; a ``.part`` left by an interrupted run continues
  from its length (its prefix is hashed first; a bad prefix is copied again).
- Large reads, several streams: ``--workers`` streams copy files in parallel, each with
  reads of :data:`CHUNK` bytes (one ranged request each on HTTP stores: WebHDFS, S3,
  GCS). A file larger than ``--range-mb`` is cut into ranges that the streams copy in
  parallel into its ``.part`` (written at their offsets); a ``.part.ranges`` file beside it
  lists the ranges finished, so a resumed copy fetches only the others, and the whole
  file is hashed once complete (a local read).
- Free space for what is left to copy is checked before anything is copied.
- A read that fails on the store (a reset connection, a timeout, the store's own error) is
  retried ``--retries`` times (4) with exponential backoff from 1 s, resuming from what it
  had copied; a store that stays down (the name node gone, the network down) then ends the
  run with one ``error:`` line. Finished files and partial copies stay, and the same
  command resumes.
- Progress on stderr: one line redrawn in place on a terminal, a new line every 10 s
  elsewhere (a log), nothing with ``--quiet``.
- ``staged/manifest.json`` (the manifest plus ``"staged_node": k``) is removed
  first and written last: a half-staged folder has none, and the loader
  refuses it.
- Hostile manifests (docs/security.md): every path the manifest holds is checked before
  anything is touched (:func:`~userwise.pipelines.shards.manifest.safe_relpath`: relative,
  normalised, no ``..``, no scheme), and so are its fields' types; a target is written only
  inside ``staged`` after resolving the symlinks in its folders, a local source only inside the
  shard set's root; ``.part`` files are opened without following links; every source file's
  size is checked against the manifest before the first byte is written.
- One stage per destination: ``staged/.stage.lock`` (an ``flock``, released by the kernel
  when the process dies, so a killed stage's lock is taken over by the next) refuses a
  second concurrent stage, naming the first's process.

No Spark here: trainers run this.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import shutil
import sys
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

import pyarrow.fs as pafs

from userwise.pipelines.errors import ArgumentError, ShardError, StoreGone, short
from userwise.pipelines.records.writer_lock import FolderLock
from userwise.pipelines.runtime import progress
from userwise.pipelines.shards import manifest as mf
from userwise.schemas import FORMAT_VERSION

MARGIN = 16 << 20  # free space kept besides what the copy needs
RETRIES = 4  # a failed read is retried this often (exponential backoff) before the node fails
BACKOFF_S = 1.0  # the first retry's wait; each next one waits twice as long
CHUNK = 8 << 20  # bytes per read: one ranged request on an HTTP store
RANGE_MB = 64.0  # files larger than this are copied as parallel ranges of this size


def _is_store_failure(e: BaseException) -> bool:
    """A failure of the remote source (connection refused or reset, timeouts, the store's own
    errors), not of the local disk (full, read-only, no permission) nor of the shard set."""
    import errno

    if isinstance(e, (ShardError, PermissionError, IsADirectoryError, NotADirectoryError)):
        return False
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES):
        return False
    try:
        import requests

        if isinstance(e, requests.RequestException):
            return True
    except ImportError:
        pass
    return isinstance(e, (OSError, RuntimeError, ConnectionError, TimeoutError))


class _Progress:
    """Files, bytes and MB/s on stderr: on a terminal one line redrawn in place (at most every
    ``every`` seconds), elsewhere (a log file, a CI console) a new line every ``every_log``
    seconds, so a log is not flooded. Nothing with ``--quiet`` (``progress.QUIET``)."""

    def __init__(self, node: int, files: int, total: int, *, out=sys.stderr, every: float = 0.5,
                 every_log: float = 10.0, limit_mbps: float | None = None):
        self.node, self.files, self.total = node, files, total
        self.out = None if progress.QUIET else out
        self.tty = progress.isatty(out)
        self.every = every if self.tty else every_log
        self.limit = limit_mbps * 1e6 if limit_mbps else None
        self.done_files = self.done_bytes = 0
        self.retries = 0
        self.t0 = self.last = time.monotonic()
        self.lock = threading.Lock()

    def add(self, n: int) -> None:
        with self.lock:
            self.done_bytes += n
            now = time.monotonic()
            if now - self.last >= self.every:
                self.last = now
                self._print(now, final=False)
            ahead = self.done_bytes / self.limit - (now - self.t0) if self.limit else 0
        if ahead > 0:
            time.sleep(ahead)

    def file_done(self) -> None:
        with self.lock:
            self.done_files += 1

    def retried(self, what: str, attempt: int, wait: float, e: BaseException) -> None:
        with self.lock:
            self.retries += 1
            if self.out is not None:
                self._clear()
                print(f"stage node={self.node}: {what}: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
                      f"; retry {attempt} in {wait:.1f} s", file=self.out, flush=True)

    def _clear(self) -> None:
        if self.tty:
            self.out.write("\r\x1b[K")

    def _print(self, now: float, final: bool) -> None:
        if self.out is None:
            return
        dt_ = max(now - self.t0, 1e-9)
        text = (f"stage node={self.node}: files {self.done_files}/{self.files}, "
                f"{self.done_bytes / 1e6:.1f}/{self.total / 1e6:.1f} MB, {self.done_bytes / 1e6 / dt_:.1f} MB/s")
        if self.tty:
            self.out.write("\r" + text + "\x1b[K" + ("\n" if final else ""))
            self.out.flush()
        else:
            print(text, file=self.out, flush=True)

    def finish(self) -> float:
        now = time.monotonic()
        with self.lock:
            self._print(now, final=True)
        return now - self.t0


def retrying(fn, *, retries: int, backoff: float, what: str, prog: _Progress, stop: threading.Event):
    """Run ``fn()``; a failure of the store (:func:`_is_store_failure`: a reset connection, a
    timeout, the store's own error) is retried up to ``retries`` times, waiting ``backoff``,
    then twice that, and so on; anything else, or the last failure, is raised."""
    for attempt in range(retries + 1):
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - sorted below
            if attempt == retries or stop.is_set() or not _is_store_failure(e):
                raise
            wait = backoff * (2 ** attempt)
            prog.retried(what, attempt + 1, wait, e)
            if stop.wait(wait):
                raise


def _check_staged_manifest(staged: str, m: dict, node: int) -> None:
    if not os.path.exists(os.path.join(staged, mf.MANIFEST)):
        return
    try:
        old = mf.load(staged)
    except ShardError:
        return  # a damaged leftover: it is removed and rewritten
    same = ({k: v for k, v in old.items() if k != "staged_node"} == m) and old.get("staged_node") == node
    if not same:
        what = f"node {old.get('staged_node')} of {old.get('source', {}).get('table')} " \
               f"(version {old.get('source', {}).get('version')}, schema {old.get('schema_fingerprint')})"
        raise ShardError(f"{staged}: already holds {what}, a different shard set or node; "
                         "stage into an empty folder or delete it first")


def stage(shards: str, node: int, staged: str, *, workers: int = 8, limit_mbps: float | None = None,
          fs=None, out=sys.stderr, range_mb: float = RANGE_MB, retries: int = RETRIES,
          backoff: float = BACKOFF_S) -> dict:
    """Stage node ``node`` of the shard set at ``shards`` into ``staged``; return a report dict.

    A file's (or a range's) copy that fails on the store is retried ``retries`` times with
    exponential backoff from ``backoff`` seconds, resuming from what it had copied."""
    _check_rate("limit_mbps", "--limit-mbps", limit_mbps, nullable=True)
    _check_rate("range_mb", "--range-mb", range_mb)
    try:
        return _stage(shards, node, staged, workers=workers, limit_mbps=limit_mbps, fs=fs, out=out,
                      range_bytes=max(int(range_mb * (1 << 20)), 1 << 16), retries=retries, backoff=backoff)
    except Exception as e:
        if (fs is None and "://" not in shards) or not _is_store_failure(e):
            raise
        msg = str(e).splitlines()[0][:160] if str(e) else ""
        raise StoreGone(f"{shards}: the store stopped answering while node {node} was staged "
                        f"({type(e).__name__}{': ' + msg if msg else ''}); finished and partial files in {staged} "
                        "are kept: run the same command again when the store is back, it resumes") from None


def _check_rate(name: str, flag: str, value, *, nullable: bool = False) -> None:
    """``value`` is a finite number > 0 (or None where ``nullable``), else ArgumentError naming the flag."""
    if value is None and nullable:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ArgumentError(f"{flag} ({name}) must be a finite number > 0, got {short(value)}"
                            + ("; leave it out for no cap" if nullable else ""))


def _stage(shards: str, node: int, staged: str, *, workers: int, limit_mbps: float | None, fs, out,
           range_bytes: int, retries: int, backoff: float) -> dict:
    src_fs, src_base = mf.resolve(shards, fs)
    m = mf.load(shards, fs)
    if int(m["format_version"]) != FORMAT_VERSION:
        raise ShardError(f"{shards}: shard format version {m['format_version']} differs from this "
                         f"reader's {FORMAT_VERSION}; use the userwise version that wrote it or rerun preshard")
    items = [f for s in mf.node_shards(m, node) for f in mf.shard_files(s)]
    if not items:
        raise ShardError(f"{shards}: the manifest lists no shards for node {node}")
    local_src = isinstance(src_fs, pafs.LocalFileSystem)
    if local_src:  # a source path must stay inside the shard set's root, links resolved
        src_root = os.path.realpath(src_base)
        for rel, _, _ in items:
            _inside(src_root, os.path.realpath(os.path.join(src_base, rel)), f"{shards}: {rel}", "the shard set's root")
    staged = os.path.abspath(staged)
    existed = os.path.isdir(staged)
    if not existed and os.path.lexists(staged):
        raise ShardError(f"--staged {staged}: is a file, not a folder; choose a folder (stage creates it)")
    os.makedirs(staged, exist_ok=True)
    try:
        with _lock(staged, f"node {node} of {shards}"):
            return _stage_locked(m, items, src_fs, src_base, shards, node, staged, workers=workers,
                                 limit_mbps=limit_mbps, out=out, range_bytes=range_bytes, retries=retries,
                                 backoff=backoff)
    except BaseException:
        if not existed:  # a refusal leaves no empty destination behind (a copy under way keeps its files)
            with contextlib.suppress(OSError):
                os.rmdir(staged)
        raise


LOCK = ".stage.lock"


@contextlib.contextmanager
def _lock(staged: str, what: str):
    """Hold ``staged``'s stage lock; anything but a regular file at ``staged/.stage.lock`` (a link, a
    folder) is refused, never followed: the lock is opened with ``O_NOFOLLOW``, so a link's target
    is untouched."""
    import stat

    path = os.path.join(staged, LOCK)
    bad = ShardError(f"{path}: not a lock file stage wrote (a symbolic link, a folder or another special file); "
                     "refused without touching what it points at: remove it and run the same command again")
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISREG(os.lstat(path).st_mode):
            raise bad
    lock = FolderLock(path, "stage", what=what)
    try:
        lock.acquire()
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO, errno.ENOTDIR):
            raise bad from None
        raise
    try:
        yield lock
    finally:
        lock.release()


def _inside(root: str, path: str, what: str, where: str) -> None:
    if path != root and not path.startswith(root.rstrip(os.sep) + os.sep):
        raise ShardError(f"{what}: resolves to {path}, outside {where} ({root}) through a symbolic link; "
                         "refused before anything was written: remove the link")


def _target(staged: str, rel: str) -> str:
    """The local path of ``rel`` in ``staged``: refused unless its folder, symlinks resolved, is in ``staged``."""
    final = os.path.join(staged, rel)
    _inside(os.path.realpath(staged), os.path.realpath(os.path.dirname(final)), f"{staged}: {rel}", "the destination")
    return final


def _open_part(part: str, flags: int) -> int:
    """Open a ``.part`` for writing without following a link: a link there is removed first
    (the name is stage's own), and O_NOFOLLOW refuses one that appears in between."""
    if os.path.islink(part):
        os.unlink(part)
    try:
        return os.open(part, flags | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ShardError(f"{part}: a symbolic link appeared while stage ran; refused: remove it") from None
        raise


def _stage_locked(m: dict, items: list, src_fs, src_base: str, shards: str, node: int, staged: str, *, workers: int,
                  limit_mbps: float | None, out, range_bytes: int, retries: int, backoff: float) -> dict:
    _check_staged_manifest(staged, m, node)
    finals = {rel: _target(staged, rel) for rel, _, _ in items}
    dman = os.path.join(staged, mf.MANIFEST)
    if os.path.lexists(dman):
        os.remove(dman)

    # 1. what is already there and verified
    pending, skipped = [], 0
    for rel, size, sha in items:
        final = finals[rel]
        if os.path.islink(final):  # not a file stage wrote: the link goes, its target stays
            os.unlink(final)
        elif os.path.isfile(final):
            if os.path.getsize(final) == size and mf.file_sha256(final) == sha:
                skipped += 1
                continue
            os.remove(final)
        pending.append((rel, size, sha))

    # every source file as the manifest lists it, before a byte is written
    if pending:
        infos = src_fs.get_file_info([mf.join(src_base, rel) for rel, _, _ in pending])
        for (rel, size, _), info in zip(pending, infos):
            if info.type == pafs.FileType.NotFound:
                raise ShardError(f"{info.path}: the manifest lists this file but it is missing: the shard set is "
                                 "incomplete or was changed after preshard; rerun `userwise preshard`")
            if info.type != pafs.FileType.File or info.size != size:
                raise ShardError(f"{info.path}: {info.size} bytes, the manifest says {size}: the source file was "
                                 "changed after preshard, or the manifest was edited; rerun `userwise preshard`")

    # 2. room for the rest, before copying anything
    need = 0
    for rel, size, _ in pending:
        part = finals[rel] + ".part"
        if size > range_bytes:
            have = sum(min(range_bytes, size - r * range_bytes) for r in _ranges_done(part, size, range_bytes))
        else:
            have = os.path.getsize(part) if os.path.isfile(part) and not os.path.islink(part) else 0
        need += size - min(have, size)
    free = disk_free(staged)
    if free < need + MARGIN:
        raise ShardError(f"{staged}: {free / 1e9:.2f} GB free, node {node} needs {need / 1e9:.2f} GB "
                         f"(+{MARGIN >> 20} MB margin); free space or choose another --staged folder")

    # 3. copy in parallel
    prog = _Progress(node, len(pending), sum(s for _, s, _ in pending), out=out, limit_mbps=limit_mbps)
    chunk = CHUNK if not limit_mbps else max(4096, min(CHUNK, int(limit_mbps * 1e6 / 20)))
    stop = threading.Event()
    resumed = []

    def open_src(src_path: str):
        try:
            return src_fs.open_input_file(src_path)
        except FileNotFoundError:
            # pyarrow's fsspec bridge reads "no answer" as "no file": ask the store again, so that
            # an outage raises its own error (a store failure) rather than "missing"
            if src_fs.get_file_info(src_path).type != pafs.FileType.NotFound:
                raise
            raise ShardError(f"{src_path}: the manifest lists this file but it is missing: the shard set "
                             "is incomplete or was changed after preshard; rerun `userwise preshard`") from None

    def finish_file(rel: str, part: str, final: str) -> None:
        if rel.endswith(".parquet"):
            try:
                mf.check_parquet(part, m)
            except ShardError:
                os.remove(part)
                raise
        os.replace(part, final)
        prog.file_done()

    big = {}  # rel -> [ranges left, lock, size, sha]

    def one_range(rel: str, size: int, sha: str, r: int) -> None:
        final = finals[rel]
        part = final + ".part"
        src_path = mf.join(src_base, rel)
        start, end = r * range_bytes, min(size, (r + 1) * range_bytes)
        fd = _open_part(part, os.O_WRONLY)
        try:
            with open_src(src_path) as src:
                src.seek(start)
                pos = start
                while pos < end and not stop.is_set():
                    b = src.read(min(chunk, end - pos))
                    if not b:
                        break
                    os.pwrite(fd, b, pos)
                    pos += len(b)
                    prog.add(len(b))
            os.fsync(fd)
        finally:
            os.close(fd)
        if stop.is_set():
            return
        if pos != end:
            raise ShardError(f"{src_path}: {pos - start} bytes at offset {start}, the manifest says the file has "
                             f"{size}: the source file was changed after preshard; rerun `userwise preshard`")
        state = big[rel]
        with state[1]:
            _mark_range(part, r, range_bytes)
            state[0].discard(r)
            last = not state[0]
        if not last:
            return
        with os.fdopen(_open_part(part, os.O_RDONLY), "rb") as f:
            h, n = mf.hash_stream(f)
        if n != size or h.hexdigest() != sha:
            os.remove(part)
            _remove_ranges(part)
            raise ShardError(f"{src_path}: checksum mismatch ({n} bytes, sha256 {h.hexdigest()[:12]}..; "
                             f"manifest: {size} bytes, {sha[:12]}..): the source file is corrupt or "
                             "was changed after preshard; rerun `userwise preshard`")
        _remove_ranges(part)
        finish_file(rel, part, final)

    def one(rel: str, size: int, sha: str) -> None:
        final = finals[rel]
        os.makedirs(os.path.dirname(final), exist_ok=True)
        part = final + ".part"
        for attempt in (0, 1):
            offset = 0
            h = hashlib.sha256()
            if attempt == 0 and os.path.isfile(part) and not os.path.islink(part) and os.path.getsize(part) <= size:
                with os.fdopen(_open_part(part, os.O_RDONLY), "rb") as f:
                    h, offset = mf.hash_stream(f)
                if offset:
                    resumed.append(rel)
            src_path = mf.join(src_base, rel)
            src = open_src(src_path)
            mode = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if offset else os.O_TRUNC)
            with src, os.fdopen(_open_part(part, mode), "ab" if offset else "wb") as dst:
                if offset:
                    src.seek(offset)
                while not stop.is_set():
                    b = src.read(chunk)
                    if not b:
                        break
                    dst.write(b)
                    h.update(b)
                    offset += len(b)
                    prog.add(len(b))
                dst.flush()
                os.fsync(dst.fileno())
            if stop.is_set():
                return
            if offset == size and h.hexdigest() == sha:
                break
            os.remove(part)
            if attempt == 1 or offset > size:
                raise ShardError(f"{src_path}: checksum mismatch ({offset} bytes, sha256 {h.hexdigest()[:12]}..; "
                                 f"manifest: {size} bytes, {sha[:12]}..): the source file is corrupt or "
                                 "was changed after preshard; rerun `userwise preshard`")
        finish_file(rel, part, final)

    tasks = []
    for rel, size, sha in pending:
        if size <= range_bytes:
            tasks.append((one, (rel, size, sha)))
            continue
        part = finals[rel] + ".part"
        os.makedirs(os.path.dirname(part), exist_ok=True)
        done = _ranges_done(part, size, range_bytes)
        if done:
            resumed.append(rel)
        else:
            with os.fdopen(_open_part(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "wb") as f:
                f.truncate(size)
            _remove_ranges(part)
        left = set(range(-(-size // range_bytes))) - done
        big[rel] = [left, threading.Lock(), size, sha]
        tasks += [(one_range, (rel, size, sha, r)) for r in sorted(left)]

    def task(fn, a):
        what = a[0] if fn is one else f"{a[0]} range {a[3]}"
        return lambda: retrying(lambda: fn(*a), retries=retries, backoff=backoff, what=what, prog=prog, stop=stop)

    with ThreadPoolExecutor(max_workers=workers) as ex:
        futs = [ex.submit(task(fn, a)) for fn, a in tasks]
        done, _ = wait(futs, return_when=FIRST_EXCEPTION)
        err = next((f.exception() for f in done if f.exception() is not None), None)
        if err is not None:
            stop.set()
            wait(futs)
            raise err
    seconds = prog.finish()

    # 4. the manifest, last
    mf.write(staged, dict(m, staged_node=node))
    return {"node": node, "staged": staged, "files": len(items), "copied": len(pending), "skipped": skipped,
            "resumed": len(resumed), "retries": prog.retries, "bytes": prog.done_bytes, "seconds": round(seconds, 3),
            "mb_per_s": round(prog.done_bytes / 1e6 / max(seconds, 1e-9), 2)}


def _ranges_path(part: str) -> str:
    return part + ".ranges"


def _ranges_done(part: str, size: int, range_bytes: int) -> set[int]:
    """The ranges of a ranged ``.part`` already copied (empty when it is missing or of another size)."""
    try:
        if os.path.islink(part) or os.path.islink(_ranges_path(part)) or os.path.getsize(part) != size:
            return set()
        with open(_ranges_path(part)) as f:
            rec = json.load(f)
    except (OSError, ValueError):
        return set()
    if rec.get("range_bytes") != range_bytes:
        return set()
    return {int(r) for r in rec.get("done", [])}


def _mark_range(part: str, r: int, range_bytes: int) -> None:
    p = _ranges_path(part)
    try:
        with open(p) as f:
            rec = json.load(f)
    except (OSError, ValueError):
        rec = {"done": []}
    rec["done"] = sorted(set(rec.get("done", [])) | {r})
    rec["range_bytes"] = range_bytes
    tmp = p + ".tmp"
    with os.fdopen(_open_part(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "w") as f:
        json.dump(rec, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, p)


def _remove_ranges(part: str) -> None:
    try:
        os.remove(_ranges_path(part))
    except FileNotFoundError:
        pass


def disk_free(path: str) -> int:
    return shutil.disk_usage(path).free


def report_text(rep: dict) -> str:
    return (f"staged node {rep['node']} into {rep['staged']}: {rep['files']} files, {rep['copied']} copied "
            f"({rep['resumed']} resumed), {rep['skipped']} already there, {rep['bytes'] / 1e6:.1f} MB in "
            f"{rep['seconds']:.1f} s ({rep['mb_per_s']:.1f} MB/s)")
