"""Which copy kernels this process uses: compiled (numba) or numpy.

:func:`seg_copy` is ``out = concatenate([src[s:s+l] for s, l in zip(starts, lengths)])``,
the hot loop of batch assembly: a shuffled buffer's batch is its samples' runs
of every list column, copied one after another into the batch buffer. In
numpy that is a Python-level view per run and column (more than copying the
run itself once samples hold a few hundred events) or an element-wise gather
(an index array, then one read per element). Compiled (:mod:`kernels`) it is
one memcpy per run, without the GIL. :func:`batch_kernels` hands out the
compiled whole-batch kernels the same way (:mod:`program` runs them).

numba is part of the loader's extra; where it is missing (or
``USERWISE_NO_NUMBA=1``) the numpy version runs instead, with the same result,
and the loader logs once (INFO, logger ``userwise.loader``) which one it uses.
The kernels are compiled on first use (cached on disk), not at import:
importing the loader stays light.
"""

from __future__ import annotations

import os
import threading

import numpy as np

from userwise.pipelines.loader.io.decode import NUMPY_DTYPES
from userwise.pipelines.loader.logs import log

_IMPL = None
_BATCH = None  # the compiled batch kernels (module), when numba compiles them
_LOCK = threading.Lock()  # the read-ahead thread and the main thread may both make the first call
_NO_KERNEL: set = set()  # dtypes the compiled kernel does not take: copied as bytes instead


def _numpy_copy(src: np.ndarray, starts: np.ndarray, lengths: np.ndarray, out: np.ndarray) -> None:
    views = [src[s: s + n] for s, n in zip(starts.tolist(), lengths.tolist())]
    np.concatenate(views or [src[:0]], out=out[: int(lengths.sum())])


def _compile():
    from userwise.pipelines.loader.assembly import kernels as nb

    i = np.zeros(1, np.int64)
    nb.kernel(np.zeros(2, np.int64), i, i + 1, np.zeros(2, np.int64))  # fails here if numba cannot compile at all
    # every dtype at once (compiled, or loaded from numba's cache), so that worker processes
    # forked afterwards inherit them instead of each loading its own
    for dt in sorted({np.dtype(t) for t in NUMPY_DTYPES.values()}, key=str):
        try:
            nb.kernel(np.zeros(2, dt), i, i + 1, np.zeros(2, dt))
        except Exception:  # noqa: BLE001 (a dtype numba lacks, e.g. float16: see seg_copy)
            _NO_KERNEL.add(np.dtype(dt))
    global _BATCH
    try:  # the whole-batch kernels (assemble.Prepared): compiled now too, for the same reason
        nb.warm()
        _BATCH = nb
    except Exception as e:  # noqa: BLE001 (assembly then runs in numpy; seg_copy still compiled)
        log.info("userwise loader: batch kernels unavailable (%s: %s); batches assembled by numpy", type(e).__name__, e)
    return nb.kernel


def batch_kernels():
    """The compiled batch kernels (the :mod:`kernels` module), or None
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


__all__ = ["seg_copy", "implementation", "batch_kernels"]
