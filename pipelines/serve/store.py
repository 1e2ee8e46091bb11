"""The K/V store: users' paged states in three tiers, LRU by user, never stale, thread-safe.

Tiers, fastest first:

- ``device``: a pool of page slots on the serving device (CUDA when there is one; on a
  host without one it is CPU memory, so the same code runs in tests);
- ``host``: a pool of page slots in host memory (page-locked when CUDA exists, so
  copies to the device are asynchronous-capable);
- ``disk``: one file per user under a folder.

Each tier is bounded in bytes (``device_bytes``, ``host_bytes``, ``disk_bytes``): a memory
tier holds ``bytes // page_bytes`` slots of one page (``[slots, P, dim]``) each. A user's
pages live in one tier. When a tier is full its least recently used user moves down
(device to host, host to disk; off the disk it is dropped); a lookup of a user found on
host or disk moves it back to the device.

Entries carry their key (the user, and the model version inside their :class:`Chain`)
and the chain of the events they encode. :meth:`KVStore.acquire` takes the current
chain: the entry is cut to :func:`longest_valid_prefix` (a changed event, a re-anchored
window, another model version: the rest is dropped, never served) and returned as a
:class:`Lease`. A lease pins its user (never moved or dropped while leased) and holds a
reference on every slot it hands out: a slot is written only while free, and it is freed
only when neither an entry nor a lease holds it, so a leased state never changes under
its reader, whatever other threads store or evict. One lock guards the store's tables
and copies; readers compute on leased pages outside it.

Example::

    store = KVStore(page_size=64, device_bytes=8 << 30, host_bytes=64 << 30, disk_bytes=1 << 40, folder="/cache")
    cur = chain_of(events, block=64, version=v)
    with store.acquire(user, cur) as lease:
        st = lease.state or empty_state(model, max_seq_len=50, page_size=64)
        st = extend(model, st, events[lease.length:])
        store.put(user, cur, st)
        logits = score(model, st, candidates)
    store.stats()["hit_rate"], store.stats()["resident_bytes"]
"""

from __future__ import annotations

import itertools
import math
import os
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from userwise.pipelines.errors import UserwiseError
from userwise.pipelines.serve.chain import Chain, longest_valid_prefix
from userwise.pipelines.serve.incremental import KVState

__all__ = ["KVStore", "Lease", "TIERS"]

TIERS = ("device", "host", "disk")


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
    file: Path | None = None  # disk


