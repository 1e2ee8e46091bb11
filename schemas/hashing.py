"""Spark's ``xxhash64`` in Python, for the ids and tie-breaks the Spark jobs compute natively.

Spark's ``xxhash64(c1, c2, ...)`` folds its arguments left to right: the running hash starts
at 42 and each non-null value is hashed with it as the seed: an ``int`` as its 4 and a
``long`` as its 8 little-endian bytes, a string as its UTF-8 bytes. :func:`xxhash64` is that
fold, so code without Spark (the shard assignment's tie-breaks, the synthetic samples) gets
the bytes the jobs get.

The one definition of a sample's id (the samples table's ``sample_id``) is here too:
``xxhash64(kind, string(window_end), string(user), int(chunk))``; the build computes it
with :func:`sample_id_column`, code without Spark with :func:`sample_id`.

Example::

    xxhash64([("a", "string"), (7, "int")])     # == spark.sql("SELECT xxhash64('a', 7)")
"""

from __future__ import annotations

import datetime as dt
import struct

SPARK_SEED = 42
_PACK = {"int": "<i", "long": "<q"}


def xxhash64(values, seed: int = SPARK_SEED) -> int:
    """Spark's ``xxhash64`` of ``values``: (value, kind) pairs, kind ``int``, ``long`` or
    ``string``; None values are skipped, as Spark skips nulls. A signed 64-bit int."""
    import xxhash

    h = seed & 0xFFFFFFFFFFFFFFFF
    for v, kind in values:
        if v is None:
            continue
        if kind == "string":
            data = str(v).encode("utf-8")
        elif kind in _PACK:
            data = struct.pack(_PACK[kind], int(v))
        else:
            raise ValueError(f"kind must be int, long or string, got {kind!r}")
        h = xxhash.xxh64_intdigest(data, seed=h)
    return h - (1 << 64) if h >= 1 << 63 else h


def sample_id(kind: str, window_end, user, chunk: int) -> int:
    """The ``sample_id`` a build gives the sample (kind, window_end, user, chunk)."""
    we = window_end.isoformat() if isinstance(window_end, dt.date) else str(window_end)
    return xxhash64([(kind, "string"), (we, "string"), (str(user), "string"), (chunk, "int")])


def sample_id_column():
    """The Spark column of :func:`sample_id` over the columns kind, window_end, user, chunk."""
    from pyspark.sql import functions as F

    return F.xxhash64(F.col("kind"), F.col("window_end").cast("string"), F.col("user").cast("string"),
                      F.col("chunk").cast("int"))
