"""TorchRec's planner inputs from the data: per embedding table, the distinct ids of a global
batch (``expected_lookups``) and its exact LRU miss-ratio curve, in the shapes TorchRec's
``CacheStatistics`` and ``EmbeddingOffloadStats`` take.

TorchRec sizes a table's UVM cache (``compute_kernel="fused_uvm_caching"``) by its
``CacheParams(stats=...)``: the planner's ``EmbeddingOffloadScaleupProposer`` gives the HBM it
has to the tables whose caches gain most (``cacheability`` x ``expected_lookups``), and its
estimators price a cache load factor ``clf`` by ``expected_miss_rate(clf)`` x
``expected_lookups`` rows fetched per step. Both come from how the trainer will read the ids:

- a global batch is ``batch_size`` examples on each of ``world_size`` ranks; what the cache
  sees per step is its distinct ids (fbgemm's cache prefetches a batch's unique ids), so the
  LRU stream is, batch after batch, each batch's distinct ids (ascending);
- ``expected_lookups``: the mean distinct ids of a global batch (of the full batches);
- the miss-ratio curve: every access of the stream has an LRU stack distance ``d`` (the
  distinct other ids since its previous access; :func:`lru_stack_distances`, exact), and a
  cache of ``k`` rows hits exactly the accesses with ``d < k``. First accesses miss at any
  size and are left out, as TorchRec's curve is 0 at ``clf = 1``;
- ``EmbeddingOffloadStats``' histogram: the distances counted in ``bins`` bins of
  ``linspace(0, height, bins + 1)``; with ``bins = height`` its ``expected_miss_rate`` is the
  exact curve (tested against a direct LRU simulation in ``tests/train/test_planner_stats.py``);
- ``cacheability``: the area under the curve over ``clf`` in [0, 1] (0: any cache hits,
  1: none does), exactly ``mean(d) / height``.

:func:`table_stats` takes the ids in training order (a shard set read in the loader's order,
or any stream); :func:`table_stats_from_counts` takes the build's ``id_stats`` (lookups per id,
:func:`read_id_stats`) and models a shuffled trainer: the lookups in a seeded random order.
:func:`planner_constraints` hands them to TorchRec. numpy; torch and torchrec only when a
TorchRec object is asked for; never imports pyspark.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from userwise.pipelines.errors import ArgumentError

__all__ = ["TableStats", "lru_stack_distances", "table_stats", "table_stats_from_counts", "read_id_stats",
           "planner_constraints"]


def _distances(codes, n_ids):
    """Stack distances by a Fenwick tree over access times: a 1 at each id's last access; an
    access's distance is the 1s after its id's previous access. Plain loops: numba compiles
    them when it is installed; without it they run as they are, giving the same distances."""
    n = len(codes)
    tree = np.zeros(n + 1, dtype=np.int64)
    last = np.full(n_ids, -1, dtype=np.int64)
    out = np.empty(n, dtype=np.int64)
    total = 0
    for t in range(n):
        c = codes[t]
        p = last[c]
        if p < 0:
            out[t] = -1
        else:
            s = 0
            i = p + 1
            while i > 0:
                s += tree[i]
                i -= i & -i
            out[t] = total - s
            i = p + 1
            while i <= n:
                tree[i] -= 1
                i += i & -i
            total -= 1
        i = t + 1
        while i <= n:
            tree[i] += 1
            i += i & -i
        total += 1
        last[c] = t
    return out


_KERNEL: list = []


def lru_stack_distances(stream: np.ndarray) -> np.ndarray:
    """Per access of ``stream`` (ids, any dtype numpy can sort), its exact LRU stack distance:
    the number of distinct other ids accessed since its previous access (0: the id was the
    last one used), or -1 for a first access. An LRU cache of ``k`` rows hits an access exactly
    when ``0 <= d < k``. O(n log n) (a Fenwick tree; compiled with numba when it is installed).

    Example::

        lru_stack_distances(np.array([1, 2, 1, 1, 3, 2]))   # [-1, -1, 1, 0, -1, 2]
    """
    stream = np.asarray(stream)
    if stream.ndim != 1:
        raise ArgumentError(f"stream: expected a 1-d array of ids, got shape {stream.shape}")
    if len(stream) == 0:
        return np.zeros(0, dtype=np.int64)
    uniq, codes = np.unique(stream, return_inverse=True)
    codes = codes.astype(np.int64)
    if not _KERNEL:
        try:
            import numba

            _KERNEL.append(numba.njit(nogil=True)(_distances))
        except ImportError:  # numba is optional: the same loops in Python give the same distances
            _KERNEL.append(_distances)
    return _KERNEL[0](codes, len(uniq))


@dataclass(frozen=True)
class TableStats:
    """One embedding table's planner statistics (see the module doc).

    ``height``: the table's rows (``num_embeddings``); ``expected_lookups``: mean distinct ids
    per global batch; ``distance_counts``: the accesses at each LRU stack distance 0, 1, ...
    (reuses only); ``first_accesses``: the accesses that miss at any cache size; ``batches``:
    the global batches counted.

    Example::

        st = table_stats(ids, batch_size=512, world_size=8, height=1_000_000)
        st.miss_ratio(100_000), st.cacheability
        CacheParams(stats=st.to_torchrec())          # torchrec.distributed.types.CacheParams
    """

    height: int
    expected_lookups: float
    distance_counts: np.ndarray
    first_accesses: int
    batches: int

    @property
    def reuses(self) -> int:
        return int(self.distance_counts.sum())

    def miss_ratio(self, cache_rows) -> np.ndarray | float:
        """The exact LRU miss ratio of the reuses for a cache of ``cache_rows`` rows (a number
        or an array): the share of reuses at distance ``>= cache_rows`` (0 when none reuse)."""
        k = np.asarray(cache_rows, dtype=np.int64)
        if self.reuses == 0:
            out = np.zeros(k.shape)
        else:
            hits = np.concatenate([[0], np.cumsum(self.distance_counts)])
            out = 1.0 - hits[np.clip(k, 0, len(self.distance_counts))] / self.reuses
        return float(out) if out.ndim == 0 else out

    @property
    def cacheability(self) -> float:
        """The area under the miss-ratio curve over load factors [0, 1]: ``mean(d) / height``."""
        if self.reuses == 0 or self.height == 0:
            return 0.0
        d = np.arange(len(self.distance_counts), dtype=np.float64)
        return float((d * self.distance_counts).sum() / self.reuses / self.height)

    def mrc_hist(self, bins: int = 100) -> np.ndarray:
        """The distances counted in ``bins`` bins of ``linspace(0, height, bins + 1)``:
        ``EmbeddingOffloadStats``' ``mrc_hist_counts`` (float64)."""
        if bins < 1:
            raise ArgumentError(f"bins: expected at least 1, got {bins}")
        edges = np.linspace(0, self.height, bins + 1)
        d = np.arange(len(self.distance_counts))
        idx = np.clip(np.searchsorted(edges, d, side="right") - 1, 0, bins - 1)
        return np.bincount(idx, weights=self.distance_counts.astype(np.float64), minlength=bins)

    def to_torchrec(self, bins: int | None = 100):
        """TorchRec's ``EmbeddingOffloadStats`` (a ``CacheStatistics``) of this table; ``bins``
        None: one bin per row (the exact curve; fine for small tables)."""
        import torch
        from torchrec.distributed.planner.shard_estimators import EmbeddingOffloadStats

        hist = torch.from_numpy(self.mrc_hist(self.height if bins is None else bins))
        return EmbeddingOffloadStats(cacheability=self.cacheability, expected_lookups=self.expected_lookups,
                                     mrc_hist_counts=hist, height=self.height)


