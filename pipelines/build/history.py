"""The user history table: per user the newest H events, kept by a daily MERGE.

A small ``history_log`` table records, per date, the history's Delta version
after that date's MERGE: the window starting the next day reads the history
at that version (time travel). Rerunning an older date restores the version
of the day before and replays the later dates.
"""

from __future__ import annotations

import datetime as dt
import os

from pyspark.sql import DataFrame, Window
from pyspark.sql import functions as F

from userwise import schemas as S
from userwise.pipelines.build.ingest import day_of, day_start
from userwise.pipelines.build.pointer import bucket_of, event_cols
from userwise.pipelines.config import Config
from userwise.pipelines.errors import UserwiseError
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
    ups = cfg.units_per_second
    cond = F.col(EV + "ts") < F.lit(day_start(end, ups))
    if start is not None:
        cond = cond & (F.col(EV + "ts") >= F.lit(day_start(start, ups)))
    return events.where(cond)


class History:
    """The history table and its version log under one build folder."""

    def __init__(self, spark, cfg: Config, layout: Layout, output: str):
        self.spark, self.cfg, self.layout = spark, cfg, layout
        self.path = delta_io.table_path(output, "history")
        self.log_path = delta_io.table_path(output, "history_log")
        self.events_path = delta_io.table_path(output, "events")

    # -- the log --------------------------------------------------------------
    def log(self) -> dict[dt.date, int]:
        if not os.path.isdir(os.path.join(self.log_path, "_delta_log")):
            return {}
        t = delta_io.read_small(self.log_path, ["date", "version"])
        return {d: int(v) for d, v in zip(t.column("date").to_pylist(), t.column("version").to_pylist())}

    def _record(self, date: dt.date, retention_days: int) -> int:
        import pyarrow as pa

        v = delta_io.version(self.spark, self.path)
        row = pa.Table.from_pylist([{"date": date, "version": v, "written_at": dt.datetime.now(dt.timezone.utc)}],
                                   schema=S.HISTORY_LOG.to_arrow())
        delta_io.write_small(self.log_path, row, f"date = '{date.isoformat()}'")
        return v

    def _drop_log_from(self, date: dt.date) -> None:
        delta_io.delete_small(self.log_path, f"date >= '{date.isoformat()}'")

    def version_before(self, date: dt.date) -> int | None:
        """Delta version holding the history as of the start of ``date`` (None: empty history)."""
        log = self.log()
        prev = date - dt.timedelta(days=1)
        if prev in log:
            return log[prev]
        if not log or min(log) > prev:
            return None
        raise UserwiseError(
            f"history: no version logged for {prev} (logged: {min(log)}..{max(log)}); "
            f"run `userwise history --date {prev}` first")

    def at(self, version: int | None) -> DataFrame:
        if version is None:
            return self.spark.createDataFrame([], S.history_schema(self.layout).to_spark())
        return delta_io.read(self.spark, self.path, version)

    # -- writes ----------------------------------------------------------------
    def seed(self, date: dt.date, retention_days: int = DEFAULT_RETENTION_DAYS) -> int:
        """History as of the end of ``date`` in one job from the events table (range builds)."""
        events = delta_io.read(self.spark, self.events_path)
        hist = newest(self.cfg, self.layout, events_between(self.cfg, events, None,
                                                           date + dt.timedelta(days=1)),
                      self.cfg.history_length)
        delta_io.replace(hist, self.path, None, schema=S.history_schema(self.layout),
                         properties=delta_io.retention_properties(retention_days))
        self._drop_log_from(dt.date(1970, 1, 1))
        return self._record(date, retention_days)

    def _merge_one(self, date: dt.date, retention_days: int) -> int:
        events = delta_io.read(self.spark, self.events_path)
        day = events_between(self.cfg, events, date, date + dt.timedelta(days=1))
        exists = delta_io.exists(self.spark, self.path)
        base = delta_io.read(self.spark, self.path) if exists else self.at(None)
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
        return self._record(date, retention_days)

    def update(self, date: dt.date, retention_days: int = DEFAULT_RETENTION_DAYS) -> dict:
        """MERGE ``date``; a date at or before the newest restores and replays (idempotent)."""
        log = self.log()
        replay: list[dt.date] = []
        if log and max(log) >= date:
            replay = sorted(d for d in log if d > date)
            before = self.version_before(date)
            if before is None:
                # Nothing before this date: start the table over.
                empty = self.at(None)
                delta_io.replace(empty, self.path, None, schema=S.history_schema(self.layout))
            else:
                delta_io.restore(self.spark, self.path, before)
            self._drop_log_from(date)
        elif log:
            self.version_before(date)  # refuses a gap
        versions = {date.isoformat(): self._merge_one(date, retention_days)}
        for d in replay:
            versions[d.isoformat()] = self._merge_one(d, retention_days)
        return {"history_versions": versions, "replayed": [d.isoformat() for d in replay]}
