"""A Parquet file's Thrift compact structs, read and edited byte by byte, as someone who damages
a shard on purpose would: the page headers (to flip a bit in a page) and the footer's row
groups (to edit a ``num_rows``). The tests' one reader of the compact protocol."""

from __future__ import annotations


def varint(b, i):
    """The unsigned varint at ``i`` and the position after it."""
    r = s = 0
    while True:
        x = b[i]
        i += 1
        r |= (x & 0x7F) << s
        s += 7
        if not x & 0x80:
            return r, i


def unzigzag(z: int) -> int:
    return (z >> 1) ^ -(z & 1)


def zigzag_bytes(v: int) -> bytes:
    """``v`` as a zigzag varint (an i32/i64 field's value)."""
    z = (v << 1) ^ (v >> 63)
    out = bytearray()
    while True:
        if z < 0x80:
            out.append(z)
            return bytes(out)
        out.append((z & 0x7F) | 0x80)
        z >>= 7


def skip(b, i, t):
    """Past one value of compact type ``t`` at ``i``."""
    if t in (1, 2):  # booleans live in the field header
        return i
    if t == 3:
        return i + 1
    if t in (4, 5, 6):
        return varint(b, i)[1]
    if t == 7:
        return i + 8
    if t == 8:
        n, i = varint(b, i)
        return i + n
    if t in (9, 10):  # list, set
        n, et, i = list_header(b, i)
        for _ in range(n):
            i = i + 1 if et in (1, 2) else skip(b, i, et)
        return i
    if t == 11:  # map
        n, i = varint(b, i)
        if n:
            kv, i = b[i], i + 1
            for _ in range(n):
                i = skip(b, skip(b, i, kv >> 4), kv & 0x0F)
        return i
    if t == 12:
        return fields(b, i)[1]
    raise ValueError(f"not a Thrift compact type: {t}")


def list_header(b, i):
    """A list's (length, element type, position of its first element)."""
    h = b[i]
    n, et, i = h >> 4, h & 0x0F, i + 1
    if n == 15:
        n, i = varint(b, i)
    return n, et, i


def fields(b, i):
    """A struct's fields at ``i``: {id: (type, start of the value)}, and the position after it."""
    out, fid = {}, 0
    while True:
        h = b[i]
        i += 1
        if h == 0:
            return out, i
        if h >> 4:
            fid += h >> 4
        else:
            n, i = varint(b, i)
            fid = unzigzag(n)
        out[fid] = (h & 0x0F, i)
        i = skip(b, i, h & 0x0F)


def i32_fields(b, i):
    """A struct's i32 fields by id (its other fields skipped), and the position after it."""
    fs, end = fields(b, i)
    return {fid: unzigzag(varint(b, at)[0]) for fid, (t, at) in fs.items() if t == 5}, end


def row_count_bytes(data: bytes):
    """Where each row group's ``num_rows`` (RowGroup field 3, an i64 varint) sits in a Parquet
    file's bytes, with its value: [(start, end, rows)] (the FileMetaData's field 4 is the list
    of row groups)."""
    size = len(data)
    meta_len = int.from_bytes(data[size - 8:size - 4], "little")
    top, _ = fields(data, size - 8 - meta_len)
    t, i = top[4]
    assert t == 9
    n, _, i = list_header(data, i)
    out = []
    for _ in range(n):
        rg, i = fields(data, i)
        _, j = rg[3]
        z, end = varint(data, j)
        out.append((j, end, unzigzag(z)))
    return out