def _global_batches(n: int, lengths: np.ndarray | None, batch_size: int, world_size: int) -> tuple[np.ndarray, int]:
    """Per lookup, its global batch; and the number of full global batches."""
    if batch_size < 1 or world_size < 1:
        raise ArgumentError(f"batch_size and world_size: expected at least 1, got {batch_size} and {world_size}")
    per = batch_size * world_size
    if lengths is None:
        return np.arange(n, dtype=np.int64) // per, n // per
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.sum() != n or (lengths < 0).any():
        raise ArgumentError(f"lengths: expected non-negative lookups per example summing to {n} ids, "
                            f"got {int(lengths.sum())}")
    example = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)
    return example // per, len(lengths) // per


def table_stats(ids: np.ndarray, *, batch_size: int, world_size: int, height: int | None = None,
                lengths: np.ndarray | None = None) -> TableStats:
    """A table's :class:`TableStats` from its lookups in training order: ``ids`` one per lookup,
    ``lengths`` the lookups of each example (None: one each; a sequence of ``L`` items is one
    example of length ``L``); a global batch is ``batch_size`` examples on each of
    ``world_size`` ranks, consecutive. ``height``: the table's rows (default: the largest id + 1).

    Example::

        st = table_stats(item_ids, batch_size=1024, world_size=8, height=2_000_000)
        st.expected_lookups        # distinct items per global batch
    """
    ids = np.asarray(ids)
    batch, full = _global_batches(len(ids), lengths, batch_size, world_size)
    if len(ids) == 0:
        return TableStats(int(height or 0), 0.0, np.zeros(0, dtype=np.int64), 0, 0)
    if height is None:
        if not np.issubdtype(ids.dtype, np.integer):
            raise ArgumentError("height: give the table's rows when the ids are not integers")
        height = int(ids.max()) + 1
    # the LRU stream: batch after batch, its distinct ids ascending
    order = np.lexsort((ids, batch))
    b, v = batch[order], ids[order]
    keep = np.ones(len(v), dtype=bool)
    keep[1:] = (b[1:] != b[:-1]) | (v[1:] != v[:-1])
    b, v = b[keep], v[keep]
    per_batch = np.bincount(b)
    counted = per_batch[:full] if full else per_batch
    d = lru_stack_distances(v)
    reuse = d[d >= 0]
    counts = np.bincount(reuse) if len(reuse) else np.zeros(0, dtype=np.int64)
    return TableStats(int(height), float(counted.mean()), counts.astype(np.int64), int((d < 0).sum()), len(counted))


