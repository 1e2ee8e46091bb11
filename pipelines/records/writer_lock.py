"""One writer per build folder: a lock file that a crash cannot wedge.

Every job that writes a build folder ``D`` holds a lock under ``D/_userwise/locks/``
while it runs:

- ``build``, ``backfill``, ``history``, ``window``, ``pretrain`` and ``forget`` take the
  folder's **exclusive** lock (``exclusive.lock``): they read or rewrite state that spans
  dates (the history, the samples of a range, every table).
- ``requests`` takes a lock **per date** (``requests-YYYY-MM-DD.lock``): it replaces
  only its own date's partitions of ``requests``, ``events`` and ``quarantine``, so the
  daily ``requests`` jobs of different dates may run in parallel (an Airflow catch-up
  does), while a second ``requests`` job of the same date, or any exclusive job, is
  refused.

A refused job fails at once, before it reads or writes anything, with one line naming
the job that holds the lock (its command, pid, host and start time).

A lock is a small JSON file created with ``O_CREAT | O_EXCL`` (atomic on a local or
network file system), or on HDFS with a create that refuses an existing file (the name
node creates a file once; ``pipelines/runtime/storage.py``). On an object store, which has
no exclusive create, the lock is a check-then-write: it catches a second job started
later, not two started in the same instant. Its holder touches it every :data:`HEARTBEAT_S` seconds from a
daemon thread. A lock is **stale** when its process is gone (same host: the pid no
longer runs, or runs another program) or when nobody has touched it for
:data:`STALE_S` seconds (any host). A stale lock is taken over safely: the taker first
renames it aside (one rename wins, whoever races), then creates its own.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import socket
import threading
import time

from userwise.pipelines.errors import LockedError
from userwise.pipelines.records import folder
from userwise.pipelines.runtime import storage

HEARTBEAT_S = 10.0
STALE_S = 120.0
EXCLUSIVE = "exclusive.lock"


lock_dir = folder.locks_dir


def _pid_alive(pid: int, started: float | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if started is not None:
        # A recycled pid: the process running now started after the lock was taken.
        try:
            with open(f"/proc/{pid}/stat") as f:
                ticks = int(f.read().rsplit(")", 1)[1].split()[19])
            with open("/proc/uptime") as f:
                uptime = float(f.read().split()[0])
            proc_start = time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")
            if proc_start > started + 5:
                return False
        except (OSError, ValueError, IndexError):
            pass
    return True


def read_holder(path: str) -> dict | None:
    try:
        data = storage.read_bytes(path)
    except OSError:
        return {}  # unreadable: judged by its age alone
    if data is None:
        return None
    try:
        return json.loads(data)
    except ValueError:
        return {}  # being written: judged by its age alone


def is_stale(path: str, holder: dict | None) -> bool:
    mtime = storage.mtime(path)
    if mtime is None:
        return True
    age = time.time() - mtime
    if age > STALE_S:
        return True
    if holder and holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int):
        return not _pid_alive(holder["pid"], holder.get("started_ts"))
    return False


def describe(holder: dict | None) -> str:
    if not holder:
        return "another job (its lock file is being written)"
    what = holder.get("job", "a job")
    date = f" --date {holder['date']}" if holder.get("date") else ""
    return (f"`userwise {what}{date}` (pid {holder.get('pid')} on {holder.get('host')}, "
            f"since {holder.get('started')})")


def _create(path: str, me: dict) -> bool:
    return storage.create_exclusive(path, json.dumps(me).encode())


def _take_over_if_stale(path: str) -> dict | None:
    """Return the live holder of ``path``, or None when there is none (any stale lock is moved aside)."""
    holder = read_holder(path)
    if holder is None:
        return None
    if not is_stale(path, holder):
        return holder
    aside = f"{path}.stale-{os.getpid()}-{time.time_ns()}"
    if not storage.rename(path, aside):  # one rename wins; a loser finds the file gone and retries
        return None
    moved = read_holder(aside)
    if not is_stale(aside, moved):
        # A racing taker replaced the stale lock with its fresh one before our rename: put it back.
        if storage.is_local(aside):
            with contextlib.suppress(FileExistsError):
                os.link(aside, path)
        else:
            with contextlib.suppress(OSError):
                storage.rename(aside, path)  # HDFS' rename never replaces a file
        storage.remove(aside)
        return moved or {}
    storage.remove(aside)
    return None


class WriterLock:
    """Hold ``D``'s lock for ``job`` (exclusive, or per date for ``requests``).

    Use as a context manager; :meth:`acquire` raises :class:`LockedError` when a live
    job holds a conflicting lock, and changes nothing then.
    """

    def __init__(self, build_dir: str, job: str, date: str | None = None):
        self.build_dir, self.job, self.date = build_dir, job, date
        self.name = f"requests-{date}.lock" if job == "requests" and date else EXCLUSIVE
        self.path = storage.join(lock_dir(build_dir), self.name)
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        self.held = False

    def _conflicts(self) -> list[str]:
        d = lock_dir(self.build_dir)
        names = storage.listdir(d)
        names = [n for n in names if n.endswith(".lock") and n != self.name]
        if self.name != EXCLUSIVE:
            names = [n for n in names if n == EXCLUSIVE]  # other dates' requests jobs may run
        return [storage.join(d, n) for n in sorted(names)]

    def _folders(self) -> list[str]:
        """The folders the lock lives in, innermost first: the locks folder, ``_userwise``, ``D``."""
        return [lock_dir(self.build_dir), folder.meta_dir(self.build_dir), self.build_dir]

    def _make_dir(self) -> None:
        if storage.is_local(self.build_dir):
            os.makedirs(lock_dir(self.build_dir), exist_ok=True)
        else:
            fs, p = storage.filesystem(lock_dir(self.build_dir))
            fs.create_dir(p, recursive=True)

    def acquire(self) -> "WriterLock":
        # The folders this job creates go again when it releases the lock and they are empty,
        # so that a refused job leaves no empty build folder behind.
        self._created = [d for d in self._folders() if not storage.exists(d)]
        self._make_dir()
        now = time.time()
        me = {"job": self.job, "date": self.date, "pid": os.getpid(), "host": socket.gethostname(),
              "started": dt.datetime.fromtimestamp(now, dt.timezone.utc).isoformat(timespec="seconds"),
              "started_ts": now, "build_dir": self.build_dir}
        for _ in range(20):
            try:
                if _create(self.path, me):
                    break
            except FileNotFoundError:  # a job that created the folder released it in between
                self._make_dir()
                continue
            holder = _take_over_if_stale(self.path)
            if holder is not None:
                raise LockedError(f"{self.build_dir} is being written by {describe(holder)}; wait for it to "
                                  f"finish (if that job is gone, its lock {self.path} is taken over "
                                  f"after {int(STALE_S)} s without a heartbeat)")
        else:
            raise LockedError(f"could not take the lock {self.path}: it keeps changing hands")
        # Both sides check after creating their own: of two racing conflicting jobs, at
        # least one sees the other and steps back (both may; neither proceeds unseen).
        for other in self._conflicts():
            holder = _take_over_if_stale(other)
            if holder is not None:
                self._remove()
                raise LockedError(f"{self.build_dir} is being written by {describe(holder)}; wait for it "
                                  f"to finish, then run this job again")
        self.held = True
        self._beat = threading.Thread(target=self._heartbeat, name="userwise-lock", daemon=True)
        self._beat.start()
        return self

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            with contextlib.suppress(OSError, RuntimeError, ValueError):
                storage.touch(self.path)

    def _remove(self) -> None:
        with contextlib.suppress(OSError):
            storage.remove(self.path)

    def release(self) -> None:
        self._stop.set()
        if self.held:
            self._remove()
            self.held = False
        for d in getattr(self, "_created", ()):
            if not _remove_if_empty(d):
                break
        self._created = []

    def __enter__(self) -> "WriterLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _remove_if_empty(path: str) -> bool:
    """Remove the folder ``path`` when it is empty; whether it is gone."""
    try:
        if storage.is_local(path):
            os.rmdir(storage.local_path(path))
            return True
        if storage.listdir(path):
            return False
        fs, p = storage.filesystem(path)
        fs.delete_dir(p)
        return True
    except OSError:
        return False


def live_writer(build_dir: str) -> bool:
    """Whether a live job holds any of the folder's locks now (running, not killed)."""
    d = lock_dir(build_dir)
    names = [n for n in storage.listdir(d) if n.endswith(".lock")]
    return any(not is_stale(storage.join(d, n), read_holder(storage.join(d, n))) for n in names)


