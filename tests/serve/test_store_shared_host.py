"""The disk tier belongs to its store (docs/security.md, issue 54): on a shared host and a
shared disk, a store serves only what it wrote for that user, under that chain, L and shape.

- Two stores on one folder: the second is refused naming the holder's pid (in this process
  and from another); a store that died leaves files that the next one never serves.
- A damaged, swapped, foreign, linked or unreadable file (a flipped bit, another user's or
  another store's file, a file of NaN, of another shape or dtype, truncated, gone, a FIFO) is
  a miss counted ``unreadable``, never served or raised, and the store stays consistent.
- A failed write (ENOSPC, or a wrapper's RuntimeError around it) drops that entry, leaves no
  ``.tmp``, keeps ``check()`` passing and raises an OSError the CLI prints as "the disk is
  full" with exit 2.
- The files' real sizes stay within ``disk_bytes`` under churn (truncations included).
- The folder is 0700 and the files 0600; a folder of another user is refused.
- One key per user id (routing's :func:`user_id`); L is part of what must match.

Pages here name themselves (slot 0 the user, slot 1 ``page * 1000 + version``, slot 2 each
row's event id), so a served state shows whose it is."""

from __future__ import annotations

import errno
import math
import os
import random
import stat
import subprocess
import sys

import numpy as np
import pytest
import torch

from userwise.pipelines import errors
from userwise.pipelines.errors import ArgumentError, UserwiseError
from userwise.pipelines.serve import (
    Candidates,
    Events,
    KVState,
    KVStore,
    chain_of,
    empty_state,
    full_scores,
    node_of,
    prefill,
    score,
)
from userwise.pipelines.serve import store as store_module
from userwise.pipelines.train import ReferenceRanker

P = 4
PAGE_BYTES = 3 * P * 1 * 8  # [3 slots, P rows, dim 1] float64
ALICE, BOB = 1, 2


