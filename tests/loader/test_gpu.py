"""The loader's CUDA paths: pinned pool, side-stream prefetch, record_stream, GDS reads.

These need a CUDA device; on a CPU-only machine (CI) they are skipped and the
same code's CPU behaviour is tested in test_loader.py / test_gds.py (unpinned
host batches, the GDS fallback, the device assembler run on CPU tensors). On
a GPU machine: ``python -m pytest tests/loader/test_gpu.py`` (benchmarks/device_check.sh
runs it with the GPU benchmarks; results in benchmarks/README.md).

Every check compares the device batches byte for byte with the CPU loader's
batches of the same seed, while the consumer keeps the default stream busy,
so a copy that raced its pinned buffer's reuse, or a device buffer freed to
the allocator too early, shows up as different bytes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from userwise.pipelines.loader import UserwiseDataset, UserwiseLoader, expand_batch
from userwise.pipelines.tools.shardgen import write_shard_set

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (GPU machines only)")


@pytest.fixture(scope="module")
def gpuset(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("gpu"))
    write_shard_set(root, nodes=1, ranks_per_node=1, row_group_rows=32, gds=True,
                    sets=(("pretrain", "2025-12-01", "2026-01-04", 300), ("incremental", "2026-01-04", "2026-01-05", 500)))
    return root


KW = dict(world_size=1, rank=0, batch_size=24, seed=5, verify="none")


def host_reference(root, **kw):
    ds = UserwiseDataset(root, device="cpu", gds=False, **{**KW, **kw})
    return [(b.spec, bytes(b.buffer.numpy())) for b in UserwiseLoader(ds, device="cpu")]


def busy(a):
    """Consumer work on the default stream between batches (the copies run beside it)."""
    for _ in range(3):
        a = (a @ a).clamp_(-1, 1)
    return a


@pytest.mark.parametrize("workers,prefetch", [(0, 1), (0, 4), (1, 2), (2, 1), (2, 4)])
def test_cuda_batches_equal_host_batches(gpuset, workers, prefetch):
    ref = host_reference(gpuset)
    ds = UserwiseDataset(gpuset, device="cuda", gds=False, **KW)
    ld = UserwiseLoader(ds, num_workers=workers, device="cuda", prefetch=prefetch)
    assert ld.pin and ds.data_path == "parquet"
    a = torch.randn(512, 512, device="cuda")
    kept, most_lent = [], 0
    for b in ld:
        assert b.device.type == "cuda"
        a = busy(a)
        kept.append(b)  # held to the end: the allocator must not hand these buffers out again
        if workers:
            most_lent = max(most_lent, sum(ld._workers.lent))
    torch.cuda.synchronize()
    pool = ld._pool  # reused pinned buffers, not one per batch
    assert pool.count < len(kept) and all(t.is_pinned() for t in pool.free + [b for b, _ in pool.busy])
    if workers:  # the workers' slots are page-locked: batches go to the device from there, no copy
        assert ld._workers.registered and most_lent >= 1
    else:
        assert pool.count > 0
    assert [(b.spec, bytes(b.buffer.cpu().numpy())) for b in kept] == ref
    ld.close()


def test_batches_dropped_right_away_stay_correct(gpuset):
    """A consumer that keeps nothing: freed device buffers are reused by the allocator
    only after the consumer stream's work on them (record_stream)."""
    ref = host_reference(gpuset)
    ld = UserwiseLoader(UserwiseDataset(gpuset, device="cuda", gds=False, **KW), num_workers=0, device="cuda",
                        prefetch=3)
    a = torch.randn(512, 512, device="cuda")
    sums = []
    for b in ld:
        a = busy(a)
        sums.append(b.buffer.to(torch.int64).sum())  # on the consumer stream, after the wait
        del b
    want = [sum(r[1]) for r in ref]
    assert [int(s) for s in sums] == want


def test_resume_on_cuda_with_other_worker_count(gpuset):
    ref = host_reference(gpuset)
    ld = UserwiseLoader(UserwiseDataset(gpuset, device="cuda", gds=False, **KW), num_workers=2, device="cuda")
    it = iter(ld)
    first = [bytes(next(it).buffer.cpu().numpy()) for _ in range(5)]
    state = ld.state_dict()
    it.close()
    ld2 = UserwiseLoader(UserwiseDataset(gpuset, device="cuda", gds=False, **KW), num_workers=0, device="cuda")
    ld2.load_state_dict(state)
    rest = [bytes(b.buffer.cpu().numpy()) for b in ld2]
    assert first + rest == [r[1] for r in ref]


def test_batch_pin_copy_and_record_stream(gpuset):
    b = next(iter(UserwiseLoader(UserwiseDataset(gpuset, device="cpu", gds=False, **KW), device="cpu")))
    assert not b.is_pinned()
    p = b.pin_memory()
    assert p.is_pinned() and p.pin_memory() is p
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        d = p.to("cuda", non_blocking=True)
    torch.cuda.current_stream().wait_stream(side)
    assert d.record_stream(torch.cuda.current_stream()) is d
    assert torch.equal(d["seq_item"].cpu(), b["seq_item"]) and torch.equal(d["imp.req"].cpu(), b["imp.req"])
    assert expand_batch(d).equals(expand_batch(b))


def test_gds_reads_into_device_memory_and_equals_parquet(gpuset):
    pytest.importorskip("kvikio")
    ref = host_reference(gpuset)
    ds = UserwiseDataset(gpuset, device="cuda", gds="device", **KW)  # kvikio even without a GDS driver
    assert ds.data_path == "gds"
    got = [b for b in UserwiseLoader(ds, device="cuda")]
    assert all(b.device.type == "cuda" for b in got)
    assert [(b.spec, bytes(b.buffer.cpu().numpy())) for b in got] == ref


def test_diagnose_on_cuda_names_a_bottleneck(gpuset):
    from userwise.pipelines.loader import diagnose

    r = diagnose.run(gpuset, device="cuda", batch_size=16, batches=10)
    assert r["device"].startswith("cuda") and r["bottleneck"]
    assert min(r["device_samples_per_s"], r["host_copy_samples_per_s"], r["shards_samples_per_s"]) > 0


def test_stats_on_cuda_count_every_sample(gpuset):
    ld = UserwiseLoader(UserwiseDataset(gpuset, device="cuda", gds=False, **KW), num_workers=1, device="cuda")
    for _ in ld:
        pass
    s = ld.stats.summary()
    ref = UserwiseLoader(UserwiseDataset(gpuset, device="cpu", gds=False, **KW), device="cpu")
    n = sum(b.num_samples for b in ref)
    assert s["samples"] == n == 800 and s["bytes_per_s"] > 0 and 0 <= s["wait_share"] <= 1
    assert np.isfinite(s["events_per_s"])
