"""The epoch plan: a pure, seeded function of row-group sizes (and costs).

Every rank computes the plan of every rank of its node from metadata alone,
so all agree without communication: which row groups a rank reads, in what
order, how samples are shuffled within a buffer of row groups, and where the
batches are cut. Ranks with less work cut more, smaller batches so that every
rank has the same number of batches in every set (no sample dropped or
repeated; a rank with fewer samples than batches gets empty batches).

Which samples form a batch is what the shuffle draws; inside a batch they come
in stored order by default (``batch_order="stored"``: preshard already wrote
each shard in a seeded hash order, so that order says nothing of the samples),
which lets the loader's gathers stream through memory instead of jumping to a
random sample each time. ``"shuffled"`` keeps the drawn order.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from userwise.pipelines.errors import ArgumentError
from userwise.pipelines.jagged import np_offsets, np_positions
from userwise.pipelines.loader.io.shards import NodeShards

# the order of the samples inside one batch (the batch's samples are the same either way)
BATCH_ORDERS = ("stored", "shuffled")


def check_batch_order(batch_order: str) -> str:
    """``batch_order`` if it is one of :data:`BATCH_ORDERS` (the dataset checks it once, when
    it is made; :func:`plan_node` takes it as checked)."""
    if batch_order not in BATCH_ORDERS:
        raise ArgumentError(f"batch_order must be one of {BATCH_ORDERS}, got {batch_order!r}")
    return batch_order


def rng(seed: int, *keys: int) -> np.random.Generator:
    return np.random.default_rng([int(seed) & 0xFFFFFFFF, *[int(k) & 0xFFFFFFFF for k in keys]])


def _splitmix(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def user_unit(users, seed: int) -> np.ndarray:
    """A seeded uniform number in [0, 1) per user id (ints or strings), vectorised."""
    u = np.asarray(users)
    if u.dtype.kind in "iu":
        h = _splitmix(u.astype(np.int64).view(np.uint64) ^ _splitmix(np.array([seed], np.uint64)))
    else:  # strings: polynomial hash of the utf-8 bytes, then splitmix
        enc = [str(x).encode() for x in u]  # planning only (once per dataset), not on the decode path
        lens = np.array([len(e) for e in enc], np.int64)
        data = np.frombuffer(b"".join(enc), np.uint8).astype(np.uint64) + np.uint64(1)
        seg, pos = np_positions(np_offsets(lens))  # each byte's string and place in it
        with np.errstate(over="ignore"):
            w = data * _splitmix(pos.astype(np.uint64))
        acc = np.zeros(len(u), np.uint64)
        np.add.at(acc, seg, w)
        h = _splitmix(acc ^ _splitmix(np.array([seed], np.uint64)))
    return (h >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def holdout(rg_rows, rg_set, *, split: str, eval_set_idx, eval_user_share: float, eval_seed: int,
            users=None) -> list:
    """Per row group, the rows a ``split`` keeps ("all": None for every group, all rows): the
    held-out rows are those of the sets in ``eval_set_idx`` and, with ``eval_user_share``, a
    seeded share of the users (:func:`user_unit` by ``eval_seed``; ``users``: each row group's
    user column). "eval" keeps the held-out rows, "train" the others."""
    n = len(rg_rows)
    if split == "all":
        return [None] * n
    users_out = None
    if eval_user_share > 0:
        users_out = [user_unit(u, eval_seed) < eval_user_share for u in users]
    keep = []
    for g in range(n):
        ev = np.full(int(rg_rows[g]), int(rg_set[g]) in eval_set_idx)
        if users_out is not None:
            ev = ev | users_out[g]
        keep.append(ev if split == "eval" else ~ev)
    return keep


@dataclass(frozen=True)
class PlanSettings:
    """What decides one rank's plans besides the epoch: the node's shards and the dataset's
    (checked) arguments. The dataset makes it once; :class:`~userwise.pipelines.loader.planning.epochs.Epochs`
    plans from it and :mod:`~userwise.pipelines.loader.planning.resume` checks saved states against it."""

    shards: NodeShards
    rank: int
    world_size: int
    batch_size: int | None
    token_budget: int | None
    seed: int
    shuffle: bool
    batch_order: str
    buffer_row_groups: int
    set_idx: tuple[int, ...]  # the selected sets, in training order
    split: str
    eval_set_idx: frozenset[int]
    eval_user_share: float
    eval_seed: int
    all_reduce_targets: bool


@dataclass
class Buffer:
    """Row groups read together; samples shuffled within; cut into batches."""

    set_idx: int
    rgs: np.ndarray      # global row-group ids, in read order
    perm: np.ndarray     # row indices into the concatenated row groups (kept rows only, shuffled;
                         # each batch's slice sorted under batch_order="stored")
    bounds: np.ndarray   # batch b = perm[bounds[b]:bounds[b+1]]

    @property
    def num_batches(self) -> int:
        return len(self.bounds) - 1


@dataclass
class RankPlan:
    epoch: int
    rank: int
    world: int
    buffers: list[Buffer]

    @property
    def num_batches(self) -> int:
        return sum(b.num_batches for b in self.buffers)

    def batch_owner(self, num_workers: int) -> np.ndarray:
        """Worker id of each batch in epoch order (buffer i goes to worker i % num_workers)."""
        k = max(1, num_workers)
        return np.concatenate([np.full(b.num_batches, i % k) for i, b in enumerate(self.buffers)] or [np.zeros(0, int)]).astype(int)

    def first_batch(self) -> np.ndarray:
        """Epoch index of each buffer's first batch."""
        n = np.array([b.num_batches for b in self.buffers], int)
        return np.cumsum(n) - n


