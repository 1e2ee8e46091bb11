"""Masks over a jagged batch, as intervals: query row ``i`` sees key rows ``[lo[i], hi[i])``.

Every mask the product needs is one interval per query row, in flat (batch-level)
indices:

- target attention (:func:`target_intervals`): impression ``n`` sees its request's span
  ``[imp_begin[n], imp_end[n])`` of the stored events;
- the causal sequence encoder (:func:`causal_intervals`): stored event ``i`` sees the
  events of its own sample up to itself, ``[sample start, i + 1)``, or with ``window=W``
  only the ``W`` newest of them, ``[max(sample start, i - W + 1), i + 1)``;
- per-request sequences (:func:`request_sequences`): each request's span copied out as
  its own sequence, causal within it (what point-wise rows truncated at L encode).

An :class:`Intervals` turns into the three forms attention code takes: a dense boolean
mask (small batches, tests; :meth:`Intervals.dense`, and per sample
:func:`dense_target_masks` / :func:`dense_causal_masks`), a FlexAttention ``mask_mod``
(:meth:`Intervals.mask_mod`) and a FlexAttention ``BlockMask`` built straight from the
intervals (:meth:`Intervals.block_mask`: memory grows with the rows, not their square).
All of it is vectorised torch on the batch's device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from userwise.pipelines.errors import ArgumentError
from userwise.pipelines.jagged import offsets as offsets_of
from userwise.pipelines.jagged import positions, ranges, segment_ids
from userwise.pipelines.train.batch_spans import Spans

__all__ = ["Intervals", "target_intervals", "causal_intervals", "request_sequences", "RequestSequences",
           "dense_target_masks", "dense_causal_masks"]


@dataclass(frozen=True)
class Intervals:
    """Query row ``i`` sees key rows ``[lo[i], hi[i])`` (int64 [Nq]); ``num_keys`` key rows.

    Example::

        iv = Intervals(torch.tensor([0, 0, 2]), torch.tensor([1, 2, 3]), num_keys=3)
        iv.dense(), iv.pairs()            # the [3, 3] mask; 4 visible pairs
        iv.block_mask(128)                # a FlexAttention BlockMask of the same mask
    """

    lo: torch.Tensor
    hi: torch.Tensor
    num_keys: int

    @property
    def num_queries(self) -> int:
        return self.lo.numel()

    def pairs(self) -> int:
        """Visible (query, key) pairs: what an exact kernel computes."""
        return int((self.hi - self.lo).clamp(min=0).sum()) if self.lo.numel() else 0

    def dense(self) -> torch.Tensor:
        """[Nq, Nk] bool (tests, small batches)."""
        k = torch.arange(self.num_keys, device=self.lo.device)
        return (k[None, :] >= self.lo[:, None]) & (k[None, :] < self.hi[:, None])

    def mask_mod(self):
        """FlexAttention ``mask_mod(b, h, q_idx, kv_idx)`` of these intervals (b and h unused)."""
        lo, hi = self.lo, self.hi
        last = max(self.num_queries - 1, 0)

        def mask_mod(b, h, q_idx, kv_idx):
            q = q_idx.clamp(max=last)
            return (kv_idx >= lo[q]) & (kv_idx < hi[q])

        return mask_mod

    def block_hull(self, q_block: int, kv_block: int):
        """Per query block: ``(kv_first, kv_stop, full_first, full_stop)`` (int64 [QB]): the kv
        blocks that hold any key one of its rows sees, and the run of kv blocks that every
        one of its rows sees whole (``full_first >= full_stop``: none)."""
        nq, dev = self.num_queries, self.lo.device
        qb = -(-nq // q_block)
        lo, hi = self.lo, self.hi
        seen = hi > lo
        big = torch.iinfo(torch.long).max

        def rows(x, fill):  # [QB, q_block], padded with an exact int64 fill
            tail = torch.full((qb * q_block - nq,), fill, dtype=torch.long, device=dev)
            return torch.cat([x, tail]).view(qb, q_block)

        lo_min = rows(torch.where(seen, lo, big), big).amin(1)
        hi_max = rows(torch.where(seen, hi, 0), 0).amax(1)
        any_seen = hi_max > 0
        first = torch.where(any_seen, lo_min // kv_block, 0)
        stop = torch.where(any_seen, -(-hi_max // kv_block), 0)
        # full: every real row of the block sees [lo_max, hi_min); padded rows count as seeing everything
        lo_max = rows(torch.where(seen, lo, big), -1).amax(1)
        hi_min = rows(torch.where(seen, hi, -1), big).amin(1)
        f_first = -(-lo_max.clamp(min=0) // kv_block)
        f_stop = torch.minimum(hi_min.clamp(min=0), torch.tensor(self.num_keys, device=dev)) // kv_block
        ok = (lo_max >= 0) & (hi_min >= 0) & (f_stop > f_first)
        return first, stop, torch.where(ok, f_first, first), torch.where(ok, f_stop, first)

    def block_mask(self, block: int = 128):
        """A FlexAttention ``BlockMask`` (B = H = 1, broadcast) built from the intervals without
        materialising the [Nq, Nk] mask: partial blocks apply :meth:`mask_mod`, full blocks skip it."""
        from torch.nn.attention.flex_attention import BlockMask

        first, stop, f_first, f_stop = self.block_hull(block, block)
        n_full = f_stop - f_first
        n_part = (stop - first) - n_full
        dev = self.lo.device
        nkb = max(-(-self.num_keys // block), 1)
        j = torch.arange(nkb, device=dev)[None, :]  # kv_indices are [.., QB, KVB], as FlexAttention lays them out
        before = (f_first - first)[:, None]
        part = torch.where(j < before, first[:, None] + j, f_stop[:, None] + (j - before))
        full = f_first[:, None] + j
        part = torch.where(j < n_part[:, None], part, 0).clamp(0, nkb - 1)
        full = torch.where(j < n_full[:, None], full, 0).clamp(0, nkb - 1)
        i32 = torch.int32
        return BlockMask.from_kv_blocks(
            n_part.to(i32)[None, None], part.to(i32)[None, None], n_full.to(i32)[None, None], full.to(i32)[None, None],
            BLOCK_SIZE=block, mask_mod=self.mask_mod(), seq_lengths=(self.num_queries, self.num_keys))


def target_intervals(sp: Spans) -> Intervals:
    """Impressions (queries) over the stored events (keys): each sees its request's span.

    Example::

        iv = target_intervals(spans(batch))     # iv.lo[n], iv.hi[n]: impression n's span
    """
    return Intervals(sp.imp_begin, sp.imp_end, sp.num_events)


def causal_intervals(sp: Spans, window: int | None = None) -> Intervals:
    """Stored events over stored events: each sees the earlier events of its own sample and
    itself; with ``window`` only the ``window`` newest of them (itself included).

    Example::

        iv = causal_intervals(spans(batch), window=50)
    """
    return causal_over(sp.seq_offsets, window)


def causal_over(offsets: torch.Tensor, window: int | None = None) -> Intervals:
    """Causal intervals within the segments of ``offsets`` [S+1] (optionally windowed): the
    element ``i`` of a segment sees the segment's elements up to itself.

    Example::

        rs = request_sequences(sp)
        iv = causal_over(rs.offsets)            # causal within each request's copied span
    """
    if window is not None and int(window) < 1:
        raise ArgumentError(f"window={window}: use a number of events >= 1 (or None for the whole sample)")
    offsets = offsets.long()
    total = int(offsets[-1]) if offsets.numel() else 0
    i = torch.arange(total, device=offsets.device)
    lo = offsets[:-1][segment_ids(offsets)]
    if window is not None:
        lo = torch.maximum(lo, i - int(window) + 1)
    return Intervals(lo, i + 1, total)


@dataclass(frozen=True)
class RequestSequences:
    """Every request's span copied out as its own sequence: token ``j`` is stored event
    ``event[j]``; request ``r``'s tokens are ``[offsets[r], offsets[r + 1])``."""

    event: torch.Tensor
    offsets: torch.Tensor


