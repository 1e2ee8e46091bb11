"""The pointer: one stream per user, requests index into it, chunks cap the cost.

The per-user running quantities (event index, request seq_end) are computed with
:func:`prefix`, which splits a user's rows by time bucket before any window, so a
bot user with millions of rows spreads over many tasks instead of sinking one.

Chunking (:func:`assign_chunks`) is a greedy fill. A chunk's cost is what its
sample stores: the events from its slices' least begin to their greatest end,
plus its requests' own costs (impressions, and override events for fat rows).
In (req_time, req_id) order a chunk takes the user's next request unless that
would take its cost over ``max_sample_cost``; a request over the cap alone is a
chunk of its own. One fold per (user, set) over the sorted narrow rows does it,
linear in the user's requests (a heavy user's pass through one task). Events are
then routed to chunks by an equi-join on (user, index bucket), never a range join.
"""

from __future__ import annotations

import datetime as dt

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F

from userwise import schemas as S
from userwise.pipelines.builder.ingest import day_of
from userwise.pipelines.config import Config
from userwise.schemas import EV, IMP, OVR, REQ, SEQ, Layout
from userwise.schemas.hashing import sample_id_column

UNB = Window.unboundedPreceding
CUR = Window.currentRow

_KEPT: list[DataFrame] = []


def keep(df: DataFrame) -> DataFrame:
    """Persist an intermediate that later steps read twice (a plan branches on it), so its
    lineage (windows, joins) is computed once; :func:`release` frees them after the write."""
    from pyspark import StorageLevel

    df = df.persist(StorageLevel.MEMORY_AND_DISK)
    _KEPT.append(df)
    return df


def release() -> None:
    while _KEPT:
        _KEPT.pop().unpersist()


def prefix(df: DataFrame, part: list[str], bucket: str, order: list[Column | str],
           sums: dict[str, str] | None = None, maxes: dict[str, str] | None = None) -> DataFrame:
    """Inclusive running sums / maxes per ``part`` in (bucket, *order), skew-safe.

    Rows are windowed per (part, bucket); per-bucket totals are prefixed over
    the (few) buckets of a part and added back.
    """
    sums, maxes = sums or {}, maxes or {}
    aggs = [F.sum(c).alias(f"_bs_{o}") for o, c in sums.items()]
    aggs += [F.max(c).alias(f"_bm_{o}") for o, c in maxes.items()]
    per_bucket = df.groupBy(*part, bucket).agg(*aggs)
    wb = Window.partitionBy(*part).orderBy(bucket).rowsBetween(UNB, -1)
    offs = per_bucket.select(
        *part, bucket,
        *[F.coalesce(F.sum(f"_bs_{o}").over(wb), F.lit(0)).alias(f"_os_{o}") for o in sums],
        *[F.max(f"_bm_{o}").over(wb).alias(f"_om_{o}") for o in maxes],
    )
    w = Window.partitionBy(*part, bucket).orderBy(*order).rowsBetween(UNB, CUR)
    out = df.join(offs, on=[*part, bucket], how="inner")
    for o, c in sums.items():
        out = out.withColumn(o, F.col(f"_os_{o}") + F.sum(c).over(w))
    for o, c in maxes.items():
        run = F.max(c).over(w)
        out = out.withColumn(o, F.when(F.col(f"_om_{o}").isNull(), run)
                             .when(run.isNull(), F.col(f"_om_{o}"))
                             .otherwise(F.greatest(F.col(f"_om_{o}"), run)))
    return out.drop(*[f"_os_{o}" for o in sums], *[f"_om_{o}" for o in maxes])


def bucket_of(units: Column, cfg: Config) -> Column:
    return F.floor(units / F.lit(cfg.skew_bucket_seconds * cfg.units_per_second)).cast("long")


def event_cols(layout: Layout) -> list[str]:
    return [f.name for f in S.event_fields(layout)]


