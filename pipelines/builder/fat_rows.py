"""Fat rows: stitch a user's snapshots into one stream, losslessly.

Per sample set (pretrain, or one window; a range build computes all of them in one
plan, keyed by (user, set)) and user:
1. each request's snapshot (already proven identical across its impressions)
   is exploded; an event's identity is its full tuple plus its occurrence
   number among equal tuples in the snapshot;
2. the distinct events, ordered by time, then (for equal times) by where the
   first snapshot holding them lists them, then by their fields, are the
   stitched stream; each gets its index;
3. a snapshot whose events sit at consecutive indexes, in order, is a slice
   [seq_begin, seq_end); any other one (edited history, reordered, clock
   skew) is kept whole as an override for its request. A wrong guess costs
   space, never correctness. Null snapshots come back null, empty ones empty.
Leaking snapshots (events at or after the request time) are reproduced as
given and counted.
"""

from __future__ import annotations

from pyspark.sql import DataFrame, Window
from pyspark.sql import functions as F
from pyspark.sql import types as T

from userwise import schemas as S
from userwise.pipelines.builder.pointer import (
    SET,
    assign_chunks,
    bucket_of,
    by_set,
    chunk_seqs,
    keep,
    prefix,
    route_events,
    sample_rows,
)
from userwise.pipelines.config import Config
from userwise.pipelines.runtime import delta_io
from userwise.schemas import EV, SNAP, Layout


def _roles(layout: Layout) -> list[str]:
    return [sf.name for sf in layout.snapshot]


