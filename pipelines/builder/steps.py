"""The steps of the chain that ``userwise build`` and the daily jobs share.

- :func:`ingest_range`: validate the input rows of a range of days and write the
  requests, events and quarantine of those days (one Spark job);
- :func:`set_samples`: the samples of any number of sets (the pretrain set and
  incremental windows) from one Spark plan, written in one commit, and their id
  statistics (:mod:`~userwise.pipelines.builder.id_stats`);
- :func:`pretrain_samples`, :func:`window_samples`: one set each.

The range build (:mod:`~userwise.pipelines.builder.build`) calls them once for all
its days and sets, the daily jobs (:mod:`~userwise.pipelines.builder.daily`) once per
day, so a range build and the daily jobs run one by one give the same tables.
"""

from __future__ import annotations

import datetime as dt
import time
from dataclasses import dataclass, field

from pyspark import StorageLevel
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from userwise import schemas as S
from userwise.pipelines import config as C
from userwise.pipelines.builder import id_stats, ingest
from userwise.pipelines.builder.history import SetPlan
from userwise.pipelines.builder.inputs import read_spark
from userwise.pipelines.builder.pointer import SET, lean_sets
from userwise.pipelines.errors import QuarantineLimitError
from userwise.pipelines.records import build_record
from userwise.pipelines.runtime import delta_io, progress
from userwise.schemas import EV


def log(msg: str) -> None:
    progress.say(msg)


def as_date(s) -> dt.date:
    return s if isinstance(s, dt.date) else dt.date.fromisoformat(str(s))


@dataclass
class Ingested:
    layout: S.Layout
    counts: dict = field(default_factory=dict)


def _date_filter(df: DataFrame, cfg: C.Config, start: dt.date | None, end: dt.date | None) -> DataFrame:
    """Partition pruning on the input's `date` column when it has one."""
    if "date" not in df.columns:
        return df
    cond = F.lit(True)
    if start is not None:
        cond = cond & (F.col("date") >= F.lit(start))
    if end is not None:
        cond = cond & (F.col("date") < F.lit(end))
    return df.where(cond)


