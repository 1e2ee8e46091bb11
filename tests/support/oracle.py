"""An independent oracle for the lossless round trip (Polars and plain Python, no Spark).

It restates the pointer rule (docs/pointer.md) as directly as possible, on tiny data:

- the accepted impressions = the input minus the rejected rows (ground truth given by the
  caller, by ``row_uid``), exact duplicate rows reduced to one copy;
- the built ones = accepted with request time < as-of (00:00 UTC of that day);
- every event has an arrival time: its arrival column's value (``columns.arrival_time`` for
  the impressions' actions, ``columns.actions.arrival`` for the action log) where the config
  maps one and the value is not null, else its action time + the availability lag D (D = 0
  unless the config sets ``availability_lag``);
- a user's stream = actions of built impressions (any action label > 0, at the action time,
  the request time when no action-time column is mapped; bit i set when action label i > 0)
  plus accepted action-log events (no request fields), in arrival order, then the total order
  (action_time, request_time, request_id, position, item, action bits, item features...)
  ascending, nulls first;
- an impression sees the last L events of its user's stream that arrived strictly before
  its request time (``arrival < request_time``; without an arrival column that is
  ``action_time + D < request_time``), oldest first; no history is an empty list.

Expanded lean rows = every input column unchanged (names, order, values) + ``seq_ts``,
``seq_item``, ``seq_<item feature column>``..., ``seq_action``, and ``seq_arrival`` when the
config maps an arrival column. Fat rows come back exactly as given (their snapshots included).
"""

from __future__ import annotations

import bisect
import datetime as dt
import math
from collections import Counter
from collections.abc import Collection, Iterable, Mapping

import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from userwise.schemas import reasons as R

UNITS = {"s": 1, "ms": 1000, "us": 1_000_000}
UID = "row_uid"


# --------------------------------------------------------------------------
# reading
# --------------------------------------------------------------------------
def read_parquet_dir(path) -> pl.DataFrame:
    """A hive-partitioned Parquet folder: partition columns last, `date` as a date,
    dictionary columns decoded (what a reader of the input sees as its columns)."""
    paths = [str(p) for p in path] if isinstance(path, (list, tuple)) else str(path)
    t = ds.dataset(paths, format="parquet", partitioning="hive").to_table()
    cols = []
    for f, c in zip(t.schema, t.columns):
        if pa.types.is_dictionary(f.type):
            c = c.cast(f.type.value_type)
        if f.name == "date" and not pa.types.is_date(c.type):
            c = pc.cast(c, pa.date32())
        cols.append(c)
    return pl.from_arrow(pa.table(cols, names=t.schema.names))


def as_of_units(as_of: str, time_unit: str) -> int:
    d = dt.date.fromisoformat(str(as_of))
    secs = int(dt.datetime(d.year, d.month, d.day, tzinfo=dt.timezone.utc).timestamp())
    return secs * UNITS[time_unit]


def _time_expr(df: pl.DataFrame, col: str, time_unit: str) -> pl.Expr:
    if isinstance(df.schema[col], pl.Datetime):
        return pl.col(col).dt.epoch(time_unit)
    return pl.col(col).cast(pl.Int64)


# --------------------------------------------------------------------------
# accepted rows
# --------------------------------------------------------------------------
def _dropped(rejected) -> set:
    """Row uids with no copy left: a mapping uid -> reason keeps one copy of exact duplicates."""
    if rejected is None:
        return set()
    if isinstance(rejected, Mapping):
        return {u for u, r in rejected.items() if r != R.DUPLICATE_ROW}
    return set(rejected)


def accepted(df: pl.DataFrame, rejected) -> pl.DataFrame:
    """Exact duplicates reduced to their first copy, then rejected row uids removed."""
    out = df.unique(maintain_order=True)
    drop = _dropped(rejected)
    if drop:
        out = out.filter(~pl.col(UID).is_in(list(drop)))
    return out


def _label_bits(df: pl.DataFrame, labels: list[str]) -> pl.Expr:
    e = pl.lit(0, dtype=pl.Int64)
    for i, c in enumerate(labels):
        # NaN > 0 is false; null labels count as no action
        e = e + pl.when(pl.col(c).cast(pl.Float64) > 0).then(pl.lit(1 << i, dtype=pl.Int64)).otherwise(0)
    return e


