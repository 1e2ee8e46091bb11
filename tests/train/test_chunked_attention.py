"""block_attention a bounded chunk of tiles at a time (#56 point 3: nothing but expand holds
requests x L): the same outputs and gradients as the dense reference and as all the tiles at
once, whatever the chunk (one tile, a query block's tiles split across chunks), the model's
leakage properties through the chunked path, and peak memory that stays flat as impressions
grow 10x at a fixed L."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import userwise.pipelines.train.attention as attention
from tests.train.helpers import synthetic
from tests.train.test_model import (
    test_no_leakage_bitwise_in_float64 as _leak_bitwise,
)
from tests.train.test_model import (
    test_no_leakage_the_gradient_of_a_target_is_exactly_zero_on_what_it_cannot_see as _leak_grad,
)
from userwise.pipelines.errors import ArgumentError
from userwise.pipelines.train import UserBatch, causal_intervals, spans, target_intervals
from userwise.pipelines.train.attention import attend, block_attention, dense_attention

H, D = 2, 8
ONE_CHUNK = 1 << 40


def _qkv(nq, nk, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, H, D, generator=g, dtype=dtype).requires_grad_(True) for n in (nq, nk, nk)]


def _run(q, k, v, iv, **kw):
    out = block_attention(q, k, v, iv, **kw)
    return out, torch.autograd.grad((out * torch.linspace(-1, 2, out.numel(), dtype=out.dtype).view_as(out)).sum()
                                    + out.square().sum(), (q, k, v))


def _intervals(long_batches):
    sp = spans(long_batches[1])
    syn = synthetic(3, samples=30, max_len=25).spans
    return [target_intervals(sp), causal_intervals(sp), causal_intervals(sp, 3), target_intervals(syn),
            causal_intervals(syn, 7)]


@pytest.mark.parametrize("block", [8, 16])
def test_chunked_tiles_equal_the_dense_reference_and_all_tiles_at_once(long_batches, block):
    tile = H * block * block
    split = 0
    for iv in _intervals(long_batches):
        first, stop, _, _ = iv.block_hull(block, block)
        n = (stop - first).clamp(min=0)
        for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-6)):
            q, k, v = _qkv(iv.num_queries, iv.num_keys, 5, dtype)
            d = dense_attention(q, k, v, iv)
            gd = torch.autograd.grad((d * torch.linspace(-1, 2, d.numel(), dtype=dtype).view_as(d)).sum()
                                     + d.square().sum(), (q, k, v))
            whole, g_whole = _run(q, k, v, iv, block=block, chunk_elems=ONE_CHUNK)
            # one tile per chunk; 3 tiles (query blocks' tiles split across chunks); 1 tile and a bit
            for chunk in (1, 3 * tile, tile + 5, None):
                per = max(1, (chunk or attention.CHUNK_ELEMS) // tile)
                start = torch.cumsum(n, 0) - n  # a query block's tiles are pairs [start, start + n)
                if bool(((n > 0) & (start // per != (start + n - 1) // per)).any()):
                    split += 1  # some query block's tiles fall in two chunks: its rows' sums cross chunks
                out, g = _run(q, k, v, iv, block=block, chunk_elems=chunk)
                for got, want in [(out, whole)] + list(zip(g, g_whole)):  # against all the tiles at once
                    assert ((got - want).abs().max() / want.abs().max().clamp(min=1)) < tol, (dtype, chunk)
                if dtype == torch.float64:  # against the dense reference, to the reference's own test's bounds
                    assert (out - d).abs().max() < 1e-12
                    for x, y in zip(g, gd):
                        assert (x - y).abs().max() < 1e-11
                empty = iv.hi <= iv.lo
                assert torch.equal(out[empty], torch.zeros_like(out[empty]))  # a row that sees nothing gives 0
    assert split >= 4


def test_without_gradients_the_chunks_give_the_same_output(long_batches):
    iv = target_intervals(spans(long_batches[0]))
    q, k, v = (x.detach() for x in _qkv(iv.num_queries, iv.num_keys, 1, torch.float64))
    with torch.no_grad():
        a = block_attention(q, k, v, iv, block=8, chunk_elems=1)
        b = block_attention(q, k, v, iv, block=8, chunk_elems=ONE_CHUNK)
    assert (a - b).abs().max() < 1e-12 and not a.requires_grad


def test_attend_passes_the_chunk_to_blocks_and_the_others_ignore_it(long_batches):
    iv = causal_intervals(spans(long_batches[0]), 3)
    q, k, v = (x.detach() for x in _qkv(iv.num_queries, iv.num_keys, 2, torch.float64))
    ref = dense_attention(q, k, v, iv)
    for impl in ("blocks", "dense"):
        assert (attend(q, k, v, iv, impl, block=8, chunk_elems=1) - ref).abs().max() < 1e-12
    with pytest.raises(ArgumentError, match="chunk_elems=0"):
        block_attention(q, k, v, iv, chunk_elems=0)


@pytest.fixture
def one_tile_chunks(monkeypatch):
    """The model's attention one tile per chunk (its default chunk holds these batches whole)."""
    monkeypatch.setattr(attention, "CHUNK_ELEMS", 1)