def _pages(user, ids, version, dtype=torch.float64) -> list:
    out = []
    for i in range(-(-len(ids) // P)):
        rows = ids[i * P:(i + 1) * P]
        p = torch.empty(3, len(rows), 1, dtype=dtype)
        p[0], p[1] = float(user), float(i * 1000 + version)
        p[2, :, 0] = torch.tensor(rows, dtype=dtype)
        out.append(p)
    return out


def _state(user, ids, version=1, L=8, dtype=torch.float64) -> KVState:
    return KVState(tuple(_pages(user, ids, version, dtype)), len(ids), P, L)


def _chain(ids, version=1):
    return chain_of(np.asarray(ids, dtype=np.int64).reshape(-1, 1), block=P, version=version)


IDS = list(range(8))  # alice and bob have the same events: only the store's binding tells them apart


def _disk_store(folder, **kw):
    """A store of a disk tier alone: every put is a file, every lookup reads one."""
    return KVStore(page_size=P, device_bytes=0, disk_bytes=1 << 20, folder=folder, **kw)


def _files(folder) -> list:
    """The store's entry files in the order they were written."""
    return sorted((f for f in os.listdir(folder) if f.endswith(".kv")), key=lambda f: int(f[:-3].rsplit("-", 1)[1]))


def _whose(lease) -> int | None:
    return None if lease.state is None else int(lease.state.pages[0][0, 0, 0])


def _real_bytes(folder) -> int:
    return sum(os.lstat(os.path.join(folder, f)).st_size for f in os.listdir(folder))


# -- two stores, one folder --------------------------------------------------------------------

def test_a_second_store_on_a_folder_is_refused_and_a_closed_ones_files_are_gone(tmp_path):
    folder = tmp_path / "kv"
    a = _disk_store(folder)
    a.put(ALICE, _chain(IDS), _state(ALICE, IDS))
    with pytest.raises(UserwiseError, match=f"in use by another store \\(pid {os.getpid()} ") as exc:
        _disk_store(folder)
    assert errors.one_line(exc.value)[0] == 2 and "a folder of its own" in str(exc.value)
    with a.acquire(ALICE, _chain(IDS)) as lease:  # the refused store changed nothing
        assert _whose(lease) == ALICE and lease.tier == "disk"
    a.close()
    assert os.listdir(folder) == []  # its files and its lock
    b = _disk_store(folder)  # the folder is free again; b starts empty
    b.put(BOB, _chain(IDS), _state(BOB, IDS))
    with b.acquire(ALICE, _chain(IDS)) as lease:
        assert lease.state is None
    b.check()


def test_a_store_in_another_process_holds_its_folder(tmp_path):
    folder = tmp_path / "kv"
    code = ("import sys; from userwise.pipelines.serve import KVStore; "
            "s = KVStore(page_size=4, device_bytes=0, disk_bytes=1 << 20, folder=sys.argv[1]); "
            "print('ready', flush=True); sys.stdin.read()")
    p = subprocess.Popen([sys.executable, "-c", code, str(folder)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        with pytest.raises(UserwiseError, match=f"pid {p.pid} "):
            _disk_store(folder)
    finally:
        p.stdin.close()
        p.wait(60)
    _disk_store(folder).close()  # its process ended: the kernel released its lock


def test_a_dead_stores_files_are_never_served(tmp_path):
    """A store killed with its files on disk (no close, no finalizer): the next store on the
    folder starts empty and removes them; bob's state, stored by the new store under the same
    chain as alice's old one, is never served to alice."""
    folder = tmp_path / "kv"
    code = ("import os, sys, numpy as np, torch; from userwise.pipelines.serve import KVStore, KVState, chain_of; "
            "s = KVStore(page_size=4, device_bytes=0, disk_bytes=1 << 20, folder=sys.argv[1]); "
            "c = chain_of(np.arange(8).reshape(-1, 1), block=4, version=1); "
            "s.put(1, c, KVState((torch.ones(3, 4, 1, dtype=torch.float64),) * 2, 8, 4, 8)); os._exit(0)")
    subprocess.run([sys.executable, "-c", code, str(folder)], check=True, timeout=120)
    assert len(_files(folder)) == 1  # what the dead store left
    store = _disk_store(folder)
    assert _files(folder) == []
    store.put(BOB, _chain(IDS), _state(BOB, IDS))
    with store.acquire(ALICE, _chain(IDS)) as lease:
        assert lease.state is None
    with store.acquire(BOB, _chain(IDS)) as lease:
        assert _whose(lease) == BOB
    store.check()


# -- files that are not what their entry wrote -----------------------------------------------

def _flip_bit(folder, files, at):
    path = os.path.join(folder, files[0])
    data = bytearray(open(path, "rb").read())
    i = at if at >= 0 else len(data) + at
    data[i] ^= 0x10
    open(path, "wb").write(bytes(data))


def _swap(folder, files):
    a, b = (os.path.join(folder, f) for f in files)
    os.rename(a, a + ".x")
    os.rename(b, a)
    os.rename(a + ".x", b)


def _link_to_bobs(folder, files):
    os.unlink(os.path.join(folder, files[0]))
    os.symlink(files[1], os.path.join(folder, files[0]))


def _copy_bobs(folder, files):
    data = open(os.path.join(folder, files[1]), "rb").read()
    open(os.path.join(folder, files[0]), "wb").write(data)


def _nan(folder, files):
    path = os.path.join(folder, files[0])
    n = os.path.getsize(path)
    open(path, "wb").write(np.full(n // 8, np.nan).tobytes() + b"\0" * (n % 8))


def _truncate(folder, files):
    os.truncate(os.path.join(folder, files[0]), os.path.getsize(os.path.join(folder, files[0])) - 8)


def _remove(folder, files):
    os.unlink(os.path.join(folder, files[0]))


def _fifo(folder, files):
    os.unlink(os.path.join(folder, files[0]))
    os.mkfifo(os.path.join(folder, files[0]))


def _a_folder(folder, files):
    os.unlink(os.path.join(folder, files[0]))
    os.mkdir(os.path.join(folder, files[0]))


def _unreadable_mode(folder, files):
    os.chmod(os.path.join(folder, files[0]), 0)
    if os.geteuid() == 0:  # root reads a file of mode 0: make it unreadable another way
        _truncate(folder, files)


def _other_store(tmp_path, dtype=torch.float64, L=8):
    """Alice's file as another store (another folder, another nonce) wrote it."""
    def plant(folder, files):
        other = tmp_path / f"other-{dtype}-{L}"
        s = _disk_store(other)
        s.put(ALICE, _chain(IDS), _state(ALICE, IDS, L=L, dtype=dtype))
        (theirs,) = _files(other)
        data = open(other / theirs, "rb").read()
        s.close()
        open(os.path.join(folder, files[0]), "wb").write(data)
    return plant


DAMAGE = {
    "bit-in-the-pages": lambda tmp: lambda f, fs: _flip_bit(f, fs, -3),
    "bit-in-the-header": lambda tmp: lambda f, fs: _flip_bit(f, fs, 60),
    "swapped": lambda tmp: _swap,
    "symlink-to-bobs": lambda tmp: _link_to_bobs,
    "a-copy-of-bobs": lambda tmp: _copy_bobs,
    "nan": lambda tmp: _nan,
    "truncated": lambda tmp: _truncate,
    "removed": lambda tmp: _remove,
    "fifo": lambda tmp: _fifo,
    "a-folder": lambda tmp: _a_folder,
    "mode-0": lambda tmp: _unreadable_mode,
    "another-stores": lambda tmp: _other_store(tmp),
    "another-dtype": lambda tmp: _other_store(tmp, dtype=torch.float32),
    "another-L": lambda tmp: _other_store(tmp, L=4),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_file_that_is_not_its_entrys_is_a_miss(tmp_path, damage):
    folder = tmp_path / "kv"
    store = _disk_store(folder)
    store.put(ALICE, _chain(IDS), _state(ALICE, IDS))
    store.put(BOB, _chain(IDS), _state(BOB, IDS))
    DAMAGE[damage](tmp_path)(folder, _files(folder))
    with store.acquire(ALICE, _chain(IDS)) as lease:  # never bob's pages, never an exception
        assert lease.state is None and lease.tier is None
    s = store.stats()
    assert s["unreadable"] == 1 and s["misses"] == 1 and store.tier_of(ALICE) is None and s["pinned_users"] == 0
    store.check()
    if damage not in ("swapped",):  # bob's own file is intact (a swap damaged both)
        with store.acquire(BOB, _chain(IDS)) as lease:
            assert _whose(lease) == BOB
    assert store.put(ALICE, _chain(IDS), _state(ALICE, IDS)) == "disk"  # alice is stored again and served
    with store.acquire(ALICE, _chain(IDS)) as lease:
        assert _whose(lease) == ALICE and lease.length == 8
    store.check()


# -- a failed write ------------------------------------------------------------------------------

def _no_space(written=5):
    def write_all(fd, blobs):
        os.write(fd, bytes(memoryview(blobs[0]).cast("B")[:written]))  # a partial file, then the disk is full
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return write_all


def _torch_like(fd, blobs):
    try:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    except OSError as e:
        raise RuntimeError("[enforce fail at inline_container.cc:778] . PytorchStreamWriter failed writing file "
                           "data/0: file write failed") from e


def _assert_disk_full(exc, folder):
    assert isinstance(exc, OSError) and exc.errno == errno.ENOSPC
    code, line = errors.one_line(exc)
    assert code == 2 and line.startswith("the disk is full") and str(folder) in line, line


@pytest.mark.parametrize("writer", [_no_space(), _torch_like], ids=["enospc", "torch-runtimeerror"])
def test_a_full_disk_drops_the_entry_and_says_so(tmp_path, monkeypatch, writer):
    folder = tmp_path / "kv"
    store = KVStore(page_size=P, device_bytes=2 * PAGE_BYTES, disk_bytes=1 << 20, folder=folder)
    store.put(ALICE, _chain(IDS), _state(ALICE, IDS))  # on the device
    monkeypatch.setattr(store_module, "_write_all", writer)
    # bob's put moves alice down to the disk: that write fails, so alice is dropped
    with pytest.raises(OSError) as exc:
        store.put(BOB, _chain(IDS), _state(BOB, IDS))
    _assert_disk_full(exc.value, folder)
    store.check()
    assert store.tier_of(ALICE) is None and store.stats()["write_failed"] == 1
    assert not [f for f in os.listdir(folder) if f.endswith(".tmp")]
    # a put straight to the disk (the device holds a leased user)
    store.put(BOB, _chain(IDS), _state(BOB, IDS))
    with store.acquire(BOB, _chain(IDS)):
        with pytest.raises(OSError) as exc:
            store.put(ALICE, _chain(IDS), _state(ALICE, IDS))
        _assert_disk_full(exc.value, folder)
        store.check()
        assert store.tier_of(ALICE) is None and store.tier_of(BOB) == "device"
    assert not [f for f in os.listdir(folder) if f != ".lock"] and store.stats()["resident_bytes"]["disk"] == 0
    monkeypatch.undo()  # space again: everything works
    store.put(ALICE, _chain(IDS), _state(ALICE, IDS))
    assert store.tier_of(BOB) == "disk"
    with store.acquire(BOB, _chain(IDS)) as lease:
        assert _whose(lease) == BOB and lease.tier == "disk"
    with store.acquire(ALICE, _chain(IDS)) as lease:
        assert _whose(lease) == ALICE
    store.check()


def test_a_full_disk_during_a_lookup_leaves_the_store_consistent(tmp_path, monkeypatch):
    folder = tmp_path / "kv"
    store = KVStore(page_size=P, device_bytes=2 * PAGE_BYTES, disk_bytes=1 << 20, folder=folder)
    store.put(ALICE, _chain(IDS), _state(ALICE, IDS))
    store.put(BOB, _chain(IDS), _state(BOB, IDS))  # alice to the disk
    monkeypatch.setattr(store_module, "_write_all", _no_space())
    with pytest.raises(OSError) as exc:  # alice back to the device moves bob down: that write fails
        store.acquire(ALICE, _chain(IDS))
    _assert_disk_full(exc.value, folder)
    store.check()
    assert store.stats()["pinned_users"] == 0 and store.tier_of(BOB) is None and store.tier_of(ALICE) == "disk"
    monkeypatch.undo()
    with store.acquire(ALICE, _chain(IDS)) as lease:
        assert _whose(lease) == ALICE and lease.tier == "disk"
    store.check()


def test_a_writer_error_without_an_errno_keeps_the_store_consistent(tmp_path, monkeypatch):
    folder = tmp_path / "kv"
    store = _disk_store(folder)

    def broken(fd, blobs):
        raise RuntimeError("a writer's bug")

    monkeypatch.setattr(store_module, "_write_all", broken)
    with pytest.raises(RuntimeError, match="a writer's bug"):
        store.put(ALICE, _chain(IDS), _state(ALICE, IDS))
    store.check()
    assert os.listdir(folder) == [".lock"] and store.tier_of(ALICE) is None


# -- bytes on disk ---------------------------------------------------------------------------

def test_the_files_real_sizes_stay_within_disk_bytes(tmp_path):
    """Puts of many lengths, lookups that cut entries (late events), forgets: after each, the
    folder's files (headers and the lock file included) fit ``disk_bytes``, and the store counts
    exactly their sizes."""
    folder = tmp_path / "kv"
    budget = 5000
    store = KVStore(page_size=P, device_bytes=2 * PAGE_BYTES, host_bytes=0, disk_bytes=budget, folder=folder)
    rng = random.Random(0)
    truth = {u: list(range(100 * u, 100 * u + rng.randint(1, 20))) for u in range(12)}
    cut = 0
    for step in range(400):
        u = rng.randrange(12)
        r = rng.random()
        ids = truth[u]
        if r < 0.3:
            ids.insert(rng.randrange(len(ids)), 10_000 + step)  # a late event: the held entry is cut
        elif r < 0.5:
            ids.extend(range(20_000 + step * 10, 20_000 + step * 10 + rng.randint(1, 6)))
        elif r < 0.55:
            store.drop(u)
        with store.acquire(u, _chain(ids)) as lease:
            assert _whose(lease) in (None, u)
            cut += lease.state is not None and lease.length < len(ids)
        store.put(u, _chain(ids), _state(u, ids))
        real = _real_bytes(folder)
        assert real <= budget, (step, real)
        assert real - os.path.getsize(folder / ".lock") == store.stats()["resident_bytes"]["disk"]
        store.check()
    s = store.stats()
    assert cut > 10 and s["reuse"]["partial"] > 10 and s["offloaded_device_to_disk"] > 5 and s["hits"]["disk"] > 50, s
    assert not [f for f in os.listdir(folder) if f.endswith(".tmp")]
    store.close()
    assert os.listdir(folder) == []


def test_a_cut_entry_on_the_disk_keeps_no_unread_pages(tmp_path):
    folder = tmp_path / "kv"
    store = _disk_store(folder)
    ids = list(range(40))  # ten pages
    store.put(ALICE, _chain(ids), _state(ALICE, ids))
    (before,) = _files(folder)
    full = os.path.getsize(folder / before)
    late = ids[:5] + [999] + ids[5:]
    with store.acquire(ALICE, _chain(late)) as lease:
        assert lease.length == 4 and _whose(lease) == ALICE
    (after,) = _files(folder)
    assert after != before and os.path.getsize(folder / after) < full - 8 * PAGE_BYTES
    assert store.stats()["resident_bytes"]["disk"] == os.path.getsize(folder / after)
    store.check()


# -- modes and owners ------------------------------------------------------------------------

def test_the_folder_and_its_files_are_private(tmp_path):
    folder = tmp_path / "kv"
    store = _disk_store(folder)
    store.put(ALICE, _chain(IDS), _state(ALICE, IDS))
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    names = os.listdir(folder)
    assert len(names) == 2 and all(stat.S_IMODE(os.stat(folder / n).st_mode) == 0o600 for n in names)
    store.close()
    open_folder = tmp_path / "open"
    open_folder.mkdir(mode=0o755)
    os.chmod(open_folder, 0o755)
    _disk_store(open_folder).close()
    assert stat.S_IMODE(os.stat(open_folder).st_mode) == 0o700  # tightened: users' states are not for others


def test_a_folder_of_another_user_is_refused(tmp_path, monkeypatch):
    folder = tmp_path / "kv"
    folder.mkdir()
    monkeypatch.setattr(os, "geteuid", lambda: os.stat(folder).st_uid + 1)  # as if someone else made it
    with pytest.raises(UserwiseError, match="is owned by uid") as exc:
        _disk_store(folder)
    assert errors.one_line(exc.value) == (2, str(exc.value)) and "use another folder" in str(exc.value)
    assert os.listdir(folder) == []
    f = tmp_path / "file"
    f.write_text("x")
    monkeypatch.undo()
    with pytest.raises(UserwiseError, match="is not a folder"):
        _disk_store(f)


# -- keys and L ------------------------------------------------------------------------------

def test_one_key_per_user_id_as_routing_has_it(tmp_path):
    store = KVStore(page_size=P, device_bytes=8 * PAGE_BYTES)
    store.put(1, _chain(IDS), _state(1, IDS))
    with store.acquire(np.int64(1), _chain(IDS)) as lease:
        assert _whose(lease) == 1 and lease.user == 1
    store.put(np.int32(1), _chain(IDS), _state(1, IDS))
    assert store.stats()["users"]["device"] == 1
    with store.acquire("1", _chain(IDS)) as lease:  # a string id is another user, as in routing
        assert lease.state is None
    for bad in (True, np.bool_(True), 1.0, np.float64(1), math.nan, None, b"1", 1 << 64):
        for call in (lambda u: store.acquire(u, _chain(IDS)), lambda u: store.put(u, _chain(IDS), _state(1, IDS)),
                     store.drop, store.tier_of):
            with pytest.raises(ArgumentError, match="user id"):
                call(bad)
        with pytest.raises(ArgumentError, match="user id"):
            node_of(bad, 4)
    assert node_of(np.int64(1), 7) == node_of(1, 7) and store.stats()["users"]["device"] == 1
    assert store.stats()["pinned_users"] == 0
    assert store.drop(np.uint8(1)) and store.tier_of(1) is None
    store.check()


def test_a_state_of_another_L_is_never_served(tmp_path):
    torch.manual_seed(0)
    model = ReferenceRanker(dim=16, heads=2, layers=1, encoder="sample").double().eval()
    g = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randint(0, 1 << 20, shape, generator=g)  # noqa: E731
    events = Events(item=rand(11), side=rand(11, 2), action=torch.randint(1, 8, (11,), generator=g),
                    time=torch.cumsum(torch.randint(1, 500, (11,), generator=g), 0))
    cands = Candidates(item=rand(5), side=rand(5, 2))
    chain = chain_of(events, block=P, version="v")
    for folder in (None, tmp_path / "kv"):  # on the device, and as a disk file
        store = (KVStore(page_size=P, device_bytes=1 << 20) if folder is None else
                 KVStore(page_size=P, device_bytes=0, disk_bytes=1 << 20, folder=folder))
        store.put("alice", chain, prefill(model, events, max_seq_len=8, page_size=P))
        with store.acquire("alice", chain, max_seq_len=4) as lease:  # a caller serving with L = 4
            assert lease.state is None
            st = prefill(model, events, max_seq_len=4, page_size=P)
            torch.testing.assert_close(score(model, st, cands), full_scores(model, events, cands, 4), atol=1e-9,
                                       rtol=0)
            store.put("alice", chain, st)
        assert store.stats()["invalidated"] == 1
        with store.acquire("alice", chain, max_seq_len=4) as lease:
            assert lease.length == 11 and lease.state.max_seq_len == 4
            torch.testing.assert_close(score(model, lease.state, cands), full_scores(model, events, cands, 4),
                                       atol=1e-9, rtol=0)
        store.check()
    fixed = KVStore(page_size=P, device_bytes=1 << 20, max_seq_len=8)  # a store of one L
    with pytest.raises(ArgumentError, match="one store serves one L"):
        fixed.put("alice", chain, prefill(model, events, max_seq_len=4, page_size=P))
    with pytest.raises(ArgumentError, match="one store serves one L"):
        fixed.acquire("alice", chain, max_seq_len=4)
    fixed.put("alice", chain, prefill(model, events, max_seq_len=8, page_size=P))
    with fixed.acquire("alice", chain) as lease:
        assert lease.state.max_seq_len == 8
    assert empty_state(model, max_seq_len=8, page_size=P).max_seq_len == 8


# -- arguments -------------------------------------------------------------------------------

BAD = [dict(page_size=2.5), dict(page_size="4"), dict(page_size=True), dict(page_size=0),
       dict(device_bytes=-1), dict(device_bytes=1.5), dict(device_bytes=math.nan), dict(host_bytes=None),
       dict(disk_bytes=10), dict(max_seq_len=0), dict(max_seq_len=2.5), dict(device="tpu"), dict(device=3.5),
       dict(host_bytes=1 << 62), dict(device_bytes=1 << 62), dict(folder=3, disk_bytes=10), dict(poison_freed="yes")]


@pytest.mark.parametrize("kw", BAD, ids=[",".join(f"{k}={v!r}" for k, v in kw.items()) for kw in BAD])
def test_bad_arguments_are_refused(kw):
    args = {"page_size": P, "device_bytes": PAGE_BYTES, "device": "cpu", **kw}
    with pytest.raises(ArgumentError) as exc:
        KVStore(**args)
    assert errors.one_line(exc.value)[0] == 2


def test_cuda_without_a_gpu_is_refused():
    if torch.cuda.is_available():
        KVStore(page_size=P, device_bytes=PAGE_BYTES, device="cuda").check()
        with pytest.raises(ArgumentError, match="CUDA"):
            KVStore(page_size=P, device_bytes=PAGE_BYTES, device=f"cuda:{torch.cuda.device_count()}")
    else:
        with pytest.raises(ArgumentError, match="CUDA"):
            KVStore(page_size=P, device_bytes=PAGE_BYTES, device="cuda")
