"""Id statistics: per sample set and id column, how often each id is looked up, whether it is
new, and its hot / warm / cold tier (the ``id_stats`` table, ``schemas.ID_STATS``).

The id columns are the item and the features ``columns.id_features`` lists
(:attr:`Config.id_columns`). Per set (kind, window_end) and id column, one row per id:

- ``lookups``: the set's impressions that carry it (an item feature: per impression; a
  context or user feature: the impressions of each request that carries it), what a
  per-impression batch looks up;
- ``requests``: the set's requests that carry it (what a batch that gives request features
  once per request, TorchRec's VBE, looks up);
- ``first_date``, ``first_seen``: the first day a request of the requests table carried it,
  and whether that is in the set (no request before the set's first day carried it: an id
  a trainer must admit);
- ``rank`` (by lookups, ties by id) and ``tier``: the ``hot_budget`` most looked-up ids are
  hot, the next ``warm_budget`` warm, the rest cold (:attr:`Config.budget_ids`).

One Spark plan over the requests table (before the sets' last end): per request and id
column, its ids' occurrences (two generators, each marked where the id first occurs in the
request), aggregated once per (id column, id) into its first day and every set's sums (one
exchange), then a window ranks
each set's ids (a second); the report's summary aggregates the rows kept from the write. A set is the same code alone or among many, so the daily jobs and a
range build write the same rows (tested by ``tests/builder/test_id_stats.py``).
"""

from __future__ import annotations

import datetime as dt

from pyspark import StorageLevel
from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F

from userwise import schemas as S
from userwise.pipelines import config as C
from userwise.pipelines.builder.pointer import SET, by_set
from userwise.pipelines.runtime import delta_io
from userwise.schemas import IMP, REQ, Layout
from userwise.schemas.layout import storage_name

TIERS = ("hot", "warm", "cold")


def _values(layout: Layout, role: str, col: str) -> tuple[Column, bool]:
    """A request row's values of an id column as one array (nulls kept), and whether they are
    per impression (else once per request)."""
    name = storage_name(col)
    if role in ("item", "item_feature"):
        c = F.col(IMP + name)
        t = layout.input_schema.field(name).type
        return (F.flatten(c) if _is_list(t) else c), True
    stored = layout.derived_request_columns.get(name) or REQ + name
    c = F.col(stored)
    t = layout.input_schema.field(name).type
    return (c if _is_list(t) else F.array(c)), False


def _is_list(t) -> bool:
    import pyarrow as pa

    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


def _occurrences(cfg: C.Config, layout: Layout, reqs: DataFrame) -> DataFrame:
    """One row per occurrence of an id in a request: ``date``, ``c`` (the id column's index in
    :attr:`Config.id_columns`), ``id`` (a string), ``n`` (its lookups: 1 per impression; for a
    request feature, the request's impressions) and ``first`` (the id's first place in the
    request's values, so the requests that carry it count once). Generators and native array
    functions only (no per-element lambda: Spark evaluates those interpreted)."""
    parts = []
    for j, (role, col) in enumerate(cfg.id_columns):
        vals, per_imp = _values(layout, role, col)
        mult = F.lit(1).cast("long") if per_imp else F.col("num_imps").cast("long")
        parts.append(F.struct(F.lit(j).alias("c"), vals.cast("array<string>").alias("v"), mult.alias("m")))
    k = reqs.select("date", F.explode(F.array(*parts)).alias("_k"))
    o = k.select("date", F.col("_k.c").alias("c"), F.col("_k.m").alias("n"), F.col("_k.v").alias("_v"),
                 F.posexplode("_k.v").alias("_p", "id"))
    return o.where(F.col("id").isNotNull()).select(
        "date", "c", "id", "n", (F.array_position("_v", F.col("id")) == F.col("_p") + 1).alias("first"))


