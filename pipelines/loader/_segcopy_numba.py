"""The compiled segmented copy (imported on first use by :mod:`segcopy`; needs numba)."""

import numba


@numba.njit(nogil=True, cache=True)
def kernel(src, starts, lengths, out):  # pragma: no cover (compiled; covered through segcopy.seg_copy)
    d = 0
    for i in range(starts.shape[0]):
        s = starts[i]
        n = lengths[i]
        if n < 32:  # short runs (strings, short lists): an element loop beats a slice's set-up
            for k in range(n):
                out[d + k] = src[s + k]
        else:  # long runs: a slice assignment, which numba lowers to a block copy
            out[d: d + n] = src[s: s + n]
        d += n
