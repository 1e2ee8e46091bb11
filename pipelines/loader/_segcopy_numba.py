"""The compiled kernels (imported on first use by :mod:`segcopy`; needs numba)."""

import numba
import numpy as np
from numba.core import cgutils, types
from numba.extending import intrinsic

# batch program op kinds (decode.Prepared._program builds the table; see batch_fill)
OFFS, VAL, RUN, STR, SOFF, SUB = 0, 1, 2, 3, 4, 5


@intrinsic
def _memcpy(typingctx, dst, doff, src, soff, n):
    """dst[doff:doff+n] = src[soff:soff+n] (elements of one dtype, no bounds check) as one
    ``llvm.memcpy``: libc's block copy. Numba lowers a slice assignment to an element loop
    (5.6-7 GB/s on 1.6 KB runs here, 1.2 GB/s on 72-byte runs, where this does 21-23 and
    7.8 GB/s). Pure LLVM IR, so the kernels stay cacheable."""
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
    """Byte source k of a source table (row 0 addresses, row 1 lengths: segcopy.Sources)."""
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
def ranges(starts, lengths, out):  # pragma: no cover (compiled; covered through decode.Prepared.permuted)
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
def perm_strings(data, soff, starts, lengths, out, out_soff):  # pragma: no cover (compiled; covered through decode)
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
    returns the batch's bytes. ops rows: (kind, bytes src, int src, int src 2, itemsize,
    group offsets, base group offsets). isrc: the int sources' table (segcopy.Sources)."""
    total = 0
    for i in range(ops.shape[0]):
        kind = ops[i, 0]
        ea, eb = _range(isrc, ops[i, 5], a, b)
        if kind == OFFS:
            n = b - a + 1
        elif kind == STR:
            so = _ints(isrc, ops[i, 2])
            n = so[eb] - so[ea]
        elif kind == SOFF:
            n = eb - ea + 1
        else:  # VAL, RUN, SUB
            n = eb - ea
        numel[i] = n
        pos[i] = total
        total += (n * ops[i, 4] + align - 1) // align * align
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
    isrc: the byte and int sources' tables (segcopy.Sources; the caller keeps the arrays alive)."""
    for i in range(ops.shape[0]):
        kind = ops[i, 0]
        w = ops[i, 4]
        ea, eb = _range(isrc, ops[i, 5], a, b)
        p = pos[i]
        n = numel[i]
        if kind == VAL:
            _copy(out, p, _bytes(bsrc, ops[i, 1]), ea * w, n * w)
        elif kind == RUN:
            src = _bytes(bsrc, ops[i, 1])
            st = _ints(isrc, ops[i, 2])
            ln = _ints(isrc, ops[i, 3])
            d = p
            for s in range(a, b):
                m = ln[s] * w
                _copy(out, d, src, st[s] * w, m)
                d += m
        elif kind == STR:
            _copy(out, p, _bytes(bsrc, ops[i, 1]), _ints(isrc, ops[i, 2])[ea], n)
        else:  # int64 arrays written value by value: offsets rebased to the batch, derived indices
            o = out[p: p + 8 * n].view(np.int64)
            if kind == OFFS:
                src = _ints(isrc, ops[i, 5])
                s0, base = a, src[a]
            elif kind == SOFF:
                src = _ints(isrc, ops[i, 2])
                s0, base = ea, src[ea]
            else:  # SUB: request -> sample (base a), impression -> request (base: the batch's first request)
                src = _ints(isrc, ops[i, 2])
                s0 = ea
                base = a if ops[i, 6] < 0 else _ints(isrc, ops[i, 6])[a]
            for k in range(n):
                o[k] = src[s0 + k] - base
        end = p + (n * w + align - 1) // align * align
        for q in range(p + n * w, end):
            out[q] = 0
    for q in range(total, out.shape[0]):
        out[q] = 0
