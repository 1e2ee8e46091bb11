"""Pre-shard user-wise samples into balanced per-node Parquet shard sets.

``userwise preshard --build-dir D --shards S --nodes K --ranks-per-node R``
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
import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs

from userwise.pipelines.errors import InputError, UserwiseError, expect
from userwise.pipelines.records import build_record, state
from userwise.pipelines.runtime import delta_io, storage
from userwise.pipelines.shards import balance
from userwise.pipelines.shards import manifest as mf
from userwise.pipelines.shards.writer import STATS, width, write_empty, write_partition, writer_cfg
from userwise.schemas import FORMAT_VERSION, TableSchema
from userwise.schemas.core import Field, schema_fingerprint, schema_list

KINDS = ("pretrain", "incremental")


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


def _check_sizes(target_shard_mb, row_group_mb) -> None:
    """A size in MiB is finite, above 0 and at most MAX_MB (nan, inf and -1 are refused)."""
    expect(target_shard_mb, "mb", "--target-shard-mb")
    expect(row_group_mb, "mb", "--row-group-mb")


def _prepare_output(shards: str) -> None:
    """Remove a previous shard set at ``shards`` (manifest first); refuse other content."""
    fs, base = mf.resolve(shards)
    info = fs.get_file_info(base)
    if info.type == pafs.FileType.NotFound:
        fs.create_dir(base, recursive=True)
        return
    if info.type != pafs.FileType.Directory:
        raise UserwiseError(f"--shards {shards}: exists and is not a folder")
    entries = fs.get_file_info(pafs.FileSelector(base))
    names = [os.path.basename(e.path) for e in entries]
    foreign = [n for n in names if not (n == mf.MANIFEST or n.startswith("node=") or n.startswith("."))]
    if foreign:
        raise UserwiseError(f"--shards {shards}: holds {foreign[:3]}, which is not a shard set; "
                            "choose an empty or new folder")
    if mf.MANIFEST in names:
        fs.delete_file(mf.join(base, mf.MANIFEST))
    for e in entries:
        if e.type == pafs.FileType.Directory:
            fs.delete_dir(e.path)


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
            lens = pc.list_value_length(c).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
            if pa.types.is_string(f.type.value_type):
                flat = pc.list_flatten(c)
                sl = pc.utf8_length(flat).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
                owner = np.repeat(np.arange(t.num_rows), lens)
                est += np.bincount(owner, weights=sl + 4, minlength=t.num_rows).astype(np.int64)
            else:
                est += lens * width(f.type.value_type)
        elif pa.types.is_string(f.type):
            est += pc.utf8_length(c).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64) + 4
        else:
            est += width(f.type)
    return est


def preshard_arrow(table: pa.Table, shards: str, *, schema: pa.Schema, nodes: int, ranks_per_node: int,
                   seed: int = 0, target_shard_mb: float = 256.0, row_group_rows: int = 2048,
                   row_group_mb: float = 128.0, compression="zstd", layout: str = "parquet",
                   source: dict | None = None, dictionary: str = "all") -> dict:
    """The whole preshard on one machine, from an Arrow table of samples. Same
    assignment, same writer, same manifest as the Spark job."""
    _check_sizes(target_shard_mb, row_group_mb)
    t0 = time.time()
    cfg = writer_cfg(shards, schema, compression=compression, layout=layout,
                      row_group_rows=row_group_rows, row_group_mb=row_group_mb, dictionary=dictionary)
    _prepare_output(shards)
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
    mf.write(shards, m)
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
                terms.append(F.coalesce(F.size(f.name), F.lit(0)).cast("long") * F.lit(width(f.type.value_type)))
        elif pa.types.is_string(f.type):
            terms.append(F.coalesce(F.length(f.name), F.lit(0)).cast("long") + F.lit(4))
        else:
            terms.append(F.lit(width(f.type)).cast("long"))
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


def samples_table(build_dir: str) -> tuple[str, str]:
    """(build folder, samples table path) from --build-dir (the build folder or its samples table)."""
    d = storage.absolute(build_dir)
    if delta_io.has_log(storage.join(d, "samples")):
        return d, storage.join(d, "samples")
    if delta_io.has_log(d):
        return d.rsplit("/", 1)[0], d
    state.complete_state(d)  # a build that died before writing samples is named, not a missing table
    raise InputError(f"--build-dir {build_dir}: no Delta table at {d}/samples; pass the build folder of "
                     "`userwise build`")


def preshard(spark, *, build_dir: str, shards: str, nodes: int, ranks_per_node: int, kind: str | None = None,
             window: str | None = None, target_shard_mb: float = 256.0, row_group_rows: int = 2048,
             row_group_mb: float = 128.0, compression="zstd", layout: str = "parquet", seed: int = 0,
             window_days: int | None = None, dictionary: str = "all") -> dict:
    """Write the shard set; return the manifest (its ``_report`` key: the job report).

    A ``window`` without samples (a day without traffic) gives an empty set: every rank
    an empty shard, so the daily chain publishes it and trainers read zero batches,
    instead of failing the day. Its start is ``window`` minus ``window_days`` (default
    the build's N, else 1)."""
    from pyspark.sql import functions as F

    _check_sizes(target_shard_mb, row_group_mb)

    from userwise.pipelines.runtime import delta_io

    t0 = time.time()
    build_dir, path = samples_table(build_dir)
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
    cfg = writer_cfg(shards, schema, compression=compression, layout=layout,
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

    _prepare_output(shards)
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
    mf.write(shards, m)
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
