"""Input log -> validated canonical rows -> requests, events and quarantine.

Every input row ends in exactly one place: rejected (quarantine, with a
reason), left for a later build (request time at or after as-of), or accepted
(a request's impression). Rejected rows contribute no actions.

Canonical columns added to the user's columns (all prefixed ``_``):
``_user, _req, _rt (request time in time_unit), _at (action time), _item,
_pos, _bits (action bits), _date (UTC day of _rt)``, and with an arrival column
``_arv`` (its value in time units, null where the row has none).

Arrival times (lean input, docs/pointer.md): an event's arrival is its arrival
column's value, or its action time + availability_lag where the log has none (or
the value is null, under ``null_arrival: lag``); the events carry it as ``ev_arrival``.
"""

from __future__ import annotations

from dataclasses import dataclass

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F
from pyspark.sql import types as T

from userwise import schemas as S
from userwise.pipelines.config import SECONDS_PER_DAY, Config, time_range
from userwise.schemas import EV, IMP, REQ, SNAP, Layout
from userwise.schemas import reasons as R
from userwise.schemas.layout import field_name, input_name


@dataclass(frozen=True)
class Canon:
    """Canonicalised input: the DataFrame plus what the layout needs."""

    df: DataFrame
    layout: Layout
    input_cols: tuple[str, ...]


