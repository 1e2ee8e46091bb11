"""Spark's ``xxhash64`` in Python, for the ids and tie-breaks the Spark jobs compute natively.

Spark's ``xxhash64(c1, c2, ...)`` folds its arguments left to right: the running hash starts
at 42 and each non-null value is hashed with it as the seed: an ``int`` as its 4 and a
``long`` as its 8 little-endian bytes, a string as its UTF-8 bytes. :func:`xxhash64` is that
fold, so code without Spark (the shard assignment's tie-breaks, the synthetic samples) gets
the bytes the jobs get.

The one definition of a sample's id (the samples table's ``sample_id``) is here too:
``xxhash64(kind, string(window_end), string(user), int(chunk))``; the build computes it
with :func:`sample_id_column`, code without Spark with :func:`sample_id`.

The event chain of a user's sequence (what a serving cache checks its K/V against, and what
a Spark job can compute with native functions alone):

- an event's content hash ``e_i = xxhash64(f_1, ..., f_k)`` over its fields in order, each
  as a ``long`` (Spark: ``xxhash64(CAST(f_1 AS BIGINT), ..., CAST(f_k AS BIGINT))``;
  :func:`event_hashes`, vectorised). A field the model cannot read as an integer keeps
  Spark's own form: a string is hashed as its UTF-8 bytes and binary as its bytes (a
  ``string`` / ``binary`` value of the scalar :func:`xxhash64`); a float or decimal is read
  as the model reads it, truncated to a ``long`` (NaN and values beyond a ``long`` count as
  null); a date is its days since 1970-01-01 and a timestamp its microseconds since the
  epoch, as ``long``; a null is skipped, as Spark skips nulls (:func:`chain_value`). Which
  fields, in which order, is the samples schema's :func:`userwise.schemas.tables.chain_fields`;
  the build computes the chain with :func:`chain_column`;
- the rolling hash ``h_{-1} = 42`` (:data:`CHAIN_SEED`), ``h_i = xxhash64(h_{i-1}, e_i)``
  with both as ``long`` (:func:`rolling_hashes`); ``h_i`` identifies the first ``i + 1``
  events and their order;
- the chain of ``n`` events with block size ``P``: the checkpoints ``[h_{P-1}, h_{2P-1},
  ..., h_{kP-1}]`` (``k = n // P``: one per complete block) and the end ``h_{n-1}``
  (``42`` for no events) (:func:`chain_checkpoints`). In Spark, over a user's ordered
  ``array<bigint>`` of event hashes ``es``::

      aggregate(es, named_struct('h', CAST(42 AS BIGINT), 'n', 0, 'cps', CAST(array() AS array<bigint>)),
                (a, x) -> named_struct('h', xxhash64(a.h, x), 'n', a.n + 1,
                                       'cps', IF((a.n + 1) % P = 0, concat(a.cps, array(xxhash64(a.h, x))), a.cps)))
      -- .h is the end, .cps the checkpoints

:func:`xxhash64_longs` is Spark's hash of one ``long`` with a per-row seed, vectorised in
numpy and bit-for-bit equal to :func:`xxhash64` (the oracle), so millions of events hash in
a fraction of a second.

Example::

    xxhash64([("a", "string"), (7, "int")])     # == spark.sql("SELECT xxhash64('a', 7)")
    e = event_hashes(np.array([[11, 3, 1], [12, 4, 2]]))   # two events, three long fields
    h = rolling_hashes(e)                                  # h[-1]: the chain's end
"""

from __future__ import annotations

import datetime as dt
import struct

import numpy as np

SPARK_SEED = 42
CHAIN_SEED = 42  # h_{-1}: the rolling hash of no events
CHAIN_COLUMNS = ("chain_block", "chain_checkpoints", "chain_end")  # a sample's chain (the samples schema)
_PACK = {"int": "<i", "long": "<q"}


