"""The K/V store: users' paged states in three tiers, LRU by user, never stale, thread-safe.

Tiers, fastest first:

- ``device``: a pool of page slots on the serving device (CUDA when there is one; on a
  host without one it is CPU memory, so the same code runs in tests);
- ``host``: a pool of page slots in host memory (page-locked when CUDA exists, so
  copies to the device are asynchronous-capable);
- ``disk``: one file per user under a folder that belongs to the store.

Each tier is bounded in bytes (``device_bytes``, ``host_bytes``, ``disk_bytes``): a memory
tier holds ``bytes // page_bytes`` slots of one page (``[slots, P, dim]``, in the model's dtype:
float32, float64, float16 or bfloat16, fixed by the first state stored) each; the disk tier
counts its files' real sizes (header included, and the folder's lock file).
:meth:`KVStore.user_bytes` gives what a user of ``n`` events takes in each tier. A user's
pages live in one tier. When a tier is full its least recently used user moves down
(device to host, host to disk; off the disk it is dropped); a lookup of a user found on
host or disk moves it back to the device.

Entries carry their key (the user in :func:`user_id`'s one form, and the model version
inside their :class:`Chain`), the chain of the events they encode and the ``max_seq_len``
(L) of their state. :meth:`KVStore.acquire` takes the current chain (and the caller's L):
an entry of another L is dropped; an entry whose end hash the current chain (made from the
request's events, so it knows the hash at every count) has at the entry's length is served
whole, the unfinished last page included (a full reuse); any other is cut to
:func:`longest_valid_prefix`, its last verified block (a changed event, a re-anchored window:
a partial reuse, the rest dropped, never served; another model version: dropped) and
returned as a :class:`Lease`. A lease pins its user (never moved or dropped
while leased) and holds a reference on every slot it hands out: a slot is written only
while free, and it is freed only when neither an entry nor a lease holds it, so a leased
state never changes under its reader, whatever other threads store or evict. One lock
guards the store's tables and copies; readers compute on leased pages outside it.

The disk tier's folder is the store's alone: it is made (or tightened to) mode 0700 and
must be owned by this user; the store holds an ``flock`` on ``folder/.lock`` for its life
(a second store on the folder, in this process or another, is refused naming the
holder's pid) and removes the files a store that ended without closing left there. Each
file (``uwkv-<the store's random nonce>-<n>.kv``, mode 0600, created exclusively, opened
without following links) is a header that binds it to its entry (the store's nonce, the
user, the chain with its model version, L, the page size, shape and dtype, each page's
rows and the pages' sha256) and the pages' raw bytes (read and written as bytes, so
bfloat16, which numpy lacks, round-trips bit for bit); the entry keeps the header and the
checksum in memory and a lookup compares both. A file that differs (a flipped bit, another
user's or another store's file, a link, a file of another shape, one that is gone) is a
miss counted as ``unreadable``, never served and never raised. A write that fails (a full
disk, say) drops its entry, removes its partial file and raises the ``OSError`` (errno
``ENOSPC`` for a full disk, so the CLI prints its one line and exits 2); the store stays
consistent. :meth:`KVStore.close` removes the files and the lock (so does the store's
collection, or the end of the process).

Example::

    store = KVStore(page_size=64, device_bytes=8 << 30, host_bytes=64 << 30, disk_bytes=1 << 40, folder="/cache")
    cur = chain_of(events, block=64, version=v)
    with store.acquire(user, cur, max_seq_len=50) as lease:
        st = lease.state or empty_state(model, max_seq_len=50, page_size=64)
        st = extend(model, st, events[lease.length:])
        store.put(user, cur, st)
        logits = score(model, st, candidates)
    store.stats()["hit_rate"], store.stats()["resident_bytes"]
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import itertools
import json
import math
import os
import re
import secrets
import socket
import stat
import struct
import threading
import weakref
from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from userwise.pipelines.errors import ArgumentError, UserwiseError, expect
from userwise.pipelines.serve.chain import Chain, longest_valid_prefix
from userwise.pipelines.serve.incremental import KVState
from userwise.pipelines.serve.routing import user_id

__all__ = ["KVStore", "Lease", "TIERS"]

TIERS = ("device", "host", "disk")

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_MAGIC = b"UWKVPG01"
# magic, store nonce, sha256 of the user, sha256 of the chain, L, P, slots, dim, dtype, pages, sha256 of the pages
_HEAD = struct.Struct("<8s16s32s32sQQQQ24sQ32s")
_LOCK = ".lock"
_FILE = re.compile(r"uwkv-[0-9a-f]{16}-[0-9]+\.(kv|tmp)")  # a store's own files (this one's or a dead one's)


class _Unreadable(Exception):
    """A disk file that is not the one its entry wrote."""


def _write_all(fd: int, blobs) -> None:
    """Write every blob (bytes-like) to ``fd`` in order."""
    for b in blobs:
        view = memoryview(b).cast("B")
        while len(view):
            view = view[os.write(fd, view):]


def _as_os_error(exc: BaseException, path: str) -> BaseException:
    """The ``OSError`` behind a failed write, naming ``path`` (a writer's wrapper, like torch's
    ``inline_container`` error, hides the errno in its cause), else ``exc`` itself."""
    seen, e = set(), exc
    while e is not None and id(e) not in seen and not isinstance(e, OSError):
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    if not isinstance(e, OSError):
        return exc
    if e.filename or e.errno is None:
        return e
    out = OSError(e.errno, e.strerror or os.strerror(e.errno), path)
    out.__cause__ = exc
    return out


class _Disk:
    """The disk tier's folder, held by one store: its descriptor (every file is opened
    relative to it), the ``flock`` on ``.lock``, the store's nonce and the names of its files."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.nonce = secrets.token_hex(8)
        self.names: set[str] = set()
        self.seq = itertools.count()
        self.pid = os.getpid()
        self.dirfd = self.lockfd = None
        self.locked = False  # the flock is ours (only then is .lock removed at close)
        self.lock_bytes = 0
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    def _refuse(self, why: str):
        raise UserwiseError(f"KVStore folder {self.folder} {why}; the disk tier keeps users' states in a folder of "
                            "yours alone: use another folder")

    def _open(self) -> None:
        f, uid = self.folder, os.geteuid()
        try:
            f.mkdir(mode=0o700, parents=True, exist_ok=True)
        except FileExistsError:
            self._refuse("is not a folder")
        lst = os.lstat(f)
        if stat.S_ISLNK(lst.st_mode) and lst.st_uid not in (uid, 0):
            self._refuse(f"is a symbolic link owned by uid {lst.st_uid}, not by you (uid {uid})")
        self.dirfd = os.open(f, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)
        st = os.fstat(self.dirfd)
        if st.st_uid != uid:
            self._refuse(f"is owned by uid {st.st_uid}, not by you (uid {uid})")
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.fchmod(self.dirfd, 0o700)  # the users' states: readable by this user only
        import fcntl

        for _ in range(20):
            try:
                fd = os.open(_LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC, 0o600,
                             dir_fd=self.dirfd)
            except OSError as e:
                if e.errno != errno.ELOOP:
                    raise
                self._refuse(f"holds {_LOCK} as a symbolic link (remove it)")
            self.lockfd = fd
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                self._refuse(f"holds {_LOCK}, which is not a file (remove it)")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                try:
                    holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
                except (OSError, ValueError):
                    holder = {}
                who = (f"pid {holder.get('pid')} on {holder.get('host')}" if isinstance(holder, dict)
                       and holder.get("pid") else "a process that is starting")
                raise UserwiseError(f"KVStore folder {f} is in use by another store ({who}): give each store (each "
                                    "serving process, each `userwise replay --cache-dir`) a folder of its own, or "
                                    "close the other store first") from None
            try:
                same = os.fstat(fd).st_ino == os.stat(_LOCK, dir_fd=self.dirfd, follow_symlinks=False).st_ino
            except FileNotFoundError:
                same = False
            if same:
                self.locked = True
                break
            os.close(fd)  # a closing holder removed it between our open and our lock: take the new one
            self.lockfd = None
        else:
            raise UserwiseError(f"KVStore folder {f}: could not take {_LOCK}, it keeps changing hands")
        me = json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode()
        os.ftruncate(self.lockfd, 0)
        os.pwrite(self.lockfd, me, 0)
        with contextlib.suppress(OSError):
            os.fchmod(self.lockfd, 0o600)
        self.lock_bytes = len(me)
        for name in os.listdir(self.dirfd):  # a store that ended without closing: its files are never served
            if _FILE.fullmatch(name):
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=self.dirfd)

    def write(self, blobs, size: int) -> str:
        """A new file of ``blobs`` (``size`` bytes in all): written to a ``.tmp`` (created
        exclusively, 0600, no link followed), then renamed. On any failure the ``.tmp`` is
        removed and the error raised (an ``OSError`` naming the file where one caused it)."""
        n = next(self.seq)
        name, tmp = f"uwkv-{self.nonce}-{n}.kv", f"uwkv-{self.nonce}-{n}.tmp"
        self.names.add(tmp)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC, 0o600,
                         dir_fd=self.dirfd)
            try:
                _write_all(fd, blobs)
                got = os.fstat(fd).st_size
            finally:
                os.close(fd)
            if got != size:
                raise OSError(errno.EIO, f"wrote {got} bytes of {size}", str(self.folder / tmp))
            os.replace(tmp, name, src_dir_fd=self.dirfd, dst_dir_fd=self.dirfd)
        except Exception as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=self.dirfd)
            self.names.discard(tmp)
            err = _as_os_error(exc, str(self.folder / tmp))
            if err is exc:
                raise
            raise err from exc
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=self.dirfd)
            self.names.discard(tmp)
            raise
        self.names.discard(tmp)
        self.names.add(name)
        return name

    def read(self, name: str, size: int) -> bytearray:
        """The ``size`` bytes of one of the store's files: a regular file (no link followed,
        never blocking on a FIFO) of exactly that size, else :class:`_Unreadable`."""
        if name not in self.names:
            raise _Unreadable(name)
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC, dir_fd=self.dirfd)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != size:
                raise _Unreadable(name)
            buf = bytearray(size)
            view, got = memoryview(buf), 0
            while got < size:
                k = os.readv(fd, [view[got:]])
                if k == 0:
                    raise _Unreadable(name)
                got += k
            if os.read(fd, 1):
                raise _Unreadable(name)
            return buf
        finally:
            os.close(fd)

    def unlink(self, name: str) -> None:
        self.names.discard(name)
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=self.dirfd)

    def close(self) -> None:
        """Remove the store's files and its lock; idempotent. In a forked child (which shares
        the descriptors) nothing is removed."""
        if self.pid != os.getpid():
            return
        if self.dirfd is not None:
            for name in list(self.names):
                self.unlink(name)
            if self.locked:
                with contextlib.suppress(OSError):
                    os.unlink(_LOCK, dir_fd=self.dirfd)  # while still locked: a taker sees another inode
        for fd in (self.lockfd, self.dirfd):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.lockfd = self.dirfd = None
        self.locked = False


