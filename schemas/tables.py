"""Every table and file the product reads or writes.

Fixed tables are module constants; tables whose columns follow the user's
input (requests, events, history, samples, shards) are built from a
:class:`~userwise.schemas.layout.Layout`.
"""

from __future__ import annotations

import pyarrow as pa

from userwise.schemas.core import Field, TableSchema, fields, list_of
from userwise.schemas.layout import EV, IMP, OVR, REQ, SEQ, SNAP, Layout

i8, i32, i64, f32, f64, s, d = pa.int8(), pa.int32(), pa.int64(), pa.float32(), pa.float64(), pa.string(), pa.date32()

# --------------------------------------------------------------------------
# Inputs written by `userwise synth` (users map their own logs by config).
# --------------------------------------------------------------------------
SYNTH_IMPRESSIONS = TableSchema(
    "impressions",
    (
        Field("date", d, False, "UTC day of request_ts (partition)"),
        Field("user_id", i64, True, "null only in injected bad rows (`synth --bad-rows`)"),
        Field("request_id", s, False, "unique per request: d<YYYYMMDD>-u<user_id:010>-<k:06>"),
        Field("request_ts", i64, True, "request time, epoch ms; null only in injected bad rows"),
        Field("action_ts", i64, False, "when the impression was acted on (request_ts + dwell), epoch ms"),
        Field("item_id", i64, True, "null only in injected bad rows"),
        Field("position", i32, False, "display position within the request, 0..n-1"),
        Field("click", i8, False, "0/1"),
        Field("like", i8, False, "0/1, only when clicked"),
        Field("category", i32, False, "item side-info, a function of item_id"),
        Field("author", i64, False, "item side-info, a function of item_id"),
        Field("device", s, False, "context feature"),
        Field("hour", i8, False, "context feature: UTC hour of request_ts"),
        Field("age_bucket", i8, False, "user feature"),
        Field("country", s, False, "user feature"),
        Field("score", f32, True, "an unmapped column, carried through (NaN in a few rows with --bad-rows)"),
    ),
    partition_by=("date",),
    doc="Lean point-wise impression log (one row per impression). Files are hive-partitioned "
    "by `date`: the column lives in the path, not in the Parquet files.",
)

SYNTH_SNAPSHOT = (
    Field("hist_item_id", list_of(i64), True,
          "fat rows: the last L actions with action_ts < request_ts, oldest first; [] when none"),
    Field("hist_ts", list_of(i64), True, "fat rows: the last L actions' times (ms)"),
    Field("hist_category", list_of(i32), True, "fat rows: the last L actions' categories"),
)

SYNTH_FAT_IMPRESSIONS = TableSchema(
    "fat_impressions",
    SYNTH_IMPRESSIONS.fields + SYNTH_SNAPSHOT,
    partition_by=("date",),
    doc="Legacy fat-row log: each impression carries its user's sequence snapshot.",
)

SYNTH_ACTIONS = TableSchema(
    "actions",
    (
        Field("date", d, False),
        Field("uid", i64, False),
        Field("iid", i64, False),
        Field("ts", i64, False, "epoch ms"),
        Field("bits", i64, False, "action bits (bit 0 click, bit 1 like)"),
        Field("cat", i32, False),
        Field("auth", i64, False),
    ),
    partition_by=("date",),
    doc="Optional separate action log (searches, purchases, ... from other surfaces).",
)

# --------------------------------------------------------------------------
# Quarantine and bookkeeping
# --------------------------------------------------------------------------
QUARANTINE = TableSchema(
    "quarantine",
    (
        Field("date", d, True, "UTC day of the row's time (null when the time is unreadable)"),
        Field("source", s, False, "impressions | actions"),
        Field("reason", s, False, "machine-readable reason, one of schemas.REASONS, e.g. null_user, bad_label"),
        Field("column", s, True, "the offending column"),
        Field("detail", s, True, "a human-readable explanation"),
        Field("input_file", s, True),
        Field("input_row", i64, True, "row index within input_file"),
        Field("row", s, False, "the whole input row as JSON: nothing is lost"),
    ),
    partition_by=("date",),
    doc="Every rejected input row with a reason.",
)