def ingest_range(spark, cfg: C.Config, input_path: str, build_dir: str, start: dt.date | None, end: dt.date,
                 actions_path: str | None = None, as_of: dt.date | None = None) -> Ingested:
    """Validate input rows of days [start, end) (all days when start is None) and write
    requests, events and quarantine for those days. Rows at or after ``as_of`` are counted
    and left alone."""
    t0 = time.monotonic()
    raw = read_spark(spark, input_path)
    input_cols = [c for c in raw.columns if c not in ("_file", "_row")]
    canon = ingest.canonical(cfg, raw, input_cols)
    layout = canon.layout
    build_record.save(build_dir, cfg, layout)
    ups = cfg.units_per_second
    df = canon.df
    if start is not None:
        # A daily job reads its own partition; rows without a readable day belong to the
        # partition they are filed under.
        df = _date_filter(df, cfg, start, end) if "date" in input_cols else \
            df.where((F.col("_date") >= F.lit(start)) & (F.col("_date") < F.lit(end)))
    df = ingest.row_reasons(cfg, ingest.Canon(df, layout, canon.input_cols))
    limit = C.day_start(as_of or end, ups)
    later = F.col("_reason").isNull() & (F.col("_rt") >= F.lit(limit))
    df = df.withColumn("_later", later)
    # Cross-row checks never mix rows before and after as-of (a request, a duplicate and a
    # position all live within one day), so they run once over everything; rows left for
    # a later build keep no reason. One scan counts it all.
    df = ingest.cross_row_reasons(cfg, canon, df)
    df = df.withColumn("_reason", F.when(F.col("_later"), F.lit(None)).otherwise(F.col("_reason")))
    # actions whose null arrival is taken as action time + lag (null_arrival: lag): counted
    keys = [F.col("_later"), F.col("_reason")]
    if cfg.col("arrival_time"):
        keys.append(ingest.filled_arrival(cfg, True).alias("_filled"))
    df = df.persist(StorageLevel.MEMORY_AND_DISK)
    with progress.step("ingest", started=t0) as st:
        tally = df.groupBy(*keys).count().collect()  # one row per reason: tiny
        st.rows = sum(int(r["count"]) for r in tally)
    counts_rows = [r for r in tally if not r["_later"]]
    n_later = sum(int(r["count"]) for r in tally if r["_later"])
    now = df.where(~F.col("_later"))
    q = ingest.quarantine_rows(now, canon.input_cols, "impressions")
    accepted = now.where(F.col("_reason").isNull())
    # aggregated once: the requests' range partitioning samples them before their write
    # (and fat rows explode their events from them)
    reqs = ingest.requests_frame(cfg, canon, accepted).persist(StorageLevel.MEMORY_AND_DISK)
    if layout.fat:
        from userwise.pipelines.builder.fat_rows import fat_events

        events = fat_events(cfg, layout, reqs)
    else:
        events = ingest.impression_events(cfg, canon, accepted)
    quarantined = {r["_reason"]: int(r["count"]) for r in counts_rows if r["_reason"] is not None}
    counts = {
        "rows_read": sum(int(r["count"]) for r in counts_rows) + n_later,
        "accepted": sum(int(r["count"]) for r in counts_rows if r["_reason"] is None),
        "quarantined": quarantined,
        "after_as_of": n_later,
    }
    if cfg.col("arrival_time"):
        counts["arrivals_filled"] = sum(int(r["count"]) for r in counts_rows if r["_filled"])
    if actions_path:
        a_raw = read_spark(spark, actions_path)
        a_cols = [c for c in a_raw.columns if c not in ("_file", "_row")]
        import pyarrow as pa

        from userwise.schemas.core import spark_to_arrow

        C.check_actions_columns(cfg, pa.schema([pa.field(f.name, spark_to_arrow(f.dataType))
                                                for f in a_raw.schema.fields if f.name in a_cols]))
        if start is not None and "date" in a_cols:
            a_raw = _date_filter(a_raw, cfg, start, end)
        a_events, a_checked = ingest.action_log(cfg, layout, a_raw)
        # the as-of cut, chosen once: with an arrival column the action log is filed by arrival
        # day (events arriving at or after as-of are a later build's), else by action time
        if cfg.actions.arrival is not None:
            checked_now, event_now = F.col("_date") < F.lit(as_of or end), F.col("date") < F.lit(as_of or end)
        else:
            checked_now, event_now = F.col("_at") < F.lit(limit), F.col(EV + "ts") < F.lit(limit)
        a_checked = a_checked.where(F.col("_reason").isNotNull() | checked_now)
        if start is not None:
            a_events = a_events.where((F.col("date") >= F.lit(start)) & (F.col("date") < F.lit(end)))
        a_events = a_events.where(event_now)
        aq = ingest.quarantine_rows(a_checked, tuple(a_cols), "actions")
        a_filled = cfg.actions.arrival is not None
        with progress.step("actions") as st:
            a_counts = (a_checked.groupBy("_reason", ingest.filled_arrival(cfg, True).alias("_filled")) if a_filled
                        else a_checked.groupBy("_reason")).count().collect()
            st.rows = sum(int(r["count"]) for r in a_counts)
        counts["actions_quarantined"] = {}
        for r in a_counts:
            if r["_reason"]:
                counts["actions_quarantined"][r["_reason"]] = counts["actions_quarantined"].get(r["_reason"], 0) \
                    + int(r["count"])
        if a_filled:
            counts["actions_arrivals_filled"] = sum(int(r["count"]) for r in a_counts if r["_filled"])
        q = q.unionByName(aq)
        events = events.unionByName(a_events)
    rejected = sum(quarantined.values())
    considered = counts["rows_read"] - n_later
    share = rejected / considered if considered else 0.0
    counts["quarantine_share"] = share
    where = _where_dates("date", start, end)
    with progress.step("quarantine", delta_io.commits(delta_io.table_path(build_dir, "quarantine"))):
        delta_io.replace(q, delta_io.table_path(build_dir, "quarantine"),
                         where + (" OR date IS NULL" if start is None else ""),
                         schema=S.QUARANTINE)
    if share > cfg.max_quarantine_share:
        reqs.unpersist()
        df.unpersist()
        raise QuarantineLimitError(
            f"{rejected} of {considered} input rows ({share:.2%}) were quarantined, above "
            f"max_quarantine_share {cfg.max_quarantine_share:.2%}; see {delta_io.table_path(build_dir, 'quarantine')} "
            f"(by reason: {quarantined}){ingest.limit_hint(quarantined)}; fix the input or the config, or raise "
            "the limit")
    with progress.step("requests", delta_io.commits(delta_io.table_path(build_dir, "requests"))):
        delta_io.replace(reqs, delta_io.table_path(build_dir, "requests"), where, schema=S.requests_schema(layout))
    with progress.step("events", delta_io.commits(delta_io.table_path(build_dir, "events"))):
        delta_io.replace(events, delta_io.table_path(build_dir, "events"), where, schema=S.events_schema(layout))
    reqs.unpersist()
    df.unpersist()
    return Ingested(layout, counts)


