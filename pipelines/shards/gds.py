"""The GDS side file: raw column arrays that GPUDirect Storage can DMA.

Parquet pages cannot be read straight into usable device tensors (levels,
page headers, encodings). For a shard ``shard-NNNNN.parquet`` the side file
``shard-NNNNN.gds`` holds, for every row group and every column of primitive
or list-of-primitive type, the values as one little-endian array and, for
list columns, the int64 offsets (row-group relative, starting at 0) as
another; every array is uncompressed and starts on a 4096-byte boundary.

At the end: a JSON index, 8 bytes little-endian index length, the magic
``UWGDS001``::

    {"format_version": 1, "row_groups": [{"rows": n, "columns": {name: {
        "dtype": "<i8", "values": [offset, nbytes],
        "offsets": [offset, nbytes] | null,
        # extensions (absent when not needed):
        "str_offsets": [offset, nbytes],   # string elements: int64 offsets into the utf-8 bytes
        "validity": [offset, nbytes],      # uint8 per value, 1 = valid, only when nulls exist
        "arrow": "<element arrow type>"}}}]}

Types: date32 is stored as ``<i4`` (days), bool as ``|u1``, strings as utf-8
bytes (``|u1``) plus ``str_offsets`` (readable on the host; the loader reads
them from there, not into tensors). Null elements are stored as 0 with a
validity array, so nothing is lost.

API: :func:`write_side_file`, :func:`read_index`, :func:`read_host`,
:func:`read_device` (kvikio, when present). No Spark, no torch at import.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from userwise.pipelines.errors import ShardError
from userwise.schemas.core import GDS_INDEX_FORMAT

MAGIC = b"UWGDS001"
ALIGN = 4096
FORMAT_VERSION = GDS_INDEX_FORMAT

__all__ = ["MAGIC", "ALIGN", "write_side_file", "read_index", "read_host", "read_device", "side_path"]


def side_path(parquet_path: str) -> str:
    """``.../shard-00003.parquet`` -> ``.../shard-00003.gds``."""
    base, _ = os.path.splitext(parquet_path)
    return base + ".gds"


def _is_stringy(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t) or pa.types.is_large_binary(t)


def _supported(t: pa.DataType) -> bool:
    return pa.types.is_primitive(t) or pa.types.is_date32(t) or _is_stringy(t)


def validity(arr: pa.Array) -> np.ndarray:
    """An Arrow array's validity as uint8 (1 = valid), unpacked from its bitmap in numpy.
    (``np.asarray(arr.is_valid())`` converts through Python objects: orders of magnitude slower.)"""
    if not arr.null_count:
        return np.ones(len(arr), np.uint8)
    if arr.buffers()[0] is None:  # a null-type array: no bitmap, all null
        return np.zeros(len(arr), np.uint8)
    bits = np.unpackbits(np.frombuffer(arr.buffers()[0], np.uint8), bitorder="little")
    return bits[arr.offset: arr.offset + len(arr)]


def _np_values(arr: pa.Array) -> tuple[np.ndarray, np.ndarray | None]:
    """A flat primitive Arrow array -> (little-endian numpy values, validity or None)."""
    valid = None
    if arr.null_count:
        valid = validity(arr)
        arr = pc.fill_null(arr, pa.scalar(0, arr.type) if not pa.types.is_date32(arr.type) else pa.scalar(0, pa.int32()).cast(arr.type))
    t = arr.type
    if pa.types.is_date32(t):
        arr = arr.cast(pa.int32())
    elif pa.types.is_boolean(t):
        arr = arr.cast(pa.uint8())
    v = arr.to_numpy(zero_copy_only=False)
    return v.astype(v.dtype.newbyteorder("<"), copy=False), valid


def _np_strings(arr: pa.Array) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A flat string/binary array -> (utf-8 bytes, int64 offsets from 0, validity or None)."""
    valid = validity(arr) if arr.null_count else None
    big = arr.cast(pa.large_binary()) if not pa.types.is_large_binary(arr.type) else arr
    bufs = big.buffers()
    n = len(big)
    offs = np.frombuffer(bufs[1], dtype="<i8")[big.offset: big.offset + n + 1] if n else np.zeros(1, "<i8")
    data = np.frombuffer(bufs[2], dtype=np.uint8) if bufs[2] is not None else np.zeros(0, np.uint8)
    data = data[offs[0]: offs[-1]] if n else data[:0]
    return data, (offs - offs[0]).astype("<i8"), valid