def assign(rg_set: np.ndarray, rg_rank: np.ndarray, weight: np.ndarray, ranks_per_node: int, world: int) -> np.ndarray:
    """The rank of every row group: the preshard's balance when the world matches it,
    otherwise a re-split at row-group granularity (largest first onto the least loaded rank)."""
    if world == ranks_per_node:
        return rg_rank.astype(int)
    out = np.zeros(len(rg_set), int)
    for s in np.unique(rg_set):
        ids = np.flatnonzero(rg_set == s)
        order = ids[np.lexsort((ids, -weight[ids]))]
        load = [(0, r) for r in range(world)]
        heapq.heapify(load)
        for i in order:
            w, r = heapq.heappop(load)
            out[i] = r
            heapq.heappush(load, (w + int(weight[i]), r))
    return out


def cut(costs: np.ndarray, batch_size: int | None, token_budget: int | None) -> np.ndarray:
    """Batch bounds over samples in order: by count, or greedily by a token budget
    (a batch never exceeds the budget unless it is one oversize sample)."""
    n = len(costs)
    if token_budget is None:
        return np.unique(np.concatenate([np.arange(0, n, batch_size), [n]])) if n else np.zeros(1, int)
    cs = np.concatenate([[0], np.cumsum(costs, dtype=np.int64)])
    bounds, a = [0], 0
    while a < n:  # one iteration per batch (not per sample)
        b = int(np.searchsorted(cs, cs[a] + token_budget, side="right")) - 1
        b = max(b, a + 1)
        bounds.append(min(b, n))
        a = bounds[-1]
    return np.array(bounds, int)


def oversize(costs: list, keep: list, token_budget: int) -> tuple[int, int, int]:
    """(samples over ``token_budget``, samples, the largest cost) among the kept rows
    (``keep``: per row group a mask or None) of row groups of ``costs``: the samples
    :func:`cut` gives a batch of their own, each over the budget."""
    over = total = largest = 0
    for c, k in zip(costs, keep):
        c = c if k is None else c[k]
        if len(c):
            over += int(np.count_nonzero(c > token_budget))
            total += len(c)
            largest = max(largest, int(c.max()))
    return over, total, largest


def stored_order(buf: Buffer) -> None:
    """Each batch of ``buf`` with its samples in stored (row) order: the same samples per
    batch, sorted inside it: one sort of (batch, row) keys per buffer, about ten times
    cheaper than ``np.lexsort`` of the two (the trainer plans each epoch while its workers
    start reading)."""
    if len(buf.perm) < 2:
        return
    m = np.int64(buf.perm.max()) + 1  # rows skip held-out ones: key by the largest row, not the count
    batch = np.repeat(np.arange(buf.num_batches, dtype=np.int64), np.diff(buf.bounds)) * m
    key = batch + buf.perm
    key.sort()
    buf.perm = key - batch


