"""The stream as of any date, derived from the events table, and the history table.

The events table is the truth. A window's stored stream is, per user, the
newest L events strictly before its start (L = max_seq_len: all that a request
of the window can see of the past) plus its own events, both moved back by the
config's availability lag; the history as of a date D is the newest H events
strictly before D (the stream's state once the day is over: no lag). With an arrival
column both go by arrival instead: a window's stream is the newest L events that arrived
before its start plus those that arrived within it, the history as of D the newest H that
arrived before D, each in arrival order (docs/pointer.md). Both are one Spark
computation over the events for any number of dates (the sample sets'
streams in :func:`pointer.lean_sets`, the history in :func:`newest`): nothing
replays days or reads an old Delta version.

The history table is a cache that the daily job keeps with one MERGE per
date. ``history_log`` records, per date a history job ran for, the table's
Delta version after it; its newest date is the day the table is as of (end
of). Rerunning a date at or before that day derives the history as of that
day from the events in one job.
"""

from __future__ import annotations

import datetime as dt

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F

from userwise import schemas as S
from userwise.pipelines.builder.ingest import day_of
from userwise.pipelines.builder.pointer import bucket_of, event_cols
from userwise.pipelines.config import Config, day_start
from userwise.pipelines.errors import UserwiseError
from userwise.pipelines.records import state
from userwise.pipelines.runtime import delta_io
from userwise.schemas import EV, Layout

DEFAULT_RETENTION_DAYS = 37


def _ordered(layout: Layout, df: DataFrame, desc: bool):
    keys = S.sort_key(layout)
    return [F.col(k).desc_nulls_last() if desc else F.col(k).asc_nulls_first() for k in keys]


def newest(cfg: Config, layout: Layout, events: DataFrame, H: int) -> DataFrame:
    """Per user, the newest H events as one history row (arrays in stream order)."""
    keys = S.sort_key(layout)
    cols = event_cols(layout)
    e = events.select("user", *cols)
    if layout.fat:
        # Snapshot events repeat across days: identity is the full tuple (ev_pos = occurrence).
        e = e.distinct()
    e = e.withColumn("_sk", bucket_of(F.col(EV + "ts"), cfg))
    w1 = Window.partitionBy("user", "_sk").orderBy(*_ordered(layout, e, True))
    e = e.withColumn("_rn", F.row_number().over(w1)).where(F.col("_rn") <= H)
    w2 = Window.partitionBy("user").orderBy(*_ordered(layout, e, True))
    e = e.withColumn("_rn", F.row_number().over(w2)).where(F.col("_rn") <= H)
    st = F.struct(*[F.col(k) for k in keys], *[F.col(c) for c in cols if c not in keys])
    g = e.groupBy("user").agg(F.sort_array(F.collect_list(st)).alias("_h"), F.max(EV + "ts").alias("_mx"))
    return g.select(
        "user",
        day_of(F.col("_mx"), cfg.units_per_second).alias("last_event_date"),
        F.size("_h").cast("int").alias("num_events"),
        *[F.col(f"_h.{c}").alias(c) for c in cols],
    )


def explode_history(layout: Layout, hist: DataFrame) -> DataFrame:
    """History rows back to one row per event (user + ev_* columns)."""
    cols = event_cols(layout)
    z = hist.select("user", F.explode(F.arrays_zip(*[F.col(c) for c in cols])).alias("_z"))
    return z.select("user", *[F.col(f"_z.{c}").alias(c) for c in cols])


def events_between(cfg: Config, events: DataFrame, start: dt.date | None, end: dt.date) -> DataFrame:
    """The events that reached the stream in days [start, end): by arrival where the events
    carry one (an arrival column), else by action time (the history is the stream's state
    once a day is over, no lag)."""
    ups = cfg.units_per_second
    t = F.col(EV + "arrival") if cfg.arrivals else F.col(EV + "ts")
    cond = t < F.lit(day_start(end, ups))
    if start is not None:
        cond = cond & (t >= F.lit(day_start(start, ups)))
    return events.where(cond)


class SetPlan:
    """Sample sets by their time bounds, on a calendar of UTC days.

    ``bounds``: per set (start, end) dates, start None for "from the beginning" (the
    pretrain set); ``times``: the same bounds in time units (a set holds the requests and
    events timed in [start, end)). Days from the first bound on are segments 0, 1, ...;
    everything before it is segment -1. A set covers the segments of its days, so a
    request's sets are a lookup by its day's segment (sets may overlap).
    """

    def __init__(self, cfg: Config, bounds: list[tuple[dt.date | None, dt.date]]):
        if not bounds:
            raise ValueError("no sample sets")
        self.bounds = bounds
        finite = [d for s_, e in bounds for d in (s_, e) if d is not None]
        self.d0, self.dend = min(finite), max(e for _, e in bounds)
        ups = cfg.units_per_second
        self.times = [(None if s_ is None else day_start(s_, ups), day_start(e, ups)) for s_, e in bounds]
        segs = (self.dend - self.d0).days
        first = [-1 if s_ is None else (s_ - self.d0).days for s_, _ in bounds]
        self.covers = {g: [j for j, (f, (_, e)) in enumerate(zip(first, bounds))
                           if f <= g < (e - self.d0).days] for g in range(-1, segs)}

    def segment_of_date(self, d: Column) -> Column:
        return F.when(d < F.lit(self.d0), F.lit(-1)).otherwise(F.datediff(d, F.lit(self.d0))).cast("int")

    def sets_of(self, segment: Column) -> Column:
        """The sets covering a segment (array<int>, empty when none)."""
        table = F.array(*[F.array(*[F.lit(j) for j in self.covers[g]]).cast("array<int>")
                          for g in sorted(self.covers)])
        return F.element_at(table, segment + 2)


