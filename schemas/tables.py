"""Every table and file the product reads or writes.

Fixed tables are module constants; tables whose columns follow the user's
input (requests, events, history, samples, shards) are built from a
:class:`~userwise.schemas.layout.Layout`.
"""

from __future__ import annotations

import pyarrow as pa

from userwise.schemas.core import Field, TableSchema, fields, list_of
from userwise.schemas.labels import action_bits_property
from userwise.schemas.layout import EV, IMP, OVR, REQ, SEQ, SNAP, Layout, SeqField, input_name

i8, i32, i64, f32, f64, s, d = pa.int8(), pa.int32(), pa.int64(), pa.float32(), pa.float64(), pa.string(), pa.date32()

# --------------------------------------------------------------------------
# Inputs written by `userwise synth` (users map their own logs by config).
# --------------------------------------------------------------------------
BUILD_TABLES = ("requests", "events", "history", "history_log", "samples", "quarantine", "id_stats")
"""The Delta tables of a build folder, each in ``D/<name>``; their versions make its complete state."""


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
        Field("date", d, False, "UTC day of ts (partition)"),
        Field("uid", i64, False, "user id"),
        Field("iid", i64, False, "item id"),
        Field("ts", i64, False, "epoch ms"),
        Field("bits", i64, False, "action bits (bit 0 click, bit 1 like)"),
        Field("cat", i32, False, "item side-info: the item's category"),
        Field("auth", i64, False, "item side-info: the item's author"),
    ),
    partition_by=("date",),
    doc="Optional separate action log (searches, purchases, ... from other surfaces).",
)

# --------------------------------------------------------------------------
# Quarantine and bookkeeping
# --------------------------------------------------------------------------
DATE_LAYOUT = """The layout of `requests`, `events` and `quarantine`: not partitioned. A write orders
its rows by the table's ``order_by`` (date first) and range-partitions them into files that
Spark sizes by the data, so a file holds a contiguous run of dates and the number of files
follows the data, not the number of days. Readers that filter by date skip files by their
min/max statistics (Spark's data skipping, delta-rs' Arrow dataset), and ``replaceWhere`` on
dates replaces exactly those dates' rows, rewriting only the files whose runs hold them. A
table created with date partitions keeps them (Delta keeps a table's partitioning) and stays
readable and writable; build into an empty folder for this layout."""

QUARANTINE = TableSchema(
    "quarantine",
    (
        Field("date", d, True, "UTC day of the row's time (null when the time is unreadable)"),
        Field("source", s, False, "the input the row comes from: impressions or actions"),
        Field("reason", s, False, "machine-readable reason, one of schemas.REASONS, e.g. null_user, bad_label"),
        Field("column", s, True, "the offending column"),
        Field("detail", s, True, "a human-readable explanation"),
        Field("input_file", s, True, "the input file that holds the row"),
        Field("input_row", i64, True, "row index within input_file"),
        Field("row", s, False, "the whole input row as JSON: nothing is lost"),
    ),
    order_by=("date", "input_file", "input_row"),
    doc="Every rejected input row with a reason. Not partitioned: files hold runs of dates (DATE_LAYOUT).",
)

HISTORY_LOG = TableSchema(
    "history_log",
    (
        Field("date", d, False, "the date whose MERGE produced this version"),
        Field("version", i64, False, "Delta version of `history` after that date's MERGE"),
        Field("written_at", pa.timestamp("us", tz="UTC"), False, "when the date was logged (UTC)"),
    ),
    doc="Per date, the history table's Delta version: the start of the next window.",
)

ID_STATS = TableSchema(
    "id_stats",
    (
        Field("kind", s, False, "the sample set: pretrain or incremental (partition)"),
        Field("window_start", d, False, "the set's first day"),
        Field("window_end", d, False, "the day after the set (partition), as in samples"),
        Field("role", s, False, "the id column's role: item, item_feature, context_feature or user_feature"),
        Field("column", s, False, "the id column: the input's name (columns.item, or one of columns.id_features)"),
        Field("id", s, False, "the id, as a string (an integer id in decimal)"),
        Field("lookups", i64, False, "impressions of the set that carry the id: its lookups in a per-impression batch"),
        Field("requests", i64, False, "requests of the set that carry the id: its lookups when request features "
              "come once per request (VBE)"),
        Field("first_date", d, False, "the first day any request in the requests table carried the id in this column"),
        Field("first_seen", pa.bool_(), False, "no request before the set's first day carried the id: a new id "
              "to admit"),
        Field("rank", i64, False, "1 for the most looked-up id of (set, column), ties by id"),
        Field("tier", s, False, "hot (rank within hot_budget: data-parallel), warm (within hot_budget + "
              "warm_budget: sharded in GPU memory) or cold (CPU memory or SSD)"),
    ),
    partition_by=("kind", "window_end"),
    doc="Per sample set, id column and id: how often the build's samples look it up, whether it is new, "
    "and its hot/warm/cold tier (docs/embeddings.md). Partitioned by set, as the samples.",
)

