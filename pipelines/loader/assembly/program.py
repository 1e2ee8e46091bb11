"""The compiled assembler: a permuted buffer's batches cut by two kernel calls each.

:meth:`BatchProgram.build` turns a permuted buffer (:mod:`stacked`) into a
*batch program*: one :class:`kernels.OpRow` per array of the batch layout
(which source it copies, over which group's element range, and how), with
the arrays it reads in two source tables. :meth:`BatchProgram.run` then
writes the batch of samples ``[a, b)``: ``batch_layout`` sizes every array,
``batch_fill`` copies them all, whatever the number of columns. The bytes are
those of the numpy assembler (:meth:`assemble.Prepared.assemble_range`).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import numpy as np

from userwise.pipelines.jagged import ALIGN
from userwise.pipelines.loader.assembly.batch import JaggedBatch
from userwise.pipelines.loader.assembly.buffer_layout import BatchLayout
from userwise.pipelines.loader.assembly.stacked import Permuted, Runs


@dataclass
class BatchProgram:
    """A permuted buffer's batch program and what it reads."""

    kernels: ModuleType  # the compiled kernels (segcopy.batch_kernels())
    layout: BatchLayout
    ops: np.ndarray  # (arrays, len(OpRow)) int64
    bytes_src: object  # kernels.Sources: the byte sources
    int_src: object  # kernels.Sources: the int64 sources
    seq_offsets: np.ndarray | None  # for meta["events"]
    imp_offsets: np.ndarray | None  # for meta["impressions"] (where imp.req is in the batch)

    @classmethod
    def build(cls, nb: ModuleType, layout: BatchLayout, p: Permuted) -> BatchProgram | None:
        """The program of permuted buffer ``p``, run by the compiled kernels ``nb``; None
        where a layout entry has no op (numpy assembles; same bytes)."""
        Op, OpRow = nb.Op, nb.OpRow
        bsrc, isrc = [], []
        rows: list = [None] * len(layout.names)

        def b_(a):
            bsrc.append(a)
            return len(bsrc) - 1

        def i_(a):
            isrc.append(a)
            return len(isrc) - 1

        goff = {}
        for G in p.groups:
            r = G.recipe
            go = -1  # the int source of the group's offsets (-1: per sample)
            if G.offsets is not None:
                go = i_(G.offsets)
                if r.group != "list":
                    goff[r.group] = go
                rows[r.offsets_at] = OpRow(Op.OFFSETS, 0, 0, 0, 8, go, -1)
            runs = None  # the group's runs (shared by its blocks), listed once
            for blk, V in zip(r.blocks, G.blocks):
                if isinstance(V, Runs):
                    st, ln = runs = runs or (i_(V.starts), i_(V.lengths))
                    for k, v in enumerate(V.arrays):
                        rows[blk.at + k] = OpRow(Op.RUNS, b_(v), st, ln, v.dtype.itemsize, go, -1)
                else:
                    for k in range(len(V)):
                        rows[blk.at + k] = OpRow(Op.VALUES, b_(V[k]), 0, 0, V.dtype.itemsize, go, -1)
            if G.strings is not None:
                s = r.strings
                d = b_(G.strings.data)
                for c in range(len(G.strings.soff)):
                    so = i_(G.strings.soff[c])
                    rows[s.bytes_at + c] = OpRow(Op.STRINGS, d, so, 0, 1, go, -1)
                    rows[s.soff_at + c] = OpRow(Op.STR_OFFSETS, 0, so, 0, 8, go, -1)
            if G.valid is not None:
                for k in range(len(G.valid)):
                    rows[r.valid.at + k] = OpRow(Op.VALUES, b_(G.valid[k]), 0, 0, 1, go, -1)
        if p.req_sample is not None:
            rows[layout.req_sample_at] = OpRow(Op.DERIVED, 0, i_(p.req_sample), 0, 8, goff["req"], -1)
            if p.imp_req is not None:
                rows[layout.imp_req_at] = OpRow(Op.DERIVED, 0, i_(p.imp_req), 0, 8, goff["imp"], goff["req"])
        if any(r is None for r in rows):  # pragma: no cover (a layout entry without an op: stay on numpy)
            return None
        seq = isrc[goff["seq"]] if "seq" in goff else None
        imp = isrc[goff["imp"]] if "imp" in goff and p.imp_req is not None else None
        return cls(nb, layout, np.array(rows, np.int64).reshape(-1, len(OpRow._fields)), nb.byte_sources(bsrc),
                   nb.int_sources(isrc), seq, imp)

    def run(self, a: int, b: int, alloc, meta: dict) -> JaggedBatch:
        """The batch of samples ``[a, b)`` in one buffer from ``alloc(nbytes)``."""
        nb, ops = self.kernels, self.ops
        pos, numel = np.empty(len(ops), np.int64), np.empty(len(ops), np.int64)
        total = int(nb.batch_layout(ops, a, b, self.int_src.table, ALIGN, pos, numel))
        buf = alloc(max(total, ALIGN))
        nb.batch_fill(buf.numpy(), ops, a, b, self.bytes_src.table, self.int_src.table, pos, numel, ALIGN, total)
        m = dict(meta)
        m["num_samples"] = b - a
        m["columns"] = self.layout.columns
        seq, imp = self.seq_offsets, self.imp_offsets
        m["events"] = int(seq[b] - seq[a]) if seq is not None and b > a else 0
        m["impressions"] = int(imp[b] - imp[a]) if imp is not None else 0
        return JaggedBatch(buf, tuple(zip(self.layout.names, self.layout.dtypes, pos.tolist(), numel.tolist())), m)


__all__ = ["BatchProgram"]
