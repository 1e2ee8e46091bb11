"""Row groups -> flat column buffers -> one contiguous jagged batch.

Arrow decodes a buffer of row groups; every column becomes flat arrays
(values, list offsets, string offsets, validity), numpy views of Arrow's
buffers where possible. On the host (:class:`Prepared`) the columns of one
group and dtype are stacked, the whole buffer is shuffled once, and each
batch is a contiguous range copied with a few slice copies per block
(:meth:`Prepared.assemble_range`; no per-row Python, no per-column loop per
batch). Device columns (the GDS path) are gathered with torch index ops by
:func:`assemble`. Both write the arrays in the order of :func:`layout_key`,
so the same batch has the same bytes on either path.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

from userwise.pipelines.errors import ShardError
from userwise.pipelines.loader import segcopy
from userwise.pipelines.loader.batch import (
    ALIGN,
    JaggedBatch,
    _np_ranges,
    _ranges,
    dtype_name,
    repeat,
    take,
    torch_dtype,
)
from userwise.pipelines.loader.segcopy import seg_copy
from userwise.pipelines.shards import gds as gdsmod

REQ_LISTS = ("req_id", "req_time", "req_seq_begin", "req_seq_end", "req_num_imps", "req_snapshot")


def column_group(name: str, t: pa.DataType) -> str:
    """sample (scalar), seq, req, imp, or list (a list with its own offsets)."""
    if not (pa.types.is_list(t) or pa.types.is_large_list(t)):
        return "sample"
    return _list_group(name)


def _list_group(name: str) -> str:
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


_NP = {pa.int8(): np.int8, pa.int16(): np.int16, pa.int32(): np.int32, pa.int64(): np.int64,
       pa.uint8(): np.uint8, pa.uint16(): np.uint16, pa.uint32(): np.uint32, pa.uint64(): np.uint64,
       pa.float16(): np.float16, pa.float32(): np.float32, pa.float64(): np.float64, pa.date32(): np.int32}


_KINDS: dict = {}  # Arrow type id (list: with its value type's) -> how _fast decodes it


def _kind(t):
    """(list offsets dtype or None, "str" / "num" / None, string offsets dtype or numpy dtype,
    the type's name) for :func:`_fast`, worked out once per type: the per-column cost of a
    buffer's decode was mostly these type checks and names (Python calls), not the arrays."""
    key = (t.id, t.value_type.id) if pa.types.is_list(t) or pa.types.is_large_list(t) else t.id
    k = _KINDS.get(key)
    if k is None:
        off, leaf = None, t
        if pa.types.is_list(t) or pa.types.is_large_list(t):
            off, leaf = (np.int32 if pa.types.is_list(t) else np.int64), t.value_type
        if pa.types.is_string(leaf) or pa.types.is_binary(leaf):
            k = (off, "str", np.int32, str(leaf))
        elif pa.types.is_large_string(leaf) or pa.types.is_large_binary(leaf):
            k = (off, "str", np.int64, str(leaf))
        else:
            dt = _NP.get(leaf)
            k = (off, "num" if dt is not None and np.dtype(dt).byteorder != ">" else None, dt, str(leaf))
        _KINDS[key] = k  # the types _NP lists take no parameters: their id names them
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


def _torch_cols(cols: dict[str, Col]) -> dict[str, Col]:
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
    """Parallel list columns of a group must have equal lengths (else the shard is corrupt)."""
    if all(isinstance(c.values, np.ndarray) for c in cols.values()):
        _check_groups_np(cols, where)
        return
    cols = _torch_cols(cols)
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


def _check_groups_np(cols: dict[str, Col], where: str) -> None:
    first: dict[str, tuple[str, np.ndarray]] = {}
    for name, c in cols.items():
        g = _group_of(name, c)
        if g in ("seq", "req", "imp"):
            if g not in first:
                first[g] = (name, c.offsets)
            elif not np.array_equal(first[g][1], c.offsets):
                raise ShardError(f"{where}: list column {name!r} is not parallel to {first[g][0]!r} "
                                 "(different lengths per sample); rebuild the shard")
    if "req_num_imps" in cols and "imp" in first:
        rni = cols["req_num_imps"]
        csum = np.zeros(len(rni.values) + 1, np.int64)
        np.cumsum(rni.values, out=csum[1:])
        per_sample = csum[rni.offsets[1:]] - csum[rni.offsets[:-1]]
        if not np.array_equal(per_sample, np.diff(first["imp"][1])):
            raise ShardError(f"{where}: req_num_imps does not add up to the impressions of each sample; rebuild the shard")


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.device.type == "cpu":  # numpy: no intra-op thread pool (see batch._ranges)
        return bool(np.array_equal(a.numpy(), b.numpy()))
    return bool(torch.equal(a, b))


def _group_of(name: str, c: Col) -> str:
    """:func:`column_group` of a decoded column (a list is what has offsets)."""
    return "sample" if c.offsets is None else _list_group(name)


_ESIZE = {t: torch.empty((), dtype=t).element_size() for t in
          (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16, torch.uint32, torch.uint64,
           torch.float16, torch.float32, torch.float64)}


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


_GRANK = {"sample": 0, "seq": 1, "req": 2, "imp": 3, "list": 4}


def layout_key(group: str, group_sub: int, kind: int, dtype: str, col: int) -> tuple:
    """Where an array goes in the batch buffer (both assemblers sort by it, so
    host, worker and device batches have the same bytes): by group (sample,
    seq, req, imp, then each other list column), then offsets (0), numeric
    values (1, grouped by dtype), string bytes (2), string offsets (3),
    validity (4), derived indices (5), then the column's position."""
    return (_GRANK[group], group_sub, kind, dtype, col)


def _take_rows(arrays: list[np.ndarray], e: np.ndarray) -> np.ndarray:
    """Stack ``[a[e] for a in arrays]`` into one 2-D array (gathered straight into place)."""
    out = np.empty((len(arrays), len(e)), arrays[0].dtype)
    for r, a in enumerate(arrays):
        np.take(a, e, out=out[r], mode="clip")
    return out


class _Runs:
    """A block of long list columns left in place by :meth:`Prepared.permuted`: sample i of the
    permuted buffer is the run ``starts[i]: starts[i] + lengths[i]`` of every array. A batch
    copies its samples' runs straight into its buffer (:func:`segcopy.seg_copy`: one memcpy per
    run, where gather-then-slice made two copies and an element-wise gather costs more than a
    copy once lists hold a few dozen elements)."""

    def __init__(self, arrays: list[np.ndarray], starts: np.ndarray, lengths: np.ndarray):
        self.arrays, self.starts, self.lengths = arrays, starts, lengths
        self.dtype = arrays[0].dtype

    def __len__(self) -> int:
        return len(self.arrays)

    def copy_into(self, out: np.ndarray, a: int, b: int) -> None:
        st, ln = self.starts[a:b], self.lengths[a:b]
        for r, v in enumerate(self.arrays):
            seg_copy(v, st, ln, out[r])


# mean list length from which whole runs are copied instead of gathering elements
RUN_COPY_MIN = 32


def _select_lists(off: np.ndarray, rows: np.ndarray):
    """Rows ``rows`` of a list column with offsets ``off``: (element indexes, new offsets, lengths)."""
    start = off[rows]
    ln = off[rows + 1] - start
    new = np.zeros(len(rows) + 1, np.int64)
    np.cumsum(ln, out=new[1:])
    return _np_ranges(start, ln), new, ln


_LAYOUTS: dict = {}  # Prepared's layout per column signature (names, types, which arrays exist)


def _layout(cols: dict[str, Col]):
    """What :class:`Prepared` derives from the columns' names and kinds alone, worked out once
    per schema (every buffer of a node has the same one): the batch layout (entries in
    :func:`layout_key` order, count slots) and, per group, which columns form each block, the
    string group and the validity rows. Returns (attributes, group recipes)."""
    order = {name: i for i, name in enumerate(cols)}
    columns = {}
    groups: dict[tuple, dict] = {}
    for name, c in cols.items():
        g = _group_of(name, c)
        columns[name] = (g, c.arrow)
        gk = (g, order[name] if g == "list" else 0)
        G = groups.setdefault(gk, {"label": g if g != "list" else name, "off": None, "num": {}, "str": [],
                                   "valid": []})
        if c.offsets is not None and G["off"] is None:
            G["off"] = name
        if c.str_offsets is not None:
            G["str"].append((order[name], name))
        else:
            G["num"].setdefault(c.values.dtype.name, []).append((order[name], name))
        if c.validity is not None:
            G["valid"].append((order[name], name))
    # entries: (key, name, dtype, count slot); counts per batch: [B, B+1, n_g, n_g+1 ..., string bytes ...]
    entries = []
    recipes = []  # (g, sub, offsets column or None, count slot of n_g, blocks, strings, valid)
    nslot = 2
    for gk in sorted(groups, key=lambda k: (_GRANK[k[0]], k[1])):
        G = groups[gk]
        g, sub = gk
        if G["off"] is None:
            n_slot, n1_slot = 0, 1
        else:
            n_slot, n1_slot = nslot, nslot + 1
            nslot += 2
            entries.append((layout_key(g, sub, 0, "", 0), f"{G['label']}.offsets", "int64", 1))
        blocks = []
        for dt, items in G["num"].items():
            items.sort()
            for ci, name in items:
                entries.append((layout_key(g, sub, 1, dt, ci), name, dt, n_slot))
            blocks.append((layout_key(g, sub, 1, dt, items[0][0]), [name for _, name in items]))
        strings = None
        if G["str"]:
            G["str"].sort()
            first = nslot
            for ci, name in G["str"]:
                entries.append((layout_key(g, sub, 2, "", ci), name, "uint8", nslot))
                entries.append((layout_key(g, sub, 3, "int64", ci), name + ".soff", "int64", n1_slot))
                nslot += 1
            c0 = G["str"][0][0]
            strings = (layout_key(g, sub, 2, "", c0), layout_key(g, sub, 3, "int64", c0),
                       [name for _, name in G["str"]], first)
        valid = None
        if G["valid"]:
            G["valid"].sort()
            for ci, name in G["valid"]:
                entries.append((layout_key(g, sub, 4, "uint8", ci), name + ".valid", "uint8", n_slot))
            valid = (layout_key(g, sub, 4, "uint8", G["valid"][0][0]), [name for _, name in G["valid"]])
        recipes.append((g, sub, G["off"], n_slot, blocks, strings, valid))
    slots = {g: n for g, _, off, n, *_ in recipes if off is not None and g in ("req", "imp", "seq")}
    req_slot, imp_slot, seq_slot = slots.get("req"), slots.get("imp"), slots.get("seq")
    if req_slot is not None:
        entries.append((layout_key("req", 0, 5, "", 0), "req.sample", "int64", req_slot))
        if "req_num_imps" in cols and imp_slot is not None:
            entries.append((layout_key("imp", 0, 5, "", 0), "imp.req", "int64", imp_slot))
    entries.sort(key=lambda e: e[0])
    attrs = {"columns": columns, "req_slot": req_slot, "imp_slot": imp_slot, "seq_slot": seq_slot, "nslot": nslot,
             "keys": [e[0] for e in entries], "where": {e[0]: i for i, e in enumerate(entries)},
             "names": [e[1] for e in entries], "dtypes": [e[2] for e in entries],
             "itemsize": np.array([np.dtype(e[2]).itemsize for e in entries], np.int64),
             "slot": np.array([e[3] for e in entries], np.int64)}
    return attrs, recipes


class Prepared:
    """One decoded buffer (host columns) laid out for fast batch gathers.

    Built once per buffer of row groups: columns of the same group and dtype
    are stacked into one 2-D array (one gather per block instead of one per
    column), the string columns of a group share one byte array, and the
    order of the arrays in a batch (:func:`layout_key`) is fixed. A batch is
    then a handful of vectorised numpy gathers straight into the caller's
    buffer, whatever the number of columns (numpy, not torch: no intra-op
    threads on a busy host)."""

    def __init__(self, cols: dict[str, Col]):
        if not all(isinstance(x, np.ndarray) or x is None
                   for c in cols.values() for x in (c.values, c.offsets, c.str_offsets, c.validity)):
            cols = {n: Col(*(None if x is None else np.asarray(x) for x in (c.values, c.offsets, c.str_offsets,
                                                                            c.validity)), c.arrow)
                    for n, c in cols.items()}
        sig = tuple((n, c.arrow, c.values.dtype.str, c.offsets is None, c.str_offsets is None, c.validity is None)
                    for n, c in cols.items())
        lay = _LAYOUTS.get(sig)
        if lay is None:
            lay = _layout(cols)
            if len(_LAYOUTS) >= 64:  # a long run over many schemas: start over rather than grow
                _LAYOUTS.clear()
            _LAYOUTS[sig] = lay
        attrs, recipes = lay
        self.__dict__.update(attrs)
        self.rni = cols["req_num_imps"].values.astype(np.int64) if "req_num_imps" in cols else None
        self.groups = []  # (g, sub, offsets or None, count slot of n_g, blocks, strings, valid)
        for g, sub, off_name, n_slot, blocks, strings, valid in recipes:
            off = None if off_name is None else cols[off_name].offsets.astype(np.int64, copy=False)
            blocks2 = [(key, [cols[n].values for n in names]) for key, names in blocks]
            strings2 = None
            if strings is not None:
                bkey, skey, names, first = strings
                ds = [cols[n].values for n in names]
                data = np.concatenate(ds) if len(ds) > 1 else ds[0]
                base = 0
                soff = np.empty((len(names), len(cols[names[0]].str_offsets)), np.int64)
                for r, (n, d) in enumerate(zip(names, ds)):
                    np.add(cols[n].str_offsets, base, out=soff[r])
                    base += len(d)
                strings2 = (bkey, skey, data, soff, first)
            valid2 = None
            if valid is not None:
                key, names = valid
                valid2 = (key, [cols[n].validity.astype(np.uint8, copy=False) for n in names])
            self.groups.append((g, sub, off, n_slot, blocks2, strings2, valid2))

    def permuted(self, perm) -> "Prepared":
        """This buffer with its samples in ``perm`` order: one gather per block for the
        whole buffer, after which every batch is a contiguous range (:meth:`assemble_range`:
        slices and copies only, the per-batch work no longer grows with the gathers)."""
        perm = np.asarray(perm, dtype=np.int64)
        B = len(perm)
        p = object.__new__(Prepared)
        p.__dict__.update(self.__dict__)
        groups = []
        req_e = None
        nb = segcopy.batch_kernels()
        for g, sub, off, n_slot, blocks, strings, valid in self.groups:
            runs = None
            if off is None:
                e, new = perm, None
                st, ln = perm, np.ones(B, np.int64)
            else:
                st = off[perm]
                ln = off[perm + 1] - st
                new = np.zeros(B + 1, np.int64)
                np.cumsum(ln, out=new[1:])
                if g != "req" and B and new[-1] >= RUN_COPY_MIN * B and not strings and not valid:
                    runs = (st, ln)
                elif nb is not None:
                    e = np.empty(int(new[-1]), np.int64)
                    nb.ranges(st, ln, e)
                else:
                    e = _np_ranges(st, ln)
                if g == "req":
                    req_e = e
            if runs is None:
                blocks2 = [(key, _take_rows(V, e)) for key, V in blocks]
            else:  # long lists stay where they are: each batch copies its samples' runs (one copy, not two)
                blocks2 = [(key, _Runs(V, *runs)) for key, V in blocks]
            strings2 = None
            if strings is not None and nb is not None:  # compiled: one block copy per (sample, column)
                bkey, skey, data, soff, first = strings
                data2 = np.empty(len(data), np.uint8)  # the runs are distinct samples: at most every byte
                soff2 = np.empty((len(soff), len(e) + 1), np.int64)
                n = nb.perm_strings(data, soff, st, ln, data2, soff2)
                strings2 = (bkey, skey, data2[:n], soff2, first)
            elif strings is not None:
                bkey, skey, data, soff, first = strings
                s0 = soff[:, e]
                sl = soff[:, e + 1] - s0
                snew = np.zeros((len(soff), len(e) + 1), np.int64)
                np.cumsum(sl, axis=1, out=snew[:, 1:])
                base = np.concatenate([[0], np.cumsum(snew[:, -1])[:-1]])
                data2 = np.empty(int(snew[:, -1].sum()), np.uint8)
                seg_copy(data, s0.ravel(), sl.ravel(), data2)  # one run per string
                strings2 = (bkey, skey, data2, snew + base[:, None], first)
            valid2 = None if valid is None else (valid[0], _take_rows(valid[1], e))
            groups.append((g, sub, new, n_slot, blocks2, strings2, valid2))
        p.groups = groups
        p.B = B
        p.req_sample = p.imp_req = None
        if self.req_slot is not None:
            roff = next(off for g, _, off, *_ in groups if g == "req")
            p.req_sample = np.repeat(np.arange(B, dtype=np.int64), np.diff(roff))
            if self.rni is not None and self.imp_slot is not None:
                p.imp_req = np.repeat(np.arange(len(req_e), dtype=np.int64), self.rni[req_e])
        p._prog = p._program()
        return p

    def _program(self):
        """The batch program of a permuted buffer for the compiled kernels: one op per array of
        the batch layout (which source, which group's range, how it is copied), so that a batch
        is two compiled calls (:meth:`assemble_range`) instead of a few numpy calls per array.
        None where the kernels are unavailable (numpy assembles; same bytes)."""
        nb = segcopy.batch_kernels()
        if nb is None:
            return None
        bsrc, isrc = [], []
        rows: list = [None] * len(self.names)
        where = self.where

        def b_(a):
            bsrc.append(a)
            return len(bsrc) - 1

        def i_(a):
            isrc.append(a)
            return len(isrc) - 1

        goff = {}
        for g, sub, off, _, blocks, strings, valid in self.groups:
            go = -1
            if off is not None:
                go = i_(off)
                if g != "list":
                    goff[g] = go
                rows[where[layout_key(g, sub, 0, "", 0)]] = (nb.OFFS, 0, 0, 0, 8, go, -1)
            runs = None  # the group's runs (shared by its blocks), listed once
            for key, V in blocks:
                i0 = where[key]
                if isinstance(V, _Runs):
                    st, ln = runs = runs or (i_(V.starts), i_(V.lengths))
                    for r, v in enumerate(V.arrays):
                        rows[i0 + r] = (nb.RUN, b_(v), st, ln, v.dtype.itemsize, go, -1)
                else:
                    for r in range(len(V)):
                        rows[i0 + r] = (nb.VAL, b_(V[r]), 0, 0, V.dtype.itemsize, go, -1)
            if strings is not None:
                bkey, skey, data, soff, _ = strings
                d, i0, j0 = b_(data), where[bkey], where[skey]
                for c in range(len(soff)):
                    so = i_(soff[c])
                    rows[i0 + c] = (nb.STR, d, so, 0, 1, go, -1)
                    rows[j0 + c] = (nb.SOFF, 0, so, 0, 8, go, -1)
            if valid is not None:
                key, V = valid
                for r in range(len(V)):
                    rows[where[key] + r] = (nb.VAL, b_(V[r]), 0, 0, 1, go, -1)
        if self.req_sample is not None:
            rows[where[layout_key("req", 0, 5, "", 0)]] = (nb.SUB, 0, i_(self.req_sample), 0, 8, goff["req"], -1)
            if self.imp_req is not None:
                rows[where[layout_key("imp", 0, 5, "", 0)]] = (nb.SUB, 0, i_(self.imp_req), 0, 8, goff["imp"],
                                                               goff["req"])
        if any(r is None for r in rows):  # pragma: no cover (a layout entry without an op: stay on numpy)
            return None
        seq = isrc[goff["seq"]] if "seq" in goff else None
        imp = isrc[goff["imp"]] if "imp" in goff and self.imp_req is not None else None
        return (nb, np.array(rows, np.int64).reshape(-1, 7), segcopy.byte_sources(bsrc), segcopy.int_sources(isrc),
                seq, imp)

    def _assemble_compiled(self, prog, a: int, b: int, alloc, meta: dict) -> JaggedBatch:
        nb, ops, bsrc, isrc, seq, imp = prog
        pos, numel = np.empty(len(ops), np.int64), np.empty(len(ops), np.int64)
        total = int(nb.batch_layout(ops, a, b, isrc.table, ALIGN, pos, numel))
        buf = alloc(max(total, ALIGN))
        nb.batch_fill(buf.numpy(), ops, a, b, bsrc.table, isrc.table, pos, numel, ALIGN, total)
        m = dict(meta)
        m["num_samples"] = b - a
        m["columns"] = self.columns
        m["events"] = int(seq[b] - seq[a]) if seq is not None and b > a else 0
        m["impressions"] = int(imp[b] - imp[a]) if imp is not None else 0
        return JaggedBatch(buf, tuple(zip(self.names, self.dtypes, pos.tolist(), numel.tolist())), m)

    def _layout_buffer(self, counts, alloc):
        """One buffer for the batch: every array in its own ALIGN-aligned slot, padding zeroed
        (equal batches are equal bytes). Returns (buffer, its uint8 view, slot offsets, slot sizes)."""
        numel = counts[self.slot]
        nbytes = numel * self.itemsize
        aligned = (nbytes + (ALIGN - 1)) // ALIGN * ALIGN
        pos = np.cumsum(aligned) - aligned
        total = int(aligned.sum())
        buf = alloc(max(total, ALIGN))
        out = buf.numpy()
        pad = _np_ranges(pos + nbytes, aligned - nbytes)
        if len(pad):
            out[pad] = 0
        if len(out) > total:
            out[total:] = 0
        return buf, out, pos.tolist(), aligned.tolist()

    def assemble_range(self, a: int, b: int, alloc, meta: dict) -> JaggedBatch:
        """Samples ``a:b`` of a :meth:`permuted` buffer as one batch (same bytes as
        ``assemble(perm[a:b])`` on the unpermuted buffer): compiled where numba is, else numpy."""
        prog = getattr(self, "_prog", None)
        if prog is not None:
            return self._assemble_compiled(prog, a, b, alloc, meta)
        B = b - a
        counts = np.zeros(self.nslot, np.int64)
        counts[0], counts[1] = B, B + 1
        work = []
        rng = {}
        for g, sub, off, n_slot, blocks, strings, valid in self.groups:
            if off is None:
                ea, eb, new = a, b, None
            else:
                ea, eb = int(off[a]), int(off[b])
                new = off[a: b + 1] - ea
                counts[n_slot], counts[n_slot + 1] = eb - ea, eb - ea + 1
            rng[g] = (ea, eb)
            snew = None
            if strings is not None:
                _, _, _, soff, first = strings
                snew = soff[:, ea: eb + 1] - soff[:, ea: ea + 1]
                counts[first: first + len(soff)] = snew[:, -1]
            work.append((g, sub, ea, eb, new, blocks, strings, valid, snew))
        buf, out, P, A = self._layout_buffer(counts, alloc)
        numel = counts[self.slot]
        where = self.where

        def block(key, dt, rows, n):
            i = where[key]
            stride = A[i] // np.dtype(dt).itemsize
            return out[P[i]: P[i] + rows * A[i]].view(dt).reshape(rows, stride)[:, :n]

        for g, sub, ea, eb, new, blocks, strings, valid, snew in work:
            n = eb - ea
            if new is not None:
                i = where[layout_key(g, sub, 0, "", 0)]
                out[P[i]: P[i] + 8 * (B + 1)].view(np.int64)[:] = new
            for key, V in blocks:
                if isinstance(V, _Runs):
                    V.copy_into(block(key, V.dtype, len(V), n), a, b)
                else:
                    block(key, V.dtype, len(V), n)[:] = V[:, ea:eb]
            if strings is not None:
                bkey, skey, data, soff, _ = strings
                i0 = where[bkey]
                lo, hi = soff[:, ea].tolist(), soff[:, eb].tolist()
                for c in range(len(soff)):
                    out[P[i0 + c]: P[i0 + c] + hi[c] - lo[c]] = data[lo[c]: hi[c]]
                block(skey, np.int64, len(soff), n + 1)[:] = snew
            if valid is not None:
                key, V = valid
                block(key, V.dtype, len(V), n)[:] = V[:, ea:eb]
        if self.req_sample is not None:
            ra, rb = rng["req"]
            i = where[layout_key("req", 0, 5, "", 0)]
            np.subtract(self.req_sample[ra:rb], a, out=out[P[i]: P[i] + 8 * (rb - ra)].view(np.int64))
            if self.imp_req is not None:
                ia, ib = rng["imp"]
                i = where[layout_key("imp", 0, 5, "", 0)]
                np.subtract(self.imp_req[ia:ib], ra, out=out[P[i]: P[i] + 8 * (ib - ia)].view(np.int64))
        spec = tuple(zip(self.names, self.dtypes, P, numel.tolist()))
        m = dict(meta)
        m["num_samples"] = B
        m["columns"] = self.columns
        m["events"] = int(counts[self.seq_slot]) if self.seq_slot is not None and B else 0
        m["impressions"] = int(counts[self.imp_slot]) if self.imp_req is not None else 0
        return JaggedBatch(buf, spec, m)

    def assemble(self, idx, alloc, meta: dict) -> JaggedBatch:
        """Gather samples ``idx`` (row numbers of this buffer) into one buffer from ``alloc(nbytes)``."""
        idx = np.asarray(idx, dtype=np.int64)
        B = len(idx)
        counts = np.zeros(self.nslot, np.int64)
        counts[0], counts[1] = B, B + 1
        work = []
        req_len = req_e = None
        for g, sub, off, n_slot, blocks, strings, valid in self.groups:
            if off is None:
                e, new = idx, None
            else:
                e, new, ln = _select_lists(off, idx)
                counts[n_slot], counts[n_slot + 1] = len(e), len(e) + 1
                if g == "req":
                    req_len, req_e = ln, e
            snew = sl = None
            if strings is not None:
                _, _, _, soff, first = strings
                s0 = soff[:, e]
                sl = soff[:, e + 1] - s0
                snew = np.zeros((len(soff), len(e) + 1), np.int64)
                np.cumsum(sl, axis=1, out=snew[:, 1:])
                counts[first: first + len(soff)] = snew[:, -1]
                sl = (s0, sl)
            work.append((g, sub, e, new, blocks, strings, valid, snew, sl))
        buf, out, P, A = self._layout_buffer(counts, alloc)
        numel = counts[self.slot]
        where = self.where

        def block(key, dt, rows, n):
            """rows arrays of n elements each, one per aligned slot, as a 2-D view."""
            i = where[key]
            size = np.dtype(dt).itemsize
            stride = A[i] // size
            return out[P[i]: P[i] + rows * A[i]].view(dt).reshape(rows, stride)[:, :n]

        for g, sub, e, new, blocks, strings, valid, snew, sl in work:
            n = len(e)
            if new is not None:
                i = where[layout_key(g, sub, 0, "", 0)]
                out[P[i]: P[i] + 8 * (B + 1)].view(np.int64)[:] = new
            for key, cs in blocks:
                o = block(key, cs[0].dtype, len(cs), n)
                for r, v in enumerate(cs):
                    np.take(v, e, out=o[r], mode="clip")
            if strings is not None:
                bkey, skey, data, soff, _ = strings
                s0, ln = sl[0].ravel(), sl[1].ravel()
                i0 = where[bkey]
                starts = np.array(P[i0: i0 + len(soff)], np.int64)
                dst = _np_ranges((starts[:, None] + snew[:, :-1]).ravel(), ln)
                if len(dst):
                    out[dst] = data[_np_ranges(s0, ln)]
                block(skey, np.int64, len(soff), n + 1)[:] = snew
            if valid is not None:
                key, cs = valid
                o = block(key, cs[0].dtype, len(cs), n)
                for r, v in enumerate(cs):
                    np.take(v, e, out=o[r], mode="clip")
        if self.req_slot is not None:
            i = where[layout_key("req", 0, 5, "", 0)]
            R = len(req_e)
            out[P[i]: P[i] + 8 * R].view(np.int64)[:] = np.repeat(np.arange(B, dtype=np.int64), req_len)
            if self.rni is not None and self.imp_slot is not None:
                i = where[layout_key("imp", 0, 5, "", 0)]
                k = self.rni[req_e]
                N = int(k.sum())
                out[P[i]: P[i] + 8 * N].view(np.int64)[:] = np.repeat(np.arange(R, dtype=np.int64), k)
        spec = tuple(zip(self.names, self.dtypes, P, numel.tolist()))
        m = dict(meta)
        m["num_samples"] = B
        m["columns"] = self.columns
        m["events"] = int(counts[self.seq_slot]) if self.seq_slot is not None and B else 0
        m["impressions"] = int(counts[self.imp_slot]) if "imp.req" in self.names else 0
        return JaggedBatch(buf, spec, m)


def assemble(cols: dict[str, Col], idx: torch.Tensor, alloc, meta: dict) -> JaggedBatch:
    """Gather samples ``idx`` (rows of ``cols``) into one buffer from ``alloc(nbytes)``."""
    cols = _torch_cols(cols)
    dev = next(iter(cols.values())).values.device
    idx = idx.to(dev).long()
    B = int(idx.numel())
    plan = []  # (name, dtype, numel, fill(out_view))
    group_idx: dict[str, torch.Tensor] = {}
    group_off: dict[str, torch.Tensor] = {}
    columns = {}

    order = {name: i for i, name in enumerate(cols)}

    def add(name, dtype, numel, fill, key=None):
        plan.append((key, name, dtype, int(numel), fill))

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
                add(f"{g}.offsets", torch.long, B + 1, lambda o, new=new: o.copy_(new), layout_key(g, 0, 0, "", 0))
            e = group_idx[g]
        else:
            e, new = list_index(c.offsets)
            add(f"{name}.offsets", torch.long, B + 1, lambda o, new=new: o.copy_(new), layout_key(g, order[name], 0, "", 0))
        gi = order[name] if g == "list" else 0
        ci = order[name]
        if c.str_offsets is not None:
            so = c.str_offsets.long()
            s0 = so[e]
            sl = so[e + 1] - s0
            snew = torch.zeros(e.numel() + 1, dtype=torch.long, device=dev)
            torch.cumsum(sl, 0, out=snew[1:])
            bidx = _ranges(s0, sl)
            add(name, torch.uint8, bidx.numel(), lambda o, v=c.values, i=bidx: take(v, i, o), layout_key(g, gi, 2, "", ci))
            add(name + ".soff", torch.long, e.numel() + 1, lambda o, s=snew: o.copy_(s), layout_key(g, gi, 3, "int64", ci))
        else:
            add(name, c.values.dtype, e.numel(), lambda o, v=c.values, i=e: take(v, i, o),
                layout_key(g, gi, 1, dtype_name(c.values.dtype), ci))
        if c.validity is not None:
            add(name + ".valid", torch.uint8, e.numel(), lambda o, v=c.validity, i=e: take(v, i, o),
                layout_key(g, gi, 4, "uint8", ci))

    # derived index arrays: request -> sample, impression -> request
    if "req" in group_idx:
        R = int(group_idx["req"].numel())
        req_new = group_off["req"]
        req_sample = repeat(torch.arange(B, device=dev), req_new[1:] - req_new[:-1], R)
        add("req.sample", torch.long, R, lambda o, s=req_sample: o.copy_(s), layout_key("req", 0, 5, "", 0))
        if "req_num_imps" in cols and "imp" in group_idx:
            rni = cols["req_num_imps"].values[group_idx["req"]].long()
            N = int(group_idx["imp"].numel())
            imp_req = repeat(torch.arange(R, device=dev), rni, N)
            add("imp.req", torch.long, N, lambda o, s=imp_req: o.copy_(s), layout_key("imp", 0, 5, "", 0))

    plan = [p[1:] for p in sorted(plan, key=lambda p: p[0])]
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


__all__ = ["Col", "Prepared", "from_arrow", "from_gds", "assemble", "check_groups", "column_group", "torch_dtype"]