MANIFEST_SHARD = TableSchema(
    "manifest_shard",
    (
        Field("path", s, False, "relative to the shard set root, e.g. node=0/shard-00000.parquet"),
        Field("node", i32, False, "the node the shard is for"),
        Field("rank", i32, False, "the local rank the shard was balanced for"),
        Field("rows", i64, False, "samples in the shard"),
        Field("events", i64, False, "stored events in the shard"),
        Field("impressions", i64, False, "impressions in the shard"),
        Field("cost", i64, False, "events + impressions"),
        Field("bytes", i64, False, "file size"),
        Field("row_groups", i32, False, "Parquet row groups in the file"),
        Field("sha256", s, False, "content checksum of the file"),
        Field("gds_path", s, True, "the raw side file (gds layout)"),
        Field("gds_bytes", i64, True, "size of the raw side file"),
        Field("gds_sha256", s, True, "content checksum of the raw side file"),
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
# Descriptions of the columns named after the input's; docs/tables.md ("The samples table") shows
# them with `<col>` and `<type>` in place of an input column's name and type.
REQ_DOC = "input column `{col}` ({type}), once per request"
IMP_DOC = "per impression, in display order: input column `{col}` ({type})"
SAMPLES_REQ_DOC = "per request: input column `{col}` ({type})"
SAMPLES_IMP_DOC = "per impression, requests in order (req_num_imps splits them): input column `{col}` ({type})"
SNAP_DOC = "fat rows: the request's snapshot, input list column `{col}` ({type})"
FEATURE_DOC = "item feature: input column `{col}` ({type})"
SNAPSHOT_FIELD_DOC = "elements of the fat rows' snapshot column `{col}` ({type})"
ACTION_DOC = ("action bits: bit i is set when action label i is > 0; the table property "
              "`userwise.action_bits` lists the labels in bit order (`userwise.schemas.action_bits`)")
SEQ_DOCS = {
    "ts": "action time, in time_unit",
    "item": "item id (the input's item column and type)",
    "action": ACTION_DOC,
    "arrival": "arrival time: when the event reached serving (the arrival column, else action time + "
               "availability_lag), in time_unit; the stream is in arrival order",
}
EVENT_LIST = "per event, oldest first: "
OVERRIDE_LIST = "fat rows, per override event (ovr_offsets splits them): "


def input_doc(template: str, layout: Layout, col: str) -> str:
    """``template`` filled with the input column stored as ``col``: its own name and type."""
    return template.format(col=input_name(col), type=layout.source_type(col))


def seq_doc(layout: Layout, sf: SeqField) -> str:
    """What one value of a sequence field is (a stored event's ``ts``, ``item``, ...)."""
    if layout.fat:
        return input_doc(SNAPSHOT_FIELD_DOC, layout, sf.source)
    if sf.source is not None:
        return input_doc(FEATURE_DOC, layout, sf.source)
    return SEQ_DOCS[sf.name]


MASK_COLUMNS = frozenset({"imp_action", EV + "action", SEQ + "action"})


def _properties(layout: Layout, flds: tuple[Field, ...]) -> dict[str, str]:
    """The table properties of a table with these fields: the action bits' label names when
    it holds a mask column."""
    return action_bits_property(layout.action_bits) if MASK_COLUMNS & {f.name for f in flds} else {}


def _orig(template: str, prefix: str, layout: Layout, cols) -> tuple[Field, ...]:
    return tuple(Field(prefix + f.name, f.type, True, input_doc(template, layout, f.name)) for f in cols)


def _orig_lists(template: str, prefix: str, layout: Layout, cols) -> tuple[Field, ...]:
    return tuple(Field(prefix + f.name, list_of(f.type), False, input_doc(template, layout, f.name))
                 for f in cols)


USER_DOC = "user key (the input's user column and type)"
REQUEST_KEY_DOC = "request key: the input's request column (its type), or req_time when none is mapped"


def event_fields(layout: Layout) -> tuple[Field, ...]:
    """Sequence events with their full sort key (action_time, request_time,
    request_id, position, item, action bits, features), nulls first; with an arrival
    column, ``ev_arrival`` (last) leads the key (:func:`sort_key`).

    Example::

        [f.name for f in event_fields(layout)][:3]   # ['ev_ts', 'ev_req_time', 'ev_req_id']
    """
    out = [
        Field(EV + "ts", i64, False, SEQ_DOCS["ts"]),
        Field(EV + "req_time", i64, True, "request time of the event's impression, in time_unit; "
              "null for action-log events"),
        Field(EV + "req_id", layout.request_key_type, True,
              "request key of the event's impression; null for action-log events"),
        Field(EV + "pos", i64, True, "display position of the event's impression; null for action-log events"),
    ]
    for sf in layout.seq_fields:
        if sf.name == "ts":
            continue
        out.append(Field(EV + sf.name, sf.type, sf.name != "arrival", seq_doc(layout, sf)))
    return tuple(out)


def sort_key(layout: Layout) -> list[str]:
    """The stream's total order, as event column names.

    Example::

        sort_key(layout)                       # ['ev_ts', 'ev_req_time', 'ev_req_id', 'ev_pos', ...]
    """
    keys = [EV + "ts", EV + "req_time", EV + "req_id", EV + "pos", EV + "item"]
    if layout.arrivals:
        # arrival order (docs/pointer.md): every request's view is a prefix of the stream
        keys.insert(0, EV + "arrival")
    if not layout.fat:
        keys.append(EV + "action")
    keys += [EV + sf.name for sf in layout.seq_fields if EV + sf.name not in keys]
    return keys


def requests_schema(layout: Layout) -> TableSchema:
    """The requests table: one row per request, its impressions' columns as lists.

    Example::

        requests_schema(layout).to_spark()
    """
    snap: tuple[Field, ...] = ()
    if layout.fat:
        snap = tuple(Field(SNAP + sf.name, list_of(sf.type), True, input_doc(SNAP_DOC, layout, sf.source))
                     for sf in layout.snapshot)
    flds = fields(
        Field("date", d, False, "UTC day of req_time"),
        Field("user", layout.user.type, False, USER_DOC),
        Field("req_id", layout.request_key_type, False, REQUEST_KEY_DOC),
        Field("req_time", i64, False, "request time, in time_unit"),
        Field("num_imps", i32, False, "impressions of the request: the length of every imp_* list"),
        _orig(REQ_DOC, REQ, layout, layout.stored_request_columns),
        _orig_lists(IMP_DOC, IMP, layout, layout.impression_columns),
        Field("imp_pos", list_of(i64), False, "per impression: display position (the canonical order)"),
        Field("imp_action_time", list_of(i64), False, "per impression: action time, in time_unit"),
        Field("imp_action", list_of(i64), False, "per impression: " + ACTION_DOC),
        snap,
    )
    return TableSchema(
        "requests", flds,
        order_by=("date", "user"),
        doc="One row per request; impressions as struct-of-arrays in display order. Not partitioned: "
        "files hold runs of dates (DATE_LAYOUT).",
        properties=_properties(layout, flds),
    )


def events_schema(layout: Layout) -> TableSchema:
    """The action stream's table: one row per event, with its full sort key.

    Example::

        events_schema(layout).to_arrow()
    """
    flds = fields(
        Field("date", d, False, "source day: the request's UTC day, or the action log's"),
        Field("user", layout.user.type, False, USER_DOC),
        event_fields(layout),
    )
    return TableSchema(
        "events", flds,
        order_by=("date", "user"),
        doc="The action stream, one row per event (internal). Not partitioned: files hold runs of "
        "dates (DATE_LAYOUT).",
        properties=_properties(layout, flds),
    )


def history_schema(layout: Layout) -> TableSchema:
    """The history table: per user, the newest H events of the stream, as lists.

    Example::

        history_schema(layout).to_delta()
    """
    flds = fields(
        Field("user", layout.user.type, False, USER_DOC),
        Field("last_event_date", d, False, "UTC day of the user's newest event"),
        Field("num_events", i32, False, "events in the lists (at most history_length)"),
        tuple(Field(f.name, list_of(f.type), False, EVENT_LIST + f.doc) for f in event_fields(layout)),
    )
    return TableSchema(
        "history", flds,
        doc="Per user, the newest H events of the stream, in stream order (kept by MERGE).",
        properties=_properties(layout, flds),
    )


def chain_fields(layout: Layout) -> tuple[SeqField, ...]:
    """The fields of a stored event its content hash covers, in order (the event chain,
    :mod:`userwise.schemas.hashing`): what the model reads of an event. Lean: the item, each
    item feature, the action bits (not the action or arrival time). Fat rows: the item, then
    every other snapshot role but the time, in the config's order.

    Example::

        [sf.name for sf in chain_fields(layout)]   # ['item', 'category', 'author', 'action']
    """
    if layout.fat:
        item = [sf for sf in layout.seq_fields if sf.name == "item"]
        return tuple(item + [sf for sf in layout.seq_fields if sf.name not in ("item", "time")])
    return tuple(sf for sf in layout.seq_fields if sf.name not in ("ts", "arrival"))


CHAIN_DOC = "(schemas.hashing: each event's hash over chain_fields, rolled from 42)"


def samples_schema(layout: Layout) -> TableSchema:
    """The samples table: one row per (user, window, chunk), the stored sequence once and
    every request's pointer into it (docs/shard-format.md).

    Example::

        samples_schema(layout).to_arrow().names[:4]
    """
    seq = tuple(Field(SEQ + sf.name, list_of(sf.type), False, EVENT_LIST + seq_doc(layout, sf))
                for sf in layout.seq_fields)
    fat: tuple[Field, ...] = ()
    if layout.fat:
        fat = (
            Field("req_snapshot", list_of(i8), False,
                  "fat rows, per request: its snapshot is 0: a slice seq_*[begin:end], 1: an override, 2: null"),
            Field(OVR + "req", list_of(i32), False, "fat rows, per override: the index of its request"),
            Field(OVR + "offsets", list_of(i32), False,
                  "fat rows: override k is ovr_*[offsets[k]:offsets[k+1]] (one more than the overrides)"),
        ) + tuple(Field(OVR + sf.name, list_of(sf.type), False, OVERRIDE_LIST + seq_doc(layout, sf))
                  for sf in layout.seq_fields)
    flds = fields(
        Field("format_version", i32, False, "userwise format version of the row (readers refuse a newer one)"),
        Field("sample_id", i64, False, "xxhash64(kind, window_end, user, chunk)"),
        Field("kind", s, False, "pretrain or incremental (partition)"),
        Field("window_start", d, False, "first day of the window"),
        Field("window_end", d, False, "day after the window: the window is [window_start, window_end) (partition)"),
        Field("user", layout.user.type, False, USER_DOC),
        Field("chunk", i32, False, "0, 1, ...: the user's chunks in time order, split by max_sample_cost"),
        Field("num_requests", i32, False, "requests in the sample: the length of every req_* list"),
        Field("num_impressions", i32, False, "impressions in the sample: the length of every imp__* list"),
        Field("num_events", i32, False, "stored events: the length of every seq_* list"),
        Field("cost", i64, False, "stored events (overrides included) + impressions"),
        seq,
        Field("chain_block", i32, False, "events per block of the event chain (the config's chain_block)"),
        Field("chain_checkpoints", list_of(i64), False,
              "per complete block of chain_block stored events, oldest first: the event chain's rolling hash "
              "after it " + CHAIN_DOC),
        Field("chain_end", i64, False, "the event chain's rolling hash after all num_events stored events "
              "(42 for none)"),
        Field("req_id", list_of(layout.request_key_type), False, "per request: " + REQUEST_KEY_DOC),
        Field("req_time", list_of(i64), False, "per request: request time, in time_unit; requests in time order"),
        Field("req_seq_begin", list_of(i32), False, "per request: it sees seq_*[begin:end]"),
        Field("req_seq_end", list_of(i32), False,
              "per request: end of what it sees, the stored events strictly before its request time "
              "(lean: less availability_lag)"),
        Field("req_num_imps", list_of(i32), False, "per request: its impressions, which split the imp__* lists"),
        _orig_lists(SAMPLES_REQ_DOC, REQ, layout, layout.stored_request_columns),
        _orig_lists(SAMPLES_IMP_DOC, IMP, layout, layout.impression_columns),
        fat,
    )
    return TableSchema(
        "samples", flds,
        partition_by=("kind", "window_end"),
        doc="One row per (user, window, chunk): one stored sequence, requests point into it. "
        "Partitioned by set: a set is what readers, preshard and publish select, and there are as "
        "many as the windows asked for (one file each), not one per day of input.",
        metadata={"roles": layout.roles()},
        properties=_properties(layout, flds),
    )


def shard_schema(layout: Layout) -> TableSchema:
    """Shards hold sample rows; partition columns are kept as plain columns.

    Example::

        shard_schema(layout).to_arrow()        # what preshard writes and the loader reads
    """
    base = samples_schema(layout)
    return TableSchema(
        "shard", base.fields, partition_by=(), doc="Per-node Parquet shard rows.", metadata=base.metadata
    )
