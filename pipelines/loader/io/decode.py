"""Shard bytes -> flat columns: what the assemblers start from.

Arrow decodes a buffer of row groups (or the GDS side files are read); every
column becomes a :class:`Col` of flat arrays: values, list offsets, string
offsets, validity. Host arrays are numpy views of Arrow's buffers where
possible; list offsets start at 0. :func:`check_groups` refuses a buffer whose
parallel list columns disagree. Each column belongs to a *group*
(:func:`column_group`): per sample, the ``seq_`` lists, the request lists, the
``imp__`` lists, or a list with its own offsets.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import torch

from userwise.pipelines.errors import ShardError
from userwise.pipelines.jagged import np_offsets, offsets
from userwise.pipelines.shards import gds as gdsmod

REQ_LISTS = ("req_id", "req_time", "req_seq_begin", "req_seq_end", "req_num_imps", "req_snapshot")


def column_group(name: str, t: pa.DataType) -> str:
    """sample (scalar), seq, req, imp, or list (a list with its own offsets)."""
    if not (pa.types.is_list(t) or pa.types.is_large_list(t)):
        return "sample"
    return list_group(name)


def list_group(name: str) -> str:
    """The group of a list column, by its name."""
    if name.startswith("seq_"):
        return "seq"
    if name.startswith("imp__"):
        return "imp"
    if name.startswith("req__") or name in REQ_LISTS:
        return "req"
    return "list"


@dataclass
class Col:
    """One decoded column: flat values, list offsets (lists), string offsets (strings: the
    values are their utf-8 bytes), validity (uint8, only where there are nulls), and the
    Arrow type's name (the batch's ``meta["columns"]``)."""

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


# the numpy dtype of each Arrow type the loader reads as numbers
NUMPY_DTYPES = {pa.int8(): np.int8, pa.int16(): np.int16, pa.int32(): np.int32, pa.int64(): np.int64,
                pa.uint8(): np.uint8, pa.uint16(): np.uint16, pa.uint32(): np.uint32, pa.uint64(): np.uint64,
                pa.float16(): np.float16, pa.float32(): np.float32, pa.float64(): np.float64,
                pa.date32(): np.int32}


class _Kind(NamedTuple):
    """How :func:`_fast` reads an Arrow type."""

    offsets: type | None  # the list offsets' numpy dtype (None: not a list)
    leaf: str | None  # "str", "num", or None (the general path)
    dtype: type | None  # "str": the string offsets' numpy dtype; "num": the values'
    name: str  # the (leaf) type's name


_KINDS: dict = {}  # Arrow type id (list: with its value type's) -> its _Kind


def _kind(t) -> _Kind:
    """The :class:`_Kind` of an Arrow type, worked out once per type: the per-column cost of
    a buffer's decode is mostly these type checks and names (Python calls), not the arrays."""
    key = (t.id, t.value_type.id) if pa.types.is_list(t) or pa.types.is_large_list(t) else t.id
    k = _KINDS.get(key)
    if k is None:
        off, leaf = None, t
        if pa.types.is_list(t) or pa.types.is_large_list(t):
            off, leaf = (np.int32 if pa.types.is_list(t) else np.int64), t.value_type
        if pa.types.is_string(leaf) or pa.types.is_binary(leaf):
            k = _Kind(off, "str", np.int32, str(leaf))
        elif pa.types.is_large_string(leaf) or pa.types.is_large_binary(leaf):
            k = _Kind(off, "str", np.int64, str(leaf))
        else:
            dt = NUMPY_DTYPES.get(leaf)
            k = _Kind(off, "num" if dt is not None and np.dtype(dt).byteorder != ">" else None, dt, str(leaf))
        _KINDS[key] = k  # the types NUMPY_DTYPES lists take no parameters: their id names them
    return k


