"""``userwise forget``: remove users from a build folder and from its shard sets.

    userwise forget --build-dir D --users FILE [--shards S ...] [--vacuum]

``FILE`` holds one user id per line (blank lines and lines starting with ``#`` are
skipped), written as the build's user column holds them (``42``, or ``u-42`` for a
string column). The CLI holds ``D``'s exclusive lock throughout. In order:

1. ``forget`` is marked running (``state.begin``).
2. The users' rows leave ``requests``, ``events``, ``history`` and ``samples`` (column
   ``user``) and ``quarantine`` (the id read from the rejected row's JSON, under the
   input's user column, or the action log's for rows of the action log): one Delta
   ``MERGE ... WHEN MATCHED DELETE`` per table, each one atomic commit; the ids are a
   broadcast join, however many. A sample holds one user only (one row per user,
   window and chunk: its sequence and requests are that user's), so deleting a user's
   samples is what re-deriving the samples without the user gives: every other sample
   stays as it was, byte for byte in content (Delta rewrites the files that held a
   forgotten user's row, copying the other rows).
3. Every shard set under each ``S`` (every folder below it with a ``manifest.json``:
   plain sets, published sets, staged sets) that holds a forgotten user is rebuilt in
   place: a sibling copy whose unaffected files are hard links, whose affected shards are
   rewritten without the users' rows by preshard's own writer (same codec, dictionary,
   page checksums, GDS side file; each remaining row group stays a row group), and whose
   manifest has the new rows, bytes, checksums and per-set balance; then two renames swap
   it in (as ``publish`` does; on an object store the changed objects are copied in, the
   manifest and marker last: ``storage.swap_in``). Shards keep their rank: a rank that lost a user's samples
   has that much less work, the loader still gives every rank the same number of
   batches, and a re-preshard balances the set afresh. A published set's marker
   (``_PUBLISHED.json``) and the build folder's record of it get the new manifest
   checksum, so the day still reads as published.
4. ``--vacuum``: Delta VACUUM with retention 0 on every table that holds user rows, so
   the files of older versions, which still hold the users, are deleted from disk;
   time travel to any version before this one ends there.
5. The completion record names the tables' new versions (``state.finish``).

A forget killed at any point is finished by running it again: deletes that already
committed match nothing, sets already rewritten hold no forgotten user, and a swap
interrupted between its two renames is completed.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import posixpath
import re

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from userwise import schemas as S
from userwise.pipelines import console
from userwise.pipelines.errors import InputError, UserwiseError
from userwise.pipelines.records import build_record, published, state
from userwise.pipelines.runtime import delta_io, storage
from userwise.pipelines.shards import balance, writer
from userwise.pipelines.shards import manifest as mf
from userwise.pipelines.shards.publish import MARKER

# The tables with a `user` column, and the one that keeps the rejected rows as JSON.
KEYED = ("requests", "events", "history", "samples")
QUARANTINE = "quarantine"
_SWAP = re.compile(r"^(.+)\.forget-(new|old)-\d+$")


# --------------------------------------------------------------------------
# the users
# --------------------------------------------------------------------------
def read_users(path: str, arrow_type: pa.DataType) -> pa.Array:
    """The distinct ids of ``path`` (one a line; blank and ``#`` lines skipped) as ``arrow_type``."""
    try:
        data = storage.read_bytes(path)
        if data is None:
            raise FileNotFoundError(2, "no such file")
        lines = data.decode("utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"--users {path}: cannot read it ({getattr(e, 'strerror', None) or e}); "
                         "give a text file with one user id per line") from None
    ids = pa.array([s.strip() for s in lines], pa.string())
    keep = pc.and_(pc.not_equal(ids, ""), pc.invert(pc.starts_with(ids, "#")))
    ids = ids.filter(keep)
    if not len(ids):
        raise InputError(f"--users {path}: holds no user id; write one id per line")
    try:
        typed = ids.cast(arrow_type)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        bad = next(v for v in ids.to_pylist() if not _casts(v, arrow_type))
        raise InputError(f"--users {path}: {bad!r} is not a user id of this build (its user column is "
                         f"{arrow_type}); fix that line") from None
    return pc.unique(typed)


def _casts(v: str, t: pa.DataType) -> bool:
    try:
        pa.array([v], pa.string()).cast(t)
        return True
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return False


# --------------------------------------------------------------------------
# the Delta tables
# --------------------------------------------------------------------------
def _json_path(col: str) -> str:
    return f"$['{col}']"


def forget_tables(spark, build_dir: str, cfg, layout, users: pa.Array) -> dict[str, int]:
    """Delete the users' rows from every table of the build folder (one commit each);
    returns {table: rows deleted} for the tables that exist."""
    from pyspark.sql import functions as F

    spark_type = S.requests_schema(layout).to_spark()["user"].dataType
    keys = spark.createDataFrame(pa.table({"user": users})).select(F.col("user").cast(spark_type).alias("user"))
    out = {}
    for name in KEYED:
        path = delta_io.table_path(build_dir, name)
        if delta_io.exists(spark, path):
            out[name] = delta_io.delete_matching(spark, path, keys, F.col("t.user") == F.col("k.user"))
    path = delta_io.table_path(build_dir, QUARANTINE)
    if delta_io.exists(spark, path):
        row = F.col("t.row")
        key = F.get_json_object(row, _json_path(cfg.col("user")))
        if cfg.actions is not None:
            key = F.when(F.col("t.source") == "actions",
                         F.get_json_object(row, _json_path(cfg.actions.user))).otherwise(key)
        # JSON holds 42 for an integer id, "u-42" for a string one: both read back as the text the
        # users file holds, so the ids match as strings.
        text = keys.select(F.col("user").cast("string").alias("key"))
        out[QUARANTINE] = delta_io.delete_matching(spark, path, text, key == F.col("k.key"))
    return out


def vacuum_tables(spark, build_dir: str) -> list[str]:
    """Purge deletion vectors, then VACUUM with retention 0, on every table with user rows."""
    done = []
    for name in (*KEYED, QUARANTINE):
        path = delta_io.table_path(build_dir, name)
        if delta_io.exists(spark, path):
            delta_io.purge_deleted(spark, path)
            delta_io.vacuum(spark, path, 0.0)
            done.append(name)
    return done


# --------------------------------------------------------------------------
# the shard sets
# --------------------------------------------------------------------------
def find_sets(root: str) -> list[str]:
    """Every shard set (a folder with a manifest.json) at or below ``root`` (a local path or a
    URL), after completing or removing what a killed forget left (a swap between its two
    renames, half-built copies)."""
    root = storage.absolute(root)
    if not storage.is_dir(root):
        raise InputError(f"--shards {root}: not a folder; give a shard set root or a folder of shard sets")
    out = []
    for dirpath, dirs, files in storage.walk(root):
        for d in sorted(dirs):
            m = _SWAP.match(d)
            if m is None:
                continue
            dirs.remove(d)
            full, base = storage.join(dirpath, d), storage.join(dirpath, m.group(1))
            if m.group(2) == "new" and storage.exists(storage.join(full, mf.MANIFEST)) and (
                    not storage.exists(base) or not storage.renames_folders(base)):
                # the swap's second rename; on an object store the copy in, completed
                storage.swap_in(full, base, f"{base}.forget-old-{os.getpid()}", last=(mf.MANIFEST, MARKER))
                if m.group(1) not in dirs:
                    dirs.append(m.group(1))
            else:
                storage.rmtree(full)
        if mf.MANIFEST in files:
            out.append(dirpath)
            dirs[:] = []
        else:
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
    return sorted(out)


def _open(path: str):
    fs, p = storage.filesystem(path)
    return fs.open_input_file(p)


def _hits(path: str, users: pa.Array) -> int:
    with _open(path) as f:
        col = pq.read_table(f, columns=["user"]).column("user")
    return int(pc.sum(pc.is_in(col, value_set=users.cast(col.type))).as_py() or 0)


def _link_tree(src: str, dst: str, skip: set[str]) -> None:
    """``dst`` as a copy of the set ``src`` but for the files ``skip`` (paths relative to it):
    local files are hard links (no byte copied); a store, which has no links, gets copies."""
    local = storage.is_local(src)
    top = storage.local_path(src) if local else str(src).rstrip("/")
    for dirpath, _, files in storage.walk(src):
        rel = dirpath[len(top):].lstrip("/")
        if local:
            os.makedirs(storage.join(dst, rel), exist_ok=True)
        for f in files:
            if f.startswith(".") or posixpath.join(rel, f) in skip:
                continue
            if local:
                os.link(storage.join(dirpath, f), storage.join(dst, rel, f))
            else:
                storage.copy_file(storage.join(dirpath, f), storage.join(dst, rel, f))


def _rebalance(m: dict) -> None:
    """Each set's rows, cost and balance from its shards' entries."""
    nodes, rpn = int(m["nodes"]), int(m["ranks_per_node"])
    for s in m["sets"]:
        cost = np.zeros((nodes, rpn), dtype=np.int64)
        rows = np.zeros((nodes, rpn), dtype=np.int64)
        for e in m["shards"]:
            if e["set"] == s["id"]:
                cost[int(e["node"]), int(e["rank"])] += int(e["cost"])
                rows[int(e["node"]), int(e["rank"])] += int(e["rows"])
        s["rows"], s["cost"] = int(rows.sum()), int(cost.sum())
        bal = s.get("balance") or {}
        max_cost = int(bal.get("max_sample_cost", 0))
        s["balance"] = {**bal, **balance.spread(cost, rows), "within_bound": balance.within_bound(cost, max_cost)}


def rewrite_set(root: str, users: pa.Array) -> dict | None:
    """Rebuild the set at ``root`` without the users' rows; None when it holds none of them."""
    m = mf.load(root)
    staged = m.get("staged_node")
    shards = m["shards"] if staged is None else mf.node_shards(m, int(staged))
    hit = [e for e in shards if _hits(storage.join(root, e["path"]), users)]
    if not hit:
        return None
    new, old = f"{root}.forget-new-{os.getpid()}", f"{root}.forget-old-{os.getpid()}"
    _link_tree(root, new, {p for e in hit for p, _, _ in mf.shard_files(e)})
    removed = 0
    for e in hit:
        with _open(storage.join(root, e["path"])) as f:
            pf = pq.ParquetFile(f)
            w = writer.rewriter(new, m, pf.schema_arrow, e["path"], int(e["node"]), int(e["rank"]))
            for i in range(pf.num_row_groups):
                t = pf.read_row_group(i)
                kept = t.filter(pc.invert(pc.is_in(t.column("user"),
                                                   value_set=users.cast(t.schema.field("user").type))))
                removed += t.num_rows - kept.num_rows
                if kept.num_rows:
                    w.add_row_group(kept)
        st = w.close()
        e.update({k: st[k] for k in S.MANIFEST_SHARD.names if k not in ("path", "node", "rank")})
    _rebalance(m)
    mf.write(new, m)
    for e in hit:
        mf.check_files(new, e)
        mf.check_parquet(storage.join(new, e["path"]), m, rows=e["rows"])
    sha = mf.file_sha256(storage.join(new, mf.MANIFEST))
    marker = storage.join(new, MARKER)
    data = storage.read_bytes(marker)
    if data is not None:
        rec = json.loads(data)
        if rec.get("shards"):
            rec["shards"].update(manifest_sha256=sha, rows=sum(int(e["rows"]) for e in m["shards"]))
        rec["forgotten_at"] = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        state.write_json(marker, rec)  # a new file: the old set's marker (same inode until now) is kept
    storage.swap_in(new, root, old, last=(mf.MANIFEST, MARKER))
    return {"root": root, "files_rewritten": len(hit), "rows_removed": removed, "manifest_sha256": sha}


def sync_published(build_dir: str, root: str) -> bool:
    """Give the build folder's record of the published set at ``root`` its marker's content (the
    marker is rewritten with the set; the record follows it). True when the record changed."""
    data = storage.read_bytes(storage.join(root, MARKER))
    if data is None:
        return False
    rec = json.loads(data)
    changed = False
    for p, cur in published.every(build_dir):
        sh = cur.get("shards") or {}
        if sh.get("root") and storage.absolute(sh["root"]) == storage.absolute(root) and cur != rec:
            state.write_json(p, rec)
            changed = True
    return changed


# --------------------------------------------------------------------------
# the job
# --------------------------------------------------------------------------
def _check_unfinished(build_dir: str) -> None:
    """Refuse a folder whose last writer died before finishing (forget would record its partial
    tables as complete); a killed forget is what this run finishes."""
    data = storage.read_bytes(state.running_path(build_dir))
    if data is None:
        return
    try:
        running = json.loads(data)
    except ValueError:
        return
    if running.get("job") != "forget" and running.get("pid") != os.getpid():
        raise UserwiseError(
            f"{build_dir}: {state.describe(running.get('job', '?'), build_dir, running.get('detail'))} started "
            f"{running.get('started_at')} and did not finish; run it again, then forget the users")


def forget(spark, build_dir: str, users: pa.Array, sets: list[str] = (), vacuum: bool = False,
           detail: dict | None = None) -> dict:
    """Forget ``users`` (:func:`read_users`) in the build folder ``build_dir`` and in the shard
    ``sets`` (:func:`find_sets`); returns the report (rows deleted per table, shards rewritten)."""
    cfg, layout, _ = build_record.load(build_dir)
    _check_unfinished(build_dir)
    detail = detail or {}
    state.begin(build_dir, "forget", **detail)
    rep: dict = {"users": len(users), "tables": forget_tables(spark, build_dir, cfg, layout, users), "shards": []}
    for root in sets:
        r = rewrite_set(root, users)
        if r is not None:
            rep["shards"].append(r)
        if sync_published(build_dir, root):
            rep.setdefault("published_records", []).append(root)
    rep["vacuumed"] = vacuum_tables(spark, build_dir) if vacuum else []
    rec = state.finish(build_dir, "forget", **detail)
    rep["versions"] = rec["tables"]
    return rep


def rerun_detail(args) -> dict:
    """What the job records of a ``userwise forget`` (its rerun hint, :func:`state.describe`)."""
    return {"users": storage.absolute(args.users), "shards": list(args.shards or []) or None,
            "vacuum": bool(args.vacuum)}


def cli(args) -> int:
    from userwise.pipelines.runtime.spark import get_spark

    # Everything a user can get wrong fails before Spark starts.
    _, layout, _ = build_record.load(args.build_dir)
    users = read_users(args.users, layout.user.type)
    _check_unfinished(args.build_dir)
    sets = [s for r in (args.shards or []) for s in find_sets(r)]
    spark = get_spark(master=args.master)
    rep = forget(spark, args.build_dir, users, sets, args.vacuum, detail=rerun_detail(args))
    console.emit(rep, lambda r: f"forgot {r['users']} users: rows deleted {r['tables']}; "
                                f"{len(r['shards'])} shard sets rewritten; vacuumed {r['vacuumed'] or 'nothing'}")
    return 0
