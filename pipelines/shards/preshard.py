"""Pre-shard user-wise samples into balanced per-node Parquet shard sets.

``userwise preshard --samples D --output S --nodes K --ranks-per-node R``
reads the Delta table ``D/samples`` at its current version and writes
``S/node=<k>/shard-<NNNNN>.parquet`` (+ ``.gds`` with ``--layout gds``) and,
last, ``S/manifest.json`` (docs/shard-format.md is the contract).

How it stays a cluster job:
- the assignment (``balance`` rules) is computed in Spark: a global order by
  (set, cost desc, seeded hash, id) numbered with per-partition offsets
  (only one count per partition reaches the driver), the snake slot and the
  shard computed with column arithmetic; nothing per sample is collected;
- rows are range-partitioned by shard, sorted inside each partition by a
  seeded hash, and every shard is written from the executors with pyarrow
  (``mapInArrow``), which return one small stats row per shard;
- the driver collects those stats (metadata) and writes the manifest last.

The same writer and the same assignment also run without Spark on an Arrow
table (``preshard_arrow``): tests compare the two byte for byte.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import tempfile
import time
import uuid

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from userwise.pipelines import console
from userwise.pipelines.errors import InputError, UserwiseError
from userwise.pipelines.records import build_record, state
from userwise.pipelines.runtime import delta_io, storage
from userwise.pipelines.shards import balance
from userwise.pipelines.shards import manifest as mf
from userwise.schemas import FORMAT_VERSION, MANIFEST_SHARD, TableSchema
from userwise.schemas.core import Field, schema_fingerprint, schema_list

KINDS = ("pretrain", "incremental")
# What a shard writer returns: the shard's number and its manifest entry (schemas.MANIFEST_SHARD)
STATS = pa.schema([("shard", pa.int64()), *[(f.name, f.type) for f in MANIFEST_SHARD.to_arrow()]])
# helper columns that travel with the rows to the writer and are dropped there
AUX = ("_shard", "_node", "_rank", "_order", "_est")


# --------------------------------------------------------------------------
# options
# --------------------------------------------------------------------------
# The shard files' Parquet settings besides codec and dictionary (pipelines/tools/shardgen.py writes the
# benchmarks' and tests' shards with the same ones). Every page carries a CRC32 of its bytes, which
# the loader checks on each read: a flipped bit is an error even without the manifest's sha256.
PARQUET_OPTIONS = {"write_statistics": True, "version": "2.6", "data_page_version": "1.0", "write_page_checksum": True}
DICTIONARY = ("all", "scalars")


def parse_dictionary(spec: str, schema: pa.Schema):
    """``--dictionary``: ``all`` (default) dictionary-encodes every column, ``scalars`` leaves
    the list columns plain. pyarrow's ``use_dictionary`` for it: True, or the scalar columns.

    With zstd, dictionary-encoded lists are about as small and decode with much less CPU,
    because zstd then inflates small indices instead of 8-byte values (figures in
    docs/shards.md, "Parquet"). A column whose dictionary outgrows Parquet's page limit falls
    back to plain pages by itself."""
    if spec == "all":
        return True
    if spec == "scalars":
        return [f.name for f in schema if not (pa.types.is_list(f.type) or pa.types.is_large_list(f.type))]
    raise UserwiseError(f"--dictionary {spec}: use one of {list(DICTIONARY)}")


def parse_compression(spec: str | dict, schema: pa.Schema) -> dict:
    """``zstd`` | ``none`` | ``snappy`` for all columns, or ``default=zstd,seq_ts=none,...``.

    Returns the codec per Parquet leaf column (``seq_ts.list.element`` for lists)."""
    names = schema.names
    if isinstance(spec, dict):
        items = dict(spec)
    else:
        items = {}
        for part in str(spec).split(","):
            part = part.strip()
            if not part:
                continue
            k, _, v = part.rpartition("=")
            items[k or "default"] = v
    ok = {"zstd", "none", "uncompressed", "snappy", "gzip", "lz4", "brotli"}
    out = {}
    for k, v in items.items():
        v = v.lower()
        if v not in ok:
            raise UserwiseError(f"--compression {k}={v}: unknown codec; use one of {sorted(ok)}")
        if k != "default" and k not in names:
            raise UserwiseError(f"--compression names column {k!r}, which the shards do not have")
        out[k] = "none" if v == "uncompressed" else v
    default = out.pop("default", "zstd")
    leaf = {f.name: f.name + ".list.element" if pa.types.is_list(f.type) else f.name for f in schema}
    return {leaf[n]: out.get(n, default) for n in names}


def _width(t: pa.DataType) -> int:
    try:
        return max(1, t.bit_width // 8)
    except ValueError:
        return 8


# --------------------------------------------------------------------------
# the shard schema
# --------------------------------------------------------------------------
def shard_arrow_schema(columns: list[tuple[str, pa.DataType]], roles: dict) -> pa.Schema:
    """The shard schema for the samples' columns: every column non-null, list
    elements nullable (as ``schemas.samples_schema``), with the roles metadata."""
    fields = tuple(Field(n, t, False) for n, t in columns)
    return TableSchema("shard", fields, metadata={"roles": roles}).to_arrow()


def set_id(kind: str, window_end) -> str:
    return f"{kind}/{window_end}"


def set_order(keys) -> list[tuple[str, str, str]]:
    """(kind, window_start, window_end) in training order: pretrain first, then windows by end."""
    return sorted(keys, key=lambda k: (KINDS.index(k[0]) if k[0] in KINDS else 9, str(k[2]), str(k[1])))


def plan_sets(sets: list[dict], *, slots: int, target_bytes: float) -> list[dict]:
    """Give every set its shards per rank and the base of its global shard numbers.

    ``sets`` (training order) carry ``slot_rows``, ``slot_cost``, ``slot_est``
    (per slot lists) and ``max_cost``.
    """
    base = 0
    for s in sets:
        n = balance.shards_per_rank(max(s["slot_est"]) if s["slot_est"] else 0, target_bytes,
                                    min(s["slot_rows"]) if s["slot_rows"] else 0)
        s["shards_per_rank"], s["shard_base"] = n, base
        base += n * slots
    return sets


def shard_name(shard: int, node: int) -> str:
    return f"node={node}/shard-{shard:05d}.parquet"


# --------------------------------------------------------------------------
# the executor side: one function writes every shard of a partition
# --------------------------------------------------------------------------
class _ShardWriter:
    def __init__(self, cfg: dict, shard: int, node: int, rank: int):
        self.cfg, self.shard, self.node, self.rank = cfg, shard, node, rank
        self.rel = shard_name(shard, node)
        storage.apply(cfg.get("storage"))  # the driver's store settings reach the executors
        fs, base = mf.resolve(cfg["output"])
        self.fs, self.final = fs, mf.join(base, self.rel)
        self.local = isinstance(fs, pafs.LocalFileSystem)
        tag = uuid.uuid4().hex[:12]
        if self.local:
            d = os.path.dirname(self.final)
            os.makedirs(d, exist_ok=True)
            self.tmpdir = None
            self.tmp = os.path.join(d, f".shard-{shard:05d}.parquet.tmp-{tag}")
        else:
            self.tmpdir = tempfile.mkdtemp(prefix="userwise-shard-")
            self.tmp = os.path.join(self.tmpdir, f"shard-{shard:05d}.parquet")
        schema: pa.Schema = cfg["schema"]
        self.writer = pq.ParquetWriter(
            self.tmp, schema, compression=cfg["compression"],
            use_dictionary=parse_dictionary(cfg["dictionary"], schema), **PARQUET_OPTIONS,
        )
        self.buf: list[pa.Table] = []
        self.buf_rows = self.buf_est = 0
        self.rows = self.events = self.imps = self.cost = self.row_groups = 0

    def add(self, t: pa.Table, est: np.ndarray) -> None:
        # Cut row groups at row_group_rows rows or row_group_bytes of estimated
        # uncompressed data: a function of the rows only, not of Spark's batches.
        start, n = 0, t.num_rows
        while start < n:
            room = min(self.cfg["row_group_rows"] - self.buf_rows, n - start)
            cum = np.cumsum(est[start:start + room])
            fit = int(np.searchsorted(cum, self.cfg["row_group_bytes"] - self.buf_est, side="right"))
            if fit == 0 and self.buf_rows == 0:
                fit = 1  # one oversized sample makes a row group of its own
            take = min(room, fit)
            if take:
                self.buf.append(t.slice(start, take))
                self.buf_rows += take
                self.buf_est += int(cum[take - 1])
                start += take
            if self.buf_rows >= self.cfg["row_group_rows"] or take < room:
                self._flush()

    def add_row_group(self, t: pa.Table) -> None:
        """Write ``t`` as one row group of its own (``forget`` keeps a shard's row groups)."""
        self._flush()
        self.buf, self.buf_rows = [t], t.num_rows
        self._flush()

    def _flush(self) -> None:
        if not self.buf_rows:
            return
        t = pa.concat_tables(self.buf).combine_chunks()
        self.writer.write_table(t, row_group_size=t.num_rows)
        self.row_groups += 1
        self.rows += t.num_rows
        imps = pa.compute.sum(t.column("num_impressions")).as_py() or 0
        cost = pa.compute.sum(t.column("cost")).as_py() or 0
        self.imps += imps
        self.cost += cost
        self.events += cost - imps
        self.buf, self.buf_rows, self.buf_est = [], 0, 0

    def close(self) -> dict:
        self._flush()
        self.writer.close()
        out = {"shard": self.shard, "path": self.rel, "node": self.node, "rank": self.rank,
               "rows": self.rows, "events": self.events, "impressions": self.imps, "cost": self.cost,
               "bytes": os.path.getsize(self.tmp), "row_groups": self.row_groups,
               "sha256": mf.file_sha256(self.tmp), "gds_path": None, "gds_bytes": None, "gds_sha256": None}
        files = [(self.tmp, self.final)]
        if self.cfg["layout"] == "gds":
            from userwise.pipelines.shards.gds import write_side_file

            gtmp = self.tmp[: -len(".parquet")] + ".gds" if self.tmp.endswith(".parquet") else self.tmp + ".gds"
            info = write_side_file(self.tmp, gtmp)
            grel = self.rel[: -len(".parquet")] + ".gds"
            out.update(gds_path=grel, gds_bytes=int(info["bytes"]), gds_sha256=info["sha256"])
            files.append((gtmp, self.final[: -len(".parquet")] + ".gds"))
        for src, dst in files:
            if self.local:
                os.replace(src, dst)
            else:
                self.fs.create_dir(os.path.dirname(dst), recursive=True)
                with open(src, "rb") as f, self.fs.open_output_stream(dst) as o:
                    while b := f.read(mf.CHUNK):
                        o.write(b)
                os.remove(src)
        if self.tmpdir:
            os.rmdir(self.tmpdir)
        return out


def rewriter(root: str, manifest: dict, schema: pa.Schema, path: str, node: int, rank: int) -> _ShardWriter:
    """A writer that replaces the shard ``path`` (``node=<k>/shard-<NNNNN>.parquet``) of the set at
    ``root`` with the set's own settings (codec, dictionary, layout from its manifest); write its
    row groups with ``add_row_group``, then ``close()`` returns its manifest entry's stats."""
    name = os.path.basename(path)
    if not (name.startswith("shard-") and name.endswith(".parquet") and name[6:-8].isdigit()
            and path == shard_name(int(name[6:-8]), node)):
        raise UserwiseError(f"{mf.join(root, path)}: not a shard name preshard writes "
                            "(node=<k>/shard-<NNNNN>.parquet); rerun `userwise preshard`")
    codec = manifest.get("compression", "zstd")  # the manifest names leaf columns (seq_ts.list.element)
    if isinstance(codec, dict):
        codec = {k.removesuffix(".list.element"): v for k, v in codec.items()}
    cfg = _writer_cfg(root, schema, compression=codec, layout=manifest["layout"],
                      row_group_rows=manifest.get("row_group_rows", 2048), row_group_mb=128.0,
                      dictionary=manifest.get("dictionary", "all"))
    return _ShardWriter(cfg, int(name[6:-8]), node, rank)


def write_partition(batches, cfg: dict):
    """mapInArrow body: rows sorted by (_shard, _order, sample_id) in, one stats row per shard out."""
    schema: pa.Schema = cfg["schema"]
    w: _ShardWriter | None = None
    for b in batches:
        if b.num_rows == 0:
            continue
        t = pa.Table.from_batches([b])
        shard = t.column("_shard").to_numpy()
        cuts = np.flatnonzero(np.diff(shard)) + 1
        for lo, hi in zip(np.r_[0, cuts], np.r_[cuts, len(shard)]):
            part = t.slice(lo, hi - lo)
            sid = int(shard[lo])
            if w is None or w.shard != sid:
                if w is not None:
                    yield pa.RecordBatch.from_pylist([w.close()], schema=STATS)
                w = _ShardWriter(cfg, sid, int(part.column("_node")[0].as_py()), int(part.column("_rank")[0].as_py()))
            est = part.column("_est").to_numpy().astype(np.int64)
            w.add(_conform(part, schema), est)
    if w is not None:
        yield pa.RecordBatch.from_pylist([w.close()], schema=STATS)


def _conform(t: pa.Table, schema: pa.Schema) -> pa.Table:
    cols = []
    for f in schema:
        c = t.column(f.name)
        if c.type != f.type:
            c = c.cast(f.type)
        cols.append(c)
    return pa.Table.from_arrays(cols, schema=schema)


def write_empty(cfg: dict, shard: int, node: int, rank: int) -> dict:
    """A shard with no rows (a rank with no sample in a set smaller than the slots)."""
    w = _ShardWriter(cfg, shard, node, rank)
    return w.close()


# --------------------------------------------------------------------------
# the manifest
# --------------------------------------------------------------------------
def assemble(*, cfg: dict, sets: list[dict], stats: list[dict], nodes: int, ranks_per_node: int,
             seed: int, source: dict) -> dict:
    schema: pa.Schema = cfg["schema"]
    by_set = {}
    for s in sets:
        for slot in range(nodes * ranks_per_node):
            for j in range(s["shards_per_rank"]):
                by_set[s["shard_base"] + slot * s["shards_per_rank"] + j] = s["id"]
    shards = []
    for st in sorted(stats, key=lambda r: r["shard"]):
        e = {k: st[k] for k in STATS.names if k != "shard"}
        e["set"] = by_set[st["shard"]]
        shards.append(e)
    out_sets = []
    for s in sets:
        cost = np.array(s["slot_cost"], dtype=np.int64).reshape(nodes, ranks_per_node)
        rows = np.array(s["slot_rows"], dtype=np.int64).reshape(nodes, ranks_per_node)
        bal = balance.spread(cost, rows)
        bal["within_bound"] = balance.within_bound(cost, s["max_cost"])
        bal["max_sample_cost"] = int(s["max_cost"])
        out_sets.append({"id": s["id"], "kind": s["kind"], "window_start": str(s["window_start"]),
                         "window_end": str(s["window_end"]), "rows": int(rows.sum()), "cost": int(cost.sum()),
                         "shards_per_rank": s["shards_per_rank"], "balance": bal})
    return {
        "format_version": FORMAT_VERSION,
        "nodes": nodes, "ranks_per_node": ranks_per_node, "seed": seed, "layout": cfg["layout"],
        "compression": cfg["compression"], "dictionary": cfg["dictionary"], "row_group_rows": cfg["row_group_rows"],
        "schema_fingerprint": schema_fingerprint(schema),
        "schema": schema_list(schema),
        "roles": json.loads(schema.metadata[b"userwise.roles"]),
        "source": source,
        "sets": out_sets,
        "shards": shards,
    }


def _prepare_output(output: str) -> None:
    """Remove a previous shard set at ``output`` (manifest first); refuse other content."""
    fs, base = mf.resolve(output)
    info = fs.get_file_info(base)
    if info.type == pafs.FileType.NotFound:
        fs.create_dir(base, recursive=True)
        return
    if info.type != pafs.FileType.Directory:
        raise UserwiseError(f"--output {output}: exists and is not a folder")
    entries = fs.get_file_info(pafs.FileSelector(base))
    names = [os.path.basename(e.path) for e in entries]
    foreign = [n for n in names if not (n == mf.MANIFEST or n.startswith("node=") or n.startswith("."))]
    if foreign:
        raise UserwiseError(f"--output {output}: holds {foreign[:3]}, which is not a shard set; "
                            "choose an empty or new folder")
    if mf.MANIFEST in names:
        fs.delete_file(mf.join(base, mf.MANIFEST))
    for e in entries:
        if e.type == pafs.FileType.Directory:
            fs.delete_dir(e.path)


def _writer_cfg(output, schema, *, compression, layout, row_group_rows, row_group_mb, dictionary="all") -> dict:
    parse_dictionary(dictionary, schema)  # a bad value fails here, before any Spark work
    if layout not in ("parquet", "gds"):
        raise UserwiseError(f"--layout {layout}: use parquet or gds")
    if layout == "gds":
        try:
            from userwise.pipelines.shards.gds import write_side_file  # noqa: F401
        except ImportError as e:
            raise UserwiseError(f"--layout gds needs userwise.pipelines.shards.gds.write_side_file ({e}); "
                                "use --layout parquet") from None
    # field docs are not part of the contract (the fingerprint ignores them): keep files lean
    schema = pa.schema([f.remove_metadata() for f in schema], metadata=schema.metadata)
    return {"output": output, "schema": schema, "compression": parse_compression(compression, schema),
            "dictionary": dictionary, "layout": layout, "row_group_rows": int(row_group_rows),
            "row_group_bytes": int(row_group_mb * (1 << 20)), "storage": storage.settings()}


def _report(m: dict, seconds: float) -> dict:
    return {
        "shards": len(m["shards"]), "rows": sum(s["rows"] for s in m["shards"]),
        "bytes": sum(s["bytes"] + (s["gds_bytes"] or 0) for s in m["shards"]),
        "gds_bytes": sum(s["gds_bytes"] or 0 for s in m["shards"]),
        "seconds": round(seconds, 2),
        "sets": [{"id": s["id"], "rows": s["rows"], "cost": s["cost"], "shards_per_rank": s["shards_per_rank"],
                  **s["balance"]} for s in m["sets"]],
    }


# --------------------------------------------------------------------------
# without Spark: an Arrow table of samples (tests, small sets)
# --------------------------------------------------------------------------
def est_bytes_arrow(t: pa.Table) -> np.ndarray:
    """Estimated uncompressed bytes per row (values of every column); the Spark twin is ``_est_col``."""
    est = np.zeros(t.num_rows, dtype=np.int64)
    for f in t.schema:
        c = t.column(f.name)
        if pa.types.is_list(f.type):
            lens = pa.compute.list_value_length(c).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
            if pa.types.is_string(f.type.value_type):
                flat = pa.compute.list_flatten(c)
                sl = pa.compute.utf8_length(flat).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
                owner = np.repeat(np.arange(t.num_rows), lens)
                est += np.bincount(owner, weights=sl + 4, minlength=t.num_rows).astype(np.int64)
            else:
                est += lens * _width(f.type.value_type)
        elif pa.types.is_string(f.type):
            est += pa.compute.utf8_length(c).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64) + 4
        else:
            est += _width(f.type)
    return est


