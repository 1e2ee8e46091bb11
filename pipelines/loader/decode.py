"""Row groups -> flat column buffers -> one contiguous jagged batch.

Arrow decodes a row group; every column becomes flat arrays (values, list
offsets, string offsets, validity) viewed as torch tensors without copying;
a batch is gathered from them with vectorised index ops (no per-row Python)
straight into one buffer that the caller allocates (shared memory in a
worker, a pinned pool buffer, or device memory on the GDS path). The same
gather code runs on CPU and CUDA tensors.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

from .. import gds as gdsmod
from ..errors import ShardError
from .batch import ALIGN, JaggedBatch, _ranges, dtype_name, repeat, take, torch_dtype


REQ_LISTS = ("req_id", "req_time", "req_seq_begin", "req_seq_end", "req_num_imps", "req_snapshot")


def column_group(name: str, t: pa.DataType) -> str:
    """sample (scalar), seq, req, imp, or list (a list with its own offsets)."""
    if not (pa.types.is_list(t) or pa.types.is_large_list(t)):
        return "sample"
    if name.startswith("seq_"):
        return "seq"
    if name.startswith("imp__"):
        return "imp"
    if name.startswith("req__") or name in REQ_LISTS:
        return "req"
    return "list"


@dataclass
class Col:
    values: torch.Tensor
    offsets: torch.Tensor | None
    str_offsets: torch.Tensor | None
    validity: torch.Tensor | None
    arrow: str


def _t(a):
    if a is None:
        return None
    with warnings.catch_warnings():  # Arrow's buffers are read-only; we never write to them
        warnings.simplefilter("ignore")
        return torch.from_numpy(np.asarray(a))


def from_arrow(table: pa.Table, where: str = "") -> dict[str, Col]:
    """Flat columns of a (decoded) table; list offsets start at 0."""
    out = {}
    for name in table.column_names:
        a = gdsmod.column_arrays(table.column(name))
        if a is None:
            raise ShardError(f"{where}: column {name!r} of type {table.schema.field(name).type} is not supported by the loader")
        v = a["values"]
        if v.dtype.byteorder == ">":  # pragma: no cover (big-endian hosts)
            v = v.astype(v.dtype.newbyteorder("="))
        out[name] = Col(_t(v), _t(a["offsets"]), _t(a["str_offsets"]), _t(a["validity"]), a["arrow"])
    return out


def from_gds(parts: list[dict], index_arrow: dict[str, str]) -> dict[str, Col]:
    """Columns from side-file reads (``gds.read_host`` / ``read_device`` results per row group)."""
    out = {}
    for name in parts[0]:
        vals, offs, sos = [], [], []
        for p in parts:
            v, o, *so = p[name]
            vals.append(_t(v) if isinstance(v, np.ndarray) else v)
            if o is not None:
                offs.append(_t(o) if isinstance(o, np.ndarray) else o)
            if so:
                sos.append(_t(so[0]) if isinstance(so[0], np.ndarray) else so[0])
        out[name] = Col(vals[0] if len(vals) == 1 else torch.cat(vals), _cat_offsets(offs), _cat_offsets(sos), None,
                        index_arrow[name])
    return out


def _cat_offsets(offs):
    if not offs:
        return None
    if len(offs) == 1:
        return offs[0]
    parts, base = [offs[0]], offs[0][-1]
    for o in offs[1:]:
        parts.append(o[1:] + base)
        base = base + o[-1]
    return torch.cat(parts)


def check_groups(cols: dict[str, Col], where: str) -> None:
    """Parallel list columns of a group must have equal lengths (else the shard is corrupt)."""
    first: dict[str, tuple[str, torch.Tensor]] = {}
    for name, c in cols.items():
        g = _group_of(name, c)
        if g in ("seq", "req", "imp"):
            if g not in first:
                first[g] = (name, c.offsets)
            elif not _equal(first[g][1], c.offsets):
                raise ShardError(f"{where}: list column {name!r} is not parallel to {first[g][0]!r} "
                                 "(different lengths per sample); rebuild the shard")
    if "req_num_imps" in cols and "imp" in first:
        rni = cols["req_num_imps"]
        ro = rni.offsets.long()
        csum = torch.zeros(len(rni.values) + 1, dtype=torch.long, device=rni.values.device)
        torch.cumsum(rni.values.long(), 0, out=csum[1:])
        per_sample = csum[ro[1:]] - csum[ro[:-1]]
        imp_off = first["imp"][1]
        if not _equal(per_sample, (imp_off[1:] - imp_off[:-1]).long()):
            raise ShardError(f"{where}: req_num_imps does not add up to the impressions of each sample; rebuild the shard")


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.device.type == "cpu":  # numpy: no intra-op thread pool (see batch._ranges)
        return bool(np.array_equal(a.numpy(), b.numpy()))
    return bool(torch.equal(a, b))


def _group_of(name: str, c: Col) -> str:
    if c.offsets is None:
        return "sample"
    if name.startswith("seq_"):
        return "seq"
    if name.startswith("imp__"):
        return "imp"
    if name.startswith("req__") or name in REQ_LISTS:
        return "req"
    return "list"


_ESIZE = {t: torch.empty((), dtype=t).element_size() for t in
          (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16, torch.uint32, torch.uint64,
           torch.float16, torch.float32, torch.float64)}


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def assemble(cols: dict[str, Col], idx: torch.Tensor, alloc, meta: dict) -> JaggedBatch:
    """Gather samples ``idx`` (rows of ``cols``) into one buffer from ``alloc(nbytes)``."""
    dev = next(iter(cols.values())).values.device
    idx = idx.to(dev).long()
    B = int(idx.numel())
    plan = []  # (name, dtype, numel, fill(out_view))
    group_idx: dict[str, torch.Tensor] = {}
    group_off: dict[str, torch.Tensor] = {}
    columns = {}

    def add(name, dtype, numel, fill):
        plan.append((name, dtype, int(numel), fill))

    def list_index(off: torch.Tensor):
        off = off.long()
        start = off[idx]
        ln = off[idx + 1] - start
        new = torch.zeros(B + 1, dtype=torch.long, device=dev)
        torch.cumsum(ln, 0, out=new[1:])
        return _ranges(start, ln), new

    for name, c in cols.items():
        g = _group_of(name, c)
        columns[name] = (g, c.arrow)
        if g == "sample":
            e = idx
        elif g in ("seq", "req", "imp"):
            if g not in group_idx:
                e, new = list_index(c.offsets)
                group_idx[g], group_off[g] = e, new
                add(f"{g}.offsets", torch.long, B + 1, lambda o, new=new: o.copy_(new))
            e = group_idx[g]
        else:
            e, new = list_index(c.offsets)
            add(f"{name}.offsets", torch.long, B + 1, lambda o, new=new: o.copy_(new))
        if c.str_offsets is not None:
            so = c.str_offsets.long()
            s0 = so[e]
            sl = so[e + 1] - s0
            snew = torch.zeros(e.numel() + 1, dtype=torch.long, device=dev)
            torch.cumsum(sl, 0, out=snew[1:])
            bidx = _ranges(s0, sl)
            add(name, torch.uint8, bidx.numel(), lambda o, v=c.values, i=bidx: take(v, i, o))
            add(name + ".soff", torch.long, e.numel() + 1, lambda o, s=snew: o.copy_(s))
        else:
            add(name, c.values.dtype, e.numel(), lambda o, v=c.values, i=e: take(v, i, o))
        if c.validity is not None:
            add(name + ".valid", torch.uint8, e.numel(), lambda o, v=c.validity, i=e: take(v, i, o))

    # derived index arrays: request -> sample, impression -> request
    if "req" in group_idx:
        R = int(group_idx["req"].numel())
        req_new = group_off["req"]
        req_sample = repeat(torch.arange(B, device=dev), req_new[1:] - req_new[:-1], R)
        add("req.sample", torch.long, R, lambda o, s=req_sample: o.copy_(s))
        if "req_num_imps" in cols and "imp" in group_idx:
            rni = cols["req_num_imps"].values[group_idx["req"]].long()
            N = int(group_idx["imp"].numel())
            imp_req = repeat(torch.arange(R, device=dev), rni, N)
            add("imp.req", torch.long, N, lambda o, s=imp_req: o.copy_(s))

    spec, pos = [], 0
    for name, dt, numel, _ in plan:
        size = _ESIZE[dt] * numel
        spec.append((name, dtype_name(dt), pos, numel))
        pos = _align(pos + size)
    buf = alloc(max(pos, ALIGN))
    for (name, dt, numel, fill), (_, _, off, _) in zip(plan, spec):
        size = _ESIZE[dt] * numel
        if numel:
            fill(buf[off: off + size].view(dt))
        end = _align(off + size)
        if end > off + size:  # zero the alignment padding: equal batches are equal bytes
            buf[off + size: end].zero_()
    m = dict(meta)
    m["num_samples"] = B
    m["columns"] = columns
    return JaggedBatch(buf, tuple(spec), m)


__all__ = ["Col", "from_arrow", "from_gds", "assemble", "check_groups", "column_group", "torch_dtype"]
