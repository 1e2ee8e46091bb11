"""Seeded, balanced shard assignment: a pure function of (costs, slots, seed).

One shard set (the pretrain set, or one incremental window) is spread over
``slots = nodes * ranks_per_node`` ranks. The rule, which ``preshard`` also
computes in Spark (``preshard.assign_spark``) and a test holds equal:

1. Order the samples by (cost descending, ``tiebreak(id, seed, 1)``, id).
   Number them ``i = 0 .. n-1``.
2. Deal them out in a snake: block ``b = i // slots``, position
   ``j = i % slots``; slot ``j`` on even blocks, ``slots - 1 - j`` on odd ones.
   Every slot gets ``n // slots`` or ``n // slots + 1`` samples (equal counts
   +-1), and any two slots' cost differs by at most ``max(cost)`` (by at most
   ``max(cost) - min(cost)`` when ``slots`` divides ``n``: the blocks are
   consecutive runs of the sorted costs, and each pair of blocks hands the
   larger element of one to the smaller of the other), so every rank is
   within one sample's cost of the mean; with many samples per rank that is
   far below 2%.
3. Slot ``s`` is node ``s // ranks_per_node``, local rank ``s % ranks_per_node``.
4. A rank's samples go to ``shards_per_rank`` shards by block: shard
   ``b % shards_per_rank``: every shard gets every cost tier, counts +-1.
5. Inside a shard rows are ordered by ``tiebreak(id, seed, 2)`` (then id): a
   seeded shuffle, unrelated to user id or time.

The tie-break hash is Spark's ``xxhash64(seed, salt, id)`` (all longs), so the
Spark job reproduces it natively, without a UDF.

Example::

    p = plan(costs=np.array([5, 1, 9, 3]), ids=np.arange(4), nodes=1, ranks_per_node=2, seed=0)
    p["rank"], p["shard"], p["order"]
"""

from __future__ import annotations

import numpy as np

from userwise.schemas.hashing import xxhash64

ASSIGN_SALT = 1
ORDER_SALT = 2


def tiebreak(ids, seed: int, salt: int) -> np.ndarray:
    """Spark's ``xxhash64(lit(seed).cast('long'), lit(salt).cast('long'), id)`` for int64 ids."""
    return np.array([xxhash64([(seed, "long"), (salt, "long"), (int(v), "long")])
                     for v in np.asarray(ids, dtype=np.int64)], dtype=np.int64)


def snake(index, slots: int):
    """Slot of the ``index``-th sample (in cost order) for ``slots`` ranks."""
    index = np.asarray(index, dtype=np.int64)
    block, pos = index // slots, index % slots
    return np.where(block % 2 == 0, pos, slots - 1 - pos)


def cost_order(costs, ids, seed: int) -> np.ndarray:
    """Indices of the samples in dealing order: cost desc, seeded hash, id."""
    costs = np.asarray(costs, dtype=np.int64)
    ids = np.asarray(ids, dtype=np.int64)
    h = tiebreak(ids, seed, ASSIGN_SALT)
    return np.lexsort((ids, h, -costs))


def plan(costs, ids=None, *, nodes: int, ranks_per_node: int, seed: int, shards_per_rank: int = 1) -> dict:
    """Assign one shard set's samples to (node, rank, shard) and order them.

    Returns arrays aligned with the input: ``index`` (position in dealing
    order), ``slot``, ``node``, ``rank``, ``shard`` (local shard of the rank,
    ``0 .. shards_per_rank-1``) and ``order`` (the within-shard sort key;
    ties broken by id).
    """
    if nodes < 1 or ranks_per_node < 1 or shards_per_rank < 1:
        raise ValueError("nodes, ranks_per_node and shards_per_rank must be at least 1")
    costs = np.asarray(costs, dtype=np.int64)
    ids = np.arange(len(costs), dtype=np.int64) if ids is None else np.asarray(ids, dtype=np.int64)
    if len(ids) != len(costs):
        raise ValueError(f"{len(ids)} ids for {len(costs)} costs")
    slots = nodes * ranks_per_node
    index = np.empty(len(costs), dtype=np.int64)
    index[cost_order(costs, ids, seed)] = np.arange(len(costs), dtype=np.int64)
    slot = snake(index, slots)
    return {
        "index": index,
        "slot": slot,
        "node": slot // ranks_per_node,
        "rank": slot % ranks_per_node,
        "shard": (index // slots) % shards_per_rank,
        "order": tiebreak(ids, seed, ORDER_SALT),
    }


def spread(rank_cost, rank_rows) -> dict:
    """Balance summary of one set: per (node, rank) cost and rows, and the
    largest relative deviation of a rank's cost from the mean."""
    cost = np.asarray(rank_cost, dtype=np.float64)
    mean = float(cost.mean()) if cost.size else 0.0
    max_dev = float(np.abs(cost - mean).max() / mean) if mean > 0 else 0.0
    return {
        "rank_cost": np.asarray(rank_cost, dtype=np.int64).tolist(),
        "rank_rows": np.asarray(rank_rows, dtype=np.int64).tolist(),
        "max_dev": round(max_dev, 6),
    }


def within_bound(rank_cost, max_cost: int, tolerance: float = 0.02) -> bool:
    """The balance promise: every rank's cost is within ``tolerance`` of the
    mean, or within one sample's cost of it, whichever is larger."""
    cost = np.asarray(rank_cost, dtype=np.float64).ravel()
    if cost.size == 0:
        return True
    mean = cost.mean()
    return bool(np.abs(cost - mean).max() <= max(tolerance * mean, float(max_cost)))


def shards_per_rank(max_rank_bytes: float, target_bytes: float, min_rank_rows: int) -> int:
    """How many shards a rank's samples are cut into: enough to keep each near
    ``target_bytes``, never more than the smallest rank has samples (no empty shards)."""
    want = int(np.ceil(max_rank_bytes / target_bytes)) if target_bytes > 0 else 1
    return max(1, min(want, max(1, int(min_rank_rows))))
