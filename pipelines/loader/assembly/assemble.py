"""The host assembler: batches of one decoded buffer, in one buffer each.

A :class:`Prepared` holds a buffer's host columns stacked per group
(:mod:`stacked`) in the order of its :class:`buffer_layout.BatchLayout`. Shuffled
once (:meth:`Prepared.permuted`), each batch is a contiguous range of its
samples, cut by :meth:`Prepared.assemble_range`: two compiled calls
(:mod:`program`) where numba is, else a few slice copies per block (numpy, not
torch: no intra-op threads on a busy host). No per-row Python and no
per-column loop per batch on either path; both give the same bytes, and the
same bytes as the device assembler (:mod:`assemble_torch`). An empty batch
(a rank with fewer samples than batches) needs only the layout (:func:`empty_batch`).
"""

from __future__ import annotations

import numpy as np
import torch

from userwise.pipelines.jagged import ALIGN, np_ranges
from userwise.pipelines.loader.assembly import segcopy
from userwise.pipelines.loader.assembly.batch import JaggedBatch
from userwise.pipelines.loader.assembly.buffer_layout import COUNT_B, COUNT_B1, BatchLayout, layout_of
from userwise.pipelines.loader.assembly.program import BatchProgram
from userwise.pipelines.loader.assembly.stacked import Runs, as_numpy, permute, stack
from userwise.pipelines.loader.io.decode import Col


class Prepared:
    """One decoded buffer (host columns) laid out for fast batch gathers.

    Built once per buffer of row groups: columns of the same group and dtype
    are stacked into one 2-D array (one gather per block instead of one per
    column), the string columns of a group share one byte array, and the
    order of the arrays in a batch is fixed by the layout."""

    def __init__(self, cols: dict[str, Col]):
        cols = as_numpy(cols)
        self.layout = layout_of(cols)
        self.rni = cols["req_num_imps"].values.astype(np.int64) if "req_num_imps" in cols else None
        self.groups = stack(cols, self.layout)
        self.req_sample = self.imp_req = None  # derived indices of all samples (permuted buffers)
        self.program = None  # the compiled batch program (permuted buffers, where numba is)

    def permuted(self, perm) -> Prepared:
        """This buffer with its samples in ``perm`` order: one gather per block for the
        whole buffer, after which every batch is a contiguous range (:meth:`assemble_range`:
        slices and copies only, the per-batch work no longer grows with the gathers)."""
        p = object.__new__(Prepared)
        p.layout, p.rni = self.layout, self.rni
        q = permute(self.groups, self.layout, self.rni, perm)
        p.groups, p.req_sample, p.imp_req = q.groups, q.req_sample, q.imp_req
        nb = segcopy.batch_kernels()
        p.program = None if nb is None else BatchProgram.build(nb, self.layout, q)
        return p

    def _layout_buffer(self, counts, alloc):
        """One buffer for the batch: every array in its own ALIGN-aligned slot, padding zeroed
        (equal batches are equal bytes). Returns (buffer, its uint8 view, slot offsets, slot sizes)."""
        nbytes, aligned, pos = _slots(self.layout, counts)
        total = int(aligned.sum())
        buf = alloc(max(total, ALIGN))
        out = buf.numpy()
        pad = np_ranges(pos + nbytes, aligned - nbytes)
        if len(pad):
            out[pad] = 0
        if len(out) > total:
            out[total:] = 0
        return buf, out, pos.tolist(), aligned.tolist()

    def assemble_range(self, a: int, b: int, alloc, meta: dict) -> JaggedBatch:
        """Samples ``a:b`` of a :meth:`permuted` buffer as one batch (same bytes as the device
        assembler's gather of ``perm[a:b]``): compiled where numba is, else numpy."""
        if self.program is not None:
            return self.program.run(a, b, alloc, meta)
        lay = self.layout
        B = b - a
        counts = np.zeros(lay.ncounts, np.int64)
        counts[COUNT_B], counts[COUNT_B1] = B, B + 1
        work = []
        rng = {}
        for G in self.groups:
            r = G.recipe
            if G.offsets is None:
                ea, eb, new = a, b, None
            else:
                ea, eb = int(G.offsets[a]), int(G.offsets[b])
                new = G.offsets[a: b + 1] - ea
                counts[r.count], counts[r.count + 1] = eb - ea, eb - ea + 1
            rng[r.group] = (ea, eb)
            snew = None
            if G.strings is not None:
                soff = G.strings.soff
                snew = soff[:, ea: eb + 1] - soff[:, ea: ea + 1]
                counts[r.strings.first_count: r.strings.first_count + len(soff)] = snew[:, -1]
            work.append((G, ea, eb, new, snew))
        buf, out, P, A = self._layout_buffer(counts, alloc)

        def block(i, dt, rows, n):
            """rows arrays of n elements each, one per aligned slot from entry i, as a 2-D view."""
            stride = A[i] // np.dtype(dt).itemsize
            return out[P[i]: P[i] + rows * A[i]].view(dt).reshape(rows, stride)[:, :n]

        for G, ea, eb, new, snew in work:
            r = G.recipe
            n = eb - ea
            if new is not None:
                i = r.offsets_at
                out[P[i]: P[i] + 8 * (B + 1)].view(np.int64)[:] = new
            for blk, V in zip(r.blocks, G.blocks):
                if isinstance(V, Runs):
                    V.copy_into(block(blk.at, V.dtype, len(V), n), a, b)
                else:
                    block(blk.at, V.dtype, len(V), n)[:] = V[:, ea:eb]
            if G.strings is not None:
                data, soff = G.strings.data, G.strings.soff
                i0 = r.strings.bytes_at
                lo, hi = soff[:, ea].tolist(), soff[:, eb].tolist()
                for c in range(len(soff)):
                    out[P[i0 + c]: P[i0 + c] + hi[c] - lo[c]] = data[lo[c]: hi[c]]
                block(r.strings.soff_at, np.int64, len(soff), n + 1)[:] = snew
            if G.valid is not None:
                block(r.valid.at, G.valid.dtype, len(G.valid), n)[:] = G.valid[:, ea:eb]
        if self.req_sample is not None:
            ra, rb = rng["req"]
            i = lay.req_sample_at
            np.subtract(self.req_sample[ra:rb], a, out=out[P[i]: P[i] + 8 * (rb - ra)].view(np.int64))
            if self.imp_req is not None:
                ia, ib = rng["imp"]
                i = lay.imp_req_at
                np.subtract(self.imp_req[ia:ib], ra, out=out[P[i]: P[i] + 8 * (ib - ia)].view(np.int64))
        return _as_batch(lay, buf, P, counts, B, meta)