def _key_digest(user) -> bytes:
    """sha256 of a user id in :func:`user_id`'s form (an int and its string are different users)."""
    text = f"int:{user}" if isinstance(user, int) else f"str:{user}"
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()


def _chain_digest(chain: Chain) -> bytes:
    h = hashlib.sha256()
    h.update(repr(chain.version).encode("utf-8", "backslashreplace"))
    h.update(f";{chain.block};{chain.length};{chain.end};".encode())
    h.update(chain.checkpoints.astype("<i8").tobytes())
    return h.digest()


def _memory_of(device: torch.device) -> int | None:
    """The bytes of memory where a tier on ``device`` lives (None: unknown)."""
    try:
        if device.type == "cuda":
            return int(torch.cuda.get_device_properties(device).total_memory)
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError, RuntimeError, AssertionError):
        return None


class _Pool:
    """One memory tier's page slots, each with a reference count (entry + leases)."""

    def __init__(self, nslots: int, shape: tuple, dtype, device, pin: bool):
        self.data = torch.empty((nslots, *shape), dtype=dtype, device=device, pin_memory=pin) if nslots else None
        self.free = list(range(nslots - 1, -1, -1))
        self.refs = [0] * nslots

    @property
    def nslots(self) -> int:
        return len(self.refs)

    def alloc(self, k: int) -> list[int]:
        out = [self.free.pop() for _ in range(k)]
        for s in out:
            self.refs[s] = 1
        return out


