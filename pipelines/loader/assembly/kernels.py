"""The compiled kernels of batch assembly (numba; imported by :mod:`segcopy` on first use).

- :func:`kernel`: the segmented copy behind :func:`segcopy.seg_copy`.
- :func:`ranges`, :func:`perm_strings`: a buffer's shuffle (:meth:`assemble.Prepared.permuted`).
- :func:`batch_layout`, :func:`batch_fill`: a whole batch from a *batch program*
  (:mod:`program`): an int64 table with one row per array of the batch, its
  columns the fields of :class:`OpRow`, its first column an :class:`Op`.
  The arrays the rows name are passed as :class:`Sources` tables.
- :func:`ids_dense_unique`, :func:`ids_owners`, :func:`ids_hot`, :func:`ids_bucketize`: a key's
  ids deduplicated without sorting (a bitset over the ids' span) and bucketed by owner with a
  counting sort (:func:`ids.route_ids`; numpy gives the same arrays without them).
"""

from enum import IntEnum
from typing import NamedTuple

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic


class Op(IntEnum):
    """What one row of a batch program writes (:attr:`OpRow.kind`)."""

    OFFSETS = 0  # a list group's offsets of samples [a, b], rebased to start at 0 (int64)
    VALUES = 1  # the group's element range of one array, copied as it is
    RUNS = 2  # every sample's run of one array left in place (run starts and lengths: int sources)
    STRINGS = 3  # the bytes of one string column over the group's element range
    STR_OFFSETS = 4  # that column's string offsets, rebased to its bytes in the batch (int64)
    DERIVED = 5  # request -> sample or impression -> request index, rebased to the batch (int64)


class OpRow(NamedTuple):
    """One row of a batch program (one array of the batch, in layout order)."""

    kind: int  # an Op
    bytes_src: int  # byte source read (VALUES, RUNS, STRINGS; else 0)
    ints: int  # int source read: string offsets (STRINGS, STR_OFFSETS), run starts (RUNS), the index (DERIVED)
    ints2: int  # int source: run lengths (RUNS; else 0)
    itemsize: int  # bytes per element written
    group: int  # int source: offsets of the group whose element range this is (-1: one element per sample)
    base: int  # DERIVED: int source of the offsets whose entry at a is subtracted (-1: a itself)


# the ops table's column of each OpRow field (what the kernels index with)
KIND, BYTES_SRC, INTS, INTS2, ITEMSIZE, GROUP, BASE = range(len(OpRow._fields))


class Sources:
    """Arrays handed to the batch kernels as one table: row 0 their addresses, row 1 their
    lengths (elements), so a kernel views source k with ``numba.carray`` (a numba typed list
    costs a compiled call and a reference count per array). ``keep`` holds the (contiguous)
    arrays: the addresses are valid while this object lives."""

    __slots__ = ("table", "keep")

    def __init__(self, arrays, dtype):
        dtype = np.dtype(dtype)
        keep = [np.ascontiguousarray(a).reshape(-1).view(dtype) if dtype == np.uint8
                else np.ascontiguousarray(a, dtype=dtype).reshape(-1) for a in arrays]
        table = np.zeros((2, max(1, len(keep))), np.int64)  # one zero entry at least: a valid table
        for k, a in enumerate(keep):
            table[0, k] = a.__array_interface__["data"][0]
            table[1, k] = a.shape[0]
        self.table, self.keep = table, keep


def byte_sources(arrays) -> Sources:
    """The batch kernels' byte sources (uint8 views of the arrays)."""
    return Sources(arrays, np.uint8)


def int_sources(arrays) -> Sources:
    """The batch kernels' int64 sources (offsets, runs, derived indices)."""
    return Sources(arrays, np.int64)