def gap_detail(cfg: Config, date: dt.date) -> dict:
    """What ``userwise history`` needs to fill the day ``date`` (the hint of a gap in the log)."""
    return {"config": cfg.source, "date": date.isoformat()}


class History:
    """The history table and its log under one build folder."""

    def __init__(self, spark, cfg: Config, layout: Layout, build_dir: str):
        self.spark, self.cfg, self.layout, self.build_dir = spark, cfg, layout, build_dir
        self.path = delta_io.table_path(build_dir, "history")
        self.log_path = delta_io.table_path(build_dir, "history_log")
        self.events_path = delta_io.table_path(build_dir, "events")

    # -- the log --------------------------------------------------------------
    def log(self) -> dict[dt.date, int]:
        if not delta_io.has_log(self.log_path):
            return {}
        t = delta_io.read_small(self.log_path, ["date", "version"])
        return {d: int(v) for d, v in zip(t.column("date").to_pylist(), t.column("version").to_pylist())}

    def _record(self, dates: list[dt.date], since: dt.date | None = None) -> int:
        """Log ``dates`` at the table's current version, replacing the rows from ``since``
        (default: the first of ``dates``) on."""
        import pyarrow as pa

        v = delta_io.version(self.spark, self.path)
        now = dt.datetime.now(dt.timezone.utc)
        rows = pa.Table.from_pylist([{"date": d, "version": v, "written_at": now} for d in dates],
                                    schema=S.HISTORY_LOG.to_arrow())
        delta_io.write_small(self.log_path, rows, f"date >= '{(since or min(dates)).isoformat()}'")
        return v

    def empty(self) -> DataFrame:
        return self.spark.createDataFrame([], S.history_schema(self.layout).to_spark())

    # -- writes ----------------------------------------------------------------
    def derive(self, date: dt.date, retention_days: int = DEFAULT_RETENTION_DAYS,
               dates: list[dt.date] | None = None, since: dt.date | None = None) -> int:
        """The history as of the end of ``date``, derived from the events table in one job,
        replaces the table; ``dates`` (default: ``date``) are logged with its version, the
        log's rows from ``since`` on replaced (a range build passes its first day: the
        table holds nothing from before)."""
        events = delta_io.read(self.spark, self.events_path)
        hist = newest(self.cfg, self.layout, events_between(self.cfg, events, None, date + dt.timedelta(days=1)),
                      self.cfg.history_length)
        delta_io.replace(hist, self.path, None, schema=S.history_schema(self.layout),
                         properties=delta_io.retention_properties(retention_days))
        return self._record(dates or [date], since)

    def _merge_one(self, date: dt.date, retention_days: int) -> int:
        events = delta_io.read(self.spark, self.events_path)
        day = events_between(self.cfg, events, date, date + dt.timedelta(days=1))
        exists = delta_io.exists(self.spark, self.path)
        base = delta_io.read(self.spark, self.path) if exists else self.empty()
        touched = day.select("user").distinct()
        old = explode_history(self.layout, base.join(touched, on="user", how="inner"))
        updates = newest(self.cfg, self.layout, old.unionByName(day.select("user", *event_cols(self.layout))),
                         self.cfg.history_length)
        schema = S.history_schema(self.layout)
        if not exists:
            delta_io.replace(updates, self.path, None, schema=schema,
                             properties=delta_io.retention_properties(retention_days))
        else:
            st = schema.to_spark()
            updates = updates.select([F.col(f.name).cast(f.dataType) for f in st.fields])
            delta_io.merge_by_key(self.spark, self.path, updates, "user")
        return self._record([date])

    def _check_gap(self, log: dict, date: dt.date) -> None:
        if log and max(log) < date - dt.timedelta(days=1):
            prev = date - dt.timedelta(days=1)
            raise UserwiseError(
                f"history: no version logged for {prev} (logged: {min(log)}..{max(log)}); "
                f"run {state.describe('history', self.build_dir, gap_detail(self.cfg, prev))} first")

    def update_range(self, first: dt.date, last: dt.date, retention_days: int = DEFAULT_RETENTION_DAYS) -> dict:
        """What the daily updates of [first, last] in order leave, in one job: the history
        derived as of the end of ``last`` (or of the newest logged date, when later)."""
        log = self.log()
        self._check_gap(log, first)
        dates = [first + dt.timedelta(days=k) for k in range((last - first).days + 1)]
        later = sorted(d for d in log if d > last)
        v = self.derive(max(dates + later), retention_days, dates=dates + later)
        return {"history_versions": {d.isoformat(): v for d in dates + later},
                "replayed": [d.isoformat() for d in later]}

    def update(self, date: dt.date, retention_days: int = DEFAULT_RETENTION_DAYS) -> dict:
        """Bring the history to the end of ``date``: the next date is one MERGE; the first date
        (no log yet) and a date at or before the newest logged one (a rerun) derive the history
        from the events in one job, a rerun as of the newest date, so the later dates stay
        applied (idempotent)."""
        log = self.log()
        if not log or max(log) >= date:
            return self.update_range(date, date, retention_days)
        self._check_gap(log, date)
        return {"history_versions": {date.isoformat(): self._merge_one(date, retention_days)}, "replayed": []}
