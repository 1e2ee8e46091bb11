"""One node's staged shards: manifest, verification, row-group metadata.

Everything here runs once, in the trainer's main process, before any worker
starts: a missing file, a checksum mismatch or a schema that differs from the
manifest is a :class:`ShardError` naming the file, never a crash mid-epoch.
The manifest is read and the files are checked by the shard format's one
module, :mod:`userwise.pipelines.shards.manifest`.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field

import numpy as np
import pyarrow.parquet as pq

from userwise.pipelines.errors import ArgumentError, ShardError
from userwise.pipelines.shards import manifest as mf

VERIFY = mf.VERIFY


@dataclass
class NodeShards:
    """The shards of one node with per-row-group metadata (from Parquet footers).

    Row groups are numbered globally in manifest order; ``rg_*`` arrays are
    indexed by that number.
    """

    root: str
    node: int
    manifest: dict
    shards: list[dict]
    sets: list[str]
    rg_shard: np.ndarray
    rg_index: np.ndarray
    rg_rows: np.ndarray
    rg_set: np.ndarray
    rg_rank: np.ndarray
    schema: object = None
    rg_bytes: np.ndarray | None = None  # uncompressed (decoded) bytes per row group, from the footers
    _cols: dict = field(default_factory=dict, repr=False)
    _fingerprint: str | None = field(default=None, repr=False)

    @property
    def roles(self) -> dict:
        return self.manifest.get("roles") or {}

    @property
    def fingerprint(self) -> str:
        """The shard set's identity: sha256 (16 hex digits) of its manifest, without the
        ``staged_node`` that ``stage`` adds, so a set read from its root and its staged copies
        are the same set on every node. The manifest holds every file's sha256, the sets and
        the shape (nodes, ranks per node), so any change of the set's content changes it.
        A loader state records it (:mod:`~userwise.pipelines.loader.planning.resume`)."""
        if self._fingerprint is None:
            m = {k: v for k, v in self.manifest.items() if k != "staged_node"}
            text = json.dumps(m, sort_keys=True, separators=(",", ":"), default=str)
            self._fingerprint = hashlib.sha256(text.encode()).hexdigest()[:16]
        return self._fingerprint

    def path(self, shard: int) -> str:
        return os.path.join(self.root, self.shards[shard]["path"])

    def gds_path(self, shard: int) -> str | None:
        g = self.shards[shard].get("gds_path")
        return os.path.join(self.root, g) if g else None

    def column(self, name: str) -> list[np.ndarray]:
        """One (small) column of every row group, e.g. ``cost`` or ``user``, read once and cached."""
        if name not in self._cols:
            per_rg: list[np.ndarray] = []
            for s in range(len(self.shards)):
                try:  # its pages checked against their CRCs, as every read of the loader
                    t = pq.read_table(source(self.path(s)), columns=[name], page_checksum_verification=True)
                except Exception as e:  # noqa: BLE001
                    why = " ".join(str(e).split())
                    raise ShardError(f"{self.path(s)}: column {name} unreadable ({why}); re-stage this file") from None
                a = t.column(name).to_numpy()
                rows = self.rg_rows[self.rg_shard == s]
                per_rg += np.split(a, np.cumsum(rows)[:-1])
            self._cols[name] = per_rg
        return self._cols[name]


def source(path: str):
    """What pyarrow opens for a shard: the local path itself, or for a URL (a shard set read
    straight from cluster storage, the slow path: docs/storage.md) a file of
    the store's filesystem (``pipelines/runtime/storage.py``)."""
    if "://" not in path or path.startswith("file:"):
        return path
    fs, p = mf.resolve(path)
    return fs.open_input_file(p)