def _where_dates(col: str, start: dt.date | None, end: dt.date) -> str:
    w = f"{col} < '{end.isoformat()}'"
    if start is not None:
        w = f"{col} >= '{start.isoformat()}' AND " + w
    return w


# ---------------------------------------------------------------------------
# Samples
# ---------------------------------------------------------------------------
def requests_between(spark, build_dir: str, start: dt.date | None, end: dt.date) -> DataFrame:
    r = delta_io.read(spark, delta_io.table_path(build_dir, "requests"))
    cond = F.col("date") < F.lit(end)
    if start is not None:
        cond = cond & (F.col("date") >= F.lit(start))
    return r.where(cond)


def _write_samples(spark, build_dir: str, layout: S.Layout, df: DataFrame, keys: list[tuple[str, dt.date]]) -> list[dict]:
    """Replace the sets ``keys`` ((kind, window_end) each) with ``df`` in one commit; per set,
    what was written (read back from the files' columns, without Spark)."""
    from userwise.pipelines.builder.pointer import release

    path = delta_io.table_path(build_dir, "samples")
    where = " OR ".join(f"(kind = '{k}' AND window_end = '{we.isoformat()}')" for k, we in keys)
    try:
        delta_io.replace(df, path, where, schema=S.samples_schema(layout))
    finally:
        release()
    import pyarrow.compute as pc
    import pyarrow.dataset as pds

    cols = ["num_impressions", "num_requests", "chunk", "cost"]
    version = delta_io.version(spark, path)
    ds = delta_io.dataset(path)  # one read of the Delta log for all the sets
    out = []
    for kind, we in keys:
        t = ds.to_table(columns=cols, filter=(pds.field("kind") == kind) & (pds.field("window_end") == we))
        out.append({"kind": kind, "window_end": we.isoformat(), "samples": int(t.num_rows),
                    "impressions": int(pc.sum(t["num_impressions"]).as_py() or 0),
                    "requests": int(pc.sum(t["num_requests"]).as_py() or 0),
                    "extra_chunks": int(pc.sum(pc.greater(t["chunk"], 0).cast("int64")).as_py() or 0),
                    "max_cost": int(pc.max(t["cost"]).as_py() or 0),
                    "delta_version": version})
    return out


