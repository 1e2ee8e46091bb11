"""Softmax attention under an :class:`~userwise.pipelines.train.masks.Intervals` mask.

Three implementations of one function, ``out[i] = softmax(q[i] k[lo_i:hi_i]^T * scale) v[lo_i:hi_i]``
(a row that sees nothing gives 0):

- :func:`block_attention`: pure torch, block-sparse. Queries and keys are cut into
  blocks; only the (query block, key block) pairs inside a query block's hull are
  computed, the rows' intervals mask the rest. It runs forward and backward on any
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


def block_attention(q, k, v, iv: Intervals, scale: float | None = None, block: int = 64) -> torch.Tensor:
    nq, H, D = q.shape
    nk, Dv = k.shape[0], v.shape[-1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    if nq == 0 or nk == 0:
        return q.new_zeros(nq, H, Dv) + 0 * (q.sum() + k.sum() + v.sum())  # keeps the graph for empty batches
    qb, kb = -(-nq // block), -(-nk // block)
    first, stop, _, _ = iv.block_hull(block, block)
    n = (stop - first).clamp(min=0)
    pair_q = torch.repeat_interleave(torch.arange(qb, device=q.device), n)  # (P,) query block of each pair
    pair_k = ranges(first, n)                                                 # (P,) key block of each pair
    # blocks as [blocks, H, rows, D]: the gathers below are contiguous batched matrices
    qs = _pad_rows(q, qb * block).view(qb, block, H, D).transpose(1, 2)[pair_q]   # [P, H, Bq, D]
    ks = _pad_rows(k, kb * block).view(kb, block, H, D).transpose(1, 2)[pair_k]   # [P, H, Bk, D]
    vs = _pad_rows(v, kb * block).view(kb, block, H, Dv).transpose(1, 2)[pair_k]  # [P, H, Bk, Dv]
    s = torch.matmul(qs, ks.transpose(-1, -2)) * scale                           # [P, H, Bq, Bk]
    lo = torch.cat([iv.lo, iv.lo.new_zeros(qb * block - nq)]).view(qb, block)[pair_q]  # [P, Bq]
    hi = torch.cat([iv.hi, iv.hi.new_zeros(qb * block - nq)]).view(qb, block)[pair_q]
    key = pair_k[:, None] * block + torch.arange(block, device=q.device)[None, :]  # [P, Bk]
    vis = (key[:, None, :] >= lo[:, :, None]) & (key[:, None, :] < hi[:, :, None])  # [P, Bq, Bk]
    s = s.masked_fill(~vis[:, None], float("-inf"))
    row_max = s.amax(-1).detach()  # [P, H, Bq]
    mx = torch.full((qb, H, block), float("-inf"), dtype=s.dtype, device=s.device)
    mx = mx.scatter_reduce(0, pair_q[:, None, None].expand_as(row_max), row_max, "amax")
    mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
    p = torch.exp(s - mx[pair_q][..., None])
    den = torch.zeros(qb, H, block, dtype=s.dtype, device=s.device).index_add(0, pair_q, p.sum(-1))
    num = torch.zeros(qb, H, block, Dv, dtype=s.dtype, device=s.device).index_add(0, pair_q, torch.matmul(p, vs))
    out = num / torch.where(den > 0, den, torch.ones_like(den))[..., None]  # [QB, H, Bq, Dv]
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
    ``scale``, ``block`` (the tile of "blocks" and "flex"; the dense reference has none).

    Example::

        iv = target_intervals(spans(batch))
        out = attend(q, k, v, iv, "blocks", block=64)     # [N, H, Dv]
    """
    if impl == "blocks":
        return block_attention(q, k, v, iv, **kw)
    if impl == "flex":
        return flex_attention(q, k, v, iv, **kw)
    if impl == "dense":
        kw.pop("block", None)
        return dense_attention(q, k, v, iv, **kw)
    raise ArgumentError(f"attention={impl!r}: use one of {IMPLEMENTATIONS}")