def check_row_groups(md, path: str, *, rows: int, row_groups: int | None = None) -> None:
    """A shard's row groups (``md``, its ``pq.FileMetaData``) agree with the manifest's ``rows``
    (and ``row_groups``) and with their own column chunks, else a :class:`ShardError` naming
    the file. The loader reads a row group's rows as its footer says, and the footer is outside
    every page's CRC: a row count edited there (17 to 16, or to -18) would silently drop samples
    while the file's total still matched. So, in every ``verify`` mode (the footer is parsed
    anyway; no page is read): every row group's count is >= 0, their sum is the manifest's
    rows, and every column chunk holds as many values as its row group has rows (exactly, for a
    column that does not repeat; at least as many, for a list column, each of whose rows holds
    one value or an empty-list marker at least)."""
    fix = "the file's footer is damaged or was edited: copy it again (`userwise stage`) or rerun `userwise preshard`"
    if row_groups is not None and md.num_row_groups != int(row_groups):
        raise ShardError(f"{path}: {md.num_row_groups} row groups, the manifest says {row_groups}; {fix}")
    ncol = md.num_columns
    repeated = [md.schema.column(c).max_repetition_level > 0 for c in range(ncol)]
    total = 0
    for g in range(md.num_row_groups):
        rg = md.row_group(g)
        n = rg.num_rows
        if n < 0:
            raise ShardError(f"{path}: row group {g} holds {n} rows; {fix}")
        for c in range(ncol):
            v = rg.column(c).num_values
            if v < n or (v != n and not repeated[c]):
                raise ShardError(f"{path}: row group {g} holds {n} rows but its column "
                                 f"{md.schema.column(c).path} {v} values; {fix}")
        total += n
    if total != int(rows):
        raise ShardError(f"{path}: its row groups hold {total} rows, the manifest (and the footer's total) "
                         f"{rows}; {fix}")


def open_node(root: str, node: int | None = None, *, verify: str = "checksum") -> NodeShards:
    """Open (and verify) one node's shards under ``root``.

    ``node``: default the manifest's ``staged_node``, or 0 for a one-node set.
    ``verify``: ``checksum`` (size + sha256 + schema), ``size`` (size + schema), ``none``.
    """
    if verify not in VERIFY:
        raise ArgumentError(f"verify must be one of {VERIFY}, got {verify!r}")
    root = os.fspath(root)
    man = mf.load(root)
    if node is None:
        node = man.get("staged_node")
        if node is None:
            if int(man["nodes"]) != 1:
                raise ShardError(f"{os.path.join(root, mf.MANIFEST)}: {man['nodes']} nodes and no staged_node; pass node=")
            node = 0
    node = int(node)
    set_ids = [s["id"] for s in man["sets"]]
    order = {sid: i for i, sid in enumerate(set_ids)}
    shards = mf.node_shards(man, node)
    if not shards:
        raise ShardError(f"{os.path.join(root, mf.MANIFEST)}: no shards for node {node}")
    rg_shard, rg_index, rg_rows, rg_set, rg_rank, rg_bytes = [], [], [], [], [], []
    schema = None
    for si, s in enumerate(shards):
        path = os.path.join(root, s["path"])
        mf.check_files(root, s, verify=verify)
        try:
            pf = pq.ParquetFile(source(path))
        except Exception as e:  # noqa: BLE001 (any footer error is a bad shard)
            raise ShardError(f"{path}: not a readable Parquet file ({e}); re-stage it") from None
        mf.check_footer(pf, man, path, rows=s["rows"])
        check_row_groups(pf.metadata, path, rows=s["rows"], row_groups=s["row_groups"])
        md = pf.metadata
        schema = pf.schema_arrow
        for i in range(md.num_row_groups):
            rg_shard.append(si)
            rg_index.append(i)
            rg = md.row_group(i)
            rg_rows.append(rg.num_rows)
            rg_bytes.append(rg.total_byte_size)
            rg_set.append(order[s["set"]])
            rg_rank.append(int(s.get("rank", 0)))
    return NodeShards(root, node, man, shards, set_ids, np.array(rg_shard), np.array(rg_index),
                      np.array(rg_rows, dtype=np.int64), np.array(rg_set), np.array(rg_rank), schema,
                      np.array(rg_bytes, dtype=np.int64))