# The commands that write a build folder, and how each locks it.
WRITERS = {"build": "exclusive", "backfill": "exclusive", "history": "exclusive", "window": "exclusive",
           "pretrain": "exclusive", "forget": "exclusive", "requests": "per-date"}


def for_command(command: str, args) -> WriterLock | None:
    """The lock a CLI command takes on its ``--build-dir``, or None for commands that write no build folder."""
    if command not in WRITERS or not getattr(args, "build_dir", None):
        return None
    return WriterLock(args.build_dir, command, getattr(args, "date", None) if WRITERS[command] == "per-date" else None)


class FolderLock:
    """One job per local folder at a time: an ``flock`` on ``path`` (e.g. ``dest/.stage.lock``).

    The kernel releases an ``flock`` when its process dies, however it dies, so a killed
    job's lock is taken over by the next one without a heartbeat or a timeout. The file
    holds the holder's job, pid, host and start time, which a refused job names. A holder
    removes the file when it releases it; a taker checks after locking that the file it
    locked is still the one at ``path`` (else a releasing holder removed it in between,
    and it tries again), so two jobs never both hold it.

    Example::

        with FolderLock("/nvme/shards/.stage.lock", "stage", what="node 0 of s3://b/S"):
            ...  # a second FolderLock on the same path raises LockedError meanwhile
    """

    def __init__(self, path: str, job: str, *, what: str = ""):
        self.path, self.job, self.what = path, job, what
        self.fd: int | None = None

    def acquire(self) -> "FolderLock":
        import fcntl

        for _ in range(20):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_fd(fd)
                os.close(fd)
                raise LockedError(f"{os.path.dirname(self.path)} is being written by {describe(holder)}; wait for "
                                  f"it to finish or stop it, then run this `userwise {self.job}` again") from None
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path, follow_symlinks=False).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # the holder released and removed it between our open and our lock
                os.close(fd)
                continue
            now = time.time()
            me = {"job": self.job if not self.what else f"{self.job} ({self.what})", "pid": os.getpid(),
                  "host": socket.gethostname(), "started_ts": now,
                  "started": dt.datetime.fromtimestamp(now, dt.timezone.utc).isoformat(timespec="seconds")}
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(me).encode(), 0)
            self.fd = fd
            return self
        raise LockedError(f"could not take the lock {self.path}: it keeps changing hands")

    def release(self) -> None:
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            os.remove(self.path)  # while still locked: a taker that opened it sees another inode and retries
        os.close(self.fd)
        self.fd = None

    def __enter__(self) -> "FolderLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _read_fd(fd: int) -> dict | None:
    try:
        return json.loads(os.pread(fd, 4096, 0) or b"null")
    except (OSError, ValueError):
        return {}
