"""Synthetic shard sets written exactly per docs/shard-format.md (test fixtures, benchmarks).

Samples obey the pointer semantics: the stored sequence is sorted by time;
request r sees seq[begin:end] with end = events strictly before its time and
begin = max(0, end - L); the stored sequence holds exactly [min begin, max end).
Shards are deliberately uneven; a set per window (pretrain + incremental).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from tests.support.common import LEAN_CFG
from userwise import schemas
from userwise.pipelines import config

MS_DAY = 86_400_000


def layout():
    return config.parse(LEAN_CFG).layout(schemas.SYNTH_IMPRESSIONS.to_arrow())


def make_samples(n: int, *, kind: str, window_start: str, window_end: str, seed: int, max_seq_len: int = 20,
                 max_events: int = 120, first_user: int = 0, null_share: float = 0.1,
                 event_scale: float = 8.0) -> pa.Table:
    """``n`` user-wise sample rows (shard schema) of one window."""
    lay = layout()
    schema = schemas.shard_schema(lay).to_arrow()
    rng = np.random.default_rng(seed)
    ws, we = dt.date.fromisoformat(window_start), dt.date.fromisoformat(window_end)
    t0 = (ws - dt.date(1970, 1, 1)).days * MS_DAY
    t1 = (we - dt.date(1970, 1, 1)).days * MS_DAY
    cols = {name: [] for name in schema.names}
    # wide spread of sizes: most small, a few heavy
    n_events = np.minimum(rng.pareto(1.2, n) * event_scale, max_events).astype(int)
    for i in range(n):
        user = first_user + i
        R = int(rng.integers(1, 6))
        ev_ts = np.sort(rng.integers(t0 - 3 * MS_DAY, t1, n_events[i])).astype(np.int64)
        rt = np.sort(rng.integers(t0, t1, R)).astype(np.int64)
        end = np.searchsorted(ev_ts, rt, side="left").astype(np.int32)  # strictly before
        begin = np.maximum(0, end - max_seq_len).astype(np.int32)
        lo, hi = (int(begin.min()), int(end.max())) if R else (0, 0)
        ev_ts = ev_ts[lo:hi]
        begin, end = begin - lo, end - lo
        L = len(ev_ts)
        k = rng.integers(1, 5, R).astype(np.int32)
        K = int(k.sum())
        rids = [f"r{user}-{j}" for j in range(R)]
        req_day = [(dt.date(1970, 1, 1) + dt.timedelta(days=int(t // MS_DAY))) for t in rt]
        row = {
            "format_version": schemas.FORMAT_VERSION, "sample_id": (user * 1_000_003 + seed) & ((1 << 62) - 1), "kind": kind,
            "window_start": ws, "window_end": we, "user": user, "chunk": 0,
            "num_requests": R, "num_impressions": K, "seq_len": L, "cost": L + K,
            "seq_ts": ev_ts, "seq_item": rng.integers(0, 5000, L), "seq_category": rng.integers(0, 50, L).astype(np.int32),
            "seq_author": rng.integers(0, 900, L), "seq_action": rng.integers(1, 4, L),
            "req_id": rids, "req_time": rt, "req_seq_begin": begin, "req_seq_end": end, "req_num_imps": k,
            "req__request_id": rids, "req__request_ts": rt,
            "req__device": [["ios", "android", "web"][j % 3] for j in range(R)],
            "req__hour": rng.integers(0, 24, R).astype(np.int8), "req__age_bucket": np.full(R, user % 7, np.int8),
            "req__country": [("de", "fr", "jp")[user % 3]] * R,
            "imp__date": [req_day[r] for r in range(R) for _ in range(k[r])],
            "imp__action_ts": np.repeat(rt, k) + rng.integers(1, 5000, K),
            "imp__item_id": rng.integers(0, 5000, K), "imp__position": np.concatenate([np.arange(x) for x in k]).astype(np.int32),
            "imp__click": rng.integers(0, 2, K).astype(np.int8), "imp__like": (rng.random(K) < 0.1).astype(np.int8),
            "imp__category": rng.integers(0, 50, K).astype(np.int32), "imp__author": rng.integers(0, 900, K),
            "imp__score": [None if rng.random() < null_share else float(np.float32(rng.random())) for _ in range(K)],
        }
        for c in cols:
            v = row[c]
            cols[c].append(v.tolist() if isinstance(v, np.ndarray) else v)
    return pa.Table.from_pydict(cols, schema=schema)


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()


DEFAULT_SETS = (
    ("pretrain", "2025-12-01", "2026-01-03", 120),
    ("incremental", "2026-01-03", "2026-01-04", 70),
    ("incremental", "2026-01-04", "2026-01-05", 90),
)


def write_shard_set(root: str, *, nodes: int = 1, ranks_per_node: int = 2, sets=DEFAULT_SETS, seed: int = 0,
                    row_group_rows: int = 8, gds: bool = False, uneven: bool = True, compression: str = "zstd",
                    dictionary: str = "all", **sample_kw) -> dict:
    """Write a shard set under ``root`` (node=k/shard-NNNNN.parquet + manifest.json, last)."""
    from userwise.pipelines.shards import gds as gdsmod
    from userwise.pipelines.shards.preshard import PARQUET_OPTIONS, parse_dictionary

    lay = layout()
    tschema = schemas.shard_schema(lay)
    arrow = tschema.to_arrow()
    man_sets, shards = [], []
    n_shard = 0
    first_user = 0
    for si, (kind, ws, we, n) in enumerate(sets):
        set_id = "pretrain" if kind == "pretrain" else f"incremental/{we}"
        t = make_samples(n, kind=kind, window_start=ws, window_end=we, seed=seed * 100 + si, first_user=first_user,
                         **sample_kw)
        first_user += n
        slots = nodes * ranks_per_node
        # uneven: slot j gets a weight 1 + j (mod 3), so shard sizes differ
        w = np.array([1 + (j % 3) if uneven else 1 for j in range(slots)], float)
        counts = np.floor(w / w.sum() * n).astype(int)
        counts[0] += n - counts.sum()
        starts = np.concatenate([[0], np.cumsum(counts)])
        rank_rows = [[0] * ranks_per_node for _ in range(nodes)]
        rank_cost = [[0] * ranks_per_node for _ in range(nodes)]
        for j in range(slots):
            node, rank = divmod(j, ranks_per_node)
            part = t.slice(starts[j], counts[j])
            rel = f"node={node}/shard-{n_shard:05d}.parquet"
            n_shard += 1
            path = os.path.join(root, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            pq.write_table(part, path, row_group_size=row_group_rows, compression=compression,  # as preshard writes
                           use_dictionary=parse_dictionary(dictionary, part.schema), **PARQUET_OPTIONS)
            md = pq.ParquetFile(path).metadata
            entry = {
                "path": rel, "node": node, "rank": rank, "rows": part.num_rows,
                "events": int(np.asarray(part["seq_len"]).sum()), "impressions": int(np.asarray(part["num_impressions"]).sum()),
                "cost": int(np.asarray(part["cost"]).sum()), "bytes": os.path.getsize(path),
                "row_groups": md.num_row_groups, "sha256": sha256(path),
                "gds_path": None, "gds_bytes": None, "gds_sha256": None, "set": set_id,
            }
            if gds:
                g = rel[: -len(".parquet")] + ".gds"
                info = gdsmod.write_side_file(path, os.path.join(root, g))
                entry.update(gds_path=g, gds_bytes=info["bytes"], gds_sha256=info["sha256"])
            shards.append(entry)
            rank_rows[node][rank] += part.num_rows
            rank_cost[node][rank] += entry["cost"]
        man_sets.append({"id": set_id, "kind": kind, "window_start": ws, "window_end": we, "rows": n,
                         "cost": int(np.asarray(t["cost"]).sum()),
                         "balance": {"rank_cost": rank_cost, "rank_rows": rank_rows, "max_dev": 0.0}})
    manifest = {
        "format_version": schemas.FORMAT_VERSION, "nodes": nodes, "ranks_per_node": ranks_per_node, "seed": seed,
        "layout": "gds" if gds else "parquet",
        "schema_fingerprint": schemas.schema_fingerprint(arrow),
        "schema": [[f.name, str(f.type), f.nullable] for f in arrow],
        "roles": lay.roles(), "source": {"table": os.path.join(root, "samples"), "version": 0},
        "sets": man_sets, "shards": shards,
    }
    with open(os.path.join(root, "manifest.json.tmp"), "w") as f:
        json.dump(manifest, f, indent=1)
    os.replace(os.path.join(root, "manifest.json.tmp"), os.path.join(root, "manifest.json"))
    return manifest


def all_rows(root: str, node: int | None = None) -> pa.Table:
    """Every sample row of a set (of one node), read back plainly (the test oracle)."""
    man = json.load(open(os.path.join(root, "manifest.json")))
    parts = [pq.read_table(os.path.join(root, s["path"])) for s in man["shards"] if node is None or s["node"] == node]
    return pa.concat_tables(parts)