def empty_layout(cols: dict[str, Col]) -> BatchLayout:
    """The :class:`BatchLayout` of decoded columns wherever they are (host or device): what an
    empty batch of their buffer holds."""
    def host(x):
        return None if x is None else x.cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)

    return layout_of({n: Col(host(c.values), host(c.offsets), host(c.str_offsets), host(c.validity), c.arrow)
                      for n, c in cols.items()})


def empty_batch(layout: BatchLayout, alloc, meta: dict) -> JaggedBatch:
    """A batch of no samples with every array of ``layout`` (a rank with fewer samples than
    batches gets such batches): the layout alone decides it, as every array is empty but the
    offsets (one 0 each), so the buffer from ``alloc(nbytes)`` is all zeros. The same bytes
    as an empty range of any buffer of that layout, on the host or the device."""
    counts = np.zeros(layout.ncounts, np.int64)
    counts[COUNT_B1] = 1
    for r in layout.groups:
        if r.offsets_col is not None:
            counts[r.count + 1] = 1
    _, aligned, pos = _slots(layout, counts)
    buf = alloc(max(int(aligned.sum()), ALIGN))
    if buf.device.type == "cpu":
        buf.numpy().fill(0)  # numpy: no torch intra-op threads (see jagged.ranges)
    else:
        buf.zero_()
    return _as_batch(layout, buf, pos.tolist(), counts, 0, meta)


def _slots(layout: BatchLayout, counts: np.ndarray):
    """The arrays of a batch with ``counts``: their bytes, their ALIGN-aligned slots' sizes and
    the slots' byte offsets in the buffer."""
    nbytes = counts[layout.count] * layout.itemsize
    aligned = (nbytes + (ALIGN - 1)) // ALIGN * ALIGN
    return nbytes, aligned, np.cumsum(aligned) - aligned


def _as_batch(lay: BatchLayout, buf, P, counts, B: int, meta: dict) -> JaggedBatch:
    m = dict(meta)
    m["num_samples"] = B
    m["columns"] = lay.columns
    m["events"] = int(counts[lay.seq_count]) if lay.seq_count is not None and B else 0
    m["impressions"] = int(counts[lay.imp_count]) if lay.imp_req_at is not None else 0
    return JaggedBatch(buf, tuple(zip(lay.names, lay.dtypes, P, counts[lay.count].tolist())), m)


__all__ = ["Prepared", "empty_layout", "empty_batch"]