def _time_units(layout: Layout, cfg: Config, c):
    t = next(sf.type for sf in layout.snapshot if sf.name == "time")
    import pyarrow as pa

    if pa.types.is_timestamp(t):
        micros = F.unix_micros(c.cast("timestamp"))
        return F.floor(micros / F.lit(1_000_000 // cfg.units_per_second)).cast("long")
    return c.cast("long")


def explode_snapshots(layout: Layout, reqs: DataFrame, keep: tuple[str, ...] = ()) -> DataFrame:
    """One row per snapshot event: user, req_id, req_time, p (position in snapshot), f_<role>, occ."""
    roles = _roles(layout)
    z = F.arrays_zip(*[F.col(SNAP + r).alias(r) for r in roles])
    x = reqs.where(F.col(SNAP + roles[0]).isNotNull()).select(
        *keep, "user", "req_id", "req_time", F.posexplode(z).alias("p", "_z"))
    x = x.select(*keep, "user", "req_id", "req_time", "p", *[F.col(f"_z.{r}").alias(f"f_{r}") for r in roles])
    w = Window.partitionBy("user", "req_id", "req_time", *[f"f_{r}" for r in roles]).orderBy("p")
    return x.withColumn("occ", (F.row_number().over(w) - 1).cast("long"))


def stream_order(layout: Layout) -> list[str]:
    """Time first; events at the same time keep the order of the snapshot that first holds
    them (legacy logs list same-time clicks in display order, which their fields cannot tell)."""
    roles = _roles(layout)
    rest = [r for r in roles if r not in ("time", "item")]
    return ["f_time", "_first", "f_item", *[f"f_{r}" for r in rest], "occ"]


def fat_samples(cfg: Config, layout: Layout, reqs: DataFrame, kind: str, window_start, window_end) -> DataFrame:
    """The samples of one set (pretrain, or one window) from its requests."""
    return fat_sets(cfg, layout, reqs.withColumn(SET, F.lit(0)), [(kind, window_start, window_end)])


def fat_sets(cfg: Config, layout: Layout, reqs: DataFrame, sets: list[tuple]) -> DataFrame:
    """The samples of several sets at once: ``reqs`` carries ``_set`` (an index into ``sets``
    of (kind, window_start, window_end)). A fat set's stream comes from its own requests'
    snapshots alone (no history), so the sets are independent: every step is keyed by
    (user, _set), and one Spark plan serves them all. One set is the same code
    (:func:`fat_samples`), so a range build and the daily jobs give the same rows."""
    roles = _roles(layout)
    fcols = [f"f_{r}" for r in roles]
    part = (SET,)
    x = explode_snapshots(layout, reqs, keep=part)
    ev = x.groupBy("user", *part, *fcols, "occ").agg(F.min(F.struct("req_time", "req_id", "p")).alias("_first"))
    ev = ev.withColumn("_t", _time_units(layout, cfg, F.col("f_time"))).withColumn("_sk", bucket_of(F.col("_t"), cfg))
    ev = ev.withColumn("_one", F.lit(1))
    ev = prefix(ev, ["user", *part], "_sk", [F.col(c).asc_nulls_first() for c in stream_order(layout)],
                sums={"_cum": "_one"})
    ev = keep(ev.select("user", *part, *fcols, "occ", (F.col("_cum") - 1).alias("idx")))
    # where each snapshot's events sit in the stream
    j = x.join(ev, on=["user", *part, *fcols, "occ"], how="inner")
    per = j.groupBy("user", "req_id", "req_time").agg(
        F.count(F.lit(1)).alias("_n"), F.min("idx").alias("_mn"), F.max("idx").alias("_mx"),
        F.min(F.col("idx") - F.col("p")).alias("_dmin"), F.max(F.col("idx") - F.col("p")).alias("_dmax"))
    is_slice = (F.col("_n") == F.col("_mx") - F.col("_mn") + 1) & (F.col("_dmin") == F.col("_dmax"))
    # The pointer and the chunks are worked out on narrow rows (keys and sizes); the wide
    # columns (impressions, snapshots) join back once, by request, for the samples' groupBy.
    first = F.col(SNAP + roles[0])
    nar = reqs.select("user", *part, "req_id", "req_time", "num_imps",
                      F.when(first.isNull(), F.lit(-1)).otherwise(F.size(first)).alias("_sn"))
    r = nar.join(per, on=["user", "req_id", "req_time"], how="left")
    kind_col = (F.when(F.col("_sn") < 0, F.lit(2))
                .when(F.col("_sn") == 0, F.lit(0))
                .when(is_slice, F.lit(0))
                .otherwise(F.lit(1))).cast("byte")
    r = r.withColumn("_snap_kind", kind_col)
    slice_ok = (F.col("_snap_kind") == 0) & (F.col("_sn") > 0)
    r = (r.withColumn("_b", F.when(slice_ok, F.col("_mn")))
          .withColumn("_e", F.when(slice_ok, F.col("_mx") + 1))
          .withColumn("_len", F.coalesce(F.col("_e") - F.col("_b"), F.lit(0)).cast("long"))
          .withColumn("_ovr_len", F.when(F.col("_snap_kind") == 1, F.col("_sn")).otherwise(0).cast("int"))
          .withColumn("_c", (F.col("num_imps") + F.col("_ovr_len")).cast("long")))
    r = assign_chunks(cfg, r, part)
    wc = Window.partitionBy("user", *part, "chunk").rowsBetween(Window.unboundedPreceding, Window.unboundedFollowing)
    r = (r.withColumn("lo", F.coalesce(F.min("_b").over(wc), F.lit(0)))
          .withColumn("hi", F.coalesce(F.max("_e").over(wc), F.lit(0))))
    r = keep(r.select("user", *part, "req_id", "req_time", "chunk", "lo", "hi", "_b", "_e", "_snap_kind", "_ovr_len"))
    ranges = r.select("user", *part, "chunk", "lo", "hi").distinct()
    routed = route_events(cfg, ev, ranges, part)
    wide = reqs.join(r, on=["user", *part, "req_id", "req_time"], how="inner")
    for sf in layout.seq_fields:
        empty = F.array().cast(T.ArrayType(S.arrow_to_spark(sf.type)))
        wide = wide.withColumn(f"_ovr_{sf.name}",
                               F.when(F.col("_snap_kind") == 1, F.col(SNAP + sf.name)).otherwise(empty))
    seq_map = {r_: f"f_{r_}" for r_ in roles}
    kind, ws, we = (by_set([s_[i] for s_ in sets]) for i in range(3))
    return sample_rows(cfg, layout, chunk_seqs(routed, seq_map, part), wide, kind, ws, we, seq_map, part)


def fat_events(cfg: Config, layout: Layout, reqs: DataFrame) -> DataFrame:
    """Per date, the distinct snapshot events of that date's requests, in the events schema.

    ``ev_pos`` holds the occurrence number among equal events (the identity
    rule above); the history dedups across days.
    """
    roles = _roles(layout)
    x = explode_snapshots(layout, reqs, keep=("date",))
    ev = x.select("date", "user", *[f"f_{r}" for r in roles], "occ").distinct()
    ev_types = {f.name: f.type for f in S.event_fields(layout)}
    cols = [F.col("date"), F.col("user"), _time_units(layout, cfg, F.col("f_time")).alias(EV + "ts"),
            F.lit(None).cast("long").alias(EV + "req_time"),
            F.lit(None).cast(S.arrow_to_spark(ev_types[EV + "req_id"])).alias(EV + "req_id"),
            F.col("occ").alias(EV + "pos")]
    cols += [F.col(f"f_{r}").alias(EV + r) for r in roles]
    return ev.select(cols)


def snapshot_counts(spark, output: str, sets: list[tuple[str, str]]) -> dict:
    """Overrides, null and leaking snapshots in the given sample sets."""
    samples = delta_io.read(spark, delta_io.table_path(output, "samples"))
    cond = F.lit(False)
    for kind, we in sets:
        cond = cond | ((F.col("kind") == kind) & (F.col("window_end") == F.lit(we).cast("date")))
    s = samples.where(cond).agg(
        F.coalesce(F.sum(F.size(F.filter("req_snapshot", lambda v: v == 1))), F.lit(0)).alias("o"),
        F.coalesce(F.sum(F.size(F.filter("req_snapshot", lambda v: v == 2))), F.lit(0)).alias("n"),
    ).first()
    last = max((we for _, we in sets), default=None)
    reqs = delta_io.read(spark, delta_io.table_path(output, "requests"))
    if last is not None:
        reqs = reqs.where(F.col("date") < F.lit(last).cast("date"))
    leak = reqs.where(F.exists(F.col(SNAP + "time"), lambda t: t.cast("long") >= F.col("req_time"))).count()
    return {"overrides": int(s["o"]), "null_snapshots": int(s["n"]), "leaking_snapshots": int(leak)}