class Lease:
    """A user's state read from the store, valid until :meth:`release` (or the end of the
    ``with``): ``state`` (a :class:`KVState` of the valid prefix, or None: a miss), ``length``
    (its events), ``tier`` (where it was found; None on a miss). Keep a state beyond its lease
    with ``state.clone()``.

    Example::

        with store.acquire(user, chain) as lease:
            st = extend(model, lease.state or empty_state(model, max_seq_len=L, page_size=P), new)
    """

    def __init__(self, store: "KVStore", user, state: KVState | None, tier: str | None, refs: list):
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
    ``host_bytes`` (0: no host tier), ``disk_bytes`` and ``folder`` (both for a disk tier),
    ``device`` (default CUDA when available, else CPU), ``poison_freed`` (fill a freed slot
    with NaN: a read of freed memory shows; tests).

    Example::

        store = KVStore(page_size=64, device_bytes=1 << 30, host_bytes=4 << 30)
        with store.acquire(user, chain) as lease: ...
    """

    def __init__(self, *, page_size: int, device_bytes: int, host_bytes: int = 0, disk_bytes: int = 0,
                 folder=None, device=None, poison_freed: bool = False):
        if page_size < 1 or min(device_bytes, host_bytes, disk_bytes) < 0:
            raise UserwiseError(f"KVStore(page_size={page_size}, device_bytes={device_bytes}, host_bytes={host_bytes},"
                                f" disk_bytes={disk_bytes}): use a page size >= 1 and budgets >= 0")
        if disk_bytes and folder is None:
            raise UserwiseError("disk_bytes needs folder=: the disk tier's files go there")
        self.page_size = int(page_size)
        self.budgets = {"device": int(device_bytes), "host": int(host_bytes), "disk": int(disk_bytes)}
        self.device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
        self.folder = Path(folder) if folder is not None else None
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)
        self.poison_freed = poison_freed
        self._lock = threading.RLock()
        self._entries: dict = {}
        self._lru = {t: OrderedDict() for t in TIERS}
        self._pins: Counter = Counter()
        self._pools: dict | None = None
        self._page = None  # (shape, dtype, page_bytes) once the first state is stored
        self._disk_used = 0
        self._files = itertools.count()
        self._stats = Counter()

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
        elif (shape, p.dtype) != self._page[:2]:
            raise UserwiseError(f"a state of pages {list(shape)} {p.dtype} for a store of pages {list(self._page[0])} "
                                f"{self._page[1]}: one store serves one model")

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
        if self.folder is None or nbytes > self.budgets["disk"]:
            return False
        while self._disk_used + nbytes > self.budgets["disk"]:
            victim = self._evictable("disk", protect)
            if victim is None:
                return False
            self._stats["dropped"] += 1
            self._remove(victim)
        return True

    # -- moving entries -----------------------------------------------------------------
    def _pages_of(self, e: _Entry) -> list:
        """Views of an entry's pages (memory tiers) or pages read from its file."""
        if e.tier == "disk":
            data = torch.load(e.file, map_location="cpu", weights_only=True)
            return [data[i, :, :r] for i, r in enumerate(e.rows)]
        pool = self._pools[e.tier]
        return [pool.data[s, :, :r] for s, r in zip(e.slots, e.rows)]

    def _place(self, e: _Entry, pages: list, tier: str) -> None:
        """Write ``pages`` into ``tier`` (room already made) and record ``e`` there."""
        if tier == "disk":
            shape, dtype, page_bytes = self._page
            data = torch.zeros((len(pages), *shape), dtype=dtype)
            for i, p in enumerate(pages):
                data[i, :, :p.shape[1]].copy_(p)
            path = self.folder / f"{next(self._files)}.pt"
            tmp = path.with_suffix(".tmp")
            torch.save(data, tmp)
            os.replace(tmp, path)
            e.file, e.slots = path, []
            self._disk_used += len(pages) * page_bytes
        else:
            pool = self._pools[tier]
            e.slots = pool.alloc(len(pages))
            for s, p in zip(e.slots, pages):
                pool.data[s, :, :p.shape[1]].copy_(p)
            e.file = None
        e.tier = tier
        self._lru[tier][e.user] = None

    def _vacate(self, e: _Entry) -> None:
        """Free where ``e`` lives now (its slots' entry reference, or its file)."""
        self._lru[e.tier].pop(e.user, None)
        if e.tier == "disk":
            self._disk_used -= len(e.rows) * self._page[2]
            e.file.unlink(missing_ok=True)
        else:
            self._decref(e.tier, e.slots)
        e.slots, e.file = [], None

    def _move(self, e: _Entry, tier: str) -> None:
        pages = self._pages_of(e)
        old_tier, old_slots, old_file, old_n = e.tier, e.slots, e.file, len(e.rows)
        self._lru[old_tier].pop(e.user, None)
        self._place(e, pages, tier)
        if old_tier == "disk":
            self._disk_used -= old_n * self._page[2]
            old_file.unlink(missing_ok=True)
        else:
            self._decref(old_tier, old_slots)

    def _demote(self, e: _Entry, protect) -> None:
        """Move an unpinned LRU entry one tier down (or off the disk: dropped)."""
        protect = protect | {e.user}
        k = len(e.rows)
        if e.tier == "device" and self._pools["host"].nslots and self._make_room("host", k, protect):
            self._stats["offloaded_device_to_host"] += 1
            self._move(e, "host")
        elif e.tier != "disk" and self._make_room_disk(k * self._page[2], protect):
            self._stats[f"offloaded_{e.tier}_to_disk"] += 1
            self._move(e, "disk")
        else:
            self._stats["dropped"] += 1
            self._remove(e)

    def _promote(self, e: _Entry) -> None:
        k = len(e.rows)
        if self._make_room("device", k, {e.user}):
            self._move(e, "device")
        elif e.tier == "disk" and self._pools["host"].nslots and self._make_room("host", k, {e.user}):
            self._move(e, "host")

    def _remove(self, e: _Entry) -> None:
        self._vacate(e)
        del self._entries[e.user]

    # -- the API ------------------------------------------------------------------------
    def acquire(self, user, chain: Chain) -> Lease:
        """The user's held state cut to what ``chain`` (the user's current events, with the
        model version) verifies, pinned until the lease is released. A miss (nothing held,
        or nothing valid) gives a lease with ``state`` None that still pins the user.

        Example::

            with store.acquire(user, chain_of(events, block=P, version=v)) as lease:
                new = events[lease.length:]
        """
        if chain.block != self.page_size:
            raise UserwiseError(f"a chain of block {chain.block} for a store of page size {self.page_size}: "
                                "make chains with block=page_size")
        with self._lock:
            self._stats["lookups"] += 1
            self._pins[user] += 1
            try:
                return self._lookup(user, chain)
            except BaseException:
                self._unpin(user)
                raise

    def _lookup(self, user, chain: Chain) -> Lease:
        e = self._entries.get(user)
        n = longest_valid_prefix(e.chain, chain) if e is not None else 0
        if e is not None and n == 0:
            self._stats["invalidated"] += 1
            self._remove(e)
        if n == 0:
            self._stats["misses"] += 1
            return Lease(self, user, None, None, [])
        if n < e.chain.length:
            self._stats["truncated"] += 1
            keep = -(-n // self.page_size)
            if e.tier != "disk":
                self._decref(e.tier, e.slots[keep:])
                e.slots = e.slots[:keep]
            else:
                self._disk_used -= (len(e.rows) - keep) * self._page[2]  # the file keeps them, unread
            e.rows, e.chain = e.rows[:keep], e.chain.truncate(n)
        found = e.tier
        try:
            if e.tier != "device":
                self._promote(e)
            pages = self._pages_of(e)
        except (OSError, RuntimeError, EOFError):  # an unreadable file: a miss, never a wrong state
            if e.tier != "disk":
                raise
            self._stats["unreadable"] += 1
            self._stats["misses"] += 1
            self._remove(e)
            return Lease(self, user, None, None, [])
        self._stats[f"hits_{found}"] += 1
        refs = []
        if e.tier != "disk":
            pool = self._pools[e.tier]
            for s in e.slots:
                pool.refs[s] += 1
            refs = [(e.tier, list(e.slots))]
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
        landed in (``device`` unless leased users fill it), or None when no tier has room.

        Example::

            store.put(user, chain_of(events, block=P, version=v), extend(model, st, new))
        """
        if state.page_size != self.page_size or chain.block != self.page_size or chain.length != state.length:
            raise UserwiseError(f"put: a state of {state.length} events in pages of {state.page_size} with a chain of "
                                f"{chain.length} events in blocks of {chain.block}, for a store of page size "
                                f"{self.page_size}: the chain must hash the state's events, both in the store's pages")
        with self._lock:
            old = self._entries.get(user)
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
                self._lru[old.tier].pop(user, None)
                if old.tier == "disk":
                    self._vacate(old)
                else:
                    self._decref(old.tier, old.slots[len(reuse):])
                del self._entries[user]
            e = _Entry(user, chain, state.max_seq_len, "device", rows, [])
            self._entries[user] = e
            need = k - len(reuse)
            if self._make_room("device", need, {user}):
                pool = self._pools["device"]
                new = pool.alloc(need)
                for s, p in zip(new, state.pages[len(reuse):]):
                    pool.data[s, :, :p.shape[1]].copy_(p)
                e.slots = reuse + new
                self._lru["device"][user] = None
                self._stats["stored_device"] += 1
                return "device"
            if self._pools["host"].nslots and self._make_room("host", k, {user}):
                self._place(e, list(state.pages), "host")
            elif self._make_room_disk(k * self._page[2], {user}):
                self._place(e, list(state.pages), "disk")
            else:
                del self._entries[user]
            self._decref("device", reuse)  # after the copy: the pages may be those slots
            if user not in self._entries:
                self._stats["not_stored"] += 1
                return None
            self._stats[f"stored_{e.tier}"] += 1
            return e.tier

    def drop(self, user) -> bool:
        """Forget a user's entry (True if one was held). Leased pages stay readable until
        their leases end.

        Example::

            store.drop(user)   # the user asked to be forgotten
        """
        with self._lock:
            e = self._entries.get(user)
            if e is not None:
                self._remove(e)
            return e is not None

    def tier_of(self, user) -> str | None:
        """Where a user's entry is (None: not held)."""
        with self._lock:
            e = self._entries.get(user)
            return e.tier if e is not None else None

    def stats(self) -> dict:
        """Counters and gauges: ``lookups``, ``hits`` and ``hit_rate`` per tier (where a lookup
        found its user), ``misses``, ``invalidated`` (a chain or version mismatch dropped the
        entry), ``unreadable`` (a disk file that could not be read: dropped, a miss), ``truncated``, ``resident_bytes`` and ``users`` per tier, ``capacity_bytes``,
        offloads, ``dropped`` (pushed off the last tier), ``pinned_users``.

        Example::

            s = store.stats(); s["hit_rate"]["device"], s["resident_bytes"]["host"]
        """
        with self._lock:
            st = dict(self._stats)
            look = max(st.get("lookups", 0), 1)
            hits = {t: st.get(f"hits_{t}", 0) for t in TIERS}
            pb = self._page[2] if self._page else 0
            resident = {t: (self._pools[t].nslots - len(self._pools[t].free)) * pb if self._pools else 0
                        for t in ("device", "host")}
            resident["disk"] = self._disk_used
            cap = {t: (self._pools[t].nslots * pb if self._pools else self.budgets[t]) for t in ("device", "host")}
            cap["disk"] = self.budgets["disk"] if self.folder is not None else 0
            return {"lookups": st.get("lookups", 0), "hits": hits, "hit_rate": {t: hits[t] / look for t in TIERS},
                    "misses": st.get("misses", 0), "invalidated": st.get("invalidated", 0),
                    "unreadable": st.get("unreadable", 0),
                    "truncated": st.get("truncated", 0), "resident_bytes": resident, "capacity_bytes": cap,
                    "users": {t: len(self._lru[t]) for t in TIERS},
                    "offloaded_device_to_host": st.get("offloaded_device_to_host", 0),
                    "offloaded_device_to_disk": st.get("offloaded_device_to_disk", 0),
                    "offloaded_host_to_disk": st.get("offloaded_host_to_disk", 0),
                    "dropped": st.get("dropped", 0), "not_stored": st.get("not_stored", 0),
                    "pinned_users": len(self._pins)}

    def check(self) -> None:
        """Raise if the store's tables disagree (slot references, free lists, LRU, bytes):
        a consistency check for tests and debugging; leased slots count as referenced.

        Example::

            store.check()
        """
        with self._lock:
            if self._pools is None:
                return
            for t in ("device", "host"):
                pool = self._pools[t]
                owned = Counter(s for e in self._entries.values() if e.tier == t for s in e.slots)
                free = set(pool.free)
                if len(free) != len(pool.free):
                    raise RuntimeError(f"{t}: a slot is free twice")
                for s in range(pool.nslots):
                    if (s in free) != (pool.refs[s] == 0) or owned[s] > 1 or pool.refs[s] < owned[s]:
                        raise RuntimeError(f"{t}: slot {s} refs {pool.refs[s]}, owned {owned[s]}, free {s in free}")
            for t in TIERS:
                users = {u for u, e in self._entries.items() if e.tier == t}
                if users != set(self._lru[t]):
                    raise RuntimeError(f"{t}: the LRU and the entries disagree")
            disk = sum(len(e.rows) for e in self._entries.values() if e.tier == "disk") * self._page[2]
            if disk != self._disk_used or disk > self.budgets["disk"]:
                raise RuntimeError(f"disk: {self._disk_used} bytes counted, {disk} held, budget {self.budgets['disk']}")
