"""What the repeated bases of daily sets cost (#56 point 5), computed without Spark.

    .venv/bin/python benchmarks/bases_report.py                       # synth 300 users, 30 days
    .venv/bin/python benchmarks/bases_report.py --log /tmp/long       # an existing synth output

An independent model of the build's rule (docs/pointer.md, ``pipelines/builder/pointer.py``
``lean_sets`` and ``chunk_ids``), written plainly in numpy over a lean synth log
(``lean/`` + ``actions/`` + ``config.yaml``):

1. the action stream: every impression with a positive action label at its ``action_ts``,
   and every action-log event at its ``ts``; per user, sorted by time (a user's event k is
   the k-th of that order: ties do not change any count below);
2. requests: one per (user, request_id), at ``request_ts``, with its impressions;
3. the sets: the last M days before ``--as-of`` (default: the day after the log) cut into
   N-day windows. A request r at t sees the user's events strictly before t - lag:
   ``E_r`` of them, ``seq_begin = max(0, E_r - L)`` (global event indexes). Per (user, set)
   the requests in (time, id) order fill chunks greedily, as ``chunk_ids`` does: a chunk
   takes the next request unless its span (max end - min begin of the requests that see an
   event) plus its impressions would pass ``max_sample_cost``. A chunk stores the events
   [begin of its first request that sees one, end of its last). Its *base* is the part
   before the set's start - lag (what the build slices from the user's newest L events
   before the set: ``pointer.py`` ``base``), the rest its own events.
4. per set (one day for N = 1): stored events, requests and impressions, and bytes:
   events x bytes per event + requests x bytes per request + impressions x bytes per
   impression + rows x bytes per row, the widths read from the shard schema
   (``schemas.shard_schema`` of the config's layout over the log's schema: a fixed-width
   type's width, a string's mean UTF-8 length in the log + a 4-byte offset, a list's 4-byte
   offset per row; ``chain_checkpoints``: 8 bytes per ``chain_block`` events). These are
   Arrow (decoded) bytes, what the loader holds; the Parquet shards a node stages are
   zstd-compressed and smaller, in about the same shares.
5. the repeats: per (user, day) the events it stores that the same user's sample stored
   the day before (``prev_day``), or on any earlier day of the M (``any_earlier``): a node
   that kept its users from day to day would hold them already.

Outputs a table on stdout and ``--json`` (benchmarks/results/bases_report.json).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
DAY_MS = 86_400_000
DEFAULT_COST = 20_000  # config.py TOP_KEYS["max_sample_cost"]: fixed, whatever max_seq_len is


# ---------------------------------------------------------------------------
# the log
# ---------------------------------------------------------------------------
def _dataset(path: str) -> ds.Dataset:
    return ds.dataset(path, format="parquet", partitioning="hive")


def read_log(log: str) -> dict:
    """Per user: sorted event times; per request: user, time, id, impressions. Times in ms."""
    lean = _dataset(os.path.join(log, "lean")).to_table(
        columns=["user_id", "request_id", "request_ts", "action_ts", "click", "like"])
    pos = pc.or_(pc.greater(lean["click"], 0), pc.greater(lean["like"], 0))
    ev_u = [lean["user_id"].filter(pos).to_numpy()]
    ev_t = [lean["action_ts"].filter(pos).to_numpy()]
    apath = os.path.join(log, "actions")
    if os.path.isdir(apath):
        a = _dataset(apath).to_table(columns=["uid", "ts"])
        ev_u.append(a["uid"].to_numpy())
        ev_t.append(a["ts"].to_numpy())
    reqs = lean.group_by(["user_id", "request_id"]).aggregate([("request_ts", "min"), ("request_ts", "count")])
    return {
        "ev_user": np.concatenate(ev_u).astype(np.int64), "ev_ts": np.concatenate(ev_t).astype(np.int64),
        "req_user": reqs["user_id"].to_numpy().astype(np.int64),
        "req_id": np.asarray(reqs["request_id"].to_pylist(), dtype=object),
        "req_ts": reqs["request_ts_min"].to_numpy().astype(np.int64),
        "req_imps": reqs["request_ts_count"].to_numpy().astype(np.int64),
    }


def widths(log: str) -> dict:
    """Bytes per event, request, impression and sample row of the shard schema (see the docstring)."""
    sys.path.insert(0, os.path.dirname(REPO))
    from userwise import schemas as S
    from userwise.pipelines import config as C

    cfg = C.load(os.path.join(log, "config.yaml"))
    lean = _dataset(os.path.join(log, "lean"))
    layout = cfg.layout(lean.schema)
    sample = lean.head(20_000)
    strlen = {}
    for name in sample.column_names:
        col = sample[name]
        if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
            strlen[name] = float(np.mean(pc.utf8_length(col).to_numpy(zero_copy_only=False))) if len(col) else 0.0
    chain_block = cfg.chain_block
    per = {"event": 0.0, "request": 0.0, "impression": 0.0, "row": 0.0}
    cols = {k: [] for k in per}

    def one(t: pa.DataType, src: str | None) -> float:
        if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t):
            return strlen.get(src, 8.0) + 4.0
        try:
            return max(1, t.bit_width // 8)
        except ValueError:
            return 8.0

    for f in S.shard_schema(layout).to_arrow():
        name = f.name
        if pa.types.is_list(f.type):
            per["row"] += 4.0  # the list's offset
            if name == "chain_checkpoints":
                per["event"] += 8.0 / chain_block
                cols["event"].append(name)
                continue
            kind = ("event" if name.startswith("seq_") else "impression" if name.startswith("imp__")
                    else "request" if name.startswith("req") else "row")
            src = {"req_id": "request_id"}.get(name, name.split("__", 1)[1] if "__" in name else None)
            per[kind] += one(f.type.value_type, src)
            cols[kind].append(name)
        else:
            per["row"] += one(f.type, None)
            cols["row"].append(name)
    return {"bytes": {k: round(v, 3) for k, v in per.items()}, "columns": cols,
            "config": {"history_length": cfg.history_length, "max_sample_cost": cfg.max_sample_cost,
                       "max_seq_len": cfg.max_seq_len, "chain_block": chain_block}}


# ---------------------------------------------------------------------------
# the model of the build's rule
# ---------------------------------------------------------------------------
def chunks(E: np.ndarray, imps: np.ndarray, L: int, cap: int) -> list[tuple[int, int]]:
    """One (user, set)'s chunks as [lo, hi) event ranges (global indexes); ``E``: per request
    in (time, id) order, its events strictly before its time less the lag. As chunk_ids: the
    span of the slices of requests that see an event, plus impressions; close on passing cap.
    A chunk whose requests see no event stores none (lo = hi = 0)."""
    out, lo, hi, cost, n = [], None, None, 0, 0
    for e, c in zip(E.tolist(), imps.tolist()):
        b = max(e - L, 0) if e > 0 else None
        nlo = lo if b is None else (b if lo is None else min(lo, b))
        nhi = hi if b is None else (e if hi is None else max(hi, e))
        span = 0 if nlo is None else nhi - nlo
        if n > 0 and span + cost + c > cap:
            out.append((lo or 0, hi or 0))
            lo, hi, cost = b, (e if b is not None else None), c
        else:
            lo, hi, cost = nlo, nhi, cost + c
        n += 1
    if n:
        out.append((lo or 0, hi or 0))
    return out


def _union(iv: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for lo, hi in sorted(x for x in iv if x[1] > x[0]):
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [(a, b) for a, b in out]


def _length(iv) -> int:
    return sum(b - a for a, b in iv)


def _inter(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> int:
    """Events in both unions of disjoint sorted ranges."""
    i = j = n = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        n += max(0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return n


def model(log: dict, *, L: int, cap: int, as_of_ms: int, days: int, window_days: int, lag_ms: int,
          heavy: list[int] = (), pretrain: bool = False) -> dict:
    """The incremental sets (the last ``days`` days before as-of, ``window_days`` each) at L and
    cap: per set its stored events (base / own), requests, impressions, rows, and the events
    stored the previous set and on any earlier set; overall stored / distinct events."""
    ev_order = np.lexsort((log["ev_ts"], log["ev_user"]))
    ev_u, ev_t = log["ev_user"][ev_order], log["ev_ts"][ev_order]
    users, first = np.unique(ev_u, return_index=True)
    ev_of = {int(u): ev_t[s:e] for u, s, e in zip(users, first, np.append(first[1:], len(ev_u)))}
    empty = np.zeros(0, np.int64)
    start = as_of_ms - days * DAY_MS
    bounds = [(start + k * window_days * DAY_MS, min(as_of_ms, start + (k + 1) * window_days * DAY_MS))
              for k in range((days + window_days - 1) // window_days)]
    if pretrain:  # the one set before the last M days: no start, so no base
        bounds = [(-(2**62), start)]
    lo_t, hi_t = bounds[0][0], bounds[-1][1]
    keep = (log["req_ts"] >= lo_t) & (log["req_ts"] < hi_t)
    ru, rt, rid, rn = (log[k][keep] for k in ("req_user", "req_ts", "req_id", "req_imps"))
    order = np.lexsort((rid.astype(str), rt, ru))
    ru, rt, rn = ru[order], rt[order], rn[order]
    set_of = np.searchsorted([b for b, _ in bounds], rt, side="right") - 1
    per_set = [dict(events=0, base=0, own=0, requests=0, impressions=0, rows=0, users=0,
                    prev_day=0, any_earlier=0, chunk_repeats=0) for _ in bounds]
    distinct: dict[int, list] = {}
    prev: dict[int, tuple[int, list]] = {}
    seen: dict[int, list] = {}
    heavy_rows = {int(u): [] for u in heavy}
    # requests grouped by (user, set): runs of equal (ru, set_of) in the sorted order
    key_change = np.flatnonzero(np.diff(ru) != 0) + 1
    starts = np.concatenate([[0], key_change]) if len(ru) else np.zeros(0, np.int64)
    for s0, s1 in zip(starts, np.append(starts[1:], len(ru))):
        u = int(ru[s0])
        times = ev_of.get(u, empty)
        for k in np.unique(set_of[s0:s1]).tolist():
            sel = slice(s0, s1)
            m = set_of[sel] == k
            t, n = rt[sel][m], rn[sel][m]
            E = np.searchsorted(times, t - lag_ms, side="left").astype(np.int64)
            ch = chunks(E, n, L, cap)
            c = 0 if pretrain else int(np.searchsorted(times, bounds[k][0] - lag_ms, side="left"))  # before the set
            u_iv = _union(ch)
            stored = sum(hi - lo for lo, hi in ch)
            ps = per_set[k]
            ps["events"] += stored
            ps["chunk_repeats"] += stored - _length(u_iv)
            ps["base"] += sum(max(0, min(hi, c) - lo) for lo, hi in ch)
            ps["own"] += sum(max(0, hi - max(lo, c)) for lo, hi in ch)
            ps["requests"] += len(t)
            ps["impressions"] += int(n.sum())
            ps["rows"] += len(ch)
            ps["users"] += 1
            p = prev.get(u)
            if p is not None and p[0] == k - 1:
                ps["prev_day"] += _inter(u_iv, p[1])
            ps["any_earlier"] += _inter(u_iv, seen.get(u, []))
            prev[u] = (k, u_iv)
            seen[u] = _union(seen.get(u, []) + u_iv)
            distinct.setdefault(u, []).extend(u_iv)
            if u in heavy_rows:
                heavy_rows[u].append({"set": k, "chunks": len(ch), "stored": stored, "repeated": stored - _length(u_iv),
                                      "requests": len(t)})
    stored = sum(ps["events"] for ps in per_set)
    dist = sum(_length(_union(v)) for v in distinct.values())
    log_events = int(np.count_nonzero(ev_t < hi_t - lag_ms))
    own = sum(ps["own"] for ps in per_set)
    return {"L": L, "max_sample_cost": cap, "sets": per_set, "stored_events": stored, "distinct_events": dist,
            "log_events": log_events, "own_events": own,
            "stored_over_distinct": round(stored / dist, 3) if dist else None,
            "stored_over_log": round(stored / log_events, 3) if log_events else None,
            "heavy": {str(u): v for u, v in heavy_rows.items()}}


def costs(m: dict, w: dict, nodes: int) -> dict:
    """Bytes per set from a model's counts and the widths: the staged bytes, their base part, the part
    staged the day before / on an earlier day, and what the design options would stage or store."""
    b = w["bytes"]
    days = []
    for ps in m["sets"]:
        ev_b = ps["events"] * b["event"]
        total = ev_b + ps["requests"] * b["request"] + ps["impressions"] * b["impression"] + ps["rows"] * b["row"]
        days.append({
            "bytes": total, "event_bytes": ev_b, "base_bytes": ps["base"] * b["event"],
            "prev_day_bytes": ps["prev_day"] * b["event"], "any_earlier_bytes": ps["any_earlier"] * b["event"],
            # option 2 (users kept on their node): the day stages what the node does not hold yet
            "sticky_bytes": total - ps["any_earlier"] * b["event"],
        })
    active = [d for d, ps in zip(days, m["sets"]) if ps["users"]]
    tot = lambda k: sum(d[k] for d in active)  # noqa: E731
    n = max(1, len(active))
    staged = tot("bytes")
    user_days = sum(ps["users"] for ps in m["sets"])
    steady = [d for d, ps in list(zip(days, m["sets"]))[1:] if ps["users"]]
    return {
        "per_user_day_bytes_mean": staged / user_days if user_days else 0.0,
        "sticky_per_user_day_bytes_steady": (sum(d["sticky_bytes"] for d in steady)
                                             / sum(ps["users"] for ps in m["sets"][1:]) if steady else 0.0),
        "per_day_bytes_mean": staged / n,
        "per_node_day_bytes_mean": staged / n / nodes,
        "base_share": tot("base_bytes") / staged if staged else 0.0,
        "prev_day_share": tot("prev_day_bytes") / staged if staged else 0.0,
        "any_earlier_share": tot("any_earlier_bytes") / staged if staged else 0.0,
        "sticky_per_node_day_bytes_mean": tot("sticky_bytes") / n / nodes,
        # option 1 (bases referenced from the events table, materialized at preshard): the samples
        # store each set's own events once; the shards a node stages are as today
        "samples_events_option1": m["own_events"],
        "per_day": [{k: round(v) for k, v in d.items()} for d in days],
    }


def heavy_chunks(log: dict, heavy: list[int], *, L: int, cap: int, as_of_ms: int, days: int, lag_ms: int,
                 pretrain: bool = False) -> dict:
    """The heavy users' chunks at one cap (their daily sets, or the pretrain set): chunks per (user, set) and
    the events a chunk repeats from the chunk before it."""
    m = model(log, L=L, cap=cap, as_of_ms=as_of_ms, days=days, window_days=1, lag_ms=lag_ms, heavy=heavy,
              pretrain=pretrain)
    rows = [r for v in m["heavy"].values() for r in v]
    stored = sum(r["stored"] for r in rows)
    rep = sum(r["repeated"] for r in rows)
    return {"L": L, "max_sample_cost": cap, "set": "pretrain" if pretrain else "daily", "user_sets": len(rows),
            "chunks_per_user_set_max": max((r["chunks"] for r in rows), default=0),
            "chunks_per_user_set_mean": round(sum(r["chunks"] for r in rows) / len(rows), 2) if rows else 0,
            "stored_events": stored, "repeated_events": rep, "repeated_share": round(rep / stored, 3) if stored else 0}


# ---------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------
def _synth(out: str, users: int, days: int, seed: int) -> None:
    sys.path.insert(0, os.path.dirname(REPO))
    from userwise.pipelines.tools.synth import synth

    synth(out, days=days, users=users, shape="production", kinds=("lean", "actions"), seed=seed,
          log=open(os.devnull, "w"))


def _defaults() -> dict:
    sys.path.insert(0, os.path.dirname(REPO))
    from userwise.pipelines.config import TOP_KEYS

    return {k: TOP_KEYS[k] for k in ("max_seq_len", "history_length", "max_sample_cost")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--log", default=None, help="a synth output (lean/, actions/, config.yaml); default: synth one")
    p.add_argument("--users", type=int, default=500, help="synth --users (without --log)")
    p.add_argument("--days", type=int, default=37,
                   help="synth --days of impressions (without --log): M daily sets and a pretrain set before them")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lengths", default="1000,4000,16000", help="L values")
    p.add_argument("--incremental-days", type=int, default=30, help="M")
    p.add_argument("--window-days", type=int, default=1, help="N")
    p.add_argument("--as-of", default=None, help="YYYY-MM-DD; default: the day after the log's last request")
    p.add_argument("--lag-ms", type=int, default=0, help="availability_lag in ms")
    p.add_argument("--nodes", type=int, default=1, help="nodes a day's set is spread over (per-node bytes)")
    p.add_argument("--cost-factor", type=int, default=20, help="max_sample_cost = this x L (synth's rule)")
    p.add_argument("--json", default=os.path.join(HERE, "results", "bases_report.json"))
    args = p.parse_args(argv)
    t0 = time.time()
    tmp = None
    log_dir = args.log
    if log_dir is None:
        tmp = tempfile.mkdtemp(prefix="bases_report_")
        log_dir = os.path.join(tmp, "log")
        _synth(log_dir, args.users, args.days, args.seed)
    try:
        log = read_log(log_dir)
        w = widths(log_dir)
        meta = {}
        sj = os.path.join(log_dir, "synth.json")
        if os.path.exists(sj):
            with open(sj) as f:
                s = json.load(f)
            meta = {k: s.get(k) for k in ("args", "measured", "bot_user_id", "heavy_user_ids", "users")}
        heavy = sorted({int(x) for x in (meta.get("heavy_user_ids") or [])}
                       | ({int(meta["bot_user_id"])} if meta.get("bot_user_id") is not None else set()))
        if args.as_of:
            as_of = int(dt.datetime.fromisoformat(args.as_of).replace(tzinfo=dt.timezone.utc).timestamp() * 1000)
        else:
            as_of = (int(log["req_ts"].max()) // DAY_MS + 1) * DAY_MS
        runs = []
        for L in [int(x) for x in args.lengths.split(",")]:
            cap = max(args.cost_factor * L, L + 1)
            m = model(log, L=L, cap=cap, as_of_ms=as_of, days=args.incremental_days, window_days=args.window_days,
                      lag_ms=args.lag_ms)
            c = costs(m, w, args.nodes)
            # option 2's state: a node holds each of its users' newest L events (as of the last day)
            users = np.unique(log["req_user"][log["req_ts"] >= as_of - args.incremental_days * DAY_MS])
            ev_n = dict(zip(*np.unique(log["ev_user"][log["ev_ts"] < as_of - args.lag_ms], return_counts=True)))
            c["sticky_resident_bytes_per_user"] = (float(np.mean([min(L, int(ev_n.get(u, 0))) for u in users]))
                                                   * w["bytes"]["event"] if len(users) else 0.0)
            run = {k: m[k] for k in ("L", "max_sample_cost", "stored_events", "distinct_events", "log_events",
                                     "own_events", "stored_over_distinct", "stored_over_log")}
            run.update({k: v for k, v in c.items() if k != "per_day"})
            run["sets"] = [dict(ps, **d) for ps, d in zip(m["sets"], c["per_day"])]
            # the defaults: config.py's fixed max_sample_cost (20,000) against synth's 20 x L
            run["heavy_chunks"] = [heavy_chunks(log, heavy, L=L, cap=cc, as_of_ms=as_of, days=args.incremental_days,
                                                lag_ms=args.lag_ms, pretrain=pt)
                                   for pt in (False, True) for cc in sorted({cap, DEFAULT_COST}) if cc > L] if heavy else []
            # option 3: N-day windows (7) instead of daily: fewer bases
            if args.window_days == 1 and args.incremental_days >= 7:
                m7 = model(log, L=L, cap=cap, as_of_ms=as_of, days=args.incremental_days, window_days=7,
                           lag_ms=args.lag_ms)
                run["weekly_stored_over_distinct"] = m7["stored_over_distinct"]
                run["weekly_stored_events"] = m7["stored_events"]
            runs.append(run)
            print(f"L={L:>6}: stored/distinct {run['stored_over_distinct']}, stored/log {run['stored_over_log']}, "
                  f"per node-day {run['per_node_day_bytes_mean'] / 2**20:.1f} MiB "
                  f"(base {run['base_share']:.1%}, staged the day before {run['prev_day_share']:.1%}, "
                  f"on an earlier day {run['any_earlier_share']:.1%}); sticky nodes "
                  f"{run['sticky_per_node_day_bytes_mean'] / 2**20:.1f} MiB", flush=True)
        res = {"command": "benchmarks/bases_report.py " + " ".join(argv if argv is not None else sys.argv[1:]),
               "log": {"dir": None if tmp else log_dir, "events": int(len(log["ev_ts"])),
                       "requests": int(len(log["req_ts"])), "impressions": int(log["req_imps"].sum()),
                       "users": int(len(np.unique(log["req_user"]))), "heavy_users": heavy, **meta},
               "incremental_days": args.incremental_days, "window_days": args.window_days,
               "as_of": dt.datetime.fromtimestamp(as_of / 1000, dt.timezone.utc).date().isoformat(),
               "lag_ms": args.lag_ms, "nodes": args.nodes, "config_defaults": _defaults(), "widths": w, "runs": runs,
               "seconds": round(time.time() - t0, 1)}
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