@intrinsic
def _memcpy(typingctx, dst, doff, src, soff, n):
    """dst[doff:doff+n] = src[soff:soff+n] (elements of one dtype, no bounds check) as one
    ``llvm.memcpy``: libc's block copy, where numba lowers a slice assignment to an element
    loop (several times slower). Pure LLVM IR, so the kernels stay cacheable."""
    if not (isinstance(dst, types.Array) and isinstance(src, types.Array) and dst.dtype == src.dtype):
        return None
    sig = types.void(dst, types.intp, src, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        d, do, s, so, m = args
        da = context.make_array(signature.args[0])(context, builder, d)
        sa = context.make_array(signature.args[2])(context, builder, s)
        size = context.get_abi_sizeof(context.get_data_type(dst.dtype))
        cgutils.raw_memcpy(builder, builder.gep(da.data, [do]), builder.gep(sa.data, [so]), m, size)
        return context.get_dummy_value()
    return sig, codegen


def _pointer_to(nbtype):
    """An intrinsic turning an address (int64) into a typed pointer, for ``numba.carray``."""
    @intrinsic
    def pointer(typingctx, addr):
        if not isinstance(addr, types.Integer):
            return None
        sig = types.CPointer(nbtype)(addr)

        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], context.get_value_type(signature.return_type))
        return sig, codegen
    return pointer


_u8_ptr = _pointer_to(types.uint8)
_i64_ptr = _pointer_to(types.int64)


@numba.njit(nogil=True, cache=True, inline="always")
def _bytes(src, k):  # pragma: no cover (compiled)
    """Byte source k of a source table (row 0 addresses, row 1 lengths: Sources)."""
    return numba.carray(_u8_ptr(src[0, k]), (src[1, k],))


@numba.njit(nogil=True, cache=True, inline="always")
def _ints(src, k):  # pragma: no cover (compiled)
    """int64 source k of a source table."""
    return numba.carray(_i64_ptr(src[0, k]), (src[1, k],))


@numba.njit(nogil=True, cache=True)
def kernel(src, starts, lengths, out):  # pragma: no cover (compiled; covered through segcopy.seg_copy)
    total = 0
    for i in range(starts.shape[0]):  # memcpy checks nothing: every run inside src, all of them inside out
        if starts[i] < 0 or lengths[i] < 0 or starts[i] + lengths[i] > src.shape[0]:
            raise IndexError("seg_copy: a run lies outside the source")
        total += lengths[i]
    if total > out.shape[0]:
        raise IndexError("seg_copy: the runs do not fit the output")
    d = 0
    # memcpy needs unit strides (out may be any view; rows of a 2-D block are contiguous)
    contiguous = src.strides[0] == src.itemsize and out.strides[0] == out.itemsize
    for i in range(starts.shape[0]):
        s = starts[i]
        n = lengths[i]
        if n < 16 or not contiguous:  # a few elements: a loop beats a call
            for k in range(n):
                out[d + k] = src[s + k]
        else:
            _memcpy(out, d, src, s, n)
        d += n


@numba.njit(nogil=True, cache=True)
def ranges(starts, lengths, out):  # pragma: no cover (compiled; covered through assemble.Prepared.permuted)
    """out = concatenate([arange(s, s + l) for s, l in zip(starts, lengths)]) (the element
    indexes of runs), in one pass; returns the count written."""
    d = 0
    for i in range(starts.shape[0]):
        s = starts[i]
        n = lengths[i]
        if n < 0 or d + n > out.shape[0]:
            raise IndexError("ranges: the runs do not fit the output")
        for k in range(n):
            out[d + k] = s + k
        d += n
    return d


