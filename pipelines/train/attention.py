"""Softmax attention under an :class:`~userwise.pipelines.train.masks.Intervals` mask.

Three implementations of one function, ``out[i] = softmax(q[i] k[lo_i:hi_i]^T * scale) v[lo_i:hi_i]``
(a row that sees nothing gives 0):

- :func:`block_attention`: pure torch, block-sparse. Queries and keys are cut into
  blocks; only the (query block, key block) pairs inside a query block's hull are
  computed, the rows' intervals mask the rest, a bounded chunk of pairs at a time
  (``chunk_elems``), so its memory does not grow with queries x keys (impressions x L
  for target attention). It runs forward and backward on any
  device, and a masked key's value never enters a visible row's sum (its score is
  replaced by -inf and its weight is exactly 0), so outputs are bitwise independent of
  what a row cannot see. The default for training here (CPU).
- :func:`flex_attention`: ``torch.nn.attention.flex_attention`` with the intervals'
  ``BlockMask`` (:meth:`Intervals.block_mask`): the fused kernel on CUDA (compiled).
  Torch 2.13 has no FlexAttention backward on CPU; there it runs forward only, unfused.
- :func:`dense_attention`: the [H, Nq, Nk] reference (tests, small batches).

Shapes: ``q`` [Nq, H, D], ``k`` [Nk, H, D], ``v`` [Nk, H, Dv] -> [Nq, H, Dv].
"""

from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

from userwise.pipelines.errors import ArgumentError, UserwiseError
from userwise.pipelines.jagged import ranges
from userwise.pipelines.train.masks import Intervals

__all__ = ["block_attention", "dense_attention", "flex_attention", "attend", "IMPLEMENTATIONS"]

IMPLEMENTATIONS = ("blocks", "flex", "dense")


def dense_attention(q, k, v, iv: Intervals, scale: float | None = None) -> torch.Tensor:
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    m = iv.dense()[None]
    s = s.masked_fill(~m, float("-inf"))
    mx = s.amax(-1, keepdim=True).detach()
    mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
    p = torch.exp(s - mx)
    den = p.sum(-1, keepdim=True)
    out = torch.einsum("hqk,khd->qhd", p / torch.where(den > 0, den, torch.ones_like(den)), v)
    return out


def _pad_rows(x: torch.Tensor, n: int) -> torch.Tensor:
    return x if x.shape[0] == n else torch.nn.functional.pad(x, (0, 0, 0, 0, 0, n - x.shape[0]))


#: The default bound of :func:`block_attention`'s working set: at most this many scores
#: (pairs x heads x block x block) exist at a time, 4 MiB in float32. Measured on CPU, chunks
#: of 2^16 to 2^20 scores run as fast as all the tiles at once or faster (they stay in cache).
CHUNK_ELEMS = 1 << 20


def _scores(qv, kv, lo, hi, pq, pk, block: int, scale: float) -> torch.Tensor:
    """The masked scores of the listed (query block, key block) pairs: [P, H, Bq, Bk], -inf where
    the row does not see the key."""
    s = torch.matmul(qv[pq], kv[pk].transpose(-1, -2)) * scale                      # [P, H, Bq, Bk]
    key = pk[:, None] * block + torch.arange(block, device=pk.device)[None, :]       # [P, Bk]
    lo, hi = lo[pq], hi[pq]                                                          # [P, Bq]
    vis = (key[:, None, :] >= lo[:, :, None]) & (key[:, None, :] < hi[:, :, None])  # [P, Bq, Bk]
    return s.masked_fill(~vis[:, None], float("-inf"))