def column_arrays(col: pa.Array | pa.ChunkedArray) -> dict | None:
    """Flat arrays of one column: {"values", "offsets", "str_offsets", "validity", "arrow"}.

    Returns None for column types the side file does not hold (nested beyond
    one list level, structs, maps...).
    """
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    t = col.type
    offsets = None
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        if not _supported(t.value_type):
            return None
        lengths = pc.list_value_length(col)
        if lengths.null_count:
            lengths = pc.fill_null(lengths, 0)
        lengths = lengths.to_numpy(zero_copy_only=False).astype(np.int64)
        offsets = np.zeros(len(col) + 1, "<i8")
        np.cumsum(lengths, out=offsets[1:])
        col = pc.list_flatten(col)
        t = t.value_type
    elif not _supported(t):
        return None
    out = {"offsets": offsets, "str_offsets": None, "arrow": str(t)}
    if _is_stringy(t):
        out["values"], out["str_offsets"], out["validity"] = _np_strings(col)
    else:
        out["values"], out["validity"] = _np_values(col)
    return out


def _row_groups(source):
    if isinstance(source, (str, os.PathLike)):
        pf = pq.ParquetFile(source)
        for i in range(pf.num_row_groups):
            yield pf.read_row_group(i)
    else:
        yield source


def write_side_file(table_or_parquet_path, out_path: str) -> dict:
    """Write the GDS side file for a Parquet shard (one entry per row group) or
    for an in-memory table (one row group). Returns {"bytes", "sha256"}.

    Example::

        info = write_side_file("node=0/shard-00000.parquet", "node=0/shard-00000.gds")
    """
    index = {"format_version": FORMAT_VERSION, "row_groups": []}
    h = hashlib.sha256()
    tmp = out_path + ".tmp"
    pos = 0
    with open(tmp, "wb") as f:

        def put(arr: np.ndarray) -> list[int]:
            nonlocal pos
            pad = (-pos) % ALIGN
            if pad:
                z = b"\0" * pad
                f.write(z)
                h.update(z)
                pos += pad
            b = np.ascontiguousarray(arr).tobytes()
            f.write(b)
            h.update(b)
            at = pos
            pos += len(b)
            return [at, len(b)]

        for rg in _row_groups(table_or_parquet_path):
            cols = {}
            for name in rg.column_names:
                a = column_arrays(rg.column(name))
                if a is None:
                    continue
                e = {"dtype": a["values"].dtype.str, "arrow": a["arrow"], "values": put(a["values"]),
                     "offsets": put(a["offsets"]) if a["offsets"] is not None else None}
                if a["str_offsets"] is not None:
                    e["str_offsets"] = put(a["str_offsets"])
                if a["validity"] is not None:
                    e["validity"] = put(a["validity"])
                cols[name] = e
            index["row_groups"].append({"rows": rg.num_rows, "columns": cols})
        js = json.dumps(index, sort_keys=True).encode()
        tail = js + struct.pack("<Q", len(js)) + MAGIC
        f.write(tail)
        h.update(tail)
        pos += len(tail)
    os.replace(tmp, out_path)
    return {"bytes": pos, "sha256": h.hexdigest()}


