"""Segmented copy: ``out = concatenate([src[s:s+l] for s, l in zip(starts, lengths)])``.

The one hot loop of batch assembly. A shuffled buffer's batch is its samples'
runs of every list column, copied one after another into the batch buffer.
In numpy that is a Python-level view per run and column (about 0.4 us each:
more than copying the run itself once samples hold a few hundred events) or
an element-wise gather (``np.take``: an index array, then ~1.5 ns per
element). Compiled with numba it is one memcpy per run, without the GIL.

numba is part of the loader's extra; where it is missing (or
``USERWISE_NO_NUMBA=1``) the numpy version runs instead, with the same result,
and the loader logs once (INFO, logger ``userwise.loader``) which one it uses. The kernel is compiled on first
use (cached on disk), not at import: importing the loader stays light.
"""

from __future__ import annotations

import logging
import os
import threading

import numpy as np

log = logging.getLogger("userwise.loader")

_IMPL = None
_BATCH = None  # the compiled batch kernels (module), when numba compiles them
_LOCK = threading.Lock()  # the read-ahead thread and the main thread may both make the first call
_NO_KERNEL: set = set()  # dtypes the compiled kernel does not take: copied as bytes instead


def _numpy_copy(src: np.ndarray, starts: np.ndarray, lengths: np.ndarray, out: np.ndarray) -> None:
    views = [src[s: s + n] for s, n in zip(starts.tolist(), lengths.tolist())]
    np.concatenate(views or [src[:0]], out=out[: int(lengths.sum())])


def _compile():
    from userwise.pipelines.loader import _segcopy_numba as nb
    from userwise.pipelines.loader._segcopy_numba import kernel
    from userwise.pipelines.loader.decode import (
        _NP,  # the dtypes columns decode to (imported here: decode imports this module)
    )

    i = np.zeros(1, np.int64)
    kernel(np.zeros(2, np.int64), i, i + 1, np.zeros(2, np.int64))  # fails here if numba cannot compile at all
    # every dtype at once (compiled, or loaded from numba's cache), so that worker processes
    # forked afterwards inherit them instead of each loading its own
    for dt in sorted({np.dtype(t) for t in _NP.values()}, key=str):
        try:
            kernel(np.zeros(2, dt), i, i + 1, np.zeros(2, dt))
        except Exception:  # noqa: BLE001 (a dtype numba lacks, e.g. float16: see seg_copy)
            _NO_KERNEL.add(np.dtype(dt))
    global _BATCH
    try:  # the whole-batch kernels (decode.Prepared): compiled now too, for the same reason
        _warm_batch(nb)
        _BATCH = nb
    except Exception as e:  # noqa: BLE001 (assembly then runs in numpy; seg_copy still compiled)
        log.info("userwise loader: batch kernels unavailable (%s: %s); batches assembled by numpy", type(e).__name__, e)
    return kernel


class Sources:
    """Arrays handed to the batch kernels as one table: row 0 their addresses, row 1 their
    lengths (elements), so a kernel views source k with ``numba.carray``. Building a numba
    typed list instead cost about 10 us per array (a compiled call and a reference count
    each): a fifth of a short buffer's shuffle. ``keep`` holds the (contiguous) arrays: the
    addresses are valid while this object lives."""

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


def _warm_batch(nb) -> None:
    ops = np.array([[nb.OFFS, 0, 0, 0, 8, 0, -1], [nb.VAL, 0, 0, 0, 1, 0, -1], [nb.RUN, 0, 1, 2, 1, -1, -1],
                    [nb.STR, 0, 1, 0, 1, -1, -1], [nb.SOFF, 0, 1, 0, 8, -1, -1], [nb.SUB, 0, 1, 0, 8, -1, -1]], np.int64)
    bsrc = byte_sources([np.arange(4, dtype=np.uint8)])
    isrc = int_sources([np.array([0, 1, 2]), np.array([0, 1, 2]), np.array([1, 1])])
    pos, numel = np.zeros(len(ops), np.int64), np.zeros(len(ops), np.int64)
    total = nb.batch_layout(ops, 0, 1, isrc.table, 64, pos, numel)
    nb.batch_fill(np.zeros(max(total, 64), np.uint8), ops, 0, 1, bsrc.table, isrc.table, pos, numel, 64, total)
    one = np.ones(1, np.int64)
    nb.ranges(one, one, np.zeros(1, np.int64))
    data = np.arange(4, dtype=np.uint8)
    ro = data.view()
    ro.flags.writeable = False  # string bytes straight from Arrow are read-only: a type of their own to numba
    for d in (data, ro):
        nb.perm_strings(d, np.array([[0, 2, 4]], np.int64), one, one, np.zeros(2, np.uint8), np.zeros((1, 2), np.int64))


def batch_kernels():
    """The compiled whole-batch kernels (module with ``batch_layout``/``batch_fill``), or None
    where assembly runs in numpy (numba missing, USERWISE_NO_NUMBA=1, or they failed to compile)."""
    if _IMPL is None:
        implementation()
    return _BATCH if _IMPL[0] == "numba" else None


def implementation() -> str:
    """``"numba"`` or ``"numpy"``: which segmented copy this process uses."""
    global _IMPL
    with _LOCK:
        if _IMPL is None:
            _choose()
    return _IMPL[0]


def _choose() -> None:
    global _IMPL
    if os.environ.get("USERWISE_NO_NUMBA") == "1":
        _IMPL = ("numpy", _numpy_copy, "USERWISE_NO_NUMBA=1")
    else:
        try:
            _IMPL = ("numba", _compile(), "compiled")
        except Exception as e:  # noqa: BLE001 (ImportError, or a numba that cannot compile here)
            _IMPL = ("numpy", _numpy_copy, f"numba unavailable: {type(e).__name__}: {e}")
    log.info("userwise loader: segmented copies by %s (%s)", _IMPL[0], _IMPL[2])


def seg_copy(src: np.ndarray, starts: np.ndarray, lengths: np.ndarray, out: np.ndarray) -> None:
    """Copy runs ``src[starts[i]: starts[i] + lengths[i]]`` one after another into ``out``
    (1-D arrays of one dtype; ``starts``/``lengths`` int64; ``out`` at least their sum long,
    may be a strided view)."""
    if _IMPL is None:
        implementation()
    if src.dtype in _NO_KERNEL:  # same bytes, as unsigned integers of the same width
        u = np.dtype(f"u{src.dtype.itemsize}")
        src, out = src.view(u), out.view(u)
    _IMPL[1](src, starts, lengths, out)


__all__ = ["seg_copy", "implementation"]