def table_stats_from_counts(ids: np.ndarray, lookups: np.ndarray, *, batch_size: int, world_size: int,
                            height: int | None = None, seed: int = 0) -> TableStats:
    """A table's :class:`TableStats` from lookups per id (the build's ``id_stats``:
    :func:`read_id_stats`), for a trainer that reads them in random order: the multiset of
    lookups (``lookups[i]`` of ``ids[i]``) in a ``seed``-ed permutation, one lookup per example,
    ``batch_size`` per rank on ``world_size`` ranks.
    ``height`` defaults to the number of ids. (The user-wise order has more locality than
    this; :func:`table_stats` over the shards in the loader's order measures it.)

    Example::

        ids, lookups = read_id_stats(build_dir, "incremental", "2026-01-10", "item_id")
        st = table_stats_from_counts(ids, lookups, batch_size=1024, world_size=8)
    """
    ids, lookups = np.asarray(ids), np.asarray(lookups, dtype=np.int64)
    if ids.shape != lookups.shape or (lookups < 0).any():
        raise ArgumentError(f"ids and lookups: expected two arrays of one length and lookups >= 0, "
                            f"got shapes {ids.shape} and {lookups.shape}")
    codes = np.repeat(np.arange(len(ids), dtype=np.int64), lookups)
    np.random.default_rng(seed).shuffle(codes)
    return table_stats(codes, batch_size=batch_size, world_size=world_size,
                       height=len(ids) if height is None else height)


def read_id_stats(build_dir: str, kind: str, window_end: str, column: str, tier: str | None = None):
    """One set's and id column's rows of a build's ``id_stats`` table (delta-rs and pyarrow, no
    Spark): ``(ids, lookups)`` as numpy arrays (integer ids when they all are, else strings),
    most looked-up first; ``tier`` (hot, warm, cold) keeps that tier's only. UserwiseError when
    the build has no such rows.

    Example::

        hot, _ = read_id_stats(D, "incremental", "2026-01-10", "item_id", tier="hot")
        IdRouting(..., hot={"item_id": hot})          # the loader keeps them data-parallel
    """
    import datetime as dt

    import pyarrow.compute as pc
    import pyarrow.dataset as pds

    from userwise.pipelines.errors import UserwiseError
    from userwise.pipelines.runtime import delta_io

    path = delta_io.table_path(build_dir, "id_stats")
    if not delta_io.has_log(path):
        raise UserwiseError(f"{path} does not exist: build {build_dir} again (userwise build writes id_stats)")
    cond = (pds.field("kind") == kind) & (pds.field("window_end") == dt.date.fromisoformat(str(window_end))) & \
        (pds.field("column") == column)
    if tier is not None:
        cond = cond & (pds.field("tier") == tier)
    t = delta_io.dataset(path).to_table(columns=["id", "lookups", "rank"], filter=cond)
    if t.num_rows == 0 and tier is None:
        raise UserwiseError(f"{path} holds no rows of set ({kind}, {window_end}) and column {column!r}: "
                            "name a set of the build and an id column (columns.item or columns.id_features)")
    t = t.sort_by("rank")
    try:
        ids = pc.cast(t.column("id"), "int64").to_numpy(zero_copy_only=False)
    except (ValueError, TypeError):  # string ids stay strings (pyarrow's ArrowInvalid is a ValueError)
        ids = t.column("id").to_numpy(zero_copy_only=False).astype(str)
    return ids, t.column("lookups").to_numpy(zero_copy_only=False).astype(np.int64)


def planner_constraints(stats: Mapping[str, TableStats], *, bins: int | None = 100, load_factor: float | None = None,
                        **constraints) -> dict:
    """TorchRec ``ParameterConstraints`` per table name: the table cached in UVM
    (``fused_uvm_caching``) with ``CacheParams(stats=...)`` of its :class:`TableStats`, so the
    planner's ``EmbeddingOffloadScaleupProposer`` and estimators size its cache from the data.
    ``bins``: the miss-ratio histogram's bins (None: one per row, exact); ``load_factor``: the
    cache's starting load factor (None: the planner's default); ``constraints``: other
    ``ParameterConstraints`` fields (``sharding_types``, ...).

    Example::

        planner = EmbeddingShardingPlanner(topology=topology, batch_size=1024,
            constraints=planner_constraints({"t_item": st}),
            proposer=[GreedyProposer(), EmbeddingOffloadScaleupProposer()])
    """
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.types import CacheParams

    out = {}
    for name, st in stats.items():
        kw = {"compute_kernels": [EmbeddingComputeKernel.FUSED_UVM_CACHING.value], **constraints}
        out[name] = ParameterConstraints(cache_params=CacheParams(load_factor=load_factor, stats=st.to_torchrec(bins)),
                                         **kw)
    return out
