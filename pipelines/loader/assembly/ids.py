"""A batch's ids deduplicated and routed for embedding parallelism, off the GPU.

A trainer that shards its embedding tables row-wise over ``W`` ranks starts each forward
pass by (1) taking the unique ids of the batch and keeping ``inverse_indices`` and (2)
sending each id to the rank that owns its row. :func:`route_ids` does both for one id key
without sorting the ids (a bitset of the ids present; a counting sort on the owner, the values
being in bag order already), in the loader's compiled kernels (:mod:`kernels`) or, without
numba, in numpy with the same result, so a loader worker can do it while the trainer trains:

- ``unique`` (sorted) and ``inverse`` (``values == unique[inverse]``);
- ``owner`` of every unique id and ``hot`` (ids in a given hot set, which a trainer keeps
  data-parallel: they need no all-to-all);
- the owner buckets of every value as fbgemm's ``block_bucketize_sparse_features`` (TorchRec's
  ``bucketize_kjt_before_all2all``) gives them: block size ``ceil(num_embeddings / W)``, id
  ``i`` on rank ``i // block`` at local row ``i % block`` (an id at or past ``block * W``: rank
  ``i % W``, row ``i // W``, as fbgemm does), lengths ``[W, bags]`` rank-major, values in rank
  then bag order, and ``unbucketize_permute`` (each value's position in the bucketed values).

:class:`IdRouting` says which keys, tables and ranks; :func:`route_batch` applies it to a
:class:`~userwise.pipelines.loader.assembly.batch.JaggedBatch` (the dataset's ``ids=`` runs it
in the workers and puts the result in ``batch.meta["ids"]``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from userwise.pipelines.errors import ArgumentError
from userwise.pipelines.loader.assembly import segcopy

__all__ = ["RoutedIds", "IdRouting", "route_ids", "route_batch"]

PER = ("sample", "request", "impression")


@dataclass(frozen=True)
class RoutedIds:
    """One id key of one batch, deduplicated and bucketed by owner (numpy arrays; see the
    module doc). ``sends`` (int64 ``[W]``): unique ids that are not hot, per owner: what the
    deduplicated all-to-all sends to each rank. dtypes: ``unique`` and ``bucket_values`` int64;
    ``inverse``, ``unbucketize_permute`` (as fbgemm gives it), ``owner`` and ``bucket_lengths``
    int32 (a batch key holds fewer than 2^31 values), which halves what the workers send for them;
    ``hot`` bool.

    Example::

        r = route_ids(values, lengths, num_embeddings=10_000, world_size=8)
        assert (r.unique[r.inverse] == values).all()
    """

    unique: np.ndarray
    inverse: np.ndarray
    owner: np.ndarray
    hot: np.ndarray
    block_size: int
    world_size: int
    bucket_lengths: np.ndarray
    bucket_values: np.ndarray
    unbucketize_permute: np.ndarray

    @property
    def sends(self) -> np.ndarray:
        return np.bincount(self.owner[~self.hot], minlength=self.world_size).astype(np.int64)


def _owner_local(ids: np.ndarray, block: int, world: int) -> tuple[np.ndarray, np.ndarray]:
    inside = ids < block * world
    owner = np.where(inside, ids // block, ids % world)
    local = np.where(inside, ids % block, ids // world)
    return owner, local


def _hot_set(hot) -> np.ndarray:
    if hot is None:
        return np.empty(0, np.int64)
    h = np.asarray(hot)
    if h.ndim != 1 or (h.size and not np.issubdtype(h.dtype, np.integer)):
        raise ArgumentError(f"a hot set must be a 1-d array of integer ids, got {h.dtype} of shape {h.shape}")
    h = h.astype(np.int64, copy=False)
    if bool((h[1:] > h[:-1]).all()):  # sorted, no repeats (IdRouting's): used as it is
        return np.ascontiguousarray(h)
    return np.unique(h)


# Deduplication without sorting: a bitset over the ids' span [0, max id] when it costs no more than
# the values themselves (64 bits a value) or fits DENSE_BITS (16 MiB: a 134M-row table); past
# that (hashed or sparse 64-bit ids) a sort. numpy marks bytes, not bits: a smaller bound.
DENSE_BITS = 1 << 27
NUMPY_DENSE = 1 << 24


def _dense(span: int, n: int, bound: int, per_value: int) -> bool:
    return span <= max(bound, per_value * n)


def _kernels():
    """The compiled id kernels (:mod:`kernels`), or None where assembly runs in numpy (numba
    missing, ``USERWISE_NO_NUMBA=1``, or they failed to compile): :mod:`segcopy` chooses, once."""
    return segcopy.batch_kernels()


def _unique_numpy(v: np.ndarray, span: int) -> tuple[np.ndarray, np.ndarray]:
    if _dense(span, len(v), NUMPY_DENSE, 8):
        mark = np.zeros(span, bool)
        mark[v] = True
        rank = np.cumsum(mark, dtype=np.int32)
        return np.flatnonzero(mark).astype(np.int64, copy=False), rank[v] - np.int32(1)
    u, inv = np.unique(v, return_inverse=True)
    return u, inv.astype(np.int32).ravel()


def _bucketize_numpy(v: np.ndarray, ln: np.ndarray, block: int, W: int):
    owner, local = _owner_local(v, block, W)
    B = len(ln)
    key = owner * B + np.repeat(np.arange(B, dtype=np.int64), ln)
    # values come in bag order: a stable sort on the owner alone is the (owner, bag) order, and
    # numpy's stable sort of 8- or 16-bit keys is a radix sort
    small = np.uint8 if W <= 1 << 8 else np.uint16 if W <= 1 << 16 else np.int64
    order = np.argsort(owner.astype(small), kind="stable")
    perm = np.empty(len(v), np.int32)
    perm[order] = np.arange(len(v), dtype=np.int32)
    return np.bincount(key, minlength=W * B).astype(np.int32), local[order], perm


def route_ids(values, lengths, *, num_embeddings: int, world_size: int, hot=None) -> RoutedIds:
    """One key's ids (``values``, grouped into bags by ``lengths``) deduplicated, flagged hot
    and bucketed by owner for row-wise sharding over ``world_size`` ranks (see the module doc).
    Compiled (numba) where the loader's kernels are, numpy otherwise: the same arrays. Neither
    sorts the ids while they span at most ``max(DENSE_BITS, 64 * len(values))`` (a bitset marks
    the ids present); wider, they are sorted.

    Example::

        r = route_ids(np.array([5, 1, 9, 3]), np.array([3, 0, 1]), num_embeddings=10, world_size=3)
        r.unique, r.owner                 # [1 3 5 9], [0 0 1 2]   (block 4)
        r.bucket_lengths                  # [1 0 1  1 0 0  1 0 0]: rank-major, bags within
    """
    v = np.ascontiguousarray(np.asarray(values).astype(np.int64, copy=False).ravel())
    ln = np.ascontiguousarray(np.asarray(lengths).astype(np.int64, copy=False).ravel())
    if isinstance(num_embeddings, bool) or not isinstance(num_embeddings, (int, np.integer)) or num_embeddings < 1:
        raise ArgumentError(f"num_embeddings must be an int >= 1 (the table's rows), got {num_embeddings!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, (int, np.integer)) or world_size < 1:
        raise ArgumentError(f"world_size must be an int >= 1, got {world_size!r}")
    if (ln < 0).any() or int(ln.sum()) != len(v):
        raise ArgumentError(f"lengths must be >= 0 and sum to the {len(v)} values, they sum to {int(ln.sum())}")
    if len(v) >= 1 << 31:
        raise ArgumentError(f"a key of one batch holds at most 2^31 - 1 ids, got {len(v)}: make the batches smaller")
    if len(v) and int(v.min()) < 0:
        raise ArgumentError(f"ids must be >= 0 to have an owner, got {int(v.min())}")
    W = int(world_size)
    block = -(-int(num_embeddings) // W)
    span = int(v.max()) + 1 if len(v) else 0
    hs = _hot_set(hot)
    nb = _kernels()
    if nb is None:
        unique, inverse = _unique_numpy(v, span)
        owner_u, _ = _owner_local(unique, block, W)
        owner_u = owner_u.astype(np.int32)
        is_hot = np.isin(unique, hs, assume_unique=True)
        blens, bvals, perm = _bucketize_numpy(v, ln, block, W)
    else:
        if _dense(span, len(v), DENSE_BITS, 64):
            unique, inverse = nb.ids_dense_unique(v, span)
        else:
            unique, inverse = np.unique(v, return_inverse=True)
            inverse = inverse.astype(np.int32).ravel()
        owner_u = nb.ids_owners(unique, block, W)
        is_hot = nb.ids_hot(unique, hs)
        blens, bvals, perm = nb.ids_bucketize(v, ln, block, W)
    return RoutedIds(unique=unique, inverse=inverse, owner=owner_u, hot=is_hot, block_size=block, world_size=W,
                     bucket_lengths=blens, bucket_values=bvals, unbucketize_permute=perm)


@dataclass(frozen=True)
class IdRouting:
    """What :func:`route_batch` (and the dataset's ``ids=``) computes per batch: for every key
    of ``num_embeddings`` (id column -> its table's rows), its bags (``per``: ``"sample"``,
    ``"request"`` or ``"impression"``, as :meth:`JaggedBatch.to_kjt` bags them) routed over
    ``world_size`` ranks, with the ids of ``hot[key]`` flagged.

    Example::

        ds = UserwiseDataset(root, ids=IdRouting({"seq_item": 10_000_000}, world_size=64,
                                                 hot={"seq_item": top_ids}))
        r = next(iter(UserwiseLoader(ds))).meta["ids"]["seq_item"]   # a RoutedIds
    """

    num_embeddings: Mapping[str, int]
    world_size: int
    hot: Mapping[str, object] = field(default_factory=dict)
    per: str = "sample"

    def __post_init__(self):
        if not isinstance(self.num_embeddings, Mapping) or not self.num_embeddings:
            raise ArgumentError(f"IdRouting.num_embeddings must map id columns to their tables' rows, "
                                f"got {self.num_embeddings!r:.80}")
        for k, n in self.num_embeddings.items():
            if not isinstance(k, str) or isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
                raise ArgumentError(f"IdRouting.num_embeddings[{k!r}] must be an int >= 1, got {n!r}")
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, (int, np.integer)) \
                or self.world_size < 1:
            raise ArgumentError(f"IdRouting.world_size must be an int >= 1, got {self.world_size!r}")
        extra = sorted(set(self.hot) - set(self.num_embeddings))
        if extra:
            raise ArgumentError(f"IdRouting.hot has keys {extra} that num_embeddings does not route")
        if self.per not in PER:
            raise ArgumentError(f"IdRouting.per must be one of {PER}, got {self.per!r}")
        object.__setattr__(self, "hot", {k: _hot_set(h) for k, h in self.hot.items()})


def route_batch(batch, routing: IdRouting) -> dict[str, RoutedIds]:
    """Every key of ``routing`` in ``batch`` (a :class:`JaggedBatch`) routed: key -> :class:`RoutedIds`.

    Example::

        routed = route_batch(b, IdRouting({"imp__item_id": 1_000_000}, world_size=8))
    """
    out = {}
    for k, n in routing.num_embeddings.items():
        v, ln = batch.jagged(k, routing.per)
        out[k] = route_ids(v.cpu().numpy(), ln.cpu().numpy(), num_embeddings=int(n),
                           world_size=int(routing.world_size), hot=routing.hot.get(k))
    return out