def samples_frame(spark, cfg: C.Config, layout: S.Layout, build_dir: str,
                  sets: list[tuple[str, dt.date | None, dt.date]]) -> DataFrame:
    """The samples of ``sets`` ((kind, start, end) each; start None: from the first day,
    the pretrain set) as one Spark plan, not yet written (:func:`set_samples` writes it).

    Every step is keyed by (user, set): a lean set's stream is its base (the newest L
    events before its start less the availability lag: all its requests can see) and its
    own events, every set's
    sliced from each user's events collected once (:func:`pointer.lean_sets`); a fat set's
    stream is its own requests' snapshots. One set is the same code, so the daily jobs
    equal a range build."""
    plan = SetPlan(cfg, [(st, en) for _, st, en in sets])
    # the pretrain set spans from the first request day (one value per set: readers group by
    # it), read from the requests table's log rather than by a Spark job
    meta = [(k, _first_day(build_dir, en) if st is None else st, en) for k, st, en in sets]
    reqs = requests_between(spark, build_dir, None if any(st is None for _, st, _ in sets) else plan.d0, plan.dend)
    reqs = reqs.select("*", F.explode(plan.sets_of(plan.segment_of_date(F.col("date")))).alias(SET))
    if layout.fat:
        from userwise.pipelines.builder.fat_rows import fat_sets

        df = fat_sets(cfg, layout, reqs, meta)
    else:
        events = delta_io.read(spark, delta_io.table_path(build_dir, "events"))
        df = lean_sets(cfg, layout, events, reqs, meta, plan.times)
    if len(sets) > 1:
        # Every task holds rows of every set: written as they are, each set would get a file
        # per task (small files, worse compression). AQE's rebalance groups a set's rows and
        # still splits a large set into files of the advisory size. (Spark ignores the hint
        # when AQE is off: then the files are as before, never one task per set.)
        df = df.hint("rebalance", "kind", "window_end")
    return df


def set_samples(spark, cfg: C.Config, layout: S.Layout, build_dir: str,
                sets: list[tuple[str, dt.date | None, dt.date]]) -> list[dict]:
    """The samples of ``sets`` (as :func:`samples_frame`) from one Spark plan, written in one
    commit; per set, what was written."""
    df = samples_frame(spark, cfg, layout, build_dir, sets)
    with progress.step("samples") as st:
        out = _write_samples(spark, build_dir, layout, df, [(k, en) for k, _, en in sets])
        st.rows = sum(o["samples"] for o in out)
    # the sets' id statistics, from the same requests (one plan, one commit; id_stats)
    meta = [(k, _first_day(build_dir, en) if st is None else st, en) for k, st, en in sets]
    with progress.step("id_stats", delta_io.commits(delta_io.table_path(build_dir, "id_stats"))):
        ids = id_stats.write(spark, cfg, layout, build_dir, meta, [st is None for _, st, _ in sets])
    for o, summary in zip(out, ids):
        o["ids"] = summary
    return out


def pretrain_samples(spark, cfg: C.Config, layout: S.Layout, build_dir: str, boundary: dt.date) -> dict:
    """All requests before ``boundary`` (= as-of minus M days), merged per user."""
    out = set_samples(spark, cfg, layout, build_dir, [("pretrain", None, boundary)])[0]
    log_set(out, None)
    return out


def _first_day(build_dir: str, boundary: dt.date) -> dt.date:
    first = delta_io.least(delta_io.table_path(build_dir, "requests"))
    return boundary if first is None else min(first, boundary)


def log_set(out: dict, ws: dt.date | None) -> None:
    if out["kind"] == "pretrain":
        log(f"pretrain samples before {out['window_end']}: {out['samples']} samples, {out['impressions']} impressions")
    else:
        log(f"window [{ws}, {out['window_end']}): {out['samples']} samples, {out['impressions']} impressions")


def window_samples(spark, cfg: C.Config, layout: S.Layout, build_dir: str, ws: dt.date, we: dt.date) -> dict:
    """Incremental samples of [ws, we): the newest L events before ws (less the availability
    lag), derived from the events table, plus the window's own events."""
    out = set_samples(spark, cfg, layout, build_dir, [("incremental", ws, we)])[0]
    log_set(out, ws)
    return out