class _BlockAttention(torch.autograd.Function):
    """The listed tiles' softmax, ``per`` pairs at a time. Forward: a first pass takes each
    row's largest visible score, a second sums ``exp(s - max)`` and ``exp(s - max) v``; the
    tiles are then dropped (but for a single chunk, whose weights are kept). Backward: each
    chunk's tiles are recomputed from q, k and the saved maxima and sums (as FlashAttention
    does), so no pass holds more than one chunk of scores.
    Inputs and output are blocked: ``qv`` [QB, H, Bq, D], ``kv`` [KB, H, Bk, D], ``vv`` [KB, H,
    Bk, Dv], ``lo``/``hi`` [QB, Bq]; output [QB, H, Bq, Dv]."""

    @staticmethod
    def forward(ctx, qv, kv, vv, lo, hi, pair_q, pair_k, block: int, scale: float, per: int):
        cuts = [(pair_q[a:a + per], pair_k[a:a + per]) for a in range(0, pair_q.numel(), per)]
        QB, H, Bq, _ = qv.shape
        dtype = torch.result_type(qv, kv)
        mx = torch.full((QB, H, Bq), float("-inf"), dtype=dtype, device=qv.device)
        s = None
        for pq, pk in cuts:  # pass 1: the rows' maxima (a constant of the softmax)
            s = _scores(qv, kv, lo, hi, pq, pk, block, scale)
            row_max = s.amax(-1)  # [P, H, Bq]
            mx = mx.scatter_reduce(0, pq[:, None, None].expand_as(row_max), row_max, "amax")
        mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
        den = torch.zeros(QB, H, Bq, dtype=dtype, device=qv.device)
        num = torch.zeros(QB, H, Bq, vv.shape[-1], dtype=dtype, device=qv.device)
        for pq, pk in cuts:  # pass 2: the sums (one chunk: its scores are still here)
            s = s if len(cuts) == 1 else _scores(qv, kv, lo, hi, pq, pk, block, scale)
            p = torch.exp(s - mx[pq][..., None])
            den.index_add_(0, pq, p.sum(-1))
            num.index_add_(0, pq, torch.matmul(p, vv[pk]))
            del s
        den = torch.where(den > 0, den, torch.ones_like(den))  # a row that sees nothing: num = 0
        out = num / den[..., None]
        # one chunk: its weights (within the bound) are kept for the backward, not recomputed
        w = p / den[pair_q][..., None] if len(cuts) == 1 and any(ctx.needs_input_grad[:3]) else None
        ctx.save_for_backward(qv, kv, vv, lo, hi, pair_q, pair_k, mx, den, out, w)
        ctx.args = (block, scale, per)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        qv, kv, vv, lo, hi, pair_q, pair_k, mx, den, out, w1 = ctx.saved_tensors
        block, scale, per = ctx.args
        g = g.to(out.dtype)
        delta = (g * out).sum(-1)  # [QB, H, Bq]: the row's sum of w * dL/dw
        dq, dk, dv = (torch.zeros(x.shape, dtype=out.dtype, device=x.device) for x in (qv, kv, vv))
        for a in range(0, pair_q.numel(), per):
            pq, pk = pair_q[a:a + per], pair_k[a:a + per]
            w = w1 if w1 is not None else \
                torch.exp(_scores(qv, kv, lo, hi, pq, pk, block, scale) - mx[pq][..., None]) / den[pq][..., None]
            gq = g[pq]                                                                  # [P, H, Bq, Dv]
            dv.index_add_(0, pk, torch.matmul(w.transpose(-1, -2), gq))
            ds = w * (torch.matmul(gq, vv[pk].transpose(-1, -2)) - delta[pq][..., None])  # [P, H, Bq, Bk]
            dq.index_add_(0, pq, torch.matmul(ds, kv[pk]) * scale)
            dk.index_add_(0, pk, torch.matmul(ds.transpose(-1, -2), qv[pq]) * scale)
            del w, ds
        return dq.to(qv.dtype), dk.to(kv.dtype), dv.to(vv.dtype), None, None, None, None, None, None, None