def xxhash64(values, seed: int = SPARK_SEED) -> int:
    """Spark's ``xxhash64`` of ``values``: (value, kind) pairs, kind ``int``, ``long``,
    ``string`` (its UTF-8 bytes) or ``binary`` (its bytes); None values are skipped, as Spark
    skips nulls. A signed 64-bit int."""
    import xxhash

    h = seed & 0xFFFFFFFFFFFFFFFF
    for v, kind in values:
        if v is None:
            continue
        if kind == "string":
            data = str(v).encode("utf-8")
        elif kind == "binary":
            data = bytes(v)
        elif kind in _PACK:
            data = struct.pack(_PACK[kind], int(v))
        else:
            raise ValueError(f"kind must be int, long, string or binary, got {kind!r}")
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


# XXH64's primes (Spark's XXH64 and the xxhash package use the same)
_P1, _P2, _P3 = np.uint64(0x9E3779B185EBCA87), np.uint64(0xC2B2AE3D27D4EB4F), np.uint64(0x165667B19E3779F9)
_P4, _P5 = np.uint64(0x85EBCA77C2B2AE63), np.uint64(0x27D4EB2F165667C5)
_U = np.uint64
_CHUNK = 1 << 16


def _as_u64(x) -> np.ndarray:
    a = np.asarray(x)
    if a.dtype == np.uint64:
        return a
    if a.dtype.kind not in "iu" and a.size:
        raise ValueError(f"xxhash64_longs takes integers, got dtype {a.dtype}")
    return a.astype(np.int64, copy=False).view(np.uint64)


def xxhash64_longs(values, seeds=SPARK_SEED) -> np.ndarray:
    """Spark's ``xxhash64`` of one ``long`` per row with a per-row seed (``seeds``: an int or
    an array broadcast against ``values``), vectorised: ``xxhash64([(v, "long")], seed=s)``
    for every row, bit for bit. int64 array (the shape of the broadcast).

    Example::

        xxhash64_longs(np.array([7, -1]))          # == [xxhash64([(7, "long")]), xxhash64([(-1, "long")])]
        xxhash64_longs(np.array([7]), seeds=h)     # chained: a second argument of Spark's fold
    """
    v, s = np.broadcast_arrays(_as_u64(values), _as_u64(seeds))
    shape = v.shape
    v, s = np.atleast_1d(v).ravel(), np.atleast_1d(s).ravel()  # arrays, not scalars: uint64 wraps silently
    out = np.empty(v.shape, dtype=np.uint64)
    for a in range(0, len(v), _CHUNK):  # in place, a cache-sized chunk at a time
        b = min(a + _CHUNK, len(v))
        h, k, t = out[a:b], v[a:b] * _P2, np.empty(b - a, dtype=np.uint64)
        np.left_shift(k, _U(31), out=t)
        k >>= _U(33)
        k |= t
        k *= _P1                                # k = rotl(v * P2, 31) * P1
        np.add(s[a:b], _P5 + _U(8), out=h)
        h ^= k
        np.left_shift(h, _U(27), out=t)
        h >>= _U(37)
        h |= t
        h *= _P1
        h += _P4                                # h = rotl(h, 27) * P1 + P4
        for sh, p in ((33, _P2), (29, _P3), (32, None)):
            np.right_shift(h, _U(sh), out=t)
            h ^= t
            if p is not None:
                h *= p                          # the avalanche
    return out.view(np.int64).reshape(shape)


_EPOCH = dt.date(1970, 1, 1)
_LONG = 1 << 63


def chain_value(v) -> tuple:
    """One field value as the event hash reads it: a (value, kind) pair of :func:`xxhash64`
    (module docstring): integers and booleans as ``long``, floats and decimals truncated to a
    ``long`` (None when NaN, infinite or beyond a ``long``), a ``str`` as ``string``, ``bytes``
    as ``binary``, a date as its days since 1970-01-01, a datetime as its microseconds since
    the epoch (a naive one read as UTC); None stays None (skipped).

    Example::

        xxhash64([chain_value(v) for v in ("i-7", 3, None)])   # one event of a string item
    """
    if v is None:
        return None, "long"
    if isinstance(v, str):
        return v, "string"
    if isinstance(v, (bytes, bytearray, memoryview)):
        return bytes(v), "binary"
    if isinstance(v, dt.datetime):
        t = v if v.tzinfo else v.replace(tzinfo=dt.timezone.utc)
        d = t - dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)
        return (d.days * 86_400 + d.seconds) * 1_000_000 + d.microseconds, "long"
    if isinstance(v, dt.date):
        return (v - _EPOCH).days, "long"
    if isinstance(v, (bool, int, np.integer, np.bool_)):
        return int(v), "long"
    try:
        f = float(v)
    except (TypeError, ValueError):
        raise ValueError(f"the event hash reads integers, floats, decimals, strings, bytes, dates and "
                         f"datetimes, not {type(v).__name__}") from None
    if f != f or f in (float("inf"), float("-inf")):
        return None, "long"
    n = int(v)  # truncated toward zero (a decimal exactly)
    return (n, "long") if -_LONG <= n < _LONG else (None, "long")