def index_stream(cfg: Config, layout: Layout, events: DataFrame, requests: DataFrame,
                 part: tuple[str, ...] = ()) -> tuple[DataFrame, DataFrame]:
    """Give every event its index in its user's stream and every request its seq_end.

    ``events``: user, *part + ev_* columns. ``requests``: user, *part, req_id, req_time, ...
    A stream is per (user, *part): ``part`` names the sample set where one frame holds several.
    seq_end counts the events strictly before the request time.
    """
    sort_cols = S.sort_key(layout)
    ev = events.select(
        "user", *part, *event_cols(layout), F.lit(1).alias("_is_ev"), F.col(EV + "ts").alias("_t"),
    )
    rq = requests.select("user", *part, F.col("req_id").alias("_rid"), F.col("req_time").alias("_t"),
                         F.lit(0).alias("_is_ev"))
    u = ev.unionByName(rq, allowMissingColumns=True).withColumn("_sk", bucket_of(F.col("_t"), cfg))
    order = [F.col("_t").asc(), F.col("_is_ev").asc()] + [F.col(c).asc_nulls_first() for c in sort_cols]
    u = keep(prefix(u, ["user", *part], "_sk", order, sums={"_cum": "_is_ev"}))
    events_idx = u.where(F.col("_is_ev") == 1).select("user", *part, *event_cols(layout),
                                                     (F.col("_cum") - 1).alias("idx"))
    req_end = u.where(F.col("_is_ev") == 0).select("user", *part, F.col("_rid").alias("req_id"),
                                                  F.col("_t").alias("req_time"),
                                                  F.col("_cum").cast("long").alias("_seq_end"))
    return events_idx, req_end


def assign_chunks(cfg: Config, reqs: DataFrame, part: tuple[str, ...] = ()) -> DataFrame:
    """Add ``chunk`` to requests with columns user, req_time, req_id, _b, _e (slice; ignored
    where _len is 0), _c (own cost: impressions, plus override events), _len (slice length),
    keeping every other column. Chunks are numbered 0.. per (user, *part): ``part`` names
    the sample set where one frame holds several.

    Greedy, in (req_time, req_id) order: a chunk's cost is the span of its slices
    (max _e - min _b, the events it stores) plus the sum of _c, and a chunk closes only
    when the next request would take that cost over ``max_sample_cost``; a request over
    the cap alone is a chunk of its own. One fold per (user, *part) over its sorted narrow
    rows (``F.aggregate``) records where each chunk starts; the rows explode back with
    their chunk ids.
    """
    cap = cfg.max_sample_cost
    keys = ["user", *part]
    rest = [c for c in reqs.columns if c not in (*keys, "req_time", "req_id")]
    per = reqs.groupBy(*keys).agg(
        F.sort_array(F.collect_list(F.struct("req_time", "req_id", *rest))).alias("_r"))

    def step(acc: Column, x: Column) -> Column:
        has = x["_len"] > 0
        b = F.when(has, x["_b"].cast("long"))
        e = F.when(has, x["_e"].cast("long"))
        c = x["_c"].cast("long")
        lo, hi, cost = F.least(acc["lo"], b), F.greatest(acc["hi"], e), acc["c"] + c
        close = (acc["n"] > 0) & (F.coalesce(hi - lo, F.lit(0)) + cost > F.lit(cap))
        return F.struct(
            (acc["n"] + 1).alias("n"),
            F.when(close, b).otherwise(lo).alias("lo"),
            F.when(close, e).otherwise(hi).alias("hi"),
            F.when(close, c).otherwise(cost).alias("c"),
            F.when(close, F.concat(acc["starts"], F.array(acc["n"]))).otherwise(acc["starts"]).alias("starts"),
        )

    zero = F.struct(F.lit(0).alias("n"), F.lit(None).cast("long").alias("lo"), F.lit(None).cast("long").alias("hi"),
                    F.lit(0).cast("long").alias("c"), F.array().cast("array<int>").alias("starts"))

    def chunk_ids(acc: Column) -> Column:
        """Chunk k repeated over its requests: starts[k] up to the next start (or the end)."""
        starts = F.concat(F.array(F.lit(0)), acc["starts"])
        return F.flatten(F.transform(starts, lambda s, k: F.array_repeat(
            k, F.when(k + 1 < F.size(starts), F.element_at(starts, k + 2)).otherwise(acc["n"]) - s)))

    per = per.select(*keys, "_r", F.aggregate("_r", zero, step, chunk_ids).alias("chunk"))
    z = per.select(*keys, F.explode(F.arrays_zip("_r", "chunk")).alias("_z"))
    return z.select(*keys, *[F.col("_z._r")[c].alias(c) for c in ("req_time", "req_id", *rest)],
                    F.col("_z.chunk").cast("int").alias("chunk"))