def _null_eq(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def _drop_rows(df: pl.DataFrame, rows: Iterable[dict]) -> pl.DataFrame:
    """Remove every row equal (null-aware, on the given keys) to one of `rows`."""
    rows = list(rows)
    if not rows:
        return df
    keep = []
    for rec in df.iter_rows(named=True):
        hit = any(all(_null_eq(rec.get(k), v) for k, v in bad.items() if k != "date") for bad in rows)
        keep.append(not hit)
    return df.filter(pl.Series(keep, dtype=pl.Boolean))


# --------------------------------------------------------------------------
# the stream
# --------------------------------------------------------------------------
LAG_UNITS_US = {"us": 1, "ms": 1000, "s": 10**6, "m": 60 * 10**6, "h": 3600 * 10**6, "d": 86400 * 10**6}


def lag_units(config: dict) -> int:
    """The config's ``availability_lag`` (0, or a whole number and a unit: 30s, 500ms) in its
    time unit; restated here, not read through the product's parser."""
    raw = config.get("availability_lag", 0)
    if raw == 0:
        return 0
    num = int("".join(ch for ch in raw if ch.isdigit()))
    unit = "".join(ch for ch in raw if ch.isalpha())
    return num * LAG_UNITS_US[unit] * UNITS[config.get("time_unit", "ms")] // 10**6


def _cfg(config: dict) -> dict:
    cols = config["columns"]
    labels = list(cols.get("action_labels") or cols["labels"])
    return {
        "user": cols["user"], "request": cols.get("request"), "rtime": cols["request_time"],
        "atime": cols.get("action_time") or cols["request_time"], "item": cols["item"],
        "position": cols.get("position"), "labels": labels, "features": list(cols.get("item_features") or []),
        "unit": config.get("time_unit", "ms"), "L": int(config.get("max_seq_len", 1000)),
        "actions": cols.get("actions"), "arrival": cols.get("arrival_time"),
        "arrivals": bool(cols.get("arrival_time") or (cols.get("actions") or {}).get("arrival")),
    }


def _arrival(df: pl.DataFrame, col: str | None, c: dict, D: int) -> pl.Expr:
    """An event's arrival: the column's value, else (no column, or null) action time + D."""
    fallback = pl.col("at") + D
    if col is None:
        return fallback
    return pl.coalesce(_time_expr(df, col, c["unit"]), fallback)


EV_COLS = ["user", "at", "rt", "rid", "pos", "item", "bits"]


def impression_events(built: pl.DataFrame, c: dict, D: int = 0) -> pl.DataFrame:
    feats = [pl.col(f).alias(f"f{i}") for i, f in enumerate(c["features"])]
    rid = pl.col(c["request"]) if c["request"] else pl.lit(None, dtype=pl.Int64)
    pos = pl.col(c["position"]).cast(pl.Int64) if c["position"] else pl.lit(None, dtype=pl.Int64)
    arv = [_time_expr(built, c["arrival"], c["unit"]).alias("_arv")] if c["arrival"] else []
    return (
        built.select(
            pl.col(c["user"]).alias("user"),
            *arv,
            _time_expr(built, c["atime"], c["unit"]).alias("at"),
            _time_expr(built, c["rtime"], c["unit"]).alias("rt"),
            rid.alias("rid"), pos.alias("pos"), pl.col(c["item"]).alias("item"),
            _label_bits(built, c["labels"]).alias("bits"), *feats,
        )
        .filter(pl.col("bits") > 0)
        .with_columns(pl.coalesce(pl.col("_arv"), pl.col("at") + D).alias("arr") if c["arrival"]
                      else (pl.col("at") + D).alias("arr"))
        .drop("_arv", strict=False)
    )


def log_events(actions: pl.DataFrame, c: dict, like: pl.DataFrame, D: int = 0) -> pl.DataFrame:
    a = c["actions"]
    arv = a.get("arrival")
    labels = a["labels"]
    bits = pl.col(labels).cast(pl.Int64) if isinstance(labels, str) else _label_bits(actions, list(labels))
    feats = [pl.col(src).cast(like.schema[f"f{i}"]).alias(f"f{i}") for i, src in enumerate(a.get("item_features") or [])]
    return actions.select(
        pl.col(a["user"]).cast(like.schema["user"]).alias("user"),
        _time_expr(actions, a["time"], c["unit"]).alias("at"),
        pl.lit(None, dtype=pl.Int64).alias("rt"),
        pl.lit(None, dtype=like.schema["rid"]).alias("rid"),
        pl.lit(None, dtype=pl.Int64).alias("pos"),
        pl.col(a["item"]).cast(like.schema["item"]).alias("item"),
        bits.alias("bits"), *feats,
        (_time_expr(actions, arv, c["unit"]) if arv else pl.lit(None, dtype=pl.Int64)).alias("_arv"),
    ).with_columns(pl.coalesce(pl.col("_arv"), pl.col("at") + D).alias("arr")).drop("_arv")


def stream(built: pl.DataFrame, c: dict, actions: pl.DataFrame | None = None, D: int = 0) -> pl.DataFrame:
    """A user's events in the stream's order: arrival, then the total order (without an arrival
    column, arrival = action time + D keeps the action-time order)."""
    ev = impression_events(built, c, D)
    if actions is not None:
        ev = pl.concat([ev, log_events(actions, c, ev, D)], how="vertical")
    keys = ["user", "arr", "at", "rt", "rid", "pos", "item", "bits"] + [f"f{i}" for i in range(len(c["features"]))]
    return ev.sort(keys, nulls_last=False, maintain_order=True)


# --------------------------------------------------------------------------
# the oracles
# --------------------------------------------------------------------------
def expected_pointwise(input_paths, config_dict: dict, as_of: str, rejected_row_uids,
                       actions_path=None, max_seq_len: int | None = None,
                       rejected_actions: Collection[dict] = (), lag: int | None = None) -> pl.DataFrame:
    """The point-wise rows `userwise expand` must give back for a lean log.

    rejected_row_uids: a set of row uids to drop, or a mapping uid -> reason (then
    reason "duplicate_row" means: one copy is kept). rejected_actions: whole action-log rows
    (dicts) that are quarantined. max_seq_len: L' (default: the config's L). lag: the
    availability lag D in time units (default: the config's, :func:`lag_units`).
    """
    c = _cfg(config_dict)
    L = int(max_seq_len or c["L"])
    D = lag_units(config_dict) if lag is None else int(lag)
    df = read_parquet_dir(input_paths)
    columns = df.columns
    acc = accepted(df, rejected_row_uids)
    built = acc.filter(_time_expr(acc, c["rtime"], c["unit"]) < as_of_units(as_of, c["unit"]))
    acts = None
    if actions_path is not None:
        if not c["actions"]:
            raise ValueError("actions_path given but the config has no columns.actions")
        acts = _drop_rows(read_parquet_dir(actions_path), rejected_actions)
    ev = stream(built, c, acts, D)

    by_user: dict = {}
    for rec in ev.iter_rows(named=True):
        by_user.setdefault(rec["user"], []).append(rec)
    arrivals = {u: [e["arr"] for e in evs] for u, evs in by_user.items()}

    out = {"ts": [], "item": [], "action": [], "arrival": []}
    out.update({f: [] for f in c["features"]})
    rts = built.select(_time_expr(built, c["rtime"], c["unit"])).to_series().to_list()
    for user, rt in zip(built[c["user"]].to_list(), rts):
        evs = by_user.get(user, [])
        end = bisect.bisect_left(arrivals.get(user, []), rt)  # events that arrived strictly before rt
        seen = evs[max(0, end - L):end]
        out["ts"].append([e["at"] for e in seen])
        out["arrival"].append([e["arr"] for e in seen])
        out["item"].append([e["item"] for e in seen])
        out["action"].append([e["bits"] for e in seen])
        for i, f in enumerate(c["features"]):
            out[f].append([e[f"f{i}"] for e in seen])

    item_t = built.schema[c["item"]]
    seq = [pl.Series("seq_ts", out["ts"], dtype=pl.List(pl.Int64)),
           pl.Series("seq_item", out["item"], dtype=pl.List(item_t))]
    seq += [pl.Series(f"seq_{f}", out[f], dtype=pl.List(built.schema[f])) for f in c["features"]]
    seq.append(pl.Series("seq_action", out["action"], dtype=pl.List(pl.Int64)))
    if c["arrivals"]:
        seq.append(pl.Series("seq_arrival", out["arrival"], dtype=pl.List(pl.Int64)))
    return built.select(columns).with_columns(seq)


def expected_fat(input_paths, config_dict: dict, as_of: str, rejected_row_uids) -> pl.DataFrame:
    """Fat rows: the accepted impressions before as-of, every column (snapshots included) as given."""
    c = _cfg(config_dict)
    df = read_parquet_dir(input_paths)
    acc = accepted(df, rejected_row_uids)
    return acc.filter(_time_expr(acc, c["rtime"], c["unit"]) < as_of_units(as_of, c["unit"]))


def seq_columns(config_dict: dict) -> list[str]:
    c = _cfg(config_dict)
    if config_dict["columns"].get("sequence"):
        return []
    return ["seq_ts", "seq_item"] + [f"seq_{f}" for f in c["features"]] + ["seq_action"] \
        + (["seq_arrival"] if c["arrivals"] else [])


# --------------------------------------------------------------------------
# comparing and reconciling
# --------------------------------------------------------------------------
def frame_diff(got: pl.DataFrame, want: pl.DataFrame, key: str = UID, max_items: int = 5) -> list[str]:
    """Differences between two point-wise frames, row by row after sorting by key
    (NaN equals NaN; types must match). Empty when they are the same."""
    out = []
    if got.columns != want.columns:
        out.append(f"columns differ: got {got.columns}, want {want.columns}")
        return out
    if got.height != want.height:
        g, w = Counter(got[key].to_list()), Counter(want[key].to_list())
        out.append(f"rows: got {got.height}, want {want.height}; extra {sorted((g - w).elements())[:20]}, "
                   f"missing {sorted((w - g).elements())[:20]}")
        return out
    got, want = got.sort(key), want.sort(key)
    for col in want.columns:
        if got.schema[col] != want.schema[col]:
            out.append(f"{col}: type {got.schema[col]} != {want.schema[col]}")
            continue
        a, b = got[col].to_list(), want[col].to_list()
        bad = [i for i, (x, y) in enumerate(zip(a, b)) if not _deep_eq(x, y)]
        for i in bad[:max_items]:
            out.append(f"{col} at {key}={want[key][i]}: got {a[i]!r}, want {b[i]!r}")
        if len(bad) > max_items:
            out.append(f"{col}: {len(bad) - max_items} more differences")
    return out


def _deep_eq(x, y) -> bool:
    if isinstance(x, list) and isinstance(y, list):
        return len(x) == len(y) and all(_deep_eq(a, b) for a, b in zip(x, y))
    if isinstance(x, float) and isinstance(y, float):
        return (math.isnan(x) and math.isnan(y)) or x == y
    if x is None or y is None:
        return x is None and y is None
    return type(x) is type(y) and x == y


def expected_report(truth) -> dict:
    """What the build's report must say about the impressions source, from an edgegen.EdgeLog."""
    return {
        "rows_read": truth.rows_read,
        "accepted": len(truth.expected_uids),
        "quarantined": truth.quarantine_counts(),
        "after_as_of": len(truth.after_as_of_uids),
        "impressions_in_samples": len(truth.expected_uids),
    }


def reconcile(report: dict, truth) -> list[str]:
    """Problems with a build report against the ground truth; empty when it reconciles.

    impressions in = impressions in samples + quarantined + at/after as-of, and each
    term equals the ground truth. `quarantined` counts impression rows by reason; action-log
    rows by reason under report["actions_quarantined"] (or report["actions"]["quarantined"])."""
    out = []
    for k in ("rows_read", "accepted", "quarantined", "after_as_of", "impressions_in_samples"):
        if k not in report:
            out.append(f"report has no key {k!r}")
    if out:
        return out
    q = {k: v for k, v in report["quarantined"].items() if v}
    if report["impressions_in_samples"] + sum(q.values()) + report["after_as_of"] != report["rows_read"]:
        out.append(f"in samples {report['impressions_in_samples']} + quarantined {sum(q.values())} + "
                   f"after as-of {report['after_as_of']} != rows read {report['rows_read']}")
    if report["accepted"] + sum(q.values()) + report["after_as_of"] != report["rows_read"]:
        out.append(f"accepted {report['accepted']} + quarantined + after as-of != rows read")
    want = expected_report(truth)
    for k, v in want.items():
        got = q if k == "quarantined" else report[k]
        if got != v:
            out.append(f"{k}: report says {got}, ground truth {v}")
    if truth.rejected_actions:
        want_a = dict(Counter(r for _, r in truth.rejected_actions))
        raw = report.get("actions_quarantined")
        if raw is None:
            raw = (report.get("actions") or {}).get("quarantined") or {}
        got_a = {k: v for k, v in raw.items() if v}
        if got_a != want_a:
            out.append(f"actions quarantined: report says {got_a}, ground truth {want_a}")
    return out
