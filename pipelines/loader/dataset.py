"""The dataset: one rank's plan over one node's staged shards, and its batches.

:class:`UserwiseDataset` checks its arguments, plans each epoch (:mod:`plan`, with the
holdout, the cross-node agreement of :mod:`distributed` and what a resumed state
already consumed, :mod:`resume`), and turns each planned buffer into its batches: read
(Parquet, :mod:`reading`; or GDS side files, :mod:`gpudirect`), checked and decoded
(:mod:`decode`), assembled (:mod:`assemble` on the host, :mod:`assemble_torch` on the
device). The loader (:mod:`loader`) and its workers iterate it.
"""

from __future__ import annotations

import collections
import contextlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch.utils.data import IterableDataset, get_worker_info

from userwise.pipelines.errors import ArgumentError, ShardError, UserwiseError, expect
from userwise.pipelines.loader import assemble_torch, decode, distributed, gpudirect, resume
from userwise.pipelines.loader.assemble import Prepared
from userwise.pipelines.loader.batch import as_device
from userwise.pipelines.loader.plan import RankPlan, assign, check_batch_order, holdout, plan_node
from userwise.pipelines.loader.reading import READ_AHEAD, ShardFiles, read_pool, read_row_groups
from userwise.pipelines.loader.shards import VERIFY, NodeShards, open_node

__all__ = ["UserwiseDataset"]

REQUIRED = ("req_num_imps", "req_seq_begin", "req_seq_end")

# buffer_row_groups="auto": row groups per shuffle buffer for about BUFFER_ROWS samples (at least 2),
# unless that would decode more than BUFFER_BYTES (footer sizes). The work per buffer and column
# is fixed, so buffers of small row groups were dominated by it (docs/loader.md).
BUFFER_ROWS = 4096
BUFFER_BYTES = 64 << 20