def request_sequences(sp: Spans) -> RequestSequences:
    """Every request's span copied out as its own sequence (:class:`RequestSequences`): what
    point-wise rows truncated at L encode.

    Example::

        rs = request_sequences(sp)
        x_req = x[rs.event]                     # event rows, request by request
    """
    n = sp.req_end - sp.req_begin
    return RequestSequences(ranges(sp.req_begin, n), offsets_of(n))


def _padded_index(offsets: torch.Tensor):
    """(segment, position, max length) of every element of a jagged layout."""
    seg, pos = positions(offsets)
    n = offsets[1:] - offsets[:-1]
    return seg, pos, int(n.max()) if n.numel() else 0


def dense_target_masks(sp: Spans) -> torch.Tensor:
    """Per sample, [B, K, T] bool: impression k of the sample (in batch order) sees stored event
    t of the sample. Padding rows and columns are False.

    Example::

        m = dense_target_masks(spans(batch))    # m[b, k, t]
    """
    seg, pos, K = _padded_index(sp.imp_offsets)
    T = int((sp.seq_offsets[1:] - sp.seq_offsets[:-1]).max()) if sp.num_samples else 0
    base = sp.seq_offsets[:-1][seg]
    lo = torch.zeros(sp.num_samples, K, dtype=torch.long, device=sp.device)
    hi = torch.zeros_like(lo)
    lo[seg, pos] = sp.imp_begin - base
    hi[seg, pos] = sp.imp_end - base
    t = torch.arange(T, device=sp.device)
    return (t[None, None, :] >= lo[..., None]) & (t[None, None, :] < hi[..., None])


def dense_causal_masks(sp: Spans, window: int | None = None) -> torch.Tensor:
    """Per sample, [B, T, T] bool: stored event i sees event j of the same sample.

    Example::

        m = dense_causal_masks(spans(batch), window=8)   # m[b, i, j]
    """
    n = sp.seq_offsets[1:] - sp.seq_offsets[:-1]
    T = int(n.max()) if n.numel() else 0
    i = torch.arange(T, device=sp.device)
    m = (i[None, :] <= i[:, None])
    if window is not None:
        m = m & (i[:, None] - i[None, :] < int(window))
    valid = i[None, :] < n[:, None]
    return m[None] & valid[:, :, None] & valid[:, None, :]