def stats_frame(spark, cfg: C.Config, layout: Layout, build_dir: str,
                sets: list[tuple[str, dt.date, dt.date]], open_start: list[bool] | None = None) -> DataFrame:
    """The ``id_stats`` rows of ``sets`` ((kind, window_start, window_end) each, the samples'
    set keys) as one Spark plan, not yet written. ``open_start``: per set, whether it holds
    every request before its end (the pretrain set), else those of [window_start, window_end)."""
    open_start = open_start or [False] * len(sets)
    dend = max(en for _, _, en in sets)
    reqs = delta_io.read(spark, delta_io.table_path(build_dir, "requests")).where(F.col("date") < F.lit(dend))
    occ = _occurrences(cfg, layout, reqs)
    # one aggregation per (column, id): its first day and, per set, its lookups and requests
    aggs = [F.min("date").alias("first_date")]
    for j, ((_, st, en), whole) in enumerate(zip(sets, open_start)):
        inside = F.col("date") < F.lit(en)
        if not whole:
            inside = inside & (F.col("date") >= F.lit(st))
        aggs += [F.sum(F.when(inside, F.col("n"))).alias(f"_l{j}"),
                 F.count(F.when(inside & F.col("first"), F.lit(1))).alias(f"_r{j}")]
    g = occ.groupBy("c", "id").agg(*aggs)
    per_set = F.filter(F.array(*[F.struct(F.lit(j).alias(SET), F.col(f"_l{j}").alias("lookups"),
                                          F.col(f"_r{j}").alias("requests")) for j in range(len(sets))]),
                       lambda x: x["requests"] > 0)
    x = g.select("c", "id", "first_date", F.explode(per_set).alias("_s")).select("c", "id", "first_date", "_s.*")
    hot, warm = cfg.budget_ids
    rank = F.row_number().over(Window.partitionBy(SET, "c").orderBy(F.col("lookups").desc(), F.col("id").asc()))
    x = x.withColumn("rank", rank.cast("long"))
    cols = cfg.id_columns
    role = F.element_at(F.array(*[F.lit(r) for r, _ in cols]), F.col("c") + 1)
    column = F.element_at(F.array(*[F.lit(c) for _, c in cols]), F.col("c") + 1)
    lit = lambda v: v if isinstance(v, Column) else F.lit(v)  # noqa: E731
    kind = lit(by_set([k for k, _, _ in sets]))
    start = lit(by_set([st for _, st, _ in sets])).cast("date")
    end = lit(by_set([en for _, _, en in sets])).cast("date")
    tier = F.when(F.col("rank") <= hot, F.lit("hot")).when(F.col("rank") <= hot + warm, F.lit("warm")) \
        .otherwise(F.lit("cold"))
    # the window's exchange by (set, column) already puts a set's rows in few tasks: no rebalance
    return x.select(kind.alias("kind"), start.alias("window_start"), end.alias("window_end"), role.alias("role"),
                    column.alias("column"), "id", "lookups", "requests", "first_date",
                    (F.col("first_date") >= start).alias("first_seen"), "rank", tier.alias("tier"))


def write(spark, cfg: C.Config, layout: Layout, build_dir: str, sets: list[tuple[str, dt.date, dt.date]],
          open_start: list[bool] | None = None) -> list[dict]:
    """Replace the ``id_stats`` rows of ``sets`` (as :func:`stats_frame`) in one commit; per
    set, its summary (:func:`summary`, from the rows as written, kept for it)."""
    path = delta_io.table_path(build_dir, "id_stats")
    where = " OR ".join(f"(kind = '{k}' AND window_end = '{en.isoformat()}')" for k, _, en in sets)
    df = stats_frame(spark, cfg, layout, build_dir, sets, open_start).persist(StorageLevel.MEMORY_AND_DISK)
    try:
        delta_io.replace(df, path, where, schema=S.ID_STATS)
        return summary(cfg, df, [(k, en) for k, _, en in sets])
    finally:
        df.unpersist()


def summary(cfg: C.Config, stats: DataFrame, keys: list[tuple[str, dt.date]]) -> list[dict]:
    """Per set ((kind, window_end) each), per id column: distinct ids, lookups, requests, new
    ids (``first_seen``) and their lookups, and per tier its ids and lookups; from one
    aggregation of ``stats`` (the table's rows; a few rows per set come back, no ids).

    Example::

        summary(cfg, delta_io.read(spark, delta_io.table_path(D, "id_stats")), [("incremental", date(2026, 1, 10))])
        # [{"item_id": {"role": "item", "distinct": 812, "lookups": 9120, "first_seen": 37, ...}}]
    """
    t = stats
    cond = F.lit(False)
    for k, en in keys:
        cond = cond | ((F.col("kind") == k) & (F.col("window_end") == F.lit(en)))
    aggs = [F.count(F.lit(1)).alias("distinct"), F.sum("lookups").alias("lookups"), F.sum("requests").alias("requests"),
            F.sum(F.col("first_seen").cast("long")).alias("first_seen"),
            F.sum(F.when(F.col("first_seen"), F.col("lookups")).otherwise(F.lit(0))).alias("first_seen_lookups")]
    for tr in TIERS:
        aggs += [F.sum((F.col("tier") == tr).cast("long")).alias(tr),
                 F.sum(F.when(F.col("tier") == tr, F.col("lookups")).otherwise(F.lit(0))).alias(tr + "_lookups")]
    rows = t.where(cond).groupBy("kind", "window_end", "role", "column").agg(*aggs).collect()  # per set and column
    hot, warm = cfg.budget_ids
    out = []
    for k, en in keys:
        per = {}
        order = [c for _, c in cfg.id_columns]
        mine = [r for r in rows if r["kind"] == k and r["window_end"] == en]
        for r in sorted(mine, key=lambda r: order.index(r["column"]) if r["column"] in order else len(order)):
            d = {key: int(r[key] or 0) for key in ("distinct", "lookups", "requests", "first_seen",
                                                    "first_seen_lookups", *TIERS, *(x + "_lookups" for x in TIERS))}
            per[r["column"]] = {"role": r["role"], **d, "hot_budget": hot, "warm_budget": warm}
        out.append(per)
    return out