HISTORY_LOG = TableSchema(
    "history_log",
    (
        Field("date", d, False, "the date whose MERGE produced this version"),
        Field("version", i64, False, "Delta version of `history` after that date's MERGE"),
        Field("written_at", pa.timestamp("us", tz="UTC"), False),
    ),
    doc="Per date, the history table's Delta version: the start of the next window.",
)

MANIFEST_SHARD = TableSchema(
    "manifest_shard",
    (
        Field("path", s, False, "relative to the shard set root, e.g. node=0/shard-00000.parquet"),
        Field("node", i32, False),
        Field("rank", i32, False, "the local rank the shard was balanced for"),
        Field("rows", i64, False),
        Field("events", i64, False),
        Field("impressions", i64, False),
        Field("cost", i64, False, "events + impressions"),
        Field("bytes", i64, False),
        Field("row_groups", i32, False),
        Field("sha256", s, False, "content checksum of the file"),
        Field("gds_path", s, True, "the raw side file (gds layout)"),
        Field("gds_bytes", i64, True),
        Field("gds_sha256", s, True),
    ),
    doc="One entry per shard in manifest.json (see MANIFEST_KEYS).",
)

MANIFEST_KEYS = {
    "format_version": "int: the shard format version",
    "nodes": "int",
    "ranks_per_node": "int",
    "seed": "int",
    "layout": "parquet | gds",
    "compression": "the codec per Parquet leaf column",
    "dictionary": "all | scalars (which columns are dictionary-encoded)",
    "row_group_rows": "int: rows per row group (at most)",
    "schema_fingerprint": "sha256/16 of the shard schema",
    "schema": "the Arrow schema as a list of [name, type, nullable]",
    "roles": "the layout's roles (column names by role)",
    "source": "{'table': samples path, 'version': Delta version}",
    "sets": "list of MANIFEST_SET_KEYS entries, in training order",
    "shards": "list of MANIFEST_SHARD rows (each with its set's id as 'set')",
}

MANIFEST_SET_KEYS = {
    "id": "kind/window_end, e.g. incremental/2026-01-02",
    "kind": "incremental | pretrain",
    "window_start": "YYYY-MM-DD",
    "window_end": "YYYY-MM-DD (exclusive)",
    "rows": "int: samples in the set",
    "cost": "int: events + impressions in the set",
    "shards_per_rank": "int",
    "balance": "{'rank_cost': [...], 'rank_rows': [...], 'max_dev': float, 'within_bound': bool, "
               "'max_sample_cost': int}",
}


# --------------------------------------------------------------------------
# Layout-dependent tables
# --------------------------------------------------------------------------
def _orig(prefix: str, cols) -> tuple[Field, ...]:
    return tuple(Field(prefix + f.name, f.type, True) for f in cols)


def _orig_lists(prefix: str, cols) -> tuple[Field, ...]:
    return tuple(Field(prefix + f.name, list_of(f.type), False) for f in cols)


def event_fields(layout: Layout) -> tuple[Field, ...]:
    """Sequence events with their full sort key (action_time, request_time,
    request_id, position, item, action bits, features), nulls first."""
    out = [
        Field(EV + "ts", i64, False, "action time in time_unit"),
        Field(EV + "req_time", i64, True, "null for action-log events"),
        Field(EV + "req_id", layout.request_key_type, True),
        Field(EV + "pos", i64, True),
    ]
    for sf in layout.seq_fields:
        if sf.name == "ts":
            continue
        out.append(Field(EV + sf.name, sf.type, True))
    return tuple(out)


def sort_key(layout: Layout) -> list[str]:
    """The stream's total order, as event column names."""
    keys = [EV + "ts", EV + "req_time", EV + "req_id", EV + "pos", EV + "item"]
    if not layout.fat:
        keys.append(EV + "action")
    keys += [EV + sf.name for sf in layout.seq_fields if EV + sf.name not in keys]
    return keys