def equalize(buffers: list[Buffer], target: int) -> None:
    """Split the largest batches in half until the buffers hold ``target`` batches;
    pad with empty batches when there are fewer samples than batches."""
    have = sum(b.num_batches for b in buffers)
    if have > target:
        raise ArgumentError(f"target {target}: the rank already has {have} batches; a target is at least the "
                            "batches the rank cuts (plan_node takes the max)")
    heap = [(-(int(b.bounds[k + 1]) - int(b.bounds[k])), i, int(b.bounds[k])) for i, b in enumerate(buffers)
            for k in range(b.num_batches)]
    heapq.heapify(heap)
    extra = {i: [] for i in range(len(buffers))}
    while have < target and heap and -heap[0][0] >= 2:
        neg, i, a = heapq.heappop(heap)
        size = -neg
        m = a + size // 2
        extra[i].append(m)
        heapq.heappush(heap, (-(m - a), i, a))
        heapq.heappush(heap, (-(size - size // 2), i, m))
        have += 1
    for i, cuts in extra.items():
        if cuts:
            buffers[i].bounds = np.sort(np.concatenate([buffers[i].bounds, cuts])).astype(int)
    if have < target:
        last = buffers[-1]
        last.bounds = np.concatenate([last.bounds, np.full(target - have, last.bounds[-1])]).astype(int)


def plan_node(*, rg_rows, rg_set, rg_owner, keep, costs, sets, world, epoch, seed, shuffle, buffer_rgs,
              batch_size, token_budget, targets=None, batch_order="stored") -> tuple[list[RankPlan], dict[int, int]]:
    """Plans of every rank of the node for one epoch, and the batches per set.

    keep: per row group a bool mask of kept rows, or None (all). costs: per row
    group the sample costs (token budget only). targets: set -> batch count to
    reach (e.g. after a cross-node max); default the max over this node's ranks.
    batch_order: "stored" (each batch's samples sorted by row) or "shuffled" (as drawn).
    """
    plans = {r: [] for r in range(world)}
    natural: dict[int, int] = {}
    for s in sets:
        per_rank = {}
        for r in range(world):
            rgs = np.flatnonzero((rg_set == s) & (rg_owner == r))
            if shuffle:
                rgs = rgs[rng(seed, epoch, s, r).permutation(len(rgs))]
            bufs = []
            for bi in range(0, len(rgs), buffer_rgs):
                group = rgs[bi: bi + buffer_rgs]
                base = np_offsets(rg_rows[group])
                rows = np.concatenate([np.flatnonzero(keep[g]) + base[j] if keep[g] is not None
                                       else np.arange(rg_rows[g]) + base[j] for j, g in enumerate(group)] or [np.zeros(0, int)])
                if shuffle:
                    rows = rows[rng(seed, epoch, s, r, 1 + bi).permutation(len(rows))]
                c = None
                if token_budget is not None:
                    allc = np.concatenate([costs[g] for g in group])
                    c = allc[rows]
                bufs.append(Buffer(s, group, rows.astype(np.int64), cut(c if c is not None else rows, batch_size, token_budget)))
            bufs = [b for b in bufs if len(b.perm)] or [Buffer(s, np.zeros(0, int), np.zeros(0, np.int64), np.zeros(1, int))]
            per_rank[r] = bufs
        natural[s] = max(sum(b.num_batches for b in per_rank[r]) for r in range(world))
        target = natural[s] if targets is None else max(natural[s], targets.get(s, 0))
        for r in range(world):
            equalize(per_rank[r], target)
            if shuffle and batch_order == "stored":
                for b in per_rank[r]:
                    stored_order(b)
            plans[r] += per_rank[r]
    out_targets = {s: (natural[s] if targets is None else max(natural[s], targets.get(s, 0))) for s in sets}
    return [RankPlan(epoch, r, world, plans[r]) for r in range(world)], out_targets