def event_hashes(fields) -> np.ndarray:
    """Every event's content hash ``e = xxhash64(f_1, ..., f_k)``, the fields as ``long``:
    ``fields`` is an int array [n, k] (one row per event, its fields in order) or a sequence
    of k arrays [n]. An integer (or boolean) array is hashed vectorised; any other column
    (strings, floats, None for nulls, ...) one value at a time as :func:`chain_value` reads
    it, as Spark's ``xxhash64`` in :func:`chain_column` does. int64 [n].

    Example::

        event_hashes(np.array([[11, 3, 1]]))   # == [xxhash64([(11, "long"), (3, "long"), (1, "long")])]
        event_hashes([np.array(["a", "b"], dtype=object), np.array([1, 2])])   # string items
    """
    cols = list(np.asarray(fields).T) if not isinstance(fields, (list, tuple)) else list(fields)
    if not cols:
        raise ValueError("event_hashes needs at least one field per event")
    h = np.full(np.shape(cols[0]), SPARK_SEED, dtype=np.int64)
    for c in cols:
        a = np.asarray(c) if not isinstance(c, np.ndarray) else c
        if a.dtype.kind in "iub":
            h = xxhash64_longs(a.astype(np.int64) if a.dtype.kind == "b" else a, h)
        else:
            h = np.array([xxhash64([chain_value(v)], seed=s) for v, s in zip(a.tolist(), h.tolist())],
                         dtype=np.int64).reshape(h.shape)
    return h


def _roll(prev: np.ndarray, e: np.ndarray) -> np.ndarray:
    return xxhash64_longs(e, xxhash64_longs(prev, SPARK_SEED))


def _roll_scalar(e: np.ndarray, prev: int) -> np.ndarray:
    import xxhash

    out = np.empty(len(e), dtype=np.int64)
    h = prev & 0xFFFFFFFFFFFFFFFF
    pack, digest = struct.Struct("<Q").pack, xxhash.xxh64_intdigest
    for i, x in enumerate(e.view(np.uint64).tolist()):
        h = digest(pack(x), seed=digest(pack(h), seed=SPARK_SEED))
        out[i] = h - (1 << 64) if h >= 1 << 63 else h
    return out


def rolling_hashes(e, offsets=None) -> np.ndarray:
    """The rolling hash ``h_i = xxhash64(h_{i-1}, e_i)`` (both ``long``, ``h_{-1} = 42``) of
    each sequence: ``e`` int64 [T] event hashes, ``offsets`` [S+1] cutting it into sequences
    (None: one sequence). int64 [T]. Vectorised across sequences (one numpy step per
    position); a few long sequences finish with the scalar hash.

    Example::

        h = rolling_hashes(event_hashes(fields), offsets=np.array([0, 3, 3, 8]))  # three users
    """
    e = np.ascontiguousarray(e, dtype=np.int64)
    off = np.array([0, len(e)], dtype=np.int64) if offsets is None else np.asarray(offsets, dtype=np.int64)
    h = np.empty_like(e)
    starts, lens = off[:-1], off[1:] - off[:-1]
    order = np.argsort(-lens, kind="stable")  # longest first: the active ones are a prefix
    starts, lens = starts[order], lens[order]
    prev = np.full(len(lens), CHAIN_SEED, dtype=np.int64)
    pos = 0
    while True:
        active = int(np.searchsorted(-lens, -pos, side="left"))  # sequences longer than pos
        if active == 0:
            break
        if active <= 4 and int(lens[0]) - pos > 64:  # a few long tails: the scalar loop is faster
            for j in range(active):
                a, b = int(starts[j]) + pos, int(starts[j] + lens[j])
                h[a:b] = _roll_scalar(e[a:b], int(prev[j]))
            break
        idx = starts[:active] + pos
        prev = _roll(prev[:active], e[idx])
        h[idx] = prev
        pos += 1
    return h