@numba.njit(nogil=True, cache=True)
def perm_strings(data, soff, starts, lengths, out, out_soff):  # pragma: no cover (compiled; covered through assemble)
    """The string columns of one group, their elements taken run by run: run i is elements
    starts[i]: starts[i] + lengths[i] of every row of ``soff`` (per column, offsets into the
    shared bytes ``data``). ``out`` gets column 0's bytes of every run, then column 1's...;
    ``out_soff[c]`` the offsets of column c's strings into ``out``. A run's strings are
    adjacent in ``data``, so each (run, column) is one block copy, where a copy per string
    and numpy's fancy indexing of the offsets cost several times more for short strings.
    Returns the bytes written."""
    n = soff.shape[1] - 1
    pos = 0
    for c in range(soff.shape[0]):
        j = 0
        for i in range(starts.shape[0]):
            s = starts[i]
            m = lengths[i]
            if s < 0 or m < 0 or s + m > n or j + m >= out_soff.shape[1]:
                raise IndexError("perm_strings: a run lies outside the column or the output")
            b0 = soff[c, s]
            b1 = soff[c, s + m]
            if b0 < 0 or b1 < b0 or b1 > data.shape[0] or pos + (b1 - b0) > out.shape[0]:
                raise IndexError("perm_strings: a run's bytes lie outside the data or the output")
            for k in range(m):
                o = soff[c, s + k]
                if o < b0 or o > b1:
                    raise IndexError("perm_strings: a string offset lies outside its run's bytes")
                out_soff[c, j + k] = pos + o - b0
            _copy(out, pos, data, b0, b1 - b0)
            pos += b1 - b0
            j += m
        out_soff[c, j] = pos
    return pos


@numba.njit(nogil=True, cache=True)
def _range(isrc, g, a, b):  # pragma: no cover (compiled)
    """Element range of samples [a, b) in a group: [a, b) itself for sample columns (g < 0),
    else [off[a], off[b]) of the group's offsets (int source g)."""
    if g < 0:
        return a, b
    o = _ints(isrc, g)
    return o[a], o[b]


@numba.njit(nogil=True, cache=True)
def batch_layout(ops, a, b, isrc, align, pos, numel):  # pragma: no cover (compiled)
    """Element count and aligned byte position of every array of the batch of samples [a, b);
    returns the batch's bytes. ops: one :class:`OpRow` per array; isrc: the int sources'
    table (Sources)."""
    total = 0
    for i in range(ops.shape[0]):
        kind = ops[i, KIND]
        ea, eb = _range(isrc, ops[i, GROUP], a, b)
        if kind == Op.OFFSETS:
            n = b - a + 1
        elif kind == Op.STRINGS:
            so = _ints(isrc, ops[i, INTS])
            n = so[eb] - so[ea]
        elif kind == Op.STR_OFFSETS:
            n = eb - ea + 1
        else:  # VALUES, RUNS, DERIVED
            n = eb - ea
        numel[i] = n
        pos[i] = total
        total += (n * ops[i, ITEMSIZE] + align - 1) // align * align
    return total


@numba.njit(nogil=True, cache=True)
def _copy(out, d, src, s, m):  # pragma: no cover (compiled)
    """out[d:d+m] = src[s:s+m] (bytes): libc's block copy, a byte loop for the shortest runs
    (and for a strided view, which memcpy cannot take). Raises where a range lies outside
    either array (memcpy checks nothing)."""
    if s < 0 or d < 0 or m < 0 or s + m > src.shape[0] or d + m > out.shape[0]:
        raise IndexError("batch_fill: a copy lies outside its source or the batch buffer")
    if m < 16 or out.strides[0] != 1 or src.strides[0] != 1:
        for k in range(m):
            out[d + k] = src[s + k]
    else:
        _memcpy(out, d, src, s, m)