def route_events(cfg: Config, events_idx: DataFrame, ranges: DataFrame, part: tuple[str, ...] = ()) -> DataFrame:
    """Events whose index falls in a chunk's [lo, hi): equi-join on (user, *part, index bucket)."""
    G = max(1, cfg.max_seq_len)
    cover = ranges.where(F.col("hi") > F.col("lo")).select(
        "user", *part, "chunk", "lo", "hi",
        F.explode(F.sequence(F.floor(F.col("lo") / G), F.floor((F.col("hi") - 1) / G))).alias("_ib"))
    ev = events_idx.withColumn("_ib", F.floor(F.col("idx") / G))
    j = ev.join(cover, on=["user", *part, "_ib"], how="inner")
    return j.where((F.col("idx") >= F.col("lo")) & (F.col("idx") < F.col("hi"))).drop("_ib")


def _value(v) -> Column:
    return v if isinstance(v, Column) else F.lit(v)


def _field(name: str):
    """A one-argument lambda for F.transform (a second argument would be the index)."""
    return lambda x: x[name]


def sample_rows(cfg: Config, layout: Layout, events_in_chunks: DataFrame, reqs: DataFrame,
                kind: str | Column, window_start: dt.date | Column | None, window_end: dt.date | Column,
                seq_map: dict[str, str], part: tuple[str, ...] = ()) -> DataFrame:
    """Assemble one row per (user, *part, chunk) in the samples schema.

    ``reqs``: requests with chunk, lo, _b, _e (slice or null), plus the
    requests table's columns. ``seq_map``: seq field name -> event column.
    ``kind`` and the window bounds are values, or columns over ``part`` where one
    frame holds several sample sets.
    """
    req_cols = [f.name for f in layout.stored_request_columns]
    imp_cols = [f.name for f in layout.impression_columns]
    # events -> seq arrays, sorted by index
    ev_struct = F.struct(F.col("idx"), *[F.col(c).alias(f"s_{n}") for n, c in seq_map.items()])
    seq = events_in_chunks.groupBy("user", *part, "chunk").agg(F.sort_array(F.collect_list(ev_struct)).alias("_ev"))
    seq = seq.select("user", *part, "chunk", *[F.col(f"_ev.s_{n}").alias(SEQ + n) for n in seq_map])
    # requests -> req arrays (sorted by time, id) and flattened impressions
    begin = F.when(F.col("_e").isNull(), F.lit(0)).otherwise(F.col("_b") - F.col("lo"))
    end = F.when(F.col("_e").isNull(), F.lit(0)).otherwise(F.col("_e") - F.col("lo"))
    fields = [
        F.col("req_time").alias("t"), F.col("req_id").alias("id"),
        begin.cast("int").alias("b"), end.cast("int").alias("e"), F.col("num_imps").alias("n"),
        *[F.col(REQ + c).alias(f"r{i}") for i, c in enumerate(req_cols)],
        *[F.col(IMP + c).alias(f"i{i}") for i, c in enumerate(imp_cols)],
    ]
    if layout.fat:
        fields += [F.col("_snap_kind").alias("sk"), F.col("_ovr_len").alias("ol")]
        fields += [F.col(f"_ovr_{sf.name}").alias(f"o{j}") for j, sf in enumerate(layout.seq_fields)]
    g = reqs.groupBy("user", *part, "chunk").agg(
        F.sort_array(F.collect_list(F.struct(*fields))).alias("_r"),
        F.min("lo").alias("lo"),
        F.max("hi").alias("hi"),
    )
    sel = [
        "user", *part, "chunk", "lo", "hi",
        F.col("_r.t").alias("req_time"), F.col("_r.id").alias("req_id"),
        F.col("_r.b").alias("req_seq_begin"), F.col("_r.e").alias("req_seq_end"),
        F.col("_r.n").alias("req_num_imps"),
        *[F.col(f"_r.r{i}").alias(REQ + c) for i, c in enumerate(req_cols)],
        *[F.flatten(F.col(f"_r.i{i}")).alias(IMP + c) for i, c in enumerate(imp_cols)],
    ]
    if layout.fat:
        ovr = F.filter(F.col("_r"), lambda x: x["sk"] == 1)
        idx = F.filter(F.sequence(F.lit(0), F.size("_r") - 1), lambda i: F.col("_r")[i]["sk"] == 1)
        sel += [
            F.col("_r.sk").alias("req_snapshot"),
            idx.cast("array<int>").alias(OVR + "req"),
            F.concat(F.array(F.lit(0)),
                     F.transform(F.sequence(F.lit(1), F.size(ovr)),
                                 lambda k: F.aggregate(F.slice(ovr, 1, k), F.lit(0),
                                                       lambda a, x: a + x["ol"]))).cast("array<int>")
            .alias(OVR + "offsets"),
            *[F.flatten(F.transform(ovr, _field(f"o{j}"))).alias(OVR + sf.name)
              for j, sf in enumerate(layout.seq_fields)],
        ]
    r = g.select(*sel)
    out = r.join(seq, on=["user", *part, "chunk"], how="left")
    seq_types = {sf.name: sf.type for sf in layout.seq_fields}
    for n in seq_map:
        out = out.withColumn(SEQ + n, F.coalesce(F.col(SEQ + n), F.array().cast(
            S.arrow_to_spark(S.list_of(seq_types[n])))))
    n_imps = F.aggregate(F.col("req_num_imps"), F.lit(0), lambda a, x: a + x)
    ovr_events = F.element_at(F.col(OVR + "offsets"), -1) if layout.fat else F.lit(0)
    first = next(iter(seq_map))
    out = out.select(
        "*",
        F.lit(S.FORMAT_VERSION).alias("format_version"),
        _value(kind).alias("kind"),
        F.coalesce(_value(window_start).cast("date"),
                   day_of(F.array_min("req_time"), cfg.units_per_second)).alias("window_start"),
        _value(window_end).cast("date").alias("window_end"),
        F.size("req_time").cast("int").alias("num_requests"),
        n_imps.cast("int").alias("num_impressions"),
        F.size(SEQ + first).cast("int").alias("num_events"),
    )
    out = out.withColumn("cost", (F.col("num_events") + F.col("num_impressions") + ovr_events).cast("long"))
    out = out.withColumn("sample_id", sample_id_column())
    return out.select(*[f.name for f in S.samples_schema(layout).fields])


