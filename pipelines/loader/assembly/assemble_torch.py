"""The device assembler: a batch gathered with torch index ops where the columns live.

The GDS path reads side files straight to the device; :func:`assemble`
gathers a batch's samples there into one buffer, array by array, in
:func:`buffer_layout.layout_key` order (packed by :func:`jagged.pack`), so its bytes
equal the host assembler's (:mod:`assemble`) for the same samples. On CPU tensors the
gathers run in numpy (:func:`jagged.take`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from userwise.pipelines.jagged import dtype_name, offsets, pack, ranges, repeat, segment_ids, take
from userwise.pipelines.loader.assembly.batch import JaggedBatch
from userwise.pipelines.loader.assembly.buffer_layout import Part, layout_key
from userwise.pipelines.loader.io.decode import Col, group_of, torch_cols


class _Array(NamedTuple):
    """One array of the batch, to be written by ``fill(view of its slot)``."""

    key: tuple  # layout_key
    name: str
    dtype: torch.dtype
    numel: int
    fill: Callable[[torch.Tensor], object]


def assemble(cols: dict[str, Col], idx: torch.Tensor, alloc, meta: dict) -> JaggedBatch:
    """Gather samples ``idx`` (rows of ``cols``) into one buffer from ``alloc(nbytes)``."""
    cols = torch_cols(cols)
    dev = next(iter(cols.values())).values.device
    idx = idx.to(dev).long()
    B = int(idx.numel())
    plan: list[_Array] = []
    group_idx: dict[str, torch.Tensor] = {}
    group_off: dict[str, torch.Tensor] = {}
    columns = {}

    order = {name: i for i, name in enumerate(cols)}

    def add(key, name, dtype, numel, fill):
        plan.append(_Array(key, name, dtype, int(numel), fill))

    def list_index(off: torch.Tensor):
        off = off.long()
        start = off[idx]
        ln = off[idx + 1] - start
        return ranges(start, ln), offsets(ln)

    for name, c in cols.items():
        g = group_of(name, c)
        columns[name] = (g, c.arrow)
        if g == "sample":
            e = idx
        elif g in ("seq", "req", "imp"):
            if g not in group_idx:
                e, new = list_index(c.offsets)
                group_idx[g], group_off[g] = e, new
                add(layout_key(g, 0, Part.OFFSETS, "", 0), f"{g}.offsets", torch.long, B + 1,
                    lambda o, new=new: o.copy_(new))
            e = group_idx[g]
        else:
            e, new = list_index(c.offsets)
            add(layout_key(g, order[name], Part.OFFSETS, "", 0), f"{name}.offsets", torch.long, B + 1,
                lambda o, new=new: o.copy_(new))
        gi = order[name] if g == "list" else 0
        ci = order[name]
        if c.str_offsets is not None:
            so = c.str_offsets.long()
            s0 = so[e]
            sl = so[e + 1] - s0
            snew = offsets(sl)
            bidx = ranges(s0, sl)
            add(layout_key(g, gi, Part.BYTES, "", ci), name, torch.uint8, bidx.numel(),
                lambda o, v=c.values, i=bidx: take(v, i, o))
            add(layout_key(g, gi, Part.STR_OFFSETS, "int64", ci), name + ".soff", torch.long, e.numel() + 1,
                lambda o, s=snew: o.copy_(s))
        else:
            add(layout_key(g, gi, Part.VALUES, dtype_name(c.values.dtype), ci), name, c.values.dtype, e.numel(),
                lambda o, v=c.values, i=e: take(v, i, o))
        if c.validity is not None:
            add(layout_key(g, gi, Part.VALIDITY, "uint8", ci), name + ".valid", torch.uint8, e.numel(),
                lambda o, v=c.validity, i=e: take(v, i, o))

    # derived index arrays: request -> sample, impression -> request
    if "req" in group_idx:
        R = int(group_idx["req"].numel())
        req_sample = segment_ids(group_off["req"])
        add(layout_key("req", 0, Part.DERIVED, "", 0), "req.sample", torch.long, R, lambda o, s=req_sample: o.copy_(s))
        if "req_num_imps" in cols and "imp" in group_idx:
            rni = cols["req_num_imps"].values[group_idx["req"]].long()
            N = int(group_idx["imp"].numel())
            imp_req = repeat(torch.arange(R, device=dev), rni, N)
            add(layout_key("imp", 0, Part.DERIVED, "", 0), "imp.req", torch.long, N, lambda o, s=imp_req: o.copy_(s))

    plan.sort(key=lambda p: p.key)
    buf, spec = pack([(p.name, p.dtype, p.numel, p.fill) for p in plan], alloc)  # padding zeroed: equal bytes
    m = dict(meta)
    m["num_samples"] = B
    m["columns"] = columns
    return JaggedBatch(buf, tuple(spec), m)


__all__ = ["assemble"]