@numba.njit(nogil=True, cache=True)
def batch_fill(out, ops, a, b, bsrc, isrc, pos, numel, align, total):  # pragma: no cover (compiled)
    """Write the batch of samples [a, b) into ``out`` (bytes) at the positions batch_layout gave:
    every array of every column in one call, alignment padding and the tail zeroed. bsrc and
    isrc: the byte and int sources' tables (Sources; the caller keeps the arrays alive)."""
    for i in range(ops.shape[0]):
        kind = ops[i, KIND]
        w = ops[i, ITEMSIZE]
        ea, eb = _range(isrc, ops[i, GROUP], a, b)
        p = pos[i]
        n = numel[i]
        if kind == Op.VALUES:
            _copy(out, p, _bytes(bsrc, ops[i, BYTES_SRC]), ea * w, n * w)
        elif kind == Op.RUNS:
            src = _bytes(bsrc, ops[i, BYTES_SRC])
            st = _ints(isrc, ops[i, INTS])
            ln = _ints(isrc, ops[i, INTS2])
            d = p
            for s in range(a, b):
                m = ln[s] * w
                _copy(out, d, src, st[s] * w, m)
                d += m
        elif kind == Op.STRINGS:
            _copy(out, p, _bytes(bsrc, ops[i, BYTES_SRC]), _ints(isrc, ops[i, INTS])[ea], n)
        else:  # int64 arrays written value by value: offsets rebased to the batch, derived indices
            o = out[p: p + 8 * n].view(np.int64)
            if kind == Op.OFFSETS:
                src = _ints(isrc, ops[i, GROUP])
                s0, base = a, src[a]
            elif kind == Op.STR_OFFSETS:
                src = _ints(isrc, ops[i, INTS])
                s0, base = ea, src[ea]
            else:  # DERIVED: request -> sample (base a), impression -> request (base: the batch's first request)
                src = _ints(isrc, ops[i, INTS])
                s0 = ea
                base = a if ops[i, BASE] < 0 else _ints(isrc, ops[i, BASE])[a]
            for k in range(n):
                o[k] = src[s0 + k] - base
        end = p + (n * w + align - 1) // align * align
        for q in range(p + n * w, end):
            out[q] = 0
    for q in range(total, out.shape[0]):
        out[q] = 0


@intrinsic
def _popcount(typingctx, x):
    """The set bits of a uint64 (``llvm.ctpop``: one instruction where the CPU has it)."""
    if not (isinstance(x, types.Integer) and x.bitwidth == 64 and not x.signed):
        return None
    sig = types.uint64(x)

    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(64), [ir.IntType(64)]),
                                            "llvm.ctpop.i64")
        return builder.call(fn, args)
    return sig, codegen


@numba.njit(nogil=True, cache=True)
def ids_dense_unique(v, span):  # pragma: no cover (compiled; covered through ids.route_ids)
    """``np.unique(v, return_inverse=True)`` for ids in ``[0, span)`` without sorting: a bitset
    of the ids present, the ids read back in order (int64), each id's index the set bits below
    it (int32)."""
    nw = (span + 63) >> 6
    bits = np.zeros(nw, np.uint64)
    for i in range(v.shape[0]):
        x = v[i]
        bits[x >> 6] |= np.uint64(1) << np.uint64(x & 63)
    below = np.empty(nw, np.int64)  # unique ids in the words before
    c = 0
    for w in range(nw):
        below[w] = c
        c += np.int64(_popcount(bits[w]))
    uniq = np.empty(c, np.int64)
    k = 0
    for w in range(nw):
        b = bits[w]
        while b:
            low = b & (~b + np.uint64(1))
            uniq[k] = (w << 6) + np.int64(_popcount(low - np.uint64(1)))
            k += 1
            b ^= low
    inv = np.empty(v.shape[0], np.int32)
    for i in range(v.shape[0]):
        x = v[i]
        w = x >> 6
        mask = (np.uint64(1) << np.uint64(x & 63)) - np.uint64(1)
        inv[i] = below[w] + np.int64(_popcount(bits[w] & mask))
    return uniq, inv


@numba.njit(nogil=True, cache=True)
def ids_owners(u, block, world):  # pragma: no cover (compiled; covered through ids.route_ids)
    """The rank owning each id (fbgemm's block rule, ``i % world`` past ``block * world``), int32."""
    out = np.empty(u.shape[0], np.int32)
    edge = block * world
    for i in range(u.shape[0]):
        x = u[i]
        out[i] = x // block if x < edge else x % world
    return out


@numba.njit(nogil=True, cache=True)
def ids_hot(u, hot):  # pragma: no cover (compiled; covered through ids.route_ids)
    """``np.isin(u, hot)`` for two sorted, duplicate-free int64 arrays: one merge."""
    out = np.zeros(u.shape[0], np.bool_)
    j = 0
    for i in range(u.shape[0]):
        while j < hot.shape[0] and hot[j] < u[i]:
            j += 1
        if j == hot.shape[0]:
            break
        out[i] = hot[j] == u[i]
    return out


