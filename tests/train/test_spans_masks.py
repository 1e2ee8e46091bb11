"""Spans, masks and attention: the trainer's reading of the pointer against the loader's own."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from tests.train.helpers import synthetic, with_arrays
from userwise.pipelines.errors import UserwiseError
from userwise.pipelines.jagged import ranges
from userwise.pipelines.loader import expand_batch
from userwise.pipelines.train import (
    Intervals,
    causal_intervals,
    dense_causal_masks,
    dense_target_masks,
    spans,
    target_intervals,
)
from userwise.pipelines.train.attention import block_attention, dense_attention, flex_attention

CUDA = torch.cuda.is_available()


def test_spans_are_what_expand_batch_gives_each_impression(long_batches):
    checked = 0
    for b in long_batches:
        sp = spans(b)
        rows = expand_batch(b)
        hist = rows.column("seq_ts").combine_chunks()
        want = np.asarray(hist.values)
        got = b["seq_ts"][ranges(sp.imp_begin, sp.imp_end - sp.imp_begin)].numpy()
        assert np.array_equal(got, want)
        assert np.array_equal(np.diff(np.asarray(hist.offsets)), (sp.imp_end - sp.imp_begin).numpy())
        # the pointer rule, restated: every visible event is before the request; every event of the
        # sample at or after seq_end is not
        req_time = b["req_time"][sp.imp_req]
        vis_time = torch.repeat_interleave(req_time, sp.imp_end - sp.imp_begin)
        assert bool((torch.from_numpy(got) < vis_time).all())
        after = (torch.arange(sp.num_events)[None, :] >= sp.imp_end[:, None]) & \
                (sp.event_sample[None, :] == sp.imp_sample[:, None])
        assert bool((b["seq_ts"][None, :] >= req_time[:, None])[after].all())
        assert torch.equal(sp.imp_sample, b["req.sample"].long()[b["imp.req"].long()])
        checked += sp.num_impressions
    assert checked > 100
    assert any(bool((spans(b).imp_begin > spans(b).seq_offsets[:-1][spans(b).imp_sample]).any()) for b in long_batches)


def test_a_pointer_outside_its_sample_is_refused(long_batches):
    b = long_batches[0]
    end = b["req_seq_end"].clone()
    end[0] = int(b["seq.offsets"][1] - b["seq.offsets"][0]) + 1
    with pytest.raises(UserwiseError, match="points at events"):
        spans(with_arrays(b, {"req_seq_end": end}))


def test_fat_row_overrides_are_refused_or_emptied(long_batches):
    b = long_batches[0]
    fake = {n: b[n] for n in b.keys()}
    kind = torch.zeros(b.num_requests, dtype=torch.int8)
    kind[0], kind[1] = 1, 2  # an override, a null snapshot
    fake["req_snapshot"] = kind
    with pytest.raises(UserwiseError, match="override"):
        spans(fake)
    sp = spans(fake, overrides="empty")
    for r in (0, 1):
        assert int(sp.req_begin[r]) == int(sp.req_end[r])
    assert torch.equal(sp.req_end[2:], spans(b).req_end[2:])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dense_masks_are_the_intervals_sample_by_sample(seed):
    sp = synthetic(seed, samples=5).spans
    for window in (None, 3):
        full = causal_intervals(sp, window).dense()
        per = dense_causal_masks(sp, window)
        tgt_full, tgt = target_intervals(sp).dense(), dense_target_masks(sp)
        for s in range(sp.num_samples):
            a, z = int(sp.seq_offsets[s]), int(sp.seq_offsets[s + 1])
            i, j = int(sp.imp_offsets[s]), int(sp.imp_offsets[s + 1])
            assert torch.equal(per[s, : z - a, : z - a], full[a:z, a:z])
            assert not per[s, z - a:].any() and not per[s, :, z - a:].any()
            assert torch.equal(tgt[s, : j - i, : z - a], tgt_full[i:j, a:z])
            assert not tgt_full[i:j, :a].any() and not tgt_full[i:j, z:].any()  # nothing of other samples
        # causal: an event sees itself and earlier events of its own sample only
        k = torch.arange(sp.num_events)
        same = sp.event_sample[:, None] == sp.event_sample[None, :]
        want = same & (k[None, :] <= k[:, None])
        if window:
            want &= k[:, None] - k[None, :] < window
        assert torch.equal(full, want)


def test_block_mask_holds_every_visible_pair_and_full_blocks_are_full(long_batches):
    b = long_batches[0]
    sp = spans(b)
    for iv in (target_intervals(sp), causal_intervals(sp, 5)):
        blk = 16
        bm = iv.block_mask(blk)
        dense = iv.dense()
        qb, kb = torch.arange(iv.num_queries) // blk, torch.arange(iv.num_keys) // blk
        listed = bm.to_dense()[0, 0].bool()
        assert bool((dense <= listed[qb][:, kb]).all())  # no visible pair outside the listed blocks
        full = torch.zeros_like(listed)
        n_full, idx = bm.full_kv_num_blocks[0, 0], bm.full_kv_indices[0, 0]
        for q in range(n_full.numel()):  # per query block (a handful), not per row
            full[q, idx[q, : int(n_full[q])].long()] = True
        assert bool(dense[full[qb][:, kb]].all())  # full blocks: every pair visible, mask_mod skipped
        ref = create_block_mask(iv.mask_mod(), 1, None, iv.num_queries, iv.num_keys, device="cpu", BLOCK_SIZE=blk)
        assert torch.equal(ref.to_dense()[0, 0].bool() & ~listed, torch.zeros_like(listed))
        q, k = torch.meshgrid(torch.arange(iv.num_queries), torch.arange(iv.num_keys), indexing="ij")
        assert torch.equal(iv.mask_mod()(0, 0, q, k), dense)


def _qkv(nq, nk, seed, dtype=torch.float64, grad=False):
    g = torch.Generator().manual_seed(seed)
    t = [torch.randn(n, 2, 8, generator=g, dtype=dtype).requires_grad_(grad) for n in (nq, nk, nk)]
    return t


@pytest.mark.parametrize("block", [8, 64])
def test_block_attention_equals_the_dense_reference_forward_and_backward(long_batches, block):
    sp = spans(long_batches[1])
    for iv in (target_intervals(sp), causal_intervals(sp), causal_intervals(sp, 3)):
        q, k, v = _qkv(iv.num_queries, iv.num_keys, 7, grad=True)
        a, d = block_attention(q, k, v, iv, block=block), dense_attention(q, k, v, iv)
        assert (a - d).abs().max() < 1e-12
        ga, gd = torch.autograd.grad(a.square().sum(), (q, k, v)), torch.autograd.grad(d.square().sum(), (q, k, v))
        for x, y in zip(ga, gd):
            assert (x - y).abs().max() < 1e-11
        empty = iv.hi <= iv.lo
        if bool(empty.any()):
            assert torch.equal(a[empty], torch.zeros_like(a[empty]))  # a row that sees nothing gives 0


def test_flex_attention_forward_equals_the_dense_reference_on_cpu(long_batches):
    sp = spans(long_batches[0])
    iv = target_intervals(sp)
    q, k, v = _qkv(iv.num_queries, iv.num_keys, 3)
    out = flex_attention(q, k, v, iv, block=32, compiled=False)
    assert (out - dense_attention(q, k, v, iv)).abs().max() < 1e-12
    q.requires_grad_(True)
    with pytest.raises(UserwiseError, match="attention='blocks'"):
        flex_attention(q, k, v, iv)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device (benchmarks/device_check.sh)")
def test_on_cuda_spans_match_the_host_and_compiled_flex_trains_like_blocks(long_batches):
    b = long_batches[0]
    host, dev = spans(b), spans(b.to("cuda"))
    for f in host.__dataclass_fields__:
        assert torch.equal(getattr(host, f), getattr(dev, f).cpu()), f
    iv = Intervals(dev.imp_begin, dev.imp_end, dev.num_events)
    q, k, v = [t.float().cuda().requires_grad_(True) for t in _qkv(iv.num_queries, iv.num_keys, 5)]
    # the compiled kernel wants head dims of 16 or more
    q, k, v = [torch.cat([t, t], -1) for t in (q, k, v)]
    a = flex_attention(q, k, v, iv, block=128)
    r = block_attention(q, k, v, iv, block=64)
    assert (a - r).abs().max() < 1e-4
    ga, gr = torch.autograd.grad(a.sum(), (q, k, v)), torch.autograd.grad(r.sum(), (q, k, v))
    for x, y in zip(ga, gr):
        assert (x - y).abs().max() < 1e-3


def test_trainer_never_imports_pyspark(demo_set):
    code = (
        "import sys, torch\n"
        "from userwise.pipelines.loader import UserwiseDataset, UserwiseLoader\n"
        "import userwise.pipelines.train as T\n"
        f"ds = UserwiseDataset({demo_set!r}, batch_size=16, world_size=1, rank=0)\n"
        "b = next(iter(UserwiseLoader(ds)))\n"
        "ub = T.UserBatch.from_jagged(T.stochastic_length(b, max_len=50, alpha=1.5))\n"
        "T.ReferenceRanker()(ub).sum().backward()\n"
        "T.audit(T.hstu_varlen_layout(ub.spans), ub.spans)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('pyspark', 'py4j', 'delta'))\n"
        "print('BAD', bad)\n"
        "sys.exit(1 if bad else 0)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout + r.stderr