def test_the_model_through_one_tile_chunks_equals_it_through_one_chunk(long_batches, monkeypatch):
    from tests.train.test_model import _model

    for encoder in ("sample", "window", "none"):
        model = _model(encoder, window=3) if encoder == "window" else _model(encoder)
        for ub in [UserBatch.from_jagged(b) for b in long_batches[:2]] + [synthetic(4, samples=8, max_len=6)]:
            grads = []
            for chunk in (ONE_CHUNK, 1):
                monkeypatch.setattr(attention, "CHUNK_ELEMS", chunk)
                model.zero_grad()
                out = model(ub)
                model.loss(out, ub.labels).backward()
                grads.append((out.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
            (a, ga), (b, gb) = grads
            assert (a - b).abs().max() < 1e-12, encoder
            assert len(ga) == len(gb) > 0
            for x, y in zip(ga, gb):
                assert (x - y).abs().max() < 1e-11, encoder


@pytest.mark.parametrize("encoder", ["sample", "window", "request", "none"])
def test_no_leakage_bitwise_through_one_tile_chunks(long_batches, encoder, one_tile_chunks):
    _leak_bitwise(long_batches, encoder)


def test_no_leakage_in_the_gradient_through_one_tile_chunks(long_batches, one_tile_chunks):
    _leak_grad(long_batches)


_PROBE = r"""
import json, sys, torch
torch.set_num_threads(1)
from userwise.pipelines.train import Intervals
from userwise.pipelines.train.attention import block_attention
from tests.support.memory import peak_mb
chunk = json.loads(sys.argv[1])
L = 4096

def case(impressions):  # requests of 8 impressions, each seeing the L events before it in one sample
    req = impressions // 8
    end = L + 4 * torch.arange(req)
    iv = Intervals(torch.repeat_interleave(end - L, 8), torch.repeat_interleave(end, 8), L + 4 * req)
    g = torch.Generator().manual_seed(0)
    return [torch.randn(n, 2, 8, generator=g).requires_grad_(True) for n in (impressions, iv.num_keys, iv.num_keys)] + [iv]

def run(q, k, v, iv):
    block_attention(q, k, v, iv, block=64, chunk_elems=chunk).square().sum().backward()

small, big = case(256), case(2560)
run(*small); run(*small)  # warm: every code path once at 1x
before = peak_mb()
run(*big)
print(json.dumps(peak_mb() - before))
"""


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _peak_growth_mb(chunk) -> float:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(chunk)], capture_output=True, text=True, env=env,
                       timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_peak_memory_stays_flat_as_impressions_grow_tenfold_at_a_fixed_length():
    """At L = 4096, 256 -> 2560 impressions: all the tiles at once hold ~21M scores several times
    over (hundreds of MB more at 10x); the default chunk holds 1M at most, so the peak (VmHWM in a
    fresh process, after the same calls at 1x) grows by little more than q, k, v and their gradients."""
    bounded, whole = _peak_growth_mb(None), _peak_growth_mb(ONE_CHUNK)
    assert whole > 150, whole  # the measurement sees the tiles when they are all held
    assert bounded < 40, (bounded, whole)
