"""The loader on a shared host: every size it takes is bounded by the host or the data, and a
shard's footer is trusted only as far as the manifest (docs/security.md).

- ``num_workers`` is at most the host's CPU count (``10**6`` forked until the OOM killer came);
- ``worker_queue`` is at most what a worker's free pipe holds (``8200`` hung at start-up: the
  trainer wrote every slot number into a pipe the worker did not read yet);
- ``pin_memory``, ``device``, ``zero_copy`` and ``multiprocessing_context`` are checked as
  arguments;
- a row group's row count edited in the footer (one byte: 17 to 16, or to -18) is a ShardError
  naming the file under every ``verify`` mode, never fewer samples or no batches, and
  ``userwise diagnose`` says so in one line with exit 2;
- a manifest's ``nodes``, ``ranks_per_node`` and ``rows`` are bounded by the shards it lists.

Each case here is one the report reproduced. No Spark here.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from tests.reliability.test_hostile_input import cli, edit, one_error
from tests.support import parquet_thrift
from tests.support.shard_sets import one_node_set
from userwise.pipelines.errors import ArgumentError, ShardError
from userwise.pipelines.loader import UserwiseDataset, UserwiseLoader
from userwise.pipelines.loader import loader as loader_mod
from userwise.pipelines.shards import manifest as mf

KW = dict(batch_size=8, seed=1, device="cpu", buffer_row_groups=2)


@pytest.fixture
def shards(tmp_path):
    """``tmp/S``: a one-node, one-rank shard set whose shards have several row groups of 16 rows."""
    return one_node_set(str(tmp_path / "S"), seed=4, users=24, bot_chunks=4, windows=2)


def batches(root, verify, workers=0):
    ld = UserwiseLoader(UserwiseDataset(root, verify=verify, **KW), num_workers=workers, timeout=60)
    try:
        return [bytes(b.buffer.numpy()) for b in ld]
    finally:
        ld.close()


# -- 1. workers and their queues -------------------------------------------------------------------


@pytest.mark.parametrize("n", [(os.cpu_count() or 1) + 1, 10**6])
def test_more_workers_than_cpus_are_refused_before_any_fork(shards, monkeypatch, n):
    """``num_workers=10**6`` was accepted and forked workers until the OOM killer killed the
    trainer. Refused when the loader is made, naming the bound; nothing is started (a pool
    that would start fails the test)."""
    def no_pool(*a, **k):
        raise AssertionError("a worker pool was started")

    monkeypatch.setattr(loader_mod, "WorkerPool", no_pool)
    ds = UserwiseDataset(shards, **KW)
    with pytest.raises(ArgumentError, match=rf"num_workers must be at most this host's {os.cpu_count()} CPUs"):
        ld = UserwiseLoader(ds, num_workers=n)
        next(iter(ld))  # the old code: accepted; the pool stand-in fails the test here
    UserwiseLoader(ds, num_workers=os.cpu_count() or 1)  # the bound itself is fine


_QUEUE = textwrap.dedent("""
    import sys
    import torch
    torch.set_num_threads(1)
    from userwise.pipelines.errors import ArgumentError
    from userwise.pipelines.loader import UserwiseDataset, UserwiseLoader
    root, queue, zero_copy = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
    ds = UserwiseDataset(root, batch_size=8, seed=1, device="cpu", verify="none")
    try:
        ld = UserwiseLoader(ds, num_workers=1, worker_queue=queue, zero_copy=zero_copy, timeout=60)
    except ArgumentError as e:
        print("refused:", e)
        sys.exit(0)
    n = sum(1 for _ in ld)
    ld.close()
    print("batches", n)
