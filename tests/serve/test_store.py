"""The tiered K/V store: LRU by user down the tiers (device, host, disk) and back up on a
lookup, bounded bytes per tier, leased users pinned, every lookup cut to its valid prefix,
and under concurrent threads (lookups, extends, stores, forgets, evictions) no torn read and
nothing served from a freed page.

Every page here is a payload that names itself: slot 0 holds its user, slot 1 ``page index *
1000 + version``, slot 2 per row the id of the event it encodes, so a reader checks each page it
is served against the events it asked with."""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest
import torch

from userwise.pipelines.errors import UserwiseError
from userwise.pipelines.serve import KVState, KVStore, chain_of

P = 4
PAGE_BYTES = 3 * P * 1 * 8  # [3 slots, P rows, dim 1] float64


def _pages(user: int, ids, version: int, start_page: int = 0) -> list:
    out = []
    for i in range(start_page, -(-len(ids) // P)):
        rows = ids[i * P:(i + 1) * P]
        p = torch.empty(3, len(rows), 1, dtype=torch.float64)
        p[0], p[1] = float(user), float(i * 1000 + version)
        p[2, :, 0] = torch.tensor(rows, dtype=torch.float64)
        out.append(p)
    return out


def _state(user, ids, version) -> KVState:
    return KVState(tuple(_pages(user, ids, version)), len(ids), P, 8)


def _chain(ids, version):
    return chain_of(np.asarray(ids, dtype=np.int64).reshape(-1, 1), block=P, version=version)


def _problems(lease, user, ids, version) -> list:
    """What is wrong with a served state, given the events and version the lookup asked with."""
    st = lease.state
    if st is None:
        return [] if lease.length == 0 else [f"user {user}: no state but length {lease.length}"]
    bad = []
    if st.length > len(ids) or st.length != sum(p.shape[1] for p in st.pages):
        bad.append(f"user {user}: length {st.length} of {len(ids)} events")
    for i, p in enumerate(st.pages):
        rows = ids[i * P:i * P + p.shape[1]]
        if not (torch.all(p[0] == user) and torch.all(p[1] == i * 1000 + version) and len(rows) == p.shape[1]
                and torch.equal(p[2, :, 0], torch.tensor(rows, dtype=torch.float64))):
            bad.append(f"user {user} page {i}: payload {p[:, 0, 0].tolist()} rows {p[2, :, 0].tolist()}, "
                       f"want user {user}, {i * 1000 + version}, {rows}")
    return bad


def _file_bytes(tmp_path) -> tuple[int, int]:
    """The real sizes of a disk file of two pages (its header included) and of the folder's
    lock file, measured on a store of a disk tier alone."""
    probe = KVStore(page_size=P, device_bytes=0, disk_bytes=1 << 20, folder=tmp_path / "probe")
    assert probe.put(0, _chain(list(range(8)), 1), _state(0, list(range(8)), 1)) == "disk"
    sizes = {f.name: f.stat().st_size for f in (tmp_path / "probe").iterdir()}
    probe.close()
    lock = sizes.pop(".lock")
    (two,) = sizes.values()
    return two, lock


def _store(tmp_path, device_pages, host_pages, disk_pages, **kw):
    """A store whose disk holds ``disk_pages // 2`` files of two pages."""
    two, lock = _file_bytes(tmp_path)
    return KVStore(page_size=P, device_bytes=device_pages * PAGE_BYTES, host_bytes=host_pages * PAGE_BYTES,
                   disk_bytes=disk_pages // 2 * two + lock if disk_pages else 0, folder=tmp_path / "kv", **kw)


def test_users_move_down_the_tiers_by_lru_and_back_up_on_a_lookup(tmp_path):
    store = _store(tmp_path, 6, 6, 8, poison_freed=True)
    ids = {u: list(range(100 * u, 100 * u + 8)) for u in range(8)}  # two pages each
    for u in range(6):
        assert store.put(u, _chain(ids[u], 1), _state(u, ids[u], 1)) == "device"
    assert [store.tier_of(u) for u in range(6)] == ["host"] * 3 + ["device"] * 3
    store.put(6, _chain(ids[6], 1), _state(6, ids[6], 1))  # 3 goes to host, so host's oldest (0) to disk
    assert [store.tier_of(u) for u in range(7)] == ["disk", "host", "host", "host", "device", "device", "device"]
    assert len(list((tmp_path / "kv").glob("*.kv"))) == 1
    with store.acquire(0, _chain(ids[0], 1)) as lease:  # from disk, back to the device
        assert lease.tier == "disk" and lease.length == 8 and _problems(lease, 0, ids[0], 1) == []
        assert store.tier_of(0) == "device"
    assert store.tier_of(4) == "host" and store.tier_of(1) == "disk"  # the LRU ones made room
    with store.acquire(2, _chain(ids[2], 1)) as lease:
        assert lease.tier == "host" and _problems(lease, 2, ids[2], 1) == []
    with store.acquire(2, _chain(ids[2], 1)) as lease:
        assert lease.tier == "device"
    with store.acquire(7, _chain(ids[7], 1)) as lease:
        assert lease.state is None and lease.tier is None
    s = store.stats()
    assert s["lookups"] == 4 and s["hits"] == {"device": 1, "host": 1, "disk": 1} and s["misses"] == 1
    assert s["hit_rate"]["disk"] == 0.25
    # the device gave 4 then 5 to host, host gave 1 then 3 to disk
    assert [store.tier_of(u) for u in range(7)] == ["device", "disk", "device", "disk", "host", "host", "device"]
    two, _ = _file_bytes(tmp_path)
    assert s["resident_bytes"] == {"device": 6 * PAGE_BYTES, "host": 4 * PAGE_BYTES, "disk": 2 * two}
    assert all(s["resident_bytes"][t] <= s["capacity_bytes"][t] for t in s["resident_bytes"])
    assert s["users"] == {"device": 3, "host": 2, "disk": 2} and s["pinned_users"] == 0
    for u in (7, 8, 9, 10):  # the last one fills the disk: its oldest user is dropped
        store.put(u, _chain(ids[7], 1), _state(u, ids[7], 1))
    assert store.stats()["dropped"] == 1 and store.tier_of(1) is None and store.tier_of(3) == "disk"
    for f in (tmp_path / "kv").glob("*.kv"):
        f.unlink()  # the disk tier's folder was cleaned: a miss, never an error or a wrong state
    with store.acquire(3, _chain(ids[3], 1)) as lease:
        assert lease.state is None
    assert store.tier_of(3) is None and store.stats()["unreadable"] == 1 and store.stats()["pinned_users"] == 0
    store.check()


def test_a_lookup_serves_only_the_valid_prefix(tmp_path):
    store = _store(tmp_path, 16, 0, 0)
    ids = list(range(10))
    store.put(5, _chain(ids, 1), _state(5, ids, 1))
    with store.acquire(5, _chain(ids, 1)) as lease:  # unchanged: all of it, the partial page too
        assert lease.length == 10 and _problems(lease, 5, ids, 1) == []
    more = ids + [10, 11, 12]
    with store.acquire(5, _chain(more, 1)) as lease:  # appended: all of it, the partial page too
        assert lease.length == 10 and _problems(lease, 5, more, 1) == []
        st = KVState(lease.state.pages[:2] + tuple(_pages(5, more, 1, start_page=2)), len(more), P, 8)
        store.put(5, _chain(more, 1), st)
    late = more[:5] + [99] + more[5:]  # a late event inserted at 5
    with store.acquire(5, _chain(late, 1)) as lease:
        assert lease.length == 4 and _problems(lease, 5, late, 1) == []
    s = store.stats()
    assert s["reuse"] == {"full": 2, "partial": 1, "miss": 0} and s["invalidated"] == 1
    with store.acquire(5, _chain(late[:4], 2)) as lease:  # a checkpoint swap: another version
        assert lease.state is None
    assert store.tier_of(5) is None and store.stats()["invalidated"] == 2
    store.put(5, _chain(ids, 1), _state(5, ids, 1))
    with store.acquire(5, _chain(ids[3:], 1)) as lease:  # re-anchored at a later event
        assert lease.state is None
    store.put(5, _chain(ids, 1), _state(5, ids, 1))
    assert store.drop(5) and not store.drop(5)
    with store.acquire(5, _chain(ids, 1)) as lease:  # forgotten
        assert lease.state is None
    store.check()


def test_leased_users_are_pinned_and_their_pages_kept_until_released(tmp_path):
    store = _store(tmp_path, 4, 2, 0, poison_freed=True)
    ids = list(range(8))
    store.put(0, _chain(ids, 1), _state(0, ids, 1))
    lease = store.acquire(0, _chain(ids, 1))
    for u in range(1, 6):  # more than the device holds: every other user is moved, never 0
        store.put(u, _chain(ids, 1), _state(u, ids, 1))
        assert store.tier_of(0) == "device"
    store.drop(0)  # forgotten while leased: the lease still reads its pages
    store.put(7, _chain(ids, 1), _state(7, ids, 1))
    assert _problems(lease, 0, ids, 1) == []
    lease.release()
    lease.release()  # idempotent
    assert store.stats()["pinned_users"] == 0
    store.put(0, _chain(ids, 1), _state(0, ids, 1))
    with store.acquire(0, _chain(ids + [8], 1)) as lease:  # a put of the leased pages keeps their slots
        st = KVState(lease.state.pages + tuple(_pages(0, ids + [8], 1, start_page=2)), 9, P, 8)
        assert store.put(0, _chain(ids + [8], 1), st) == "device"
        first = lease.state.pages[0].data_ptr()
    with store.acquire(0, _chain(ids + [8], 1)) as lease:
        assert lease.state.pages[0].data_ptr() == first and _problems(lease, 0, ids + [8], 1) == []
    store.check()


def test_a_full_device_of_leased_users_stores_below_it(tmp_path):
    store = _store(tmp_path, 2, 2, 4)
    ids = list(range(8))
    store.put(0, _chain(ids, 1), _state(0, ids, 1))
    with store.acquire(0, _chain(ids, 1)):
        assert store.put(1, _chain(ids, 1), _state(1, ids, 1)) == "host"
        assert store.put(2, _chain(ids, 1), _state(2, ids, 1)) == "host"  # host's oldest (1) to disk
        assert store.tier_of(1) == "disk"
        with store.acquire(1, _chain(ids, 1)) as lease:  # no room on the device: served from host
            assert lease.tier == "disk" and store.tier_of(1) == "host" and _problems(lease, 1, ids, 1) == []
    store.check()


def test_mistakes_are_refused(tmp_path):
    store = _store(tmp_path, 4, 0, 0)
    ids = list(range(5))
    with pytest.raises(UserwiseError, match="block"):
        store.acquire(0, chain_of(np.zeros((3, 1)), block=8, version=1))
    with pytest.raises(UserwiseError, match="hash the state's events"):
        store.put(0, _chain(ids[:4], 1), _state(0, ids, 1))
    store.put(0, _chain(ids, 1), _state(0, ids, 1))
    other = KVState((torch.zeros(5, P, 2, dtype=torch.float64),), P, P, 8)
    with pytest.raises(UserwiseError, match="one store serves one model"):
        store.put(1, _chain(ids[:4], 1), other)
    with pytest.raises(UserwiseError, match="folder"):
        KVStore(page_size=P, device_bytes=1, disk_bytes=10)


def test_concurrent_requests_never_read_torn_or_freed_pages(tmp_path):
    """Eight threads serve 24 users through a store that holds a few of them per tier: lookups,
    extends and stores, late events, forgets, re-anchored windows and checkpoint swaps, with
    evictions on almost every store. Every page served is checked when it is leased and again
    after the thread stored its extension and yielded (freed pages read as NaN)."""
    store = _store(tmp_path, 10, 10, 16, poison_freed=True)
    users = list(range(24))
    truth = {u: [list(range(1000 * u, 1000 * u + random.Random(u).randint(0, 12))), 1] for u in users}
    truth_lock = threading.Lock()
    problems, served, ops = [], [0], [0]
    deadline = time.monotonic() + 20

    def worker(seed):
        rng = random.Random(seed)
        for _ in range(250):
            if time.monotonic() > deadline:
                break
            u = rng.choice(users)
            r = rng.random()
            with truth_lock:
                ids, ver = truth[u]
                if r < 0.25:
                    ids.extend(rng.randint(0, 1 << 30) for _ in range(rng.randint(1, 6)))
                elif r < 0.29 and ids:
                    ids.insert(rng.randrange(len(ids)), rng.randint(0, 1 << 30))  # a late event
                elif r < 0.31:
                    truth[u][0] = ids = []                                          # forget
                elif r < 0.34 and ids:
                    del ids[:rng.randint(1, len(ids))]                             # re-anchored
                elif r < 0.36:
                    truth[u][1] = ver = ver + 1                                     # checkpoint swap
                ids = list(ids)
            if r > 0.97:
                store.drop(u)
                continue
            chain = _chain(ids, ver)
            with store.acquire(u, chain) as lease:
                bad = _problems(lease, u, ids, ver)
                n = lease.length
                kept = lease.state.pages[:n // P] if lease.state is not None else ()
                st = KVState(tuple(kept) + tuple(_pages(u, ids, ver, start_page=n // P)), len(ids), P, 8)
                store.put(u, chain, st)
                time.sleep(0)
                bad += _problems(lease, u, ids, ver)  # still the same pages after others stored and evicted
                served[0] += n
            ops[0] += 1
            if bad:
                problems.extend(bad)
                return

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert problems == []
    store.check()
    s = store.stats()
    assert s["pinned_users"] == 0 and ops[0] > 500 and served[0] > 0
    assert s["hits"]["device"] and s["hits"]["host"] and s["hits"]["disk"], s
    assert s["offloaded_device_to_host"] > 100 and s["offloaded_host_to_disk"] > 50 and s["invalidated"] > 0, s
    assert all(s["resident_bytes"][t] <= s["capacity_bytes"][t] for t in s["resident_bytes"]), s