def block_attention(q, k, v, iv: Intervals, scale: float | None = None, block: int = 64,
                    chunk_elems: int | None = None) -> torch.Tensor:
    """Block-sparse attention (see the module). ``chunk_elems`` (default :data:`CHUNK_ELEMS`)
    bounds the working set: the listed pairs are taken a chunk at a time, at most
    ``chunk_elems`` scores (pairs x heads x block x block; at least one pair) per chunk,
    forward and backward, so the memory beyond q, k, v and the output does not grow with
    queries x keys (the backward recomputes each chunk's scores rather than keeping them)."""
    nq, H, D = q.shape
    nk, Dv = k.shape[0], v.shape[-1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    chunk_elems = CHUNK_ELEMS if chunk_elems is None else chunk_elems
    if chunk_elems < 1:
        raise ArgumentError(f"chunk_elems={chunk_elems}: use a positive number of scores per chunk")
    if nq == 0 or nk == 0:
        return q.new_zeros(nq, H, Dv) + 0 * (q.sum() + k.sum() + v.sum())  # keeps the graph for empty batches
    qb, kb = -(-nq // block), -(-nk // block)
    first, stop, _, _ = iv.block_hull(block, block)
    n = (stop - first).clamp(min=0)
    pair_q = torch.repeat_interleave(torch.arange(qb, device=q.device), n)  # (P,) query block of each pair
    pair_k = ranges(first, n)                                                 # (P,) key block of each pair
    # blocks as [blocks, H, rows, D]: a pair's gathers are contiguous batched matrices
    qv = _pad_rows(q, qb * block).view(qb, block, H, D).transpose(1, 2)     # [QB, H, Bq, D]
    kv = _pad_rows(k, kb * block).view(kb, block, H, D).transpose(1, 2)     # [KB, H, Bk, D]
    vv = _pad_rows(v, kb * block).view(kb, block, H, Dv).transpose(1, 2)    # [KB, H, Bk, Dv]
    lo = torch.cat([iv.lo, iv.lo.new_zeros(qb * block - nq)]).view(qb, block)  # [QB, Bq]
    hi = torch.cat([iv.hi, iv.hi.new_zeros(qb * block - nq)]).view(qb, block)
    per = max(1, chunk_elems // (H * block * block))  # pairs per chunk
    out = _BlockAttention.apply(qv, kv, vv, lo, hi, pair_q, pair_k, block, scale, per)  # [QB, H, Bq, Dv]
    return out.transpose(1, 2).reshape(qb * block, H, Dv)[:nq]


_COMPILED = {}


def flex_attention(q, k, v, iv: Intervals, scale: float | None = None, block: int = 128, compiled: bool | None = None,
                   block_mask=None) -> torch.Tensor:
    """FlexAttention over the intervals' ``BlockMask`` (pass ``block_mask`` to reuse one).
    ``compiled``: default on CUDA. On CPU torch 2.13 runs it forward only (unfused)."""
    from torch.nn.attention import flex_attention as fa

    if q.device.type == "cpu" and torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        raise UserwiseError("FlexAttention has no backward on CPU in this torch: train on CPU with "
                            "attention='blocks' (same mask, pure torch)")
    if q.device.type == "cpu":
        q, k, v = q.detach(), k.detach(), v.detach()  # forward only there (checked above)
    compiled = q.device.type == "cuda" if compiled is None else compiled
    bm = iv.block_mask(block) if block_mask is None else block_mask
    fn = fa.flex_attention
    if compiled:
        fn = _COMPILED.setdefault("flex", torch.compile(fa.flex_attention, dynamic=True))
    o = fn(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], block_mask=bm, scale=scale)
    return o[0].transpose(0, 1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, iv: Intervals, impl: str = "blocks", **kw) -> torch.Tensor:
    """Softmax attention of ``q`` [Nq, H, D] over ``k`` [Nk, H, D], ``v`` [Nk, H, Dv] under the
    intervals ``iv`` (query row ``i`` sees keys ``[lo[i], hi[i])``; a row that sees nothing
    gives 0): ``impl`` "blocks" (pure torch, block-sparse, forward and backward on any
    device), "flex" (FlexAttention, compiled on CUDA) or "dense" (the reference). ``kw``:
    ``scale``, ``block`` (the tile of "blocks" and "flex"; the dense reference has none),
    ``chunk_elems`` ("blocks": the most scores held at a time, see :func:`block_attention`).

    Example::

        iv = target_intervals(spans(batch))
        out = attend(q, k, v, iv, "blocks", block=64)     # [N, H, Dv]
    """
    if impl == "blocks":
        return block_attention(q, k, v, iv, **kw)
    if impl in ("flex", "dense"):
        kw.pop("chunk_elems", None)  # the bound of "blocks"' working set; the others have none
    if impl == "flex":
        return flex_attention(q, k, v, iv, **kw)
    if impl == "dense":
        kw.pop("block", None)
        return dense_attention(q, k, v, iv, **kw)
    raise ArgumentError(f"attention={impl!r}: use one of {IMPLEMENTATIONS}")