""")


def _queue_run(root, queue, zero_copy=True, timeout=90):
    """A loader with one worker and ``worker_queue=queue`` in its own process group, through one
    epoch; a hang fails the test (the group is killed: the old code's hang outlived `timeout`)."""
    p = subprocess.Popen([sys.executable, "-c", _QUEUE, root, str(queue), "1" if zero_copy else "0"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        pytest.fail(f"worker_queue={queue} hung for {timeout}s")
    assert p.returncode == 0, err[-2000:]
    return out.strip()


def test_a_worker_queue_the_pipe_cannot_hold_is_refused_not_a_hang(shards):
    """``worker_queue >= ~8200`` hung forever at start-up: the trainer wrote 8 bytes per slot
    number into the worker's 64 KiB free pipe before the worker read any. Refused now, naming
    the bound; the bound is what a pipe holds without blocking (PIPE_BUF bytes)."""
    out = _queue_run(shards, 8200)
    assert out.startswith("refused:") and f"worker_queue must be at most {loader_mod.MAX_WORKER_QUEUE}" in out, out
    assert 1 <= loader_mod.MAX_WORKER_QUEUE and (loader_mod.MAX_WORKER_QUEUE + 2) * 8 <= 4096


@pytest.mark.parametrize("zero_copy", [True, False])
def test_the_largest_worker_queue_runs_an_epoch(shards, zero_copy):
    """At the bound every slot number fits in the pipe at once: the epoch ends, with every batch."""
    want = len(batches(shards, "none"))
    assert _queue_run(shards, loader_mod.MAX_WORKER_QUEUE, zero_copy) == f"batches {want}"


# -- 2. ill-typed loader arguments -----------------------------------------------------------------


@pytest.mark.parametrize("kw,needle", [
    (dict(pin_memory="yes"), "pin_memory must be true or false"),
    (dict(pin_memory=1), "pin_memory must be true or false"),
    (dict(device="tpu"), "device 'tpu' is not a device"),
    (dict(device="meta"), "batches go to cpu or cuda devices only"),
    (dict(device=3), "device must be a device string"),
    (dict(device="cuda:99"), "CUDA device"),
    (dict(zero_copy="no"), "zero_copy must be true or false"),
    (dict(multiprocessing_context="threads"), "multiprocessing_context must be one of"),
])
def test_an_ill_typed_loader_argument_is_refused(shards, kw, needle):
    ds = UserwiseDataset(shards, **KW)
    with pytest.raises(ArgumentError, match=needle.replace("(", r"\(")):
        UserwiseLoader(ds, **kw)


@pytest.mark.parametrize("device,needle", [("tpu", "device 'tpu' is not a device"), (1.5, "device must be")])
def test_an_ill_typed_dataset_device_is_refused_before_a_file_is_read(tmp_path, device, needle):
    with pytest.raises(ArgumentError, match=needle):
        UserwiseDataset(str(tmp_path / "nothing-here"), device=device)


# -- 3. row counts in the footer -------------------------------------------------------------------


def row_count_bytes(path):
    """Where each row group's ``num_rows`` sits in ``path``'s footer, with its value."""
    return parquet_thrift.row_count_bytes(open(path, "rb").read())


def _rewrite(root, path, counts):
    """Set row groups' ``num_rows`` (``{index: rows}``) in ``path``'s footer, each in as many
    bytes as it had, and the manifest's size and sha256 to the edited file's, as someone who
    can write the set would: only the row groups' counts disagree with the data."""
    data = bytearray(open(path, "rb").read())
    where = row_count_bytes(path)
    for g, rows in counts.items():
        a, z, _ = where[g]
        new = parquet_thrift.zigzag_bytes(rows)
        assert len(new) == z - a, (rows, z - a)
        data[a:z] = new
    with open(path, "wb") as f:
        f.write(data)
    rel = os.path.relpath(path, root)
    sha = mf.file_sha256(path)
    edit(root, lambda m: [s.update(sha256=sha, bytes=len(data)) for s in m["shards"] if s["path"] == rel])


def _victim(root):
    """The shard with the most row groups, and its row groups' (position, end, rows)."""
    m = mf.load(root)
    path = max((os.path.join(root, s["path"]) for s in m["shards"]), key=lambda p: len(row_count_bytes(p)))
    return path, row_count_bytes(path)


@pytest.mark.parametrize("verify", ["checksum", "size", "none"])
@pytest.mark.parametrize("change", ["one less", "negative", "moved"])
def test_an_edited_row_group_count_is_a_shard_error_in_every_verify_mode(shards, verify, change):
    """A row group's ``num_rows`` changed in the footer (17 to 16 gave 16 samples and no error
    under ``verify="size"`` and ``"none"``, -18 no batches at all; the file's total still
    matched). With the manifest's sha256 updated too, ``"checksum"`` read the same. Now every
    mode refuses the file by name: a negative count, counts that do not add up to the manifest's
    rows, and a count moved from one row group to another (the sum still right) that its column
    chunks contradict."""
    assert batches(shards, verify)  # the undamaged set reads
    path, rgs = _victim(shards)
    assert len(rgs) >= 2 and rgs[0][2] >= 2
    n0, n1 = rgs[0][2], rgs[1][2]
    counts = {"one less": {0: n0 - 1}, "negative": {0: -(n0 + 1)}, "moved": {0: n0 - 1, 1: n1 + 1}}[change]
    _rewrite(shards, path, counts)
    assert [r for _, _, r in row_count_bytes(path)][:2] == [counts.get(0, n0), counts.get(1, n1)]
    with pytest.raises(ShardError) as e:
        batches(shards, verify)  # the old code: fewer samples (or no batch), no error
    assert path in str(e.value) and "row group" in str(e.value), e.value


def test_an_edited_row_group_count_read_by_a_worker_is_refused_too(shards):
    path, rgs = _victim(shards)
    _rewrite(shards, path, {0: rgs[0][2] - 1})
    with pytest.raises(ShardError, match=path):
        batches(shards, "size", workers=1)


@pytest.mark.parametrize("change", ["one less", "negative"])
def test_diagnose_on_an_edited_row_group_count_is_one_error_line(shards, change):
    """``userwise diagnose`` on such a file exited 1 (StopIteration); now exit 2 naming it."""
    path, rgs = _victim(shards)
    n0 = rgs[0][2]
    _rewrite(shards, path, {0: n0 - 1 if change == "one less" else -(n0 + 1)})
    r = cli("diagnose", "--staged", shards, "--device", "cpu", "--batch-size", "8", "--batches", "5")
    one_error(r, path, "row group")


# -- 4. the manifest's shape and rows --------------------------------------------------------------


@pytest.mark.parametrize("change,needle", [
    (lambda m: m.__setitem__("nodes", 10**8), "'nodes' x 'ranks_per_node' = 100000000 x 1"),
    (lambda m: m.__setitem__("ranks_per_node", 10**8), "'nodes' x 'ranks_per_node' = 1 x 100000000"),
    (lambda m: m.__setitem__("nodes", 2**70), "'nodes' x 'ranks_per_node'"),
    (lambda m: m["shards"][0].__setitem__("rank", 5), "rank 5 is outside the set's 1 ranks per node"),
])
def test_a_manifest_shape_beyond_its_shards_is_exit_2_before_anything_is_made(shards, tmp_path, change, needle):
    """A manifest with ``nodes: 10**8`` gave a MemoryError (exit 1). The nodes and ranks a
    manifest declares are bounded by the shards it lists (preshard lists a shard of every set
    for every rank): stage refuses it with exit 2 and makes nothing; the loader refuses it."""
    edit(shards, change)
    dest = tmp_path / "d"
    one_error(cli("stage", "--shards", shards, "--node", "0", "--staged", str(dest)), "manifest.json", needle)
    assert not dest.exists()
    with pytest.raises(ShardError, match=needle.replace("(", r"\(")):
        UserwiseDataset(shards, node=0, device="cpu", verify="none")


def _rows(m, shard_rows):
    """Shard 0's rows set to ``shard_rows`` and its set's rows kept equal to its shards' sum."""
    old = m["shards"][0]["rows"]
    m["shards"][0]["rows"] = shard_rows
    st = next(s for s in m["sets"] if s["id"] == m["shards"][0]["set"])
    st["rows"] += shard_rows - old


@pytest.mark.parametrize("change,needle", [
    (lambda m: _rows(m, 2**41), "more than a shard can hold"),
    (lambda m: _rows(m, 10**30), "more than a shard can hold"),
    (lambda m: m["sets"][0].__setitem__("rows", 10**15), "but its shards hold"),
])
def test_manifest_rows_beyond_sane_limits_are_exit_2(shards, tmp_path, change, needle):
    edit(shards, change)
    one_error(cli("stage", "--shards", shards, "--node", "0", "--staged", str(tmp_path / "d")), needle)
    with pytest.raises(ShardError, match=needle):
        UserwiseDataset(shards, node=0, device="cpu", verify="none")
