"""The dataset: one rank's plan over one node's staged shards, and its batches.

:class:`UserwiseDataset` checks its arguments, hands what decides the plan to its
:class:`~userwise.pipelines.loader.planning.epochs.Epochs` (``dataset.epochs``: the epoch plans, the
cursor and resume), and turns each planned buffer into its batches: read
(Parquet, :mod:`reading`; or GDS side files, :mod:`gpudirect`), checked and decoded
(:mod:`decode`), assembled (:mod:`assemble` on the host, :mod:`assemble_torch` on the
device). The loader (:mod:`loader`) and its workers iterate it.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch.utils.data import IterableDataset, get_worker_info

from userwise.pipelines.errors import ArgumentError, ShardError, UserwiseError, expect
from userwise.pipelines.loader.assembly import assemble_torch
from userwise.pipelines.loader.assembly.assemble import Prepared, empty_batch, empty_layout
from userwise.pipelines.loader.assembly.batch import as_device
from userwise.pipelines.loader.assembly.ids import IdRouting, route_batch
from userwise.pipelines.loader.io import decode, gpudirect
from userwise.pipelines.loader.io.reading import READ_AHEAD, ShardFiles, read_pool, read_row_groups
from userwise.pipelines.loader.io.shards import VERIFY, NodeShards, open_node
from userwise.pipelines.loader.planning import distributed
from userwise.pipelines.loader.planning.epochs import Epochs
from userwise.pipelines.loader.planning.plan import PlanSettings, RankPlan, check_batch_order

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


def _setting(name: str, doc: str) -> property:
    """A read-only view of one of the plan's settings (:class:`~userwise.pipelines.loader.planning.plan.PlanSettings`,
    owned by the dataset's :class:`~userwise.pipelines.loader.planning.epochs.Epochs`)."""
    return property(lambda self: getattr(self.epochs.settings, name), doc=doc)


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
        ids (IdRouting | None): per batch and id key, the unique ids, their inverse indices
            and owner buckets for row-wise sharding, hot ids flagged, computed where the batch
            is assembled (in the workers) into ``batch.meta["ids"]`` (key ->
            :class:`~userwise.pipelines.loader.assembly.ids.RoutedIds`). Default None: not computed.

    ``dataset.epochs`` (:class:`~userwise.pipelines.loader.planning.epochs.Epochs`) plans this rank's
    epochs and holds where the iteration is (epoch, cursor, a loaded state); the arguments that
    decide the plan read back as read-only attributes (``ds.seed``, ``ds.rank``...).

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

    def __init__(self, root: str, *, node: int | None = None, sets: str | Sequence[str] | None = None,
                 batch_size: int = 64, token_budget: int | None = None, rank: int | None = None,
                 world_size: int | None = None, seed: int = 0, shuffle: bool = True, batch_order: str = "stored",
                 buffer_row_groups: int | str = "auto", split: str = "all", eval_sets: str | Sequence[str] = (),
                 eval_user_share: float = 0.0, eval_seed: int = 0, columns: Sequence[str] | None = None,
                 verify: str = "checksum", gds: bool | str = "auto", device: str | torch.device | None = None,
                 all_reduce_targets: bool = True, ids: IdRouting | None = None) -> None:
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
        if ids is not None and not isinstance(ids, IdRouting):
            raise ArgumentError(f"ids must be an IdRouting or None, got {type(ids).__name__}")
        device = as_device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self._shards: NodeShards = open_node(root, node, verify=verify)
        sh = self._shards
        dr, dw = distributed.rank_world()
        rank = dr if rank is None else int(rank)
        world_size = dw if world_size is None else int(world_size)
        if not 0 <= rank < world_size:
            raise ArgumentError(f"rank {rank} is outside world size {world_size}")
        batch_order = check_batch_order(batch_order)
        if buffer_row_groups == "auto":
            buffer_row_groups = auto_buffer_row_groups(sh.rg_rows, sh.rg_bytes)
        kinds = {s["id"]: s["kind"] for s in sh.manifest["sets"]}
        pick = lambda sel: [i for i, sid in enumerate(sh.sets) if sid in sel or kinds[sid] in sel]  # noqa: E731
        set_idx = list(range(len(sh.sets))) if sets is None else pick(set(sets))
        if sets is not None and not set_idx:
            raise ShardError(f"{root}: no set matches {sets}; the manifest has {sh.sets}")
        names = sh.schema.names
        if columns is not None:
            bad = [c for c in columns if c not in names]
            if bad:
                raise ArgumentError(f"unknown columns {bad}; the shards have {names}")
            columns = [c for c in names if c in set(columns) | set(REQUIRED)]
        self.columns = columns or list(names)
        if ids is not None:
            bad = [k for k in ids.num_embeddings if k not in self.columns]
            if bad:
                raise ArgumentError(f"ids routes columns {bad} that this dataset does not read; it reads {self.columns}")
        self.ids = ids
        self.device = device
        self.epochs = Epochs(PlanSettings(
            shards=sh, rank=rank, world_size=world_size, batch_size=batch_size, token_budget=token_budget,
            seed=int(seed), shuffle=bool(shuffle), batch_order=batch_order, buffer_row_groups=int(buffer_row_groups),
            set_idx=tuple(set_idx), split=split, eval_set_idx=frozenset(pick(set(eval_sets))),
            eval_user_share=float(share), eval_seed=int(eval_seed), all_reduce_targets=all_reduce_targets))
        self._data_path = gpudirect.choose_path(sh, gds, self.device)
        self._empty_layout = None  # an empty batch's layout (read once, when one is due)
        self._read_threads = True  # Arrow's decode threads (workers turn them off: one core each)
        self._memory_map = True  # staged shards are local files: map them instead of copying through read()
        self._read_pool = read_pool()  # checked here, before any worker starts
        self._files = ShardFiles()  # open shard files and read-ahead lanes, per process

    # -- what it was made with (the plan's settings, read-only) -------------------------
    rank = _setting("rank", "This dataset's local rank.")
    world_size = _setting("world_size", "Ranks sharing this node's shards.")
    batch_size = _setting("batch_size", "Samples per batch (None with a token budget and no batch size).")
    token_budget = _setting("token_budget", "Events + impressions per batch at most, or None.")
    seed = _setting("seed", "The shuffle seed.")
    shuffle = _setting("shuffle", "Whether row groups and samples are shuffled.")
    batch_order = _setting("batch_order", "The order of the samples inside a batch: 'stored' or 'shuffled'.")
    buffer_row_groups = _setting("buffer_row_groups", "Row groups per shuffle buffer.")
    set_idx = _setting("set_idx", "The selected sets (their positions in the manifest), in training order.")
    split = _setting("split", "'all', 'train' or 'eval'.")
    eval_set_idx = _setting("eval_set_idx", "The held-out sets (positions in the manifest).")
    eval_user_share = _setting("eval_user_share", "The seeded share of users held out.")
    eval_seed = _setting("eval_seed", "The seed of the held-out users.")
    all_reduce_targets = _setting("all_reduce_targets", "Whether nodes agree on batch counts with an all-reduce.")

    @property
    def epoch(self) -> int:
        """The epoch the next iteration plans (:attr:`epochs`)."""
        return self.epochs.epoch

    @property
    def data_path(self) -> str:
        """The data path batches are read by: ``"parquet"``, ``"gds"`` (side files straight to
        the device) or ``"gds-host"`` (side files on the host).

        Example::

            UserwiseDataset("/nvme/shards", gds="auto").data_path    # 'parquet' without GDS
        """
        return self._data_path

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next iteration plans (a new seeded shuffle per epoch), as torch's
        samplers take it; its first batch comes next.

        Example::

            ds.set_epoch(3); batches = list(ds)     # epoch 3's batches of this rank
        """
        self.epochs.set_epoch(epoch)

    def set_read_threads(self, on: bool) -> None:
        """Arrow's decode threads on or off in this process (the loader's workers turn them off
        where they would compete for the cores).

        Example::

            ds.set_read_threads(False)        # decode in the calling thread only
        """
        self._read_threads = bool(on)

    @property
    def roles(self) -> dict:
        """The build's column roles (the manifest's ``roles``): what the samples' columns are,
        e.g. for ``ReferenceRanker.for_roles(dataset.roles)``.

        Example::

            UserwiseDataset("/nvme/shards").roles["labels"]    # ['click', 'like']
        """
        return self._shards.roles

    def __len__(self) -> int:
        """This rank's batches in the current epoch (every rank of the job has as many)."""
        return self.epochs.plan().num_batches

    # -- reading -------------------------------------------------------------------
    def _read_buffer(self, rgs) -> dict:
        """Decode row groups into flat columns (Parquet, or GDS side files), checked."""
        sh = self._shards
        if self._data_path == "parquet":
            where = sh.path(int(sh.rg_shard[rgs[0]]))
            cols = decode.from_arrow(self._read_table(rgs), where)
        else:
            cols = gpudirect.read_side_files(sh, rgs, self.columns, self._data_path, self.device)
            where = sh.gds_path(int(sh.rg_shard[rgs[0]]))
        decode.check_groups(cols, where)
        return cols

    def _read_table(self, rgs) -> pa.Table:
        """Row groups ``rgs`` as one Arrow table, as read (:func:`reading.read_row_groups`)."""
        return read_row_groups(self._shards, self._file, rgs, self.columns, use_threads=self._read_threads)

    def _file(self, shard: int) -> pq.ParquetFile:
        """The open shard file of this process and thread (:class:`reading.ShardFiles`)."""
        return self._files.open(self._shards.path(shard), self._memory_map, self._read_pool)

    def batches(self, plan: RankPlan, *, worker: int = 0, num_workers: int = 1, start: int = 0, alloc=None,
                read_ahead: bool | None = None):
        """The batches of ``plan`` (this rank's, :attr:`epochs`) for one worker: buffers
        ``i % num_workers == worker``, in epoch order, skipping batches before ``start`` (epoch
        index); each batch's buffer from ``alloc(nbytes)`` (default a new host tensor).

        ``read_ahead`` (default: when this process decodes alone, ``num_workers <= 1``):
        ``reading.READ_LANES`` threads read the next ``READ_AHEAD`` buffers while this thread shuffles
        and cuts the current one (Arrow, numpy and the compiled kernels release the GIL).

        Example::

            for b in ds.batches(ds.epochs.plan(0), worker=1, num_workers=2):
                ...                           # epoch 0's batches of every second buffer
        """
        alloc = alloc or (lambda n: torch.empty(n, dtype=torch.uint8))
        firsts = plan.first_batch()
        roles = self._shards.roles
        mine = [(i, buf) for i, buf in enumerate(plan.buffers)
                if i % max(1, num_workers) == worker and int(firsts[i]) + buf.num_batches > start]
        if read_ahead is None:
            read_ahead = num_workers <= 1 and self._data_path != "gds"
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
                    meta = {"set": self._shards.sets[buf.set_idx], "epoch": plan.epoch, "index": j, "roles": roles}
                    a, b = int(buf.bounds[k]), int(buf.bounds[k + 1])
                    with self._damage_is_a_shard_error(buf):
                        if src is None:
                            batch = self._empty(meta, alloc)
                        elif isinstance(src, Prepared):
                            batch = src.assemble_range(a, b, alloc, meta)
                        else:  # device columns (GDS)
                            idx = torch.from_numpy(np.asarray(buf.perm[a:b], np.int64))
                            batch = assemble_torch.assemble(src, idx, alloc, meta)
                    if self.ids is not None:
                        batch.meta["ids"] = route_batch(batch, self.ids)
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
            sh = self._shards
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

    def _empty(self, meta, alloc):
        """A rank with fewer samples than batches: an empty batch with the full layout (that of
        the node's first row group, read once)."""
        if self._empty_layout is None:
            self._empty_layout = empty_layout(self._read_buffer([0]))
        return empty_batch(self._empty_layout, alloc, meta)

    def __iter__(self):
        info = get_worker_info()
        w, k = (0, 1) if info is None else (info.id, info.num_workers)
        return self.batches(self.epochs.plan(), worker=w, num_workers=k)