def _fast(col) -> dict | None:
    """Zero-copy flat arrays of a primitive or list-of-primitive column (the common case:
    no null lists, native little-endian); None where the general path is needed."""
    if isinstance(col, pa.ChunkedArray):  # one chunk: use it as it is (combine_chunks copies even then)
        arr = col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()
    else:
        arr = col
    off_dt, leaf, dt, name = _kind(arr.type)
    if leaf is None:
        return None
    offsets = None
    if off_dt is not None:
        if arr.null_count:
            return None
        ob = np.frombuffer(arr.buffers()[1], off_dt)
        ob = ob[arr.offset: arr.offset + len(arr) + 1]
        o0 = int(ob[0]) if len(ob) else 0
        offsets = ob.astype(np.int64)
        if o0:
            offsets -= o0
        arr = arr.values.slice(o0, int(offsets[-1]) if len(offsets) else 0)
    if leaf == "str":
        if arr.null_count:
            return None
        bufs = arr.buffers()
        so = np.frombuffer(bufs[1], dt)
        so = so[arr.offset: arr.offset + len(arr) + 1]
        s0, s1 = (int(so[0]), int(so[-1])) if len(so) else (0, 0)
        data = np.frombuffer(bufs[2], np.uint8)[s0:s1] if bufs[2] is not None else np.zeros(0, np.uint8)
        so = so.astype(np.int64)
        if s0:
            so -= s0
        return {"values": data, "offsets": offsets, "str_offsets": so, "validity": None, "arrow": name}
    bufs = arr.buffers()
    v = np.frombuffer(bufs[1], dt)[arr.offset: arr.offset + len(arr)] if bufs[1] is not None else np.zeros(0, dt)
    valid = None
    if arr.null_count:  # nulls read as 0, with a validity mask
        valid = gdsmod.validity(arr)
        v = np.where(valid.view(bool), v, np.zeros((), dt))
    return {"values": v, "offsets": offsets, "str_offsets": None, "validity": valid, "arrow": name}


def from_arrow(table: pa.Table, where: str = "") -> dict[str, Col]:
    """Flat columns of a (decoded) table; list offsets start at 0. Host arrays are numpy
    (zero-copy views of Arrow's buffers where possible)."""
    out = {}
    for name, col in zip(table.column_names, table.columns):
        a = _fast(col)
        if a is None:
            a = gdsmod.column_arrays(col)
        if a is None:
            raise ShardError(f"{where}: column {name!r} of type {table.schema.field(name).type} is not supported by the loader")
        v = a["values"]
        if v.dtype.byteorder == ">":  # pragma: no cover (big-endian hosts)
            v = v.astype(v.dtype.newbyteorder("="))
        out[name] = Col(v, a["offsets"], a["str_offsets"], a["validity"], a["arrow"])
    return out


def torch_cols(cols: dict[str, Col]) -> dict[str, Col]:
    """Columns as torch tensors (host numpy arrays wrapped without copying)."""
    if all(isinstance(c.values, torch.Tensor) for c in cols.values()):
        return cols
    return {n: Col(*(_t(x) if isinstance(x, np.ndarray) else x for x in (c.values, c.offsets, c.str_offsets, c.validity)),
                   c.arrow) for n, c in cols.items()}


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
    """Parallel list columns of a group must have equal lengths, and ``req_num_imps`` must add
    up to each sample's impressions (else the shard is corrupt). Host columns are checked in
    numpy, device columns where they are."""
    host = all(isinstance(c.values, np.ndarray) or c.values.device.type == "cpu" for c in cols.values())
    if host:
        arr = lambda x: x if isinstance(x, np.ndarray) else x.numpy()  # noqa: E731
        off_of, equal = np_offsets, np.array_equal
    else:
        cols = torch_cols(cols)
        arr = lambda x: x.long()  # noqa: E731
        off_of, equal = offsets, torch.equal
    first: dict[str, tuple[str, object]] = {}
    for name, c in cols.items():
        g = group_of(name, c)
        if g in ("seq", "req", "imp"):
            if g not in first:
                first[g] = (name, arr(c.offsets))
            elif not bool(equal(first[g][1], arr(c.offsets))):
                raise ShardError(f"{where}: list column {name!r} is not parallel to {first[g][0]!r} "
                                 "(different lengths per sample); rebuild the shard")
    if "req_num_imps" in cols and "imp" in first:
        rni = cols["req_num_imps"]
        csum, ro = off_of(arr(rni.values)), arr(rni.offsets)
        imp_off = first["imp"][1]
        if not bool(equal(csum[ro[1:]] - csum[ro[:-1]], imp_off[1:] - imp_off[:-1])):
            raise ShardError(f"{where}: req_num_imps does not add up to the impressions of each sample; rebuild the shard")


def group_of(name: str, c: Col) -> str:
    """:func:`column_group` of a decoded column (a list is what has offsets)."""
    return "sample" if c.offsets is None else list_group(name)


__all__ = ["Col", "NUMPY_DTYPES", "from_arrow", "from_gds", "torch_cols", "check_groups", "column_group",
           "group_of", "list_group"]