def read_index(path: str) -> dict:
    """The side file's JSON index; raises ShardError naming the file when it is not one."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            if size < 16:
                raise ShardError(f"{path}: too short to be a GDS side file; rewrite it with write_side_file")
            f.seek(size - 16)
            tail = f.read(16)
            if tail[8:] != MAGIC:
                raise ShardError(f"{path}: not a GDS side file (magic {tail[8:]!r}); rewrite it with write_side_file")
            n = struct.unpack("<Q", tail[:8])[0]
            f.seek(size - 16 - n)
            index = json.loads(f.read(n))
    except FileNotFoundError:
        raise ShardError(f"{path}: GDS side file missing; re-run preshard with --layout gds") from None
    if index.get("format_version", 0) > FORMAT_VERSION:
        raise ShardError(f"{path}: GDS format {index['format_version']} is newer than this reader ({FORMAT_VERSION}); upgrade userwise")
    return index


def _read(f, span, dtype) -> np.ndarray:
    off, n = span
    f.seek(off)
    return np.frombuffer(f.read(n), dtype=dtype)


def read_host(path: str, row_group: int, columns=None, index: dict | None = None) -> dict:
    """Read columns of one row group into host numpy arrays.

    Returns ``{name: (values, offsets | None)}`` for numeric columns and
    ``{name: (utf8_bytes, offsets | None, str_offsets)}`` for string columns.
    """
    index = index or read_index(path)
    rg = index["row_groups"][row_group]
    names = list(rg["columns"]) if columns is None else list(columns)
    out = {}
    with open(path, "rb") as f:
        for name in names:
            e = rg["columns"].get(name)
            if e is None:
                raise ShardError(f"{path}: row group {row_group} has no column {name!r} in its GDS index")
            vals = _read(f, e["values"], np.dtype(e["dtype"]))
            offs = _read(f, e["offsets"], "<i8") if e["offsets"] else None
            if "str_offsets" in e:
                out[name] = (vals, offs, _read(f, e["str_offsets"], "<i8"))
            else:
                out[name] = (vals, offs)
    return out


def read_device(path: str, row_group: int, columns, device="cuda", index: dict | None = None) -> dict:
    """Read numeric columns of one row group straight into device memory with
    kvikio (cuFile; kvikio itself falls back to POSIX reads without GDS).

    Returns ``{name: (values tensor, offsets tensor | None)}`` (torch, on ``device``).
    Raises ImportError when kvikio is missing.
    """
    import kvikio  # noqa: F401  (ImportError is the caller's signal to fall back)
    import torch

    index = index or read_index(path)
    rg = index["row_groups"][row_group]
    out = {}
    with kvikio.CuFile(path, "r") as f:
        futs = []
        for name in columns:
            e = rg["columns"][name]
            if "str_offsets" in e:
                raise ShardError(f"{path}: column {name!r} is a string column; read it from Parquet")
            dt = _TORCH_DTYPES[np.dtype(e["dtype"]).newbyteorder("=").str]
            v = torch.empty(e["values"][1] // torch.empty((), dtype=dt).element_size(), dtype=dt, device=device)
            futs.append(f.pread(v, e["values"][1], e["values"][0]))
            o = None
            if e["offsets"]:
                o = torch.empty(e["offsets"][1] // 8, dtype=torch.int64, device=device)
                futs.append(f.pread(o, e["offsets"][1], e["offsets"][0]))
            out[name] = (v, o)
        for fu in futs:
            fu.get()
    return out


def _torch_dtypes():
    try:
        import torch
    except ImportError:  # pragma: no cover
        return {}
    return {
        "<i8": torch.int64, "<i4": torch.int32, "<i2": torch.int16, "|i1": torch.int8, "|u1": torch.uint8,
        "<f8": torch.float64, "<f4": torch.float32, "<f2": torch.float16,
    }


class _Lazy(dict):
    def __missing__(self, k):
        self.update(_torch_dtypes())
        return dict.__getitem__(self, k)


_TORCH_DTYPES = _Lazy()