def chain_checkpoints(h, length: int, block: int) -> tuple[np.ndarray, int]:
    """The chain of one sequence from its rolling hashes ``h`` [n] (``length`` = n): the
    checkpoints ``[h_{P-1}, h_{2P-1}, ...]`` (one per complete block of ``block`` = P
    events) and the end ``h_{n-1}`` (:data:`CHAIN_SEED` for n = 0).

    Example::

        cps, end = chain_checkpoints(rolling_hashes(e), len(e), 64)
    """
    if block < 1:
        raise ValueError(f"block={block}: use a number of events >= 1")
    h = np.asarray(h, dtype=np.int64)
    return h[block - 1:length:block].copy(), int(h[length - 1]) if length else CHAIN_SEED


def sequence_chain(fields, block: int) -> tuple[np.ndarray, int]:
    """The chain of one sequence from its events' fields (as :func:`event_hashes` takes them):
    its checkpoints and end (:func:`chain_checkpoints`); what a sample's ``chain_checkpoints``
    and ``chain_end`` hold for its stored events.

    Example::

        cps, end = sequence_chain([seq_item, seq_category, seq_author, seq_action], 64)
    """
    cols = list(np.asarray(fields).T) if not isinstance(fields, (list, tuple)) else list(fields)
    n = len(cols[0]) if cols else 0
    if n == 0:
        return np.zeros(0, dtype=np.int64), CHAIN_SEED
    return chain_checkpoints(rolling_hashes(event_hashes(cols)), n, block)


def _hash_input(c, t):
    """A field's Spark column as the event hash reads it (module docstring)."""
    import pyarrow as pa

    if pa.types.is_integer(t) or pa.types.is_boolean(t):
        return c.cast("bigint")
    if pa.types.is_floating(t) or pa.types.is_decimal(t):
        return c.try_cast("bigint")
    if pa.types.is_date(t):
        from pyspark.sql import functions as F

        return F.unix_date(c).cast("bigint")
    if pa.types.is_timestamp(t):
        from pyspark.sql import functions as F

        return F.unix_micros(c)
    return c  # strings, binary (their bytes); nested values: Spark's own hash of them


def chain_column(fields, block: int):
    """The Spark column of a sequence's chain: ``fields`` are (array column, Arrow element
    type) pairs, the chain's fields in order, parallel lists of one sequence per row; a
    struct of ``checkpoints`` (array<bigint>) and ``end`` (bigint), equal to
    :func:`sequence_chain` of the same values. Native functions only: each event's hash
    by ``transform``, the rolling hash by one ``aggregate`` (the module docstring's fold).

    Example::

        df.select(chain_column([(F.col("seq_item"), pa.int64()), (F.col("seq_action"), pa.int64())], 64)
                  .alias("chain"))
    """
    from pyspark.sql import functions as F

    if block < 1:
        raise ValueError(f"block={block}: use a number of events >= 1")
    cols = list(fields)
    es = F.transform(cols[0][0], lambda _, i: F.xxhash64(*[_hash_input(c[i], t) for c, t in cols]))
    zero = F.struct(F.lit(CHAIN_SEED).cast("bigint").alias("h"), F.lit(0).alias("n"),
                    F.array().cast("array<bigint>").alias("cps"))

    def closes(a):
        """A block ended with the event before: its hash is a checkpoint."""
        return (a["n"] > 0) & (a["n"] % F.lit(block) == 0)

    def with_cp(a):
        return F.when(closes(a), F.concat(a["cps"], F.array(a["h"]))).otherwise(a["cps"])

    def step(a, e):
        return F.struct(F.xxhash64(a["h"], e).alias("h"), (a["n"] + 1).alias("n"), with_cp(a).alias("cps"))

    return F.aggregate(es, zero, step, lambda a: F.struct(with_cp(a).alias("checkpoints"), a["h"].alias("end")))