@numba.njit(nogil=True, cache=True)
def ids_bucketize(v, lengths, block, world):  # pragma: no cover (compiled; covered through ids.route_ids)
    """fbgemm's ``block_bucketize_sparse_features`` of one key: bucket lengths ``[world * bags]``
    (int32, rank-major), local rows in rank then bag order (int64), and each value's place in
    them (int32). A counting sort on the owner: the values are in bag order already, so a stable
    placement by owner is the (owner, bag) order."""
    n = v.shape[0]
    nb = lengths.shape[0]
    edge = block * world
    fast = edge <= 1 << 50  # x * (1 / block) is then within one of x // block: corrected below
    inv = 1.0 / block
    owner = np.empty(n, np.int32)
    local = np.empty(n, np.int64)
    start = np.zeros(world + 1, np.int64)
    blen = np.zeros(world * nb, np.int32)
    i = 0
    for b in range(nb):
        for _ in range(lengths[b]):
            x = v[i]
            if x < edge:
                if fast:  # an integer division costs ~20 cycles: a multiply and a correction instead
                    o = np.int64(x * inv)
                    r = x - o * block
                    if r < 0:
                        o -= 1
                        r += block
                    elif r >= block:
                        o += 1
                        r -= block
                else:
                    o = x // block
                    r = x - o * block
            else:
                o = x % world
                r = x // world
            owner[i] = o
            local[i] = r
            start[o + 1] += 1
            blen[o * nb + b] += 1
            i += 1
    for w in range(world):
        start[w + 1] += start[w]
    out = np.empty(n, np.int64)
    perm = np.empty(n, np.int32)
    for i in range(n):
        o = owner[i]
        p = start[o]
        start[o] = p + 1
        out[p] = local[i]
        perm[i] = p
    return blen, out, perm


def warm() -> None:
    """Run every batch kernel once on tiny inputs (compiles them, or loads them from numba's
    cache), so that worker processes forked afterwards inherit them compiled."""
    ops = np.array([OpRow(Op.OFFSETS, 0, 0, 0, 8, 0, -1), OpRow(Op.VALUES, 0, 0, 0, 1, 0, -1),
                    OpRow(Op.RUNS, 0, 1, 2, 1, -1, -1), OpRow(Op.STRINGS, 0, 1, 0, 1, -1, -1),
                    OpRow(Op.STR_OFFSETS, 0, 1, 0, 8, -1, -1), OpRow(Op.DERIVED, 0, 1, 0, 8, -1, -1)], np.int64)
    bsrc = byte_sources([np.arange(4, dtype=np.uint8)])
    isrc = int_sources([np.array([0, 1, 2]), np.array([0, 1, 2]), np.array([1, 1])])
    pos, numel = np.zeros(len(ops), np.int64), np.zeros(len(ops), np.int64)
    total = batch_layout(ops, 0, 1, isrc.table, 64, pos, numel)
    batch_fill(np.zeros(max(total, 64), np.uint8), ops, 0, 1, bsrc.table, isrc.table, pos, numel, 64, total)
    one = np.ones(1, np.int64)
    ranges(one, one, np.zeros(1, np.int64))
    data = np.arange(4, dtype=np.uint8)
    ro = data.view()
    ro.flags.writeable = False  # string bytes straight from Arrow are read-only: a type of their own to numba
    for d in (data, ro):
        perm_strings(d, np.array([[0, 2, 4]], np.int64), one, one, np.zeros(2, np.uint8), np.zeros((1, 2), np.int64))
    ids = np.array([3, 70, 3], np.int64)  # the id kernels (ids.route_ids)
    u, _ = ids_dense_unique(ids, 71)
    ids_owners(u, 36, 2)
    ids_hot(u, u[:1])
    ids_bucketize(ids, np.array([2, 1], np.int64), 36, 2)