def requests_schema(layout: Layout) -> TableSchema:
    snap: tuple[Field, ...] = ()
    if layout.fat:
        snap = tuple(Field(SNAP + sf.name, list_of(sf.type), True) for sf in layout.snapshot)
    return TableSchema(
        "requests",
        fields(
            Field("date", d, False, "UTC day of request_time"),
            Field("user", layout.user.type, False),
            Field("req_id", layout.request_key_type, False),
            Field("req_time", i64, False, "request time in time_unit"),
            Field("num_imps", i32, False),
            _orig(REQ, layout.stored_request_columns),
            _orig_lists(IMP, layout.impression_columns),
            Field("imp_pos", list_of(i64), False, "canonical display order"),
            Field("imp_action_time", list_of(i64), False, "action time in time_unit"),
            Field("imp_action", list_of(i64), False, "action bits per impression"),
            snap,
        ),
        partition_by=("date",),
        doc="One row per request; impressions as struct-of-arrays in display order.",
    )


def events_schema(layout: Layout) -> TableSchema:
    return TableSchema(
        "events",
        fields(
            Field("date", d, False, "source date: the request's day, or the action log's day"),
            Field("user", layout.user.type, False),
            event_fields(layout),
        ),
        partition_by=("date",),
        doc="The action stream, one row per event (internal).",
    )


def history_schema(layout: Layout) -> TableSchema:
    return TableSchema(
        "history",
        fields(
            Field("user", layout.user.type, False),
            Field("last_event_date", d, False, "UTC day of the user's newest event"),
            Field("num_events", i32, False),
            tuple(Field(f.name, list_of(f.type), False) for f in event_fields(layout)),
        ),
        doc="Per user, the newest H events of the stream, in stream order (kept by MERGE).",
    )


def samples_schema(layout: Layout) -> TableSchema:
    seq = tuple(Field(SEQ + sf.name, list_of(sf.type), False) for sf in layout.seq_fields)
    fat: tuple[Field, ...] = ()
    if layout.fat:
        fat = (
            Field("req_snapshot", list_of(i8), False, "0: slice, 1: override, 2: null snapshot"),
            Field(OVR + "req", list_of(i32), False, "request index of each override"),
            Field(OVR + "offsets", list_of(i32), False, "len(overrides)+1 offsets into ovr_<field>"),
        ) + tuple(Field(OVR + sf.name, list_of(sf.type), False) for sf in layout.seq_fields)
    return TableSchema(
        "samples",
        fields(
            Field("format_version", i32, False),
            Field("sample_id", i64, False, "xxhash64(kind, window_end, user, chunk)"),
            Field("kind", s, False, "pretrain | incremental"),
            Field("window_start", d, False),
            Field("window_end", d, False, "exclusive"),
            Field("user", layout.user.type, False),
            Field("chunk", i32, False, "0.. for users split by max_sample_cost"),
            Field("num_requests", i32, False),
            Field("num_impressions", i32, False),
            Field("num_events", i32, False, "stored events"),
            Field("cost", i64, False, "stored events (overrides included) + impressions"),
            seq,
            Field("req_id", list_of(layout.request_key_type), False),
            Field("req_time", list_of(i64), False),
            Field("req_seq_begin", list_of(i32), False, "request r sees seq[begin:end]"),
            Field("req_seq_end", list_of(i32), False),
            Field("req_num_imps", list_of(i32), False),
            _orig_lists(REQ, layout.stored_request_columns),
            _orig_lists(IMP, layout.impression_columns),
            fat,
        ),
        partition_by=("kind", "window_end"),
        doc="One row per (user, window, chunk): one stored sequence, requests point into it.",
        metadata={"roles": layout.roles()},
    )


def shard_schema(layout: Layout) -> TableSchema:
    """Shards hold sample rows; partition columns are kept as plain columns."""
    base = samples_schema(layout)
    return TableSchema(
        "shard", base.fields, partition_by=(), doc="Per-node Parquet shard rows.", metadata=base.metadata
    )