@dataclass
class _Entry:
    user: object
    chain: Chain
    max_seq_len: int
    tier: str
    rows: list        # rows of each page
    slots: list       # memory tiers: a slot per page
    file: str | None = None  # disk: the file's name in the store's folder
    nbytes: int = 0          # disk: the file's size
    sha: bytes = b""         # disk: sha256 of the pages' bytes


class Lease:
    """A user's state read from the store, valid until :meth:`release` (or the end of the
    ``with``): ``state`` (a :class:`KVState` of the valid prefix, or None: a miss), ``length``
    (its events), ``tier`` (where it was found; None on a miss). Keep a state beyond its lease
    with ``state.clone()``.

    Example::

        with store.acquire(user, chain) as lease:
            st = extend(model, lease.state or empty_state(model, max_seq_len=L, page_size=P), new)
    """

    def __init__(self, store: "KVStore", user: int | str, state: KVState | None, tier: str | None, refs: list) -> None:
        self.user, self.state, self.tier, self._store, self._refs = user, state, tier, store, refs
        self.length = state.length if state is not None else 0
        self._open = True

    def release(self):
        if self._open:
            self._open = False
            self._store._release(self)

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc):
        self.release()


class KVStore:
    """Paged per-user K/V states in device, host and disk tiers (see module doc). Args
    (keyword-only): ``page_size`` (P events per page: the chains' block), ``device_bytes``,
    ``host_bytes`` (0: no host tier), ``disk_bytes`` and ``folder`` (both for a disk tier: a
    folder of this store's alone, see module doc), ``device`` (default CUDA when available,
    else CPU), ``max_seq_len`` (the L every state held and asked for has; None: each lookup
    says its own), ``poison_freed`` (fill a freed slot with NaN: a read of freed memory
    shows; tests). A bad argument is an :class:`ArgumentError`; a memory budget beyond the
    memory it lives in is refused.

    Example::

        store = KVStore(page_size=64, device_bytes=1 << 30, host_bytes=4 << 30, max_seq_len=50)
        with store.acquire(user, chain) as lease: ...
        store.close()   # its disk files and lock removed
    """

    def __init__(self, *, page_size: int, device_bytes: int, host_bytes: int = 0, disk_bytes: int = 0,
                 folder: str | os.PathLike | None = None, device: str | torch.device | None = None,
                 max_seq_len: int | None = None, poison_freed: bool = False) -> None:
        page_size = expect(page_size, "int>=1", "KVStore page_size")
        budgets = {t: expect(b, "int>=0", f"KVStore {t}_bytes")
                   for t, b in (("device", device_bytes), ("host", host_bytes), ("disk", disk_bytes))}
        self.max_seq_len = expect(max_seq_len, "int>=1", "KVStore max_seq_len", nullable=True)
        expect(poison_freed, "bool", "KVStore poison_freed")
        if budgets["disk"] and folder is None:
            raise ArgumentError("disk_bytes needs folder=: the disk tier's files go there")
        if folder is not None and not isinstance(folder, (str, os.PathLike)):
            raise ArgumentError(f"KVStore folder must be a path, got {type(folder).__name__}")
        try:
            dev = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
        except (RuntimeError, TypeError, ValueError):
            raise ArgumentError(f"KVStore device={device!r}: use 'cpu' or 'cuda' (or 'cuda:N')") from None
        if dev.type not in ("cpu", "cuda"):
            raise ArgumentError(f"KVStore device={device!r}: use 'cpu' or 'cuda' (or 'cuda:N')")
        if dev.type == "cuda" and (not torch.cuda.is_available() or (dev.index or 0) >= torch.cuda.device_count()):
            raise ArgumentError(f"KVStore device={device!r}: this host has {torch.cuda.device_count()} CUDA "
                                "device(s); use device='cpu' or one that exists")
        host_mem = _memory_of(torch.device("cpu"))
        dev_mem = _memory_of(dev)
        on_cpu = dev.type == "cpu"
        for what, need, have, where in (
                ("device_bytes", budgets["device"] + (budgets["host"] if on_cpu else 0), dev_mem, str(dev)),
                ("host_bytes", budgets["host"], host_mem, "host")):
            if have is not None and need > have:
                both = " (with host_bytes: both tiers are in host memory)" if on_cpu and what == "device_bytes" else ""
                raise ArgumentError(f"KVStore {what}: {need:,} bytes asked of the {where}'s {have:,} bytes of "
                                    f"memory{both}: use budgets it can hold")
        self.page_size = page_size
        self.budgets = budgets
        self.device = dev
        self.poison_freed = poison_freed
        self.folder = Path(folder) if folder is not None else None
        self._disk = _Disk(self.folder) if self.folder is not None and budgets["disk"] else None
        self._closer = weakref.finalize(self, _Disk.close, self._disk) if self._disk is not None else None
        self._lock = threading.RLock()
        self._entries: dict = {}
        self._lru = {t: OrderedDict() for t in TIERS}
        self._pins: Counter = Counter()
        self._pools: dict | None = None
        self._page = None  # (shape, dtype, page_bytes) once the first state is stored
        self._disk_used = 0  # the entries' files (the lock file is set aside from the budget)
        self._stats = Counter()

    def close(self) -> None:
        """Drop the disk tier's entries, remove their files and the folder's lock (another
        store may then use the folder); the memory tiers keep serving. Idempotent; a store
        that is collected, or the end of the process, closes it too.

        Example::

            store.close()
        """
        with self._lock:
            if self._disk is None:
                return
            for user in list(self._lru["disk"]):
                self._remove(self._entries[user])
            self._closer()
            self._disk = None

    @property
    def page_bytes(self) -> int | None:
        """The bytes of one page slot (``[slots, P, dim]`` in the pages' dtype), known once a
        state is stored (None before).

        Example::

            store.put(user, chain, st); store.page_bytes   # == st.pages[0][0].numel() * ... * P
        """
        with self._lock:
            return self._page[2] if self._page else None

    def user_bytes(self, events: int, tier: str = "device") -> int:
        """The bytes a user holding ``events`` events takes in ``tier``: ``ceil(events / P)``
        page slots in a memory tier, its file's size (header, rows, pages) on the disk. Known
        once a state is stored (the page's shape and dtype); a tier of ``budget`` bytes holds
        ``budget // user_bytes(events, tier)`` such users (the disk's budget less its lock
        file, ``capacity_bytes`` in :meth:`stats`).

        Example::

            store.put(user, chain, st)
            (64 << 30) // store.user_bytes(16384, "host")   # users of 16K events in 64 GiB of host
        """
        n = expect(events, "int>=0", "user_bytes events")
        if tier not in TIERS:
            raise ArgumentError(f"user_bytes tier={tier!r}: use one of {', '.join(TIERS)}")
        with self._lock:
            if self._page is None:
                raise ArgumentError("user_bytes: the store knows its page's shape and dtype once a state is "
                                    "stored; put one first")
            k = -(-n // self.page_size)  # no events: nothing held
            return 0 if not k else self._file_bytes(k) if tier == "disk" else k * self._page[2]

    def _disk_budget(self) -> int:
        return self.budgets["disk"] - self._disk.lock_bytes if self._disk is not None else 0

    # -- pools -------------------------------------------------------------------------
    def _init(self, state: KVState):
        p = state.pages[0]
        shape = (int(p.shape[0]), self.page_size, int(p.shape[2]))
        if self._page is None:
            page_bytes = math.prod(shape) * p.element_size()
            pin = torch.cuda.is_available()
            self._pools = {"device": _Pool(self.budgets["device"] // page_bytes, shape, p.dtype, self.device, False),
                           "host": _Pool(self.budgets["host"] // page_bytes, shape, p.dtype, "cpu", pin)}
            self._page = (shape, p.dtype, page_bytes)
        for q in state.pages:
            if (int(q.shape[0]), self.page_size, int(q.shape[2])) != self._page[0] or q.dtype != self._page[1]:
                raise ArgumentError(f"a state of pages {[int(q.shape[0]), int(q.shape[2])]} {q.dtype} for a store of "
                                    f"pages {list(self._page[0])} {self._page[1]}: one store serves one model")

    def _decref(self, tier: str, slots):
        pool = self._pools[tier]
        for s in slots:
            pool.refs[s] -= 1
            if pool.refs[s] == 0:
                if self.poison_freed and pool.data.dtype.is_floating_point:
                    pool.data[s].fill_(math.nan)
                pool.free.append(s)

    def _evictable(self, tier: str, protect) -> _Entry | None:
        for user in self._lru[tier]:
            if not self._pins[user] and user not in protect:
                return self._entries[user]
        return None

    def _make_room(self, tier: str, k: int, protect) -> bool:
        """Free slots for ``k`` pages in a memory tier by moving its LRU users down."""
        pool = self._pools[tier]
        if k > pool.nslots:
            return False
        while len(pool.free) < k:
            victim = self._evictable(tier, protect)
            if victim is None:
                return False
            self._demote(victim, protect)
        return True

    def _make_room_disk(self, nbytes: int, protect) -> bool:
        if self._disk is None or nbytes > self._disk_budget():
            return False
        while self._disk_used + nbytes > self._disk_budget():
            victim = self._evictable("disk", protect)
            if victim is None:
                return False
            self._stats["dropped"] += 1
            self._remove(victim)
        return True

    # -- the disk files ------------------------------------------------------------------
    def _header(self, e: _Entry, sha: bytes) -> bytes:
        """What binds a file to its entry: the store, the user, the chain (with the model
        version), L, the page size, shape and dtype, each page's rows, the pages' sha256."""
        shape, dtype, _ = self._page
        head = _HEAD.pack(_MAGIC, self._disk.nonce.encode(), _key_digest(e.user), _chain_digest(e.chain),
                          e.max_seq_len, self.page_size, shape[0], shape[2], str(dtype).encode()[:24], len(e.rows),
                          sha)
        return head + struct.pack(f"<{len(e.rows)}I", *e.rows)

    def _file_bytes(self, k: int) -> int:
        return _HEAD.size + 4 * k + k * self._page[2]

    def _write(self, e: _Entry, pages: list) -> None:
        """Write ``pages`` as ``e``'s file (room already made); ``e`` is changed only once it is written."""
        shape, dtype, page_bytes = self._page
        data = torch.zeros((len(pages), *shape), dtype=dtype)
        for i, p in enumerate(pages):
            data[i, :, :p.shape[1]].copy_(p)
        body = data.view(torch.uint8).numpy()
        sha = hashlib.sha256(body).digest()
        head = self._header(e, sha)
        size = len(head) + body.nbytes
        name = self._disk.write([head, body], size)
        e.file, e.nbytes, e.sha = name, size, sha
        self._disk_used += size

    def _read(self, e: _Entry) -> list:
        """The pages of ``e``'s file, checked against the entry (header, size, checksum), else
        :class:`_Unreadable` (or the ``OSError`` of opening it)."""
        shape, dtype, page_bytes = self._page
        head = self._header(e, e.sha)
        buf = self._disk.read(e.file, e.nbytes)
        if len(buf) != len(head) + len(e.rows) * page_bytes or bytes(buf[:len(head)]) != head:
            raise _Unreadable(e.file)
        if hashlib.sha256(memoryview(buf)[len(head):]).digest() != e.sha:
            raise _Unreadable(e.file)
        data = torch.frombuffer(buf, dtype=torch.uint8, offset=len(head)).clone().view(dtype)
        data = data.reshape(len(e.rows), *shape)
        return [data[i, :, :r] for i, r in enumerate(e.rows)]

    # -- moving entries -----------------------------------------------------------------
    def _pages_of(self, e: _Entry) -> list:
        """Views of an entry's pages (memory tiers) or pages read from its file."""
        if e.tier == "disk":
            return self._read(e)
        pool = self._pools[e.tier]
        return [pool.data[s, :, :r] for s, r in zip(e.slots, e.rows)]

    def _place(self, e: _Entry, pages: list, tier: str) -> None:
        """Write ``pages`` into ``tier`` (room already made) and record ``e`` there. On a
        failed write ``e`` is left as it was and the error raised."""
        if tier == "disk":
            self._write(e, pages)
            e.slots = []
        else:
            pool = self._pools[tier]
            slots = pool.alloc(len(pages))
            try:
                for s, p in zip(slots, pages):
                    pool.data[s, :, :p.shape[1]].copy_(p)
            except BaseException:
                self._decref(tier, slots)
                raise
            e.slots, e.file, e.nbytes, e.sha = slots, None, 0, b""
        e.tier = tier
        self._lru[tier][e.user] = None

    def _vacate(self, e: _Entry) -> None:
        """Free where ``e`` lives now (its slots' entry reference, or its file)."""
        self._lru[e.tier].pop(e.user, None)
        if e.tier == "disk":
            self._free_file(e.file, e.nbytes)
        else:
            self._decref(e.tier, e.slots)
        e.slots, e.file, e.nbytes = [], None, 0

    def _free_file(self, name: str | None, nbytes: int) -> None:
        self._disk_used -= nbytes
        if name is not None and self._disk is not None:
            self._disk.unlink(name)

    def _move(self, e: _Entry, tier: str, pages: list | None = None) -> None:
        """Move ``e`` to ``tier`` (room already made). A failed write drops ``e`` (counted
        ``write_failed``) and raises."""
        pages = self._pages_of(e) if pages is None else pages
        old_tier, old_slots, old_file, old_nbytes = e.tier, e.slots, e.file, e.nbytes
        try:
            self._place(e, pages, tier)
        except BaseException:
            self._stats["write_failed"] += 1
            self._remove(e)
            raise
        self._lru[old_tier].pop(e.user, None)
        self._lru[tier][e.user] = None  # after the pop: old and new tier may be the same (a rewrite)
        if old_tier == "disk":
            self._free_file(old_file, old_nbytes)
        else:
            self._decref(old_tier, old_slots)

    def _demote(self, e: _Entry, protect) -> None:
        """Move an unpinned LRU entry one tier down (or off the disk: dropped)."""
        protect = protect | {e.user}
        k = len(e.rows)
        if e.tier == "device" and self._pools["host"].nslots and self._make_room("host", k, protect):
            self._stats["offloaded_device_to_host"] += 1
            self._move(e, "host")
        elif e.tier != "disk" and self._make_room_disk(self._file_bytes(k), protect):
            self._stats[f"offloaded_{e.tier}_to_disk"] += 1
            self._move(e, "disk")
        else:
            self._stats["dropped"] += 1
            self._remove(e)

    def _promote(self, e: _Entry, pages: list | None = None) -> bool:
        k = len(e.rows)
        if self._make_room("device", k, {e.user}):
            self._move(e, "device", pages)
            return True
        if e.tier == "disk" and self._pools["host"].nslots and self._make_room("host", k, {e.user}):
            self._move(e, "host", pages)
            return True
        return False

    def _remove(self, e: _Entry) -> None:
        self._vacate(e)
        if self._entries.get(e.user) is e:
            del self._entries[e.user]

    def _key(self, user):
        return user_id(user)

    def _check_len(self, max_seq_len, what: str) -> int | None:
        L = expect(max_seq_len, "int>=1", f"{what} max_seq_len", nullable=True)
        if L is None:
            return self.max_seq_len
        if self.max_seq_len is not None and L != self.max_seq_len:
            raise ArgumentError(f"{what}: max_seq_len={L} for a store of max_seq_len={self.max_seq_len}: one store "
                                "serves one L")
        return L

    # -- the API ------------------------------------------------------------------------
    def acquire(self, user, chain: Chain, *, max_seq_len: int | None = None) -> Lease:
        """The user's held state cut to what ``chain`` (the user's current events, with the
        model version) verifies, pinned until the lease is released. ``max_seq_len``: the L the
        caller scores with (default the store's): a state held with another L is dropped, never
        served. A miss (nothing held, or nothing valid) gives a lease with ``state`` None that
        still pins the user.

        Example::

            with store.acquire(user, chain_of(events, block=P, version=v), max_seq_len=L) as lease:
                new = events[lease.length:]
        """
        key = self._key(user)
        if not isinstance(chain, Chain):
            raise ArgumentError(f"acquire: chain must be a Chain (chain_of(...)), got {type(chain).__name__}")
        if chain.block != self.page_size:
            raise ArgumentError(f"a chain of block {chain.block} for a store of page size {self.page_size}: "
                                "make chains with block=page_size")
        L = self._check_len(max_seq_len, "acquire")
        with self._lock:
            self._stats["lookups"] += 1
            self._pins[key] += 1
            try:
                return self._lookup(key, chain, L)
            except BaseException:
                self._unpin(key)
                raise

    def _miss(self, user) -> Lease:
        self._stats["misses"] += 1
        return Lease(self, user, None, None, [])

    def _lookup(self, user, chain: Chain, L: int | None) -> Lease:
        e = self._entries.get(user)
        if e is None:
            return self._miss(user)
        n = longest_valid_prefix(e.chain, chain) if L is None or e.max_seq_len == L else 0
        cut = n < e.chain.length
        if cut:  # the held chain disagrees before its end (or another version, another L)
            self._stats["invalidated"] += 1
        if n == 0:
            self._remove(e)
            return self._miss(user)
        found = e.tier
        keep = -(-n // self.page_size)
        last = n - (keep - 1) * self.page_size  # rows of the last page kept
        if e.tier == "disk":
            try:
                pages = self._read(e)
            except (_Unreadable, OSError, ValueError, RuntimeError):  # a miss, never a wrong state
                self._stats["unreadable"] += 1
                self._remove(e)
                return self._miss(user)
        if cut:
            e.rows, e.chain = e.rows[:keep - 1] + [last], chain.truncate(n).compact()
        if e.tier == "disk":
            if cut:  # the file holds pages the entry no longer has: rewritten below, or moved up
                pages = pages[:keep - 1] + [pages[keep - 1][:, :last]]
            if not self._promote(e, pages) and cut:
                old_file, old_nbytes = e.file, e.nbytes
                self._lru["disk"].pop(user, None)
                self._free_file(old_file, old_nbytes)
                e.file, e.nbytes = None, 0
                if self._make_room_disk(self._file_bytes(keep), {user}):
                    try:
                        self._place(e, pages, "disk")
                    except BaseException:
                        self._stats["write_failed"] += 1
                        del self._entries[user]
                        raise
                else:
                    self._stats["dropped"] += 1
                    del self._entries[user]
        else:
            if cut:
                self._decref(e.tier, e.slots[keep:])
                e.slots = e.slots[:keep]
            if e.tier != "device":
                self._promote(e)
        self._stats[f"{'partial' if cut else 'hits'}_{found}"] += 1
        refs = []
        if self._entries.get(user) is e:
            if e.tier != "disk":
                pool = self._pools[e.tier]
                for s in e.slots:
                    pool.refs[s] += 1
                refs = [(e.tier, list(e.slots))]
                pages = self._pages_of(e)
            self._lru[e.tier].move_to_end(user)
        pages = [p.to(self.device) for p in pages]  # served on the device even when it had no room
        return Lease(self, user, KVState(tuple(pages), n, self.page_size, e.max_seq_len), found, refs)

    def _unpin(self, user) -> None:
        self._pins[user] -= 1
        if not self._pins[user]:
            del self._pins[user]

    def _release(self, lease: Lease) -> None:
        with self._lock:
            for tier, slots in lease._refs:
                self._decref(tier, slots)
            self._unpin(lease.user)

    def put(self, user, chain: Chain, state: KVState) -> str | None:
        """Store ``state`` (the events ``chain`` hashes) as the user's entry, replacing any
        held one; pages a lease handed out of the same slots are kept, not copied. The tier it
        landed in (``device`` unless leased users fill it), or None when no tier has room. A
        failed disk write (a full disk) leaves the user without an entry and raises its
        ``OSError``.

        Example::

            store.put(user, chain_of(events, block=P, version=v), extend(model, st, new))
        """
        key = self._key(user)
        if not isinstance(chain, Chain) or not isinstance(state, KVState):
            raise ArgumentError(f"put: a Chain and a KVState, got {type(chain).__name__} and {type(state).__name__}")
        if state.page_size != self.page_size or chain.block != self.page_size or chain.length != state.length:
            raise ArgumentError(f"put: a state of {state.length} events in pages of {state.page_size} with a chain of "
                                f"{chain.length} events in blocks of {chain.block}, for a store of page size "
                                f"{self.page_size}: the chain must hash the state's events, both in the store's pages")
        self._check_len(state.max_seq_len, "put")
        with self._lock:
            old = self._entries.get(key)
            if not state.pages:
                if old is not None:
                    self._remove(old)
                return None
            self._init(state)
            k = len(state.pages)
            rows = [int(p.shape[1]) for p in state.pages]
            reuse = []  # leading pages that are the old entry's own device slots
            if old is not None and old.tier == "device":
                pool = self._pools["device"]
                for i, p in enumerate(state.pages[:len(old.slots)]):
                    s = old.slots[i]
                    if p.device != pool.data.device or p.data_ptr() != pool.data[s].data_ptr() or rows[i] != old.rows[i]:
                        break
                    reuse.append(s)
            if old is not None:  # the reused slots pass from the old entry to the new one
                self._lru[old.tier].pop(key, None)
                if old.tier == "disk":
                    self._vacate(old)
                else:
                    self._decref(old.tier, old.slots[len(reuse):])
                del self._entries[key]
            e = _Entry(key, chain.compact(), state.max_seq_len, "device", rows, [])
            need = k - len(reuse)
            kept = False  # whether the reused slots now belong to e
            try:
                if self._make_room("device", need, {key}):
                    pool = self._pools["device"]
                    new = pool.alloc(need)
                    for s, p in zip(new, state.pages[len(reuse):]):
                        pool.data[s, :, :p.shape[1]].copy_(p)
                    e.slots, kept = reuse + new, True
                    self._entries[key] = e
                    self._lru["device"][key] = None
                    self._stats["stored_device"] += 1
                    return "device"
                if self._pools["host"].nslots and self._make_room("host", k, {key}):
                    self._place(e, list(state.pages), "host")
                elif self._make_room_disk(self._file_bytes(k), {key}):
                    try:
                        self._place(e, list(state.pages), "disk")
                    except BaseException:
                        self._stats["write_failed"] += 1
                        raise
                else:
                    self._stats["not_stored"] += 1
                    return None
                self._entries[key] = e
            finally:
                if not kept:
                    self._decref("device", reuse)  # after the copy: the pages may be those slots
            self._stats[f"stored_{e.tier}"] += 1
            return e.tier

    def drop(self, user) -> bool:
        """Forget a user's entry (True if one was held). Leased pages stay readable until
        their leases end.

        Example::

            store.drop(user)   # the user asked to be forgotten
        """
        key = self._key(user)
        with self._lock:
            e = self._entries.get(key)
            if e is not None:
                self._remove(e)
            return e is not None

    def tier_of(self, user) -> str | None:
        """Where a user's entry is (None: not held)."""
        key = self._key(user)
        with self._lock:
            e = self._entries.get(key)
            return e.tier if e is not None else None

    def stats(self) -> dict:
        """Counters and gauges. Each lookup is counted once in ``reuse``: ``full`` (the whole
        held state was valid and served, its unfinished last page included), ``partial`` (a
        valid prefix shorter than the held state was served, the rest dropped) or ``miss``
        (nothing served: nothing held, nothing of it valid, or an unreadable file); their sum
        is ``lookups``, and ``reuse_rate`` gives each as a fraction of it. Per tier (where the
        lookup found its user): ``hits`` (full reuses) and ``hit_rate`` (``hits`` / ``lookups``),
        ``partial_reuses``. ``misses`` (= ``reuse["miss"]``), ``invalidated`` (lookups whose
        held chain disagrees before its end, or is of another model version or L: each a partial
        reuse or a miss), ``unreadable`` (a disk file that is not the one the entry wrote:
        dropped, a miss), ``write_failed`` (a disk write that failed: its entry dropped),
        ``resident_bytes`` and ``users`` per tier (the disk's: its files' real sizes),
        ``capacity_bytes`` (the disk's: ``disk_bytes`` less the folder's lock file), offloads,
        ``dropped`` (pushed off the last tier), ``pinned_users``.

        Example::

            s = store.stats(); s["reuse_rate"]["full"], s["hit_rate"]["device"], s["resident_bytes"]["host"]
        """
        with self._lock:
            st = dict(self._stats)
            lookups = st.get("lookups", 0)
            look = max(lookups, 1)
            hits = {t: st.get(f"hits_{t}", 0) for t in TIERS}
            partial = {t: st.get(f"partial_{t}", 0) for t in TIERS}
            reuse = {"full": sum(hits.values()), "partial": sum(partial.values()), "miss": st.get("misses", 0)}
            pb = self._page[2] if self._page else 0
            resident = {t: (self._pools[t].nslots - len(self._pools[t].free)) * pb if self._pools else 0
                        for t in ("device", "host")}
            resident["disk"] = self._disk_used
            cap = {t: (self._pools[t].nslots * pb if self._pools else self.budgets[t]) for t in ("device", "host")}
            cap["disk"] = self._disk_budget()
            return {"lookups": lookups, "reuse": reuse, "reuse_rate": {k: v / look for k, v in reuse.items()},
                    "hits": hits, "hit_rate": {t: hits[t] / look for t in TIERS}, "partial_reuses": partial,
                    "misses": reuse["miss"], "invalidated": st.get("invalidated", 0),
                    "unreadable": st.get("unreadable", 0), "write_failed": st.get("write_failed", 0),
                    "resident_bytes": resident, "capacity_bytes": cap,
                    "users": {t: len(self._lru[t]) for t in TIERS},
                    "offloaded_device_to_host": st.get("offloaded_device_to_host", 0),
                    "offloaded_device_to_disk": st.get("offloaded_device_to_disk", 0),
                    "offloaded_host_to_disk": st.get("offloaded_host_to_disk", 0),
                    "dropped": st.get("dropped", 0), "not_stored": st.get("not_stored", 0),
                    "pinned_users": len(self._pins)}

    def check(self) -> None:
        """Raise if the store's tables disagree (slot references, free lists, LRU, bytes, the
        disk's files): a consistency check for tests and debugging; leased slots count as
        referenced.

        Example::

            store.check()
        """
        with self._lock:
            for t in TIERS:
                users = {u for u, e in self._entries.items() if e.tier == t}
                if users != set(self._lru[t]):
                    raise RuntimeError(f"{t}: the LRU and the entries disagree")
            if self._pools is not None:
                for t in ("device", "host"):
                    pool = self._pools[t]
                    owned = Counter(s for e in self._entries.values() if e.tier == t for s in e.slots)
                    free = set(pool.free)
                    if len(free) != len(pool.free):
                        raise RuntimeError(f"{t}: a slot is free twice")
                    for s in range(pool.nslots):
                        if (s in free) != (pool.refs[s] == 0) or owned[s] > 1 or pool.refs[s] < owned[s]:
                            raise RuntimeError(f"{t}: slot {s} refs {pool.refs[s]}, owned {owned[s]}, free {s in free}")
            on_disk = [e for e in self._entries.values() if e.tier == "disk"]
            disk = sum(e.nbytes for e in on_disk)
            if disk != self._disk_used or disk > self._disk_budget():
                raise RuntimeError(f"disk: {self._disk_used} bytes counted, {disk} held, budget {self._disk_budget()}")
            files = {e.file for e in on_disk}
            if self._disk is not None and files != self._disk.names:
                raise RuntimeError(f"disk: entries hold files {sorted(files)}, the store has "
                                   f"{sorted(self._disk.names)}")