SET = "_set"


def by_set(values: list):
    """A set's value as a column over ``_set`` (a literal when there is one set)."""
    if len(values) == 1:
        return values[0]
    c = F.lit(None)
    for i, v in enumerate(values):
        c = F.when(F.col(SET) == i, F.lit(v)).otherwise(c)
    return c


def lean_sets(cfg: Config, layout: Layout, stream: DataFrame, requests: DataFrame, sets: list[tuple]) -> DataFrame:
    """Samples of several sets at once from their streams and requests, both keyed by
    ``_set`` (an index into ``sets`` of (kind, window_start, window_end)): every step is
    per (user, _set), so one Spark plan serves them all and one set is the same code."""
    L = cfg.max_seq_len
    part = (SET,)
    events_idx, req_end = index_stream(cfg, layout, stream, requests, part)
    # pointers and chunks on narrow rows (keys and sizes); the wide columns join back once
    reqs = requests.select("user", *part, "req_id", "req_time", "num_imps").join(
        req_end, on=["user", *part, "req_id", "req_time"], how="inner")
    reqs = (reqs.withColumn("_e", F.col("_seq_end"))
                .withColumn("_b", F.greatest(F.lit(0).cast("long"), F.col("_e") - F.lit(L)))
                .withColumn("_len", F.col("_e") - F.col("_b"))
                .withColumn("_c", F.col("num_imps").cast("long")))
    reqs = assign_chunks(cfg, reqs, part)
    wc = Window.partitionBy("user", *part, "chunk").rowsBetween(Window.unboundedPreceding,
                                                                Window.unboundedFollowing)
    reqs = (reqs.withColumn("lo", F.min(F.when(F.col("_len") > 0, F.col("_b"))).over(wc))
                .withColumn("hi", F.max(F.when(F.col("_len") > 0, F.col("_e"))).over(wc))
                .withColumn("lo", F.coalesce(F.col("lo"), F.lit(0)))
                .withColumn("hi", F.coalesce(F.col("hi"), F.lit(0)))
                .withColumn("_b", F.when(F.col("_len") > 0, F.col("_b")).otherwise(F.col("lo")))
                .withColumn("_e", F.when(F.col("_len") > 0, F.col("_e")).otherwise(F.col("lo"))))
    reqs = keep(reqs.select("user", *part, "req_id", "req_time", "chunk", "lo", "hi", "_b", "_e"))
    ranges = reqs.select("user", *part, "chunk", "lo", "hi").distinct()
    ev = route_events(cfg, events_idx, ranges, part)
    wide = requests.join(reqs, on=["user", *part, "req_id", "req_time"], how="inner")
    seq_map = {sf.name: EV + sf.name for sf in layout.seq_fields}
    kind, ws, we = (by_set([s_[i] for s_ in sets]) for i in range(3))
    return sample_rows(cfg, layout, ev, wide, kind, ws, we, seq_map, part)