def auto_buffer_row_groups(rg_rows, rg_bytes=None) -> int:
    """Row groups per buffer for ``buffer_row_groups="auto"`` from the node's row-group sizes."""
    k = round(BUFFER_ROWS / max(float(np.mean(rg_rows)) if len(rg_rows) else 1.0, 1.0))
    if rg_bytes is not None and len(rg_bytes):
        k = min(k, int(BUFFER_BYTES // max(float(np.mean(rg_bytes)), 1.0)))
    return max(2, k)


class UserwiseDataset(IterableDataset):
    """Jagged batches of user-wise samples from one node's staged shards.

    Yields :class:`JaggedBatch` (already batched: use it with
    :class:`UserwiseLoader`, or with torch's DataLoader and ``batch_size=None``).

    Args (keyword-only after ``root``):
        root (str): the staged folder (``manifest.json`` + ``node=k/``).
        node (int | None): default the manifest's ``staged_node`` (or 0 for one node).
        sets (list[str] | None): set ids or kinds to read, in manifest (training)
            order: pretrain first, then incremental windows by time. Default all.
        batch_size (int): samples per batch (default 64), unless ``token_budget``.
        token_budget (int | None): max events + impressions per batch (a single
            oversize sample makes its own batch).
        rank, world_size (int | None): local rank / ranks sharing this node's shards;
            default from LOCAL_RANK/LOCAL_WORLD_SIZE or torch.distributed, else 0/1.
            A world size other than the manifest's ranks_per_node re-splits by row group.
        seed (int): shuffle seed (default 0); shuffle (bool, default True).
        batch_order ("stored" | "shuffled"): the order of the samples inside a batch.
            Default "stored": a batch holds the samples the seeded shuffle drew for it, in
            the order they are stored (preshard wrote them in a seeded hash order), which
            makes its copies about twice as cheap. "shuffled": in the drawn order. The
            batches hold the same samples either way.
        buffer_row_groups (int | "auto"): row groups per shuffle buffer. Default "auto":
            enough for about 4096 samples (at least 2, e.g. 2 of preshard's 2048-row groups,
            8 of 512-row ones), capped at 64 MB decoded (footer sizes).
        split ("all" | "train" | "eval"): with ``eval_sets`` (held-out set ids or
            kinds) and ``eval_user_share`` (a seeded share of users, by ``eval_seed``).
        columns (list[str] | None): columns to read (default all; the pointer
            columns are always read).
        verify ("checksum" | "size" | "none"): checks before training (default checksum).
        gds ("auto" | "device" | "host" | False): "auto" reads GDS side files into device
            memory when kvikio (with a GDS driver), a GPU and side files exist, else Parquet;
            "device" takes kvikio's path even in its compatibility mode (no GDS driver:
            POSIX reads; an error when kvikio, side files or CUDA are missing);
            "host" reads the side files on the host (a test path); False: Parquet.
        device: the device batches are for (only decides the GDS path; default cuda if available).
        all_reduce_targets (bool): when torch.distributed spans more ranks than this node's,
            agree on batch counts with one all-reduce (max) per epoch. Default True.

    Every argument is checked before a file is opened (an
    :class:`~userwise.pipelines.errors.ArgumentError`, also a ``ValueError``); a shard set
    that is missing, corrupt or of another format is a
    :class:`~userwise.pipelines.errors.ShardError` naming the file.

    Example::

        ds = UserwiseDataset("/nvme/staged", batch_size=256, seed=1, split="train",
                             eval_sets=["incremental"], eval_user_share=0.05)
        len(ds)                             # this rank's batches this epoch
        loader = UserwiseLoader(ds, num_workers=4)
    """

    def __init__(self, root, *, node=None, sets=None, batch_size=64, token_budget=None, rank=None, world_size=None,
                 seed=0, shuffle=True, batch_order="stored", buffer_row_groups="auto", split="all", eval_sets=(),
                 eval_user_share=0.0, eval_seed=0, columns=None, verify="checksum", gds="auto", device=None,
                 all_reduce_targets=True):
        super().__init__()
        # every argument is checked before a file is opened: one ArgumentError (a ValueError) naming it
        if token_budget is None:
            batch_size = expect(batch_size, "int>=1", "batch_size", fix="or give token_budget")
        else:
            token_budget = expect(token_budget, "int>=1", "token_budget")
            batch_size = expect(batch_size, "int>=1", "batch_size", nullable=True)
        if split not in ("all", "train", "eval"):
            raise ArgumentError(f"split must be all, train or eval, got {split!r}")
        expect(node, "int>=0", "node", nullable=True)
        expect(rank, "int>=0", "rank", nullable=True)
        expect(world_size, "int>=1", "world_size", nullable=True)
        seed, eval_seed = expect(seed, "int", "seed"), expect(eval_seed, "int", "eval_seed")
        expect(shuffle, "bool", "shuffle")
        share = expect(eval_user_share, "number", "eval_user_share")
        if not 0 <= share < 1:
            raise ArgumentError(f"eval_user_share must be in [0, 1) (the share of users held out), got {share!r}")
        if sets is not None and (isinstance(sets, str) or not all(isinstance(x, str) for x in sets)):
            raise ArgumentError(f"sets must be a list of set ids or kinds, got {sets!r}")
        if isinstance(eval_sets, str) or not all(isinstance(x, str) for x in eval_sets):
            raise ArgumentError(f"eval_sets must be a list of set ids or kinds, got {eval_sets!r}")
        if columns is not None and (isinstance(columns, str) or not all(isinstance(x, str) for x in columns)):
            raise ArgumentError(f"columns must be a list of column names, got {columns!r}")
        if buffer_row_groups != "auto":
            expect(buffer_row_groups, "int>=1", "buffer_row_groups", fix="or 'auto'")
        if verify not in VERIFY:
            raise ArgumentError(f"verify must be one of {VERIFY}, got {verify!r}")
        device = as_device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.shards: NodeShards = open_node(root, node, verify=verify)
        dr, dw = distributed.rank_world()
        self.rank = dr if rank is None else int(rank)
        self.world_size = dw if world_size is None else int(world_size)
        if not 0 <= self.rank < self.world_size:
            raise ArgumentError(f"rank {self.rank} is outside world size {self.world_size}")
        self.batch_size, self.token_budget = batch_size, token_budget
        self.seed, self.shuffle = int(seed), bool(shuffle)
        self.batch_order = check_batch_order(batch_order)
        if buffer_row_groups == "auto":
            buffer_row_groups = auto_buffer_row_groups(self.shards.rg_rows, self.shards.rg_bytes)
        self.buffer_row_groups = int(buffer_row_groups)
        self.split, self.eval_user_share, self.eval_seed = split, float(share), int(eval_seed)
        self.all_reduce_targets = all_reduce_targets
        man = self.shards.manifest
        kinds = {s["id"]: s["kind"] for s in man["sets"]}
        pick = lambda sel: [i for i, sid in enumerate(self.shards.sets) if sid in sel or kinds[sid] in sel]  # noqa: E731
        self.set_idx = list(range(len(self.shards.sets))) if sets is None else pick(set(sets))
        if sets is not None and not self.set_idx:
            raise ShardError(f"{root}: no set matches {sets}; the manifest has {self.shards.sets}")
        self.eval_set_idx = set(pick(set(eval_sets)))
        names = self.shards.schema.names
        if columns is not None:
            bad = [c for c in columns if c not in names]
            if bad:
                raise ArgumentError(f"unknown columns {bad}; the shards have {names}")
            columns = [c for c in names if c in set(columns) | set(REQUIRED)]
        self.columns = columns or list(names)
        self.device = device
        self.data_path = gpudirect.choose_path(self.shards, gds, self.device)
        self.epoch = 0
        self._start = 0
        self._plans: dict[int, RankPlan] = {}  # this rank's plans by epoch: the current one, one made ahead
        self._resumed: tuple[int, list] | None = None  # (epoch, the runs that consumed part of it: resume.py)
        self._owner = None
        self._keep_cache = None
        self.read_threads = True  # Arrow's decode threads (workers turn them off: one core each)
        self.memory_map = True  # staged shards are local files: map them instead of copying through read()
        self.read_pool = read_pool()  # checked here, before any worker starts
        self._files = ShardFiles()  # open shard files and read-ahead lanes, per process

    # -- plan ------------------------------------------------------------------
    def _rank_plans(self, epoch: int | None = None) -> list[RankPlan]:
        """Plans of every rank of this node for ``epoch`` (default the current one)."""
        epoch = self.epoch if epoch is None else int(epoch)
        sh = self.shards
        weight = sh.rg_rows if self.token_budget is None else np.array([c.sum() for c in sh.column("cost")])
        if self._owner is None:
            self._owner = assign(sh.rg_set, sh.rg_rank, weight, int(sh.manifest["ranks_per_node"]), self.world_size)
        if self._keep_cache is None:
            self._keep_cache = holdout(sh.rg_rows, sh.rg_set, split=self.split, eval_set_idx=self.eval_set_idx,
                                       eval_user_share=self.eval_user_share, eval_seed=self.eval_seed,
                                       users=sh.column("user") if self.split != "all" and self.eval_user_share > 0
                                       else None)
        owner = self._owner
        costs = sh.column("cost") if self.token_budget is not None else None
        keep = self._keep_cache
        if self._resumed is not None and self._resumed[0] == epoch:  # what the saved runs left of the epoch
            keep = resume.remaining(self, epoch, self._resumed[1], keep)
        kw = dict(rg_rows=sh.rg_rows, rg_set=sh.rg_set, rg_owner=owner, keep=keep, costs=costs,
                  sets=self.set_idx, world=self.world_size, epoch=epoch, seed=self.seed, shuffle=self.shuffle,
                  batch_order=self.batch_order, buffer_rgs=self.buffer_row_groups, batch_size=self.batch_size,
                  token_budget=self.token_budget)
        plans, targets = plan_node(**kw)
        agreed = self._cross_node_targets(targets)
        if agreed != targets:
            plans, _ = plan_node(**kw, targets=agreed)
        return plans

    def _spans_nodes(self) -> bool:
        """Planning an epoch takes one all-reduce (:func:`distributed.spans_nodes`)."""
        return distributed.spans_nodes(self.world_size, self.all_reduce_targets)

    def _cross_node_targets(self, targets: dict) -> dict:
        """The batches per set every rank of the job agrees on: this node's, or with
        :meth:`_spans_nodes` the max over all nodes (:func:`distributed.agree_targets`)."""
        if not self._spans_nodes():
            return targets
        return distributed.agree_targets({s: targets[s] for s in self.set_idx})

    def _plan(self, epoch: int | None = None) -> RankPlan:
        """This rank's plan (cached per epoch; a plan made ahead for the next epoch is kept)."""
        epoch = self.epoch if epoch is None else int(epoch)
        p = self._plans.get(epoch)
        if p is None:
            p = self._keep_plan(epoch, self._rank_plans(epoch)[self.rank])
        return p

    def _plan_ahead(self, epoch: int) -> bool:
        """Plan ``epoch`` now and keep it with the current one: the loader calls this for the
        next epoch while its workers read their first buffers, so the next epoch does not
        start with the trainer planning and every worker waiting.
        Not where planning takes a collective (ranks on other nodes must plan at the same
        point in their programs). Returns whether the plan is ready."""
        epoch = int(epoch)
        if epoch not in self._plans:
            if self._spans_nodes():
                return False
            self._keep_plan(epoch, self._rank_plans(epoch)[self.rank])
        return True

    def _keep_plan(self, epoch: int, plan: RankPlan) -> RankPlan:
        """Cache ``plan``, with the plans of the epochs next to it (the current one, or one
        made ahead) and no others."""
        self._plans = {e: q for e, q in self._plans.items() if abs(e - epoch) == 1}
        self._plans[epoch] = plan
        return plan

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next iteration plans (a new seeded shuffle per epoch), as torch's
        samplers take it. :class:`UserwiseLoader` sets it itself.

        Example::

            ds.set_epoch(3); batches = list(ds)     # epoch 3's batches of this rank
        """
        self.epoch = int(epoch)

    def _set_resumed(self, epoch: int, runs: list | None) -> None:
        """Plan ``epoch`` without the samples that the saved runs ``runs`` consumed in it
        (:func:`~userwise.pipelines.loader.resume.remaining`; none: the whole epoch). Drops
        the plans made for the epochs this changes."""
        new = (int(epoch), list(runs)) if runs else None
        if new == self._resumed:
            return
        stale = {e for e in (epoch, self._resumed and self._resumed[0]) if e is not None}
        self._plans = {e: p for e, p in self._plans.items() if e not in stale}
        self._resumed = new

    def _runs_resumed(self, epoch: int) -> list:
        """The saved runs that consumed part of ``epoch`` (empty for a whole epoch)."""
        return list(self._resumed[1]) if self._resumed is not None and self._resumed[0] == int(epoch) else []

    @property
    def roles(self) -> dict:
        """The build's column roles (the manifest's ``roles``): what the samples' columns are,
        e.g. for ``ReferenceRanker.for_roles(dataset.roles)``.

        Example::

            UserwiseDataset("/nvme/shards").roles["labels"]    # ['click', 'like']
        """
        return self.shards.roles

    def __len__(self) -> int:
        """This rank's batches in the current epoch (every rank of the job has as many)."""
        return self._plan().num_batches

    # -- reading -------------------------------------------------------------------
    def _read_buffer(self, rgs) -> dict:
        """Decode row groups into flat columns (Parquet, or GDS side files), checked."""
        sh = self.shards
        if self.data_path == "parquet":
            where = sh.path(int(sh.rg_shard[rgs[0]]))
            cols = decode.from_arrow(self._read_table(rgs), where)
        else:
            cols = gpudirect.read_side_files(sh, rgs, self.columns, self.data_path, self.device)
            where = sh.gds_path(int(sh.rg_shard[rgs[0]]))
        decode.check_groups(cols, where)
        return cols

    def _read_table(self, rgs) -> pa.Table:
        """Row groups ``rgs`` as one Arrow table, as read (:func:`reading.read_row_groups`)."""
        return read_row_groups(self.shards, self._file, rgs, self.columns, use_threads=self.read_threads)

    def _file(self, shard: int) -> pq.ParquetFile:
        """The open shard file of this process and thread (:class:`reading.ShardFiles`)."""
        return self._files.open(self.shards.path(shard), self.memory_map, self.read_pool)

    def _batches(self, worker: int = 0, num_workers: int = 1, start: int = 0, alloc=None, epoch: int | None = None,
                read_ahead: bool | None = None):
        """This rank's batches for one worker: buffers ``i % num_workers == worker``,
        in epoch order, skipping batches before ``start`` (epoch index).

        ``read_ahead`` (default: when this process decodes alone, ``num_workers <= 1``):
        ``reading.READ_LANES`` threads read the next ``READ_AHEAD`` buffers while this thread shuffles
        and cuts the current one (Arrow, numpy and the compiled kernels release the GIL)."""
        plan = self._plan(epoch)
        alloc = alloc or (lambda n: torch.empty(n, dtype=torch.uint8))
        firsts = plan.first_batch()
        roles = self.shards.roles
        mine = [(i, buf) for i, buf in enumerate(plan.buffers)
                if i % max(1, num_workers) == worker and int(firsts[i]) + buf.num_batches > start]
        if read_ahead is None:
            read_ahead = num_workers <= 1 and self.data_path != "gds"
        pool = self._files.lanes() if read_ahead and len(mine) > 1 else None
        ahead: collections.deque = collections.deque()  # reads in flight, in buffer order
        try:
            for n, (i, buf) in enumerate(mine):
                with self._damage_is_a_shard_error(buf):
                    if pool is not None:
                        while len(ahead) < READ_AHEAD and n + len(ahead) < len(mine):
                            ahead.append(pool.submit(self._read, mine[n + len(ahead)][1]))
                        cols = ahead.popleft().result()
                    else:
                        cols = self._read(buf)
                    src = self._prepared(buf, cols)
                j0 = int(firsts[i])
                for k in range(buf.num_batches):
                    j = j0 + k
                    if j < start:
                        continue
                    meta = {"set": self.shards.sets[buf.set_idx], "epoch": plan.epoch, "index": j, "roles": roles}
                    a, b = int(buf.bounds[k]), int(buf.bounds[k + 1])
                    with self._damage_is_a_shard_error(buf):
                        if src is None:
                            batch = self._empty(meta, alloc)
                        elif isinstance(src, Prepared):
                            batch = src.assemble_range(a, b, alloc, meta)
                        else:
                            batch = self._gather(src, buf.perm[a:b], alloc, meta)
                    yield batch
        finally:  # stopped early (break, error): no read of this epoch outlives it
            for f in ahead:
                f.cancel()
            for f in ahead:
                if not f.cancelled():
                    f.exception()  # waits; its error, if any, no longer matters

    @contextlib.contextmanager
    def _damage_is_a_shard_error(self, buf):
        """Decoding and assembling a buffer: data that breaks a bound the kernels check, or that
        Arrow cannot decode, comes from a damaged file (every ``verify`` mode; page CRCs catch
        most damage first): a :class:`ShardError` naming the buffer's files."""
        try:
            yield
        except (IndexError, ValueError, OverflowError, MemoryError, KeyError, pa.ArrowException) as e:
            if isinstance(e, UserwiseError):
                raise
            sh = self.shards
            files = sorted({sh.path(int(sh.rg_shard[g])) for g in buf.rgs})
            why = " ".join(f"{type(e).__name__}: {e}".split())[:200]
            raise ShardError(f"{', '.join(files)}: damaged, its data breaks the shard format ({why}); re-stage "
                             "this file (`userwise stage` verifies checksums)") from None

    def _read(self, buf):
        """One buffer's columns as read (None for a buffer without row groups)."""
        return self._read_buffer(buf.rgs) if len(buf.rgs) else None

    def _prepared(self, buf, cols):
        """Read columns laid out for batches; host columns come back shuffled (each batch is
        then a contiguous range)."""
        if cols is None:
            return None
        src = self._prepare(cols)
        if isinstance(src, Prepared):
            src = src.permuted(buf.perm)
        return src

    @staticmethod
    def _prepare(cols: dict):
        """Host columns: stacked once per buffer for vectorised gathers; device columns as they are."""
        v = next(iter(cols.values())).values
        return Prepared(cols) if isinstance(v, np.ndarray) or v.device.type == "cpu" else cols

    @staticmethod
    def _gather(src, idx, alloc, meta):
        if isinstance(src, Prepared):
            return src.assemble(idx, alloc, meta)
        return assemble_torch.assemble(src, torch.from_numpy(np.asarray(idx, np.int64)), alloc, meta)

    def _empty(self, meta, alloc):
        # a rank with fewer samples than batches: an empty batch with the full layout
        if getattr(self, "_empty_src", None) is None:
            self._empty_src = self._prepare(self._read_buffer([0]))
        return self._gather(self._empty_src, np.zeros(0, np.int64), alloc, meta)

    def __iter__(self):
        info = get_worker_info()
        w, k = (0, 1) if info is None else (info.id, info.num_workers)
        return self._batches(w, k, self._start)