def _to_units(c: Column, t: T.DataType, ups: int, source=None) -> Column:
    """An input time in time units (``ups`` per second): an integer epoch is taken as it is,
    a timestamp (zoned or not: UTC) converted; ``source`` (the input's Arrow type) tells a
    nanosecond timestamp, which Spark reads as int64."""
    import pyarrow as pa

    if source is not None and pa.types.is_timestamp(source) and source.unit == "ns" \
            and isinstance(t, T.LongType):
        return F.floor(c / F.lit(1_000_000_000 // ups)).cast("long")
    if isinstance(t, (T.TimestampType, T.TimestampNTZType)):
        micros = F.unix_micros(c.cast("timestamp"))
        return F.floor(micros / F.lit(1_000_000 // ups)).cast("long") if ups < 1_000_000 else micros
    return c.cast("long")


def day_of(units: Column, ups: int) -> Column:
    """UTC date of an epoch time in time units."""
    return F.date_from_unix_date(F.floor(units / F.lit(ups * SECONDS_PER_DAY)).cast("int"))


def _bits(cols: list[str]) -> Column:
    e = F.lit(0).cast("long")
    for i, c in enumerate(cols):
        e = e + F.when(F.col(c).cast("double") > 0, F.lit(1 << i)).otherwise(0).cast("long")
    return e


def source_schema(df: DataFrame, input_cols) -> "pa.Schema":  # noqa: F821
    """The input's own schema (names and Arrow types) of a frame from inputs.read_spark,
    whose columns carry it in their metadata (else: the Spark types' Arrow form)."""
    import pyarrow as pa

    from userwise.pipelines.builder.inputs import source_field
    from userwise.schemas.core import spark_to_arrow

    fields = []
    for f in df.schema.fields:
        if f.name in input_cols:
            src = source_field(f)
            fields.append(src if src is not None else pa.field(input_name(f.name), spark_to_arrow(f.dataType),
                                                               f.nullable))
    return pa.schema(fields)


def canonical(cfg: Config, df: DataFrame, input_cols: list[str]) -> Canon:
    """Add the canonical columns. ``df`` holds the input columns (storage names, as
    inputs.read_spark gives them) plus _file, _row."""
    layout = cfg.layout(source_schema(df, input_cols))
    sc = cfg.storage()
    ups = cfg.units_per_second
    types = {f.name: f.dataType for f in df.schema.fields}
    rt_col, at_col = sc.col("request_time"), sc.col("action_time")
    rt = _to_units(F.col(rt_col), types[rt_col], ups, layout.source_type(rt_col))
    at = _to_units(F.col(at_col), types[at_col], ups, layout.source_type(at_col)) if at_col else rt
    req = F.col(sc.col("request")) if sc.col("request") else rt
    pos = F.col(sc.col("position")).cast("long") if sc.col("position") else None
    out = df.select(
        "*",
        F.col(sc.col("user")).alias("_user"),
        req.alias("_req"),
        rt.alias("_rt"),
        at.alias("_at"),
        F.col(sc.col("item")).alias("_item"),
        _bits(list(sc.action_labels)).alias("_bits"),
    ).withColumn("_date", day_of(F.col("_rt"), ups))
    arv_col = sc.col("arrival_time")
    if arv_col:
        out = out.withColumn("_arv", _to_units(F.col(arv_col), types[arv_col], ups, layout.source_type(arv_col)))
    if pos is None:
        # Input order within the request: the row's place in its file.
        w = Window.partitionBy("_date", "_user", "_req").orderBy("_file", "_row").rowsBetween(
            Window.unboundedPreceding, Window.currentRow)
        out = out.withColumn("_pos", (F.row_number().over(w.rowsBetween(Window.unboundedPreceding,
                                                                          Window.currentRow)) - 1)
                             .cast("long"))
    else:
        out = out.withColumn("_pos", pos)
    return Canon(out, layout, tuple(input_cols))


# ---------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------
def _is_bad_number(c: Column, t: T.DataType) -> Column:
    if isinstance(t, (T.FloatType, T.DoubleType)):
        return c.isNull() | F.isnan(c) | (F.abs(c) == F.lit(float("inf")))
    return c.isNull()


def _outside(c: Column, lo: int, hi: int) -> Column:
    return (c < lo) | (c >= hi)


def row_reasons(cfg: Config, canon: Canon) -> DataFrame:
    """Per-row checks: adds ``_reason``, ``_column``, ``_detail`` (null when the row is fine)."""
    df = canon.df
    sc = cfg.storage()
    types = {f.name: f.dataType for f in df.schema.fields}
    lo, hi, outside = time_range(cfg)
    checks: list[tuple[Column, str, str, str]] = [
        (F.col("_user").isNull(), R.NULL_USER, cfg.col("user"), "user key is null"),
    ]
    if cfg.col("request"):
        checks.append((F.col("_req").isNull(), R.NULL_REQUEST, cfg.col("request"), "request key is null"))
    checks += [
        (F.col("_rt").isNull(), R.NULL_TIME, cfg.col("request_time"), "request time is null"),
        (_outside(F.col("_rt"), lo, hi), R.BAD_TIME, cfg.col("request_time"), f"request time {outside}"),
        (F.col("_item").isNull(), R.NULL_ITEM, cfg.col("item"), "item is null"),
    ]
    if cfg.col("position"):
        checks.append((F.col("_pos").isNull(), R.NULL_POSITION, cfg.col("position"), "position is null"))
    for c, s in zip(cfg.cols("labels"), sc.cols("labels")):
        checks.append((_is_bad_number(F.col(s), types[s]), R.BAD_LABEL, c, "label is null, NaN or infinite"))
    if cfg.col("action_time"):
        act = F.col("_bits") > 0
        checks.append((act & F.col("_at").isNull(), R.NULL_ACTION_TIME, cfg.col("action_time"),
                       "an action without an action time"))
        checks.append((act & _outside(F.col("_at"), lo, hi), R.BAD_TIME, cfg.col("action_time"),
                       f"action time {outside}"))
        checks.append((act & (F.col("_at") < F.col("_rt")), R.ACTION_BEFORE_REQUEST, cfg.col("action_time"),
                       "the action is timed before its own request"))
    if cfg.col("arrival_time"):
        checks += arrival_checks(cfg, F.col("_bits") > 0, cfg.col("arrival_time"), lo, hi, outside)
        checks.append(((F.col("_bits") > 0) & (F.col("_arv") < F.col("_rt")), R.ARRIVAL_BEFORE_REQUEST,
                       cfg.col("arrival_time"), "the action arrived before its own request"))
    if "date" in canon.input_cols and isinstance(types.get("date"), T.DateType):
        checks.append((F.col("_date") != F.col("date"), R.WRONG_PARTITION, "date",
                       "the row is filed under another day than its request time's UTC day"))
    return first_reason(df, checks)


def arrival_checks(cfg: Config, act: Column, column: str, lo: int, hi: int, outside: str) -> list:
    """The checks of an arrival column ``_arv`` on the rows that are actions (``act``): a null
    arrival (when ``null_arrival`` is quarantine), one outside the sane range, one earlier
    than its action time ``_at`` less ``arrival_skew``."""
    out = []
    if cfg.null_arrival == "quarantine":
        out.append((act & F.col("_arv").isNull(), R.NULL_ARRIVAL_TIME, column, "an action without an arrival time"))
    out.append((act & _outside(F.col("_arv"), lo, hi), R.BAD_TIME, column, f"arrival time {outside}"))
    out.append((act & (F.col("_arv") < F.col("_at") - F.lit(cfg.skew_units)), R.ARRIVAL_BEFORE_ACTION, column,
                f"the action arrived more than arrival_skew ({cfg.arrival_skew}) before its action time"))
    return out


def arrival(cfg: Config) -> Column:
    """An accepted event's arrival: its arrival column's value (``_arv``), else its action time
    ``_at`` + availability_lag."""
    return F.coalesce(F.col("_arv"), F.col("_at") + F.lit(cfg.lag_units)).cast("long")


def filled_arrival(cfg: Config, has_column: bool) -> Column:
    """Whether an accepted action's arrival comes from the lag (null arrival, ``null_arrival: lag``)."""
    if not has_column:
        return F.lit(False)
    return (F.col("_bits") > 0) & F.col("_arv").isNull() & F.col("_reason").isNull()


# The config key that governs each reason: what a refused build's error points to when one
# reason makes up most of the quarantine.
GOVERNING_KEYS = {
    R.BAD_TIME: "min_year, max_year and time_unit",
    R.WRONG_PARTITION: "time_unit (the rows' days follow from their request times)",
    R.REQUEST_USER_CONFLICT: "request_scope (user: ids are unique per user only)",
    R.NULL_USER: "columns.user", R.NULL_REQUEST: "columns.request", R.NULL_TIME: "columns.request_time",
    R.NULL_ITEM: "columns.item", R.NULL_POSITION: "columns.position", R.BAD_LABEL: "columns.labels",
    R.NULL_ACTION_TIME: "columns.action_time", R.ACTION_BEFORE_REQUEST: "columns.action_time",
    R.POSITION_CONFLICT: "columns.position", R.REQUEST_INCONSISTENT: "columns.context_features and user_features",
    R.SNAPSHOT_MISMATCH: "columns.sequence",
    R.NULL_ARRIVAL_TIME: "null_arrival (lag: a null arrival arrives at action time + availability_lag)",
    R.ARRIVAL_BEFORE_ACTION: "arrival_skew and the arrival column",
    R.ARRIVAL_BEFORE_REQUEST: "columns.arrival_time",
}


def limit_hint(quarantined: dict[str, int]) -> str:
    """For a refused build's error: the config key that governs the reason that makes up
    most (over half) of the quarantined rows, e.g. ``; 97% of them are bad_time: check
    min_year, max_year and time_unit``; empty when no reason dominates."""
    total = sum(quarantined.values())
    if not total:
        return ""
    reason, n = max(quarantined.items(), key=lambda kv: kv[1])
    key = GOVERNING_KEYS.get(reason)
    if n * 2 <= total or key is None:
        return ""
    return f"; {n / total:.0%} of them are {reason}: check {key}"


def first_reason(df: DataFrame, checks: list[tuple[Column, str, str | None, str]]) -> DataFrame:
    """Add _reason, _column, _detail: the first check (in order) that the row fails, else nulls."""
    reason = column = detail = F.lit(None).cast("string")
    for cond, r, c, d in reversed(checks):
        hit = F.coalesce(cond, F.lit(False))
        reason = F.when(hit, F.lit(r)).otherwise(reason)
        column = F.when(hit, F.lit(c)).otherwise(column)
        detail = F.when(hit, F.lit(d)).otherwise(detail)
    return df.select("*", reason.alias("_reason"), column.alias("_column"), detail.alias("_detail"))


def _mark(df: DataFrame, cond: Column, reason: str, column: str | None, detail: str) -> DataFrame:
    # the condition is evaluated once (a window condition used three times is three windows)
    hit = F.col("_hit")
    return (df.withColumn("_hit", F.col("_reason").isNull() & F.coalesce(cond, F.lit(False)))
              .withColumn("_column", F.when(hit, F.lit(column)).otherwise(F.col("_column")))
              .withColumn("_detail", F.when(hit, F.lit(detail)).otherwise(F.col("_detail")))
              .withColumn("_reason", F.when(hit, F.lit(reason)).otherwise(F.col("_reason")))
              .drop("_hit"))


def request_keys(cfg: Config) -> list[str]:
    """What makes a request: (UTC day, request id) when ids are unique across users
    (request_scope global or day), (day, user, request id) when they are unique per user
    (request_scope user), and (day, user, request time) without a request column. Each
    key holds one user and one request time, so (user, req_id, req_time) is unique in the
    requests table and (req_time, req_id) orders a user's requests totally."""
    if cfg.col("request") and cfg.request_scope != "user":
        return ["_date", "_req"]
    return ["_date", "_user", "_req"]


SNAP_KEEP = "_snap_keep"  # fat rows: the one accepted row per request that keeps the snapshot


def cross_row_reasons(cfg: Config, canon: Canon, df: DataFrame) -> DataFrame:
    """Checks across rows, on rows that passed the per-row checks."""
    layout = canon.layout
    rk = request_keys(cfg)
    # Every check below looks within one request (exact copies share their request key, and
    # so do two rows at one position): one shuffle by the request key serves them all, and the
    # windows (partitioned by supersets of it) and the requests' aggregation reuse it. Fat rows
    # are heavy: each extra shuffle of them costs about a Parquet write and read.
    # The windows share one sort as well: each one's key is a prefix of the first one's,
    # ``_ok`` (passed the per-row checks) is fixed once, and later marks are read through
    # conditional aggregates instead of re-partitioning by the changed reason.
    df = df.repartition(*[F.col(c) for c in rk]).withColumn("_ok", F.col("_reason").isNull())
    ok = F.col("_ok")
    has_pos = bool(cfg.col("position"))
    pos = [F.col("_pos")] if has_pos else []
    # Exact duplicates: the first copy (file order) is kept. Copies share the request, the
    # position (when it is a column) and the row hash; a row is a copy when it equals the row
    # before it in that group, compared whole (snapshots included, so a hash collision cannot
    # make two different rows copies: at worst the second one meets the position check).
    cols = [F.col(c) for c in canon.input_cols]
    df = df.withColumn("_h", F.xxhash64(*cols))
    wdup = Window.partitionBy(ok, *rk, *pos, "_h").orderBy("_file", "_row")
    row = F.struct(*cols)
    df = df.withColumn("_dup", F.coalesce(F.lag(row).over(wdup).eqNullSafe(row), F.lit(False)))
    df = _mark(df, F.col("_dup"), R.DUPLICATE_ROW, None, "an exact copy of an earlier row")
    # Request-level checks share one window over the request's rows: a request claimed by
    # two users, request-level columns that disagree, and (fat rows) impressions that carry
    # different snapshots. Each rejects the whole request; the first that applies names the
    # reason. (The copies just marked are equal to a kept row: they change no min or max.)
    wreq = Window.partitionBy(ok, *rk).rowsBetween(Window.unboundedPreceding, Window.unboundedFollowing)
    differs = lambda key: ~F.min(key).over(wreq).eqNullSafe(F.max(key).over(wreq))  # noqa: E731
    checks = []
    if cfg.col("request") and cfg.request_scope != "user":
        checks.append(("_c_user", differs(F.col("_user")), R.REQUEST_USER_CONFLICT, cfg.col("request"),
                       "the request id is used by more than one user"))
    req_cols = [f.name for f in layout.request_columns]
    if req_cols:
        key = F.struct(*[F.struct(F.col(c).isNull(), F.col(c)) for c in req_cols])
        checks.append(("_c_req", differs(key), R.REQUEST_INCONSISTENT, ",".join(map(input_name, req_cols)),
                       "request-level columns differ between the request's rows"))
    if layout.fat:
        snap = F.struct(*[F.struct(F.col(s.source).isNull(), F.col(s.source)) for s in layout.snapshot])
        checks.append(("_c_snap", differs(snap), R.SNAPSHOT_MISMATCH, ",".join(map(input_name, layout.snapshot_columns)),
                       "impressions of one request carry different snapshots"))
    if checks:
        df = df.select("*", *[c.alias(n) for n, c, *_ in checks])
        for n, _, reason, column, detail in checks:
            df = _mark(df, F.col(n), reason, column, detail)
        df = df.drop(*[n for n, *_ in checks])
    if has_pos:
        # Two different rows at one (request, position), among the rows still accepted.
        # (Without a position column the position is the row's place in its request: unique.)
        wpos = Window.partitionBy(ok, *rk, "_pos").rowsBetween(Window.unboundedPreceding, Window.unboundedFollowing)
        live = F.count(F.when(F.col("_reason").isNull(), F.lit(1))).over(wpos)
        df = _mark(df, live > 1, R.POSITION_CONFLICT, cfg.col("position"),
                   "rows of one request share a position with different content")
    if layout.fat:
        # All accepted rows of a request carry one snapshot (proven above): only the first
        # accepted row keeps it, so what is cached and aggregated downstream holds one snapshot
        # per request, not one per impression. Rejected rows keep theirs (quarantine keeps the
        # whole row). Same partition and order as the duplicate window: no extra sort.
        wfirst = Window.partitionBy(ok, *rk).orderBy(*pos, "_h", "_file", "_row").rowsBetween(
            Window.unboundedPreceding, Window.currentRow)
        acc = F.col("_reason").isNull()
        df = df.withColumn(SNAP_KEEP, acc & (F.count(F.when(acc, F.lit(1))).over(wfirst) == 1))
        keep = F.col(SNAP_KEEP) | ~acc
        for c in layout.snapshot_columns:
            df = df.withColumn(c, F.when(keep, F.col(c)))
    return df.drop("_dup", "_ok", "_h")


def quarantine_rows(df: DataFrame, input_cols: tuple[str, ...], source: str) -> DataFrame:
    """Rejected rows in the QUARANTINE schema; the whole row is kept as JSON."""
    date = F.col("_date")
    if "date" in input_cols:
        date = F.coalesce(F.col("_date"), F.col("date").cast("date"))
    return df.where(F.col("_reason").isNotNull()).select(
        date.alias("date"),
        F.lit(source).alias("source"),
        F.col("_reason").alias("reason"),
        F.col("_column").alias("column"),
        F.col("_detail").alias("detail"),
        F.col("_file").alias("input_file"),
        F.col("_row").alias("input_row"),
        F.to_json(F.struct(*[F.col(c).alias(input_name(c)) for c in input_cols]),
                  {"ignoreNullFields": "false"}).alias("row"),
    )


# ---------------------------------------------------------------------------
# Requests and events
# ---------------------------------------------------------------------------
def requests_frame(cfg: Config, canon: Canon, accepted: DataFrame) -> DataFrame:
    """One row per request, impressions as struct-of-arrays in display order."""
    layout = canon.layout
    imp_cols = [f.name for f in layout.impression_columns]
    req_cols = [f.name for f in layout.stored_request_columns]  # the request key and an int64 time are req_id/req_time
    # Display order is the position alone: positions are unique among a request's accepted
    # rows (copies and conflicts are quarantined; without a position column it is the row's
    # place in its file). No file name per impression in the sort.
    imp = F.struct(
        F.col("_pos").alias("p"),
        F.col("_at").alias("at"),
        F.col("_bits").alias("bits"),
        *[F.col(c).alias(f"c{i}") for i, c in enumerate(imp_cols)],
    )
    aggs = [F.sort_array(F.collect_list(imp)).alias("_imps"), F.count(F.lit(1)).cast("int").alias("num_imps")]
    aggs += [F.first(c, ignorenulls=False).alias(REQ + c) for c in req_cols]
    if layout.fat:
        # the snapshot of the request's one row that kept it (see cross_row_reasons); its
        # fields may be null (a null snapshot), the struct is not
        snap = F.struct(*[F.col(s.source).alias(s.name) for s in layout.snapshot])
        aggs.append(F.first(F.when(F.col(SNAP_KEEP), snap), ignorenulls=True).alias("_snap"))
    # grouped by the canonical columns themselves (renamed after): the shuffle by request key
    # of the cross-row checks already clusters them, so this aggregation needs no shuffle.
    g = accepted.groupBy("_date", "_user", "_req", "_rt").agg(*aggs).withColumnsRenamed(
        {"_date": "date", "_user": "user", "_req": "req_id", "_rt": "req_time"})
    sel = [F.col("date"), F.col("user"), F.col("req_id"), F.col("req_time"), F.col("num_imps")]
    sel += [F.col(REQ + c) for c in req_cols]
    sel += [F.col(f"_imps.c{i}").alias(IMP + c) for i, c in enumerate(imp_cols)]
    sel += [F.col("_imps.p").alias("imp_pos"), F.col("_imps.at").alias("imp_action_time"),
            F.col("_imps.bits").alias("imp_action")]
    if layout.fat:
        sel += [F.col(f"_snap.{s.name}").alias(SNAP + s.name) for s in layout.snapshot]
    return g.select(sel)


def impression_events(cfg: Config, canon: Canon, accepted: DataFrame) -> DataFrame:
    """Actions of accepted impressions: the lean stream's own events."""
    layout = canon.layout
    cols = [
        F.col("_date").alias("date"), F.col("_user").alias("user"), F.col("_at").alias(EV + "ts"),
        F.col("_rt").alias(EV + "req_time"), F.col("_req").alias(EV + "req_id"), F.col("_pos").alias(EV + "pos"),
        F.col("_item").alias(EV + "item"),
    ]
    cols += [F.col(f.name).alias(EV + field_name(f.name)) for f in layout.item_features]
    cols.append(F.col("_bits").alias(EV + "action"))
    if layout.arrivals:
        if "_arv" not in accepted.columns:  # only the action log has an arrival column
            accepted = accepted.withColumn("_arv", F.lit(None).cast("long"))
        cols.append(arrival(cfg).alias(EV + "arrival"))
    return accepted.where(F.col("_bits") > 0).select(cols)


def action_log(cfg: Config, layout: Layout, df: DataFrame) -> tuple[DataFrame, DataFrame]:
    """A separate action log -> (valid events in the events schema, rows with a reason).
    ``df``: the log as inputs.read_spark gives it (columns under their storage names)."""
    from userwise.pipelines.builder.inputs import source_field

    a = cfg.storage().actions
    ups = cfg.units_per_second
    types = {f.name: f.dataType for f in df.schema.fields}
    src_t = source_field(df.schema[a.time])
    ts = _to_units(F.col(a.time), types[a.time], ups, None if src_t is None else src_t.type)
    if isinstance(a.labels, tuple):
        bits = _bits(list(a.labels))
        label_cols = list(a.labels)
    else:
        bits = F.col(a.labels).cast("long")
        label_cols = [a.labels]
    lo, hi, outside = time_range(cfg)
    x = df.select("*", F.col(a.user).alias("_user"), ts.alias("_at"), F.col(a.item).alias("_item"),
                  bits.alias("_bits"))
    if a.arrival is not None:
        # a log with arrival times is filed by arrival: its day is the arrival's UTC day, so a
        # daily job takes the events that arrived that day (and an event is ingested before
        # any request can see it)
        src_a = source_field(df.schema[a.arrival])
        x = x.withColumn("_arv", _to_units(F.col(a.arrival), types[a.arrival], ups,
                                           None if src_a is None else src_a.type))
        # (an arrival outside the sane range is quarantined: that row is filed by its action time)
        lo_, hi_, _ = time_range(cfg)
        x = x.withColumn("_date", day_of(F.when(_outside(arrival(cfg), lo_, hi_), F.col("_at"))
                                         .otherwise(arrival(cfg)), ups))
    else:
        x = x.withColumn("_date", day_of(F.col("_at"), ups))
    checks = [
        (F.col("_user").isNull(), R.NULL_USER, input_name(a.user), "user key is null"),
        (F.col("_at").isNull(), R.NULL_TIME, input_name(a.time), "action time is null"),
        (_outside(F.col("_at"), lo, hi), R.BAD_TIME, input_name(a.time), f"action time {outside}"),
        (F.col("_item").isNull(), R.NULL_ITEM, input_name(a.item), "item is null"),
    ]
    checks += [(_is_bad_number(F.col(c), types[c]), R.BAD_LABEL, input_name(c), "label is null, NaN or infinite")
               for c in label_cols]
    if a.arrival is not None:
        checks += arrival_checks(cfg, F.col("_bits") > 0, input_name(a.arrival), lo, hi, outside)
    x = first_reason(x, checks)
    ok = x.where(F.col("_reason").isNull() & (F.col("_bits") > 0))
    ev_types = {f.name: f.type for f in S.event_fields(layout)}
    cols = [
        F.col("_date").alias("date"), F.col("_user").alias("user"), F.col("_at").alias(EV + "ts"),
        F.lit(None).cast("long").alias(EV + "req_time"),
        F.lit(None).cast(S.arrow_to_spark(ev_types[EV + "req_id"])).alias(EV + "req_id"),
        F.lit(None).cast("long").alias(EV + "pos"),
        F.col("_item").cast(S.arrow_to_spark(ev_types[EV + "item"])).alias(EV + "item"),
    ]
    for f, src in zip(layout.item_features, a.item_features):
        cols.append(F.col(src).cast(S.arrow_to_spark(f.type)).alias(EV + field_name(f.name)))
    cols.append(F.col("_bits").alias(EV + "action"))
    if layout.arrivals:
        if a.arrival is None:
            ok = ok.withColumn("_arv", F.lit(None).cast("long"))
        cols.append(arrival(cfg).alias(EV + "arrival"))
    return ok.select(cols), x