def preshard_arrow(table: pa.Table, output: str, *, schema: pa.Schema, nodes: int, ranks_per_node: int,
                   seed: int = 0, target_shard_mb: float = 256.0, row_group_rows: int = 2048,
                   row_group_mb: float = 128.0, compression="zstd", layout: str = "parquet",
                   source: dict | None = None, dictionary: str = "all") -> dict:
    """The whole preshard on one machine, from an Arrow table of samples. Same
    assignment, same writer, same manifest as the Spark job."""
    t0 = time.time()
    cfg = _writer_cfg(output, schema, compression=compression, layout=layout,
                      row_group_rows=row_group_rows, row_group_mb=row_group_mb, dictionary=dictionary)
    _prepare_output(output)
    slots = nodes * ranks_per_node
    est = est_bytes_arrow(table.select(schema.names))
    kinds = table.column("kind").to_pylist()
    ws = [str(x) for x in table.column("window_start").to_pylist()]
    we = [str(x) for x in table.column("window_end").to_pylist()]
    keys = set_order(set(zip(kinds, ws, we)))
    costs = table.column("cost").to_numpy().astype(np.int64)
    ids = table.column("sample_id").to_numpy().astype(np.int64)
    sets, plans = [], []
    for k, s, e in keys:
        idx = np.array([i for i in range(table.num_rows) if kinds[i] == k and we[i] == e and ws[i] == s])
        p = balance.plan(costs[idx], ids[idx], nodes=nodes, ranks_per_node=ranks_per_node, seed=seed)
        sets.append({"id": set_id(k, e), "kind": k, "window_start": s, "window_end": e,
                     "slot_rows": np.bincount(p["slot"], minlength=slots).tolist(),
                     "slot_cost": np.bincount(p["slot"], weights=costs[idx], minlength=slots).astype(np.int64).tolist(),
                     "slot_est": np.bincount(p["slot"], weights=est[idx], minlength=slots).astype(np.int64).tolist(),
                     "max_cost": int(costs[idx].max())})
        plans.append((idx, p))
    plan_sets(sets, slots=slots, target_bytes=target_shard_mb * (1 << 20))
    stats = []
    for s, (idx, p) in zip(sets, plans):
        n = s["shards_per_rank"]
        shard = s["shard_base"] + p["slot"] * n + (p["index"] // slots) % n
        order = np.lexsort((ids[idx], p["order"], shard))
        rows = idx[order]
        sub = table.take(pa.array(rows)).select(schema.names)
        aux = pa.table({"_shard": shard[order], "_node": p["node"][order].astype(np.int32),
                        "_rank": p["rank"][order].astype(np.int32), "_est": est[rows]})
        for name in aux.column_names:
            sub = sub.append_column(name, aux.column(name))
        stats += list(_stats_rows(write_partition(sub.to_batches(max_chunksize=97), cfg)))
        stats += _fill_empty(cfg, s, stats, slots, ranks_per_node)
    m = assemble(cfg=cfg, sets=sets, stats=stats, nodes=nodes, ranks_per_node=ranks_per_node, seed=seed,
                 source=source or {"table": None, "version": None})
    mf.write(output, m)
    m["_report"] = _report(m, time.time() - t0)
    return m


def _stats_rows(batches):
    for b in batches:
        yield from b.to_pylist()


def _fill_empty(cfg, s, stats, slots, ranks_per_node) -> list[dict]:
    have = {r["shard"] for r in stats}
    out = []
    for slot in range(slots):
        for j in range(s["shards_per_rank"]):
            sid = s["shard_base"] + slot * s["shards_per_rank"] + j
            if sid not in have:
                out.append(write_empty(cfg, sid, slot // ranks_per_node, slot % ranks_per_node))
    return out


# --------------------------------------------------------------------------
# Spark
# --------------------------------------------------------------------------
def _est_col(schema: pa.Schema):
    """Spark expression: estimated uncompressed bytes of a row (as ``est_bytes_arrow``)."""
    from pyspark.sql import functions as F

    terms = []
    for f in schema:
        if pa.types.is_list(f.type):
            if pa.types.is_string(f.type.value_type):
                terms.append(F.aggregate(F.col(f.name), F.lit(0).cast("long"),
                                         lambda acc, x: acc + F.coalesce(F.length(x), F.lit(0)) + F.lit(4)))
            else:
                terms.append(F.coalesce(F.size(f.name), F.lit(0)).cast("long") * F.lit(_width(f.type.value_type)))
        elif pa.types.is_string(f.type):
            terms.append(F.coalesce(F.length(f.name), F.lit(0)).cast("long") + F.lit(4))
        else:
            terms.append(F.lit(_width(f.type)).cast("long"))
    out = terms[0]
    for t in terms[1:]:
        out = out + t
    return out


def assign_spark(keys, *, slots: int, ranks_per_node: int, seed: int):
    """``keys``: DataFrame (_set int, sample_id long, cost long[, _est long]). Returns it with
    _index (within the set), _slot, _node, _rank, _block and _order, exactly as
    ``balance.plan``: numbered in one distributed sort with per-partition offsets.
    """
    from pyspark.sql import functions as F

    h1 = F.xxhash64(F.lit(seed).cast("long"), F.lit(balance.ASSIGN_SALT).cast("long"), F.col("sample_id"))
    est = F.col("_est") if "_est" in keys.columns else F.lit(0).cast("long")
    ranked = (
        keys.select("_set", "sample_id", "cost", est.alias("_est"), h1.alias("_h1"))
        .orderBy(F.col("_set").asc(), F.col("cost").desc(), F.col("_h1").asc(), F.col("sample_id").asc())
        .select("_set", "sample_id", "cost", "_est", F.spark_partition_id().alias("_pid"),
                F.monotonically_increasing_id().alias("_mid"))
        .localCheckpoint(eager=True)
    )
    # One row per partition (metadata) and one per set: their offsets turn the
    # per-partition row ids into global ranks, then into ranks within the set.
    parts = {r["_pid"]: r["n"] for r in ranked.groupBy("_pid").agg(F.count("*").alias("n")).collect()}
    offs, acc = [], 0
    for pid in range(max(parts) + 1 if parts else 0):
        offs.append(acc)
        acc += parts.get(pid, 0)
    set_n = {r["_set"]: r["n"] for r in ranked.groupBy("_set").agg(F.count("*").alias("n")).collect()}
    set_off, acc = [], 0
    for s in range(max(set_n) + 1 if set_n else 0):
        set_off.append(acc)
        acc += set_n.get(s, 0)
    pid_off = F.element_at(F.array(*[F.lit(o).cast("long") for o in offs] or [F.lit(0).cast("long")]),
                           F.col("_pid") + 1)
    set_base = F.element_at(F.array(*[F.lit(o).cast("long") for o in set_off] or [F.lit(0).cast("long")]),
                            F.col("_set") + 1)
    local = F.col("_mid") - F.shiftleft(F.col("_pid").cast("long"), 33)
    idx = pid_off + local - set_base
    block = F.floor(F.col("_index") / slots).cast("long")
    pos = F.pmod(F.col("_index"), F.lit(slots))
    slot = F.when(F.pmod(F.col("_block"), F.lit(2)) == 0, pos).otherwise(F.lit(slots - 1) - pos)
    h2 = F.xxhash64(F.lit(seed).cast("long"), F.lit(balance.ORDER_SALT).cast("long"), F.col("sample_id"))
    return (
        ranked.select("_set", "sample_id", "cost", "_est", idx.alias("_index"))
        .withColumn("_block", block)
        .withColumn("_slot", slot.cast("long"))
        .select("_set", "sample_id", "cost", "_est", "_index", "_block", "_slot",
                F.floor(F.col("_slot") / ranks_per_node).cast("int").alias("_node"),
                F.pmod(F.col("_slot"), F.lit(ranks_per_node)).cast("int").alias("_rank"),
                h2.alias("_order"))
    )


def samples_table(samples: str) -> tuple[str, str]:
    """(build folder, samples table path) from --samples (the build folder or its samples table)."""
    d = storage.absolute(samples)
    if delta_io.has_log(storage.join(d, "samples")):
        return d, storage.join(d, "samples")
    if delta_io.has_log(d):
        return d.rsplit("/", 1)[0], d
    state.complete_state(d)  # a build that died before writing samples is named, not a missing table
    raise InputError(f"--samples {samples}: no Delta table at {d}/samples; pass the output folder of "
                     "`userwise build`")


def preshard(spark, *, samples: str, output: str, nodes: int, ranks_per_node: int, kind: str | None = None,
             window: str | None = None, target_shard_mb: float = 256.0, row_group_rows: int = 2048,
             row_group_mb: float = 128.0, compression="zstd", layout: str = "parquet", seed: int = 0,
             window_days: int | None = None, dictionary: str = "all") -> dict:
    """Write the shard set; return the manifest (its ``_report`` key: the job report).

    A ``window`` without samples (a day without traffic) gives an empty set: every rank
    an empty shard, so the daily chain publishes it and trainers read zero batches,
    instead of failing the day. Its start is ``window`` minus ``window_days`` (default
    the build's N, else 1)."""
    from pyspark.sql import functions as F

    from userwise.pipelines.runtime import delta_io

    t0 = time.time()
    build_dir, path = samples_table(samples)
    _, build_layout, record = build_record.load(build_dir)
    # the folder's complete state: a build or daily job still running, or killed, is not read
    version = state.version_of(build_dir, "samples")
    df = delta_io.read(spark, path, version)
    if kind:
        df = df.where(F.col("kind") == kind)
    if window:
        if kind == "pretrain":
            raise UserwiseError("--window selects an incremental window; drop --kind pretrain")
        dt.date.fromisoformat(window)
        df = df.where((F.col("kind") == "incremental") & (F.col("window_end") == F.lit(window).cast("date")))

    from userwise.schemas import spark_to_arrow

    names = [f.name for f in df.schema]
    schema = shard_arrow_schema([(f.name, spark_to_arrow(f.dataType)) for f in df.schema], build_layout.roles())
    cfg = _writer_cfg(output, schema, compression=compression, layout=layout,
                      row_group_rows=row_group_rows, row_group_mb=row_group_mb, dictionary=dictionary)
    slots = nodes * ranks_per_node

    # sets: one row each (partition values only)
    keys = set_order([(r["kind"], str(r["window_start"]), str(r["window_end"]))
                      for r in df.select("kind", "window_start", "window_end").distinct().collect()])
    if not keys and window:
        n = window_days or int(record.get("window_days") or 1)
        end = dt.date.fromisoformat(window)
        keys = [("incremental", (end - dt.timedelta(days=n)).isoformat(), end.isoformat())]
    if not keys:
        raise InputError(f"{path} (version {version}): no samples"
                         + (f" of kind {kind}" if kind else "") + (f" for window {window}" if window else ""))
    set_idx = F.element_at(F.create_map(*[x for i, (k, s, e) in enumerate(keys)
                                          for x in (F.lit(f"{k}|{e}"), F.lit(i))]),
                           F.concat_ws("|", F.col("kind"), F.col("window_end").cast("string")))
    rows = df.select(*names, set_idx.cast("int").alias("_set"), _est_col(schema).alias("_est"))

    assigned = assign_spark(rows.select("_set", "sample_id", "cost", "_est"), slots=slots,
                            ranks_per_node=ranks_per_node, seed=seed)
    per_slot = (
        assigned.groupBy("_set", "_slot")
        .agg(F.count("*").alias("rows"), F.sum("cost").alias("cost"), F.sum("_est").alias("est"),
             F.max("cost").alias("max_cost"))
        .collect()
    )
    sets = []
    for i, (k, s, e) in enumerate(keys):
        got = {r["_slot"]: r for r in per_slot if r["_set"] == i}
        sets.append({"id": set_id(k, e), "kind": k, "window_start": s, "window_end": e,
                     "slot_rows": [int(got[j]["rows"]) if j in got else 0 for j in range(slots)],
                     "slot_cost": [int(got[j]["cost"]) if j in got else 0 for j in range(slots)],
                     "slot_est": [int(got[j]["est"]) if j in got else 0 for j in range(slots)],
                     "max_cost": max((int(r["max_cost"]) for r in got.values()), default=0)})
    plan_sets(sets, slots=slots, target_bytes=target_shard_mb * (1 << 20))
    n_sh = F.element_at(F.array(*[F.lit(s["shards_per_rank"]).cast("long") for s in sets]), F.col("_set") + 1)
    base = F.element_at(F.array(*[F.lit(s["shard_base"]).cast("long") for s in sets]), F.col("_set") + 1)
    shard = base + F.col("_slot") * n_sh + F.pmod(F.col("_block"), n_sh)
    total = sum(s["shards_per_rank"] for s in sets) * slots

    _prepare_output(output)
    full = (
        rows.join(assigned.select("_set", "sample_id", shard.alias("_shard"), "_node", "_rank", "_order"),
                  on=["_set", "sample_id"], how="inner")
        .select(*names, "_shard", "_node", "_rank", "_order", "_est")
        .repartitionByRange(total, F.col("_shard"))
        .sortWithinPartitions("_shard", "_order", "sample_id")
    )
    from pyspark.sql import types as T

    from userwise.schemas import arrow_to_spark

    wcfg = dict(cfg)
    out_type = T.StructType([T.StructField(f.name, arrow_to_spark(f.type), True) for f in STATS])
    stats = [r.asDict() for r in full.mapInArrow(lambda it: write_partition(it, wcfg), out_type).collect()]
    for s in sets:
        stats += _fill_empty(cfg, s, stats, slots, ranks_per_node)
    m = assemble(cfg=cfg, sets=sets, stats=stats, nodes=nodes, ranks_per_node=ranks_per_node, seed=seed,
                 source={"table": path, "version": version})
    mf.write(output, m)
    m["_report"] = _report(m, time.time() - t0)
    return m


def format_report(rep: dict) -> str:
    lines = [f"preshard: {rep['shards']} shards, {rep['rows']} samples, {rep['bytes'] / 1e6:.1f} MB"
             + (f" (gds side files {rep['gds_bytes'] / 1e6:.1f} MB)" if rep["gds_bytes"] else "")
             + f" in {rep['seconds']:.1f}s"]
    for s in rep["sets"]:
        rc = np.array(s["rank_cost"])
        rr = np.array(s["rank_rows"])
        lines.append(f"  {s['id']}: {s['rows']} samples, cost {s['cost']}, {s['shards_per_rank']} shard(s)/rank; "
                     f"rank cost {rc.min()}..{rc.max()} (max dev {s['max_dev'] * 100:.2f}% of mean, "
                     f"bound ok: {s['within_bound']}), rank rows {rr.min()}..{rr.max()}")
    return "\n".join(lines)


def cli(args) -> int:
    from userwise.pipelines.runtime.spark import get_spark

    spark = get_spark(args.master, app="userwise-preshard")
    m = preshard(spark, samples=args.build_dir, output=args.shards, nodes=args.nodes,
                 ranks_per_node=args.ranks_per_node, kind=args.kind, window=args.window,
                 target_shard_mb=args.target_shard_mb, row_group_rows=args.row_group_rows,
                 row_group_mb=args.row_group_mb, compression=args.compression,
                 layout=args.layout, seed=args.seed, window_days=args.window_days,
                 dictionary=args.dictionary)
    console.emit(m["_report"], format_report)
    return 0
