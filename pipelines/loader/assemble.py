"""The host assembler: batches of one decoded buffer, in one buffer each.

A :class:`Prepared` holds a buffer's host columns stacked per group
(:mod:`stacked`) in the order of its :class:`buffer_layout.BatchLayout`. Shuffled
once (:meth:`Prepared.permuted`), each batch is a contiguous range of its
samples, cut by :meth:`Prepared.assemble_range`: two compiled calls
(:mod:`program`) where numba is, else a few slice copies per block (numpy, not
torch: no intra-op threads on a busy host). :meth:`Prepared.assemble`
gathers any samples of an unshuffled buffer. No per-row Python and no
per-column loop per batch on either path; both give the same bytes, and the
same bytes as the device assembler (:mod:`assemble_torch`).
"""

from __future__ import annotations

import numpy as np

from userwise.pipelines.loader import segcopy
from userwise.pipelines.loader.batch import JaggedBatch
from userwise.pipelines.loader.buffer_layout import COUNT_B, COUNT_B1, layout_of
from userwise.pipelines.loader.decode import Col
from userwise.pipelines.loader.jagged import ALIGN, np_offsets, np_ranges
from userwise.pipelines.loader.program import BatchProgram
from userwise.pipelines.loader.stacked import Runs, as_numpy, permute, stack


def _select_lists(off: np.ndarray, rows: np.ndarray):
    """Rows ``rows`` of a list column with offsets ``off``: (element indexes, new offsets, lengths)."""
    start = off[rows]
    ln = off[rows + 1] - start
    return np_ranges(start, ln), np_offsets(ln), ln


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
        numel = counts[self.layout.count]
        nbytes = numel * self.layout.itemsize
        aligned = (nbytes + (ALIGN - 1)) // ALIGN * ALIGN
        pos = np.cumsum(aligned) - aligned
        total = int(aligned.sum())
        buf = alloc(max(total, ALIGN))
        out = buf.numpy()
        pad = np_ranges(pos + nbytes, aligned - nbytes)
        if len(pad):
            out[pad] = 0
        if len(out) > total:
            out[total:] = 0
        return buf, out, pos.tolist(), aligned.tolist()

    def _batch(self, buf, P, counts, B: int, meta: dict) -> JaggedBatch:
        lay = self.layout
        m = dict(meta)
        m["num_samples"] = B
        m["columns"] = lay.columns
        m["events"] = int(counts[lay.seq_count]) if lay.seq_count is not None and B else 0
        m["impressions"] = int(counts[lay.imp_count]) if lay.imp_req_at is not None else 0
        return JaggedBatch(buf, tuple(zip(lay.names, lay.dtypes, P, counts[lay.count].tolist())), m)

    def assemble_range(self, a: int, b: int, alloc, meta: dict) -> JaggedBatch:
        """Samples ``a:b`` of a :meth:`permuted` buffer as one batch (same bytes as
        ``assemble(perm[a:b])`` on the unpermuted buffer): compiled where numba is, else numpy."""
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
        return self._batch(buf, P, counts, B, meta)

    def assemble(self, idx, alloc, meta: dict) -> JaggedBatch:
        """Gather samples ``idx`` (row numbers of this buffer, unpermuted) into one buffer from
        ``alloc(nbytes)``."""
        lay = self.layout
        idx = np.asarray(idx, dtype=np.int64)
        B = len(idx)
        counts = np.zeros(lay.ncounts, np.int64)
        counts[COUNT_B], counts[COUNT_B1] = B, B + 1
        work = []
        req_len = req_e = None
        for G in self.groups:
            r = G.recipe
            if G.offsets is None:
                e, new = idx, None
            else:
                e, new, ln = _select_lists(G.offsets, idx)
                counts[r.count], counts[r.count + 1] = len(e), len(e) + 1
                if r.group == "req":
                    req_len, req_e = ln, e
            snew = s0 = sl = None
            if G.strings is not None:
                soff = G.strings.soff
                s0 = soff[:, e]
                sl = soff[:, e + 1] - s0
                snew = np.zeros((len(soff), len(e) + 1), np.int64)
                np.cumsum(sl, axis=1, out=snew[:, 1:])
                counts[r.strings.first_count: r.strings.first_count + len(soff)] = snew[:, -1]
            work.append((G, e, new, snew, s0, sl))
        buf, out, P, A = self._layout_buffer(counts, alloc)

        def block(i, dt, rows, n):
            """rows arrays of n elements each, one per aligned slot from entry i, as a 2-D view."""
            stride = A[i] // np.dtype(dt).itemsize
            return out[P[i]: P[i] + rows * A[i]].view(dt).reshape(rows, stride)[:, :n]

        for G, e, new, snew, s0, sl in work:
            r = G.recipe
            n = len(e)
            if new is not None:
                i = r.offsets_at
                out[P[i]: P[i] + 8 * (B + 1)].view(np.int64)[:] = new
            for blk, cs in zip(r.blocks, G.blocks):
                o = block(blk.at, cs[0].dtype, len(cs), n)
                for k, v in enumerate(cs):
                    np.take(v, e, out=o[k], mode="clip")
            if G.strings is not None:
                data, soff = G.strings.data, G.strings.soff
                ln = sl.ravel()
                i0 = r.strings.bytes_at
                starts = np.array(P[i0: i0 + len(soff)], np.int64)
                dst = np_ranges((starts[:, None] + snew[:, :-1]).ravel(), ln)
                if len(dst):
                    out[dst] = data[np_ranges(s0.ravel(), ln)]
                block(r.strings.soff_at, np.int64, len(soff), n + 1)[:] = snew
            if G.valid is not None:
                cs = G.valid
                o = block(r.valid.at, cs[0].dtype, len(cs), n)
                for k, v in enumerate(cs):
                    np.take(v, e, out=o[k], mode="clip")
        if lay.req_sample_at is not None:
            i = lay.req_sample_at
            R = len(req_e)
            out[P[i]: P[i] + 8 * R].view(np.int64)[:] = np.repeat(np.arange(B, dtype=np.int64), req_len)
            if lay.imp_req_at is not None:
                i = lay.imp_req_at
                k = self.rni[req_e]
                N = int(k.sum())
                out[P[i]: P[i] + 8 * N].view(np.int64)[:] = np.repeat(np.arange(R, dtype=np.int64), k)
        return self._batch(buf, P, counts, B, meta)


__all__ = ["Prepared"]
