"""The pointer: one stream per user, requests index into it, chunks cap the cost.

Lean input (:func:`lean_sets`): each user's events are collected once, in the
stream's total order, and every sample set slices its stream from them; a
request's seq_end comes from one sort of the set's events and requests merged.
Fat rows (:mod:`fat_rows`) stitch their stream the same way, from each (user,
set)'s snapshots collected once and sorted together.

Chunking (:func:`chunk_ids`) is a greedy fill. A chunk's cost is what its
sample stores: the events from its slices' least begin to their greatest end,
plus its requests' own costs (impressions, and override events for fat rows).
In (req_time, req_id) order a chunk takes the user's next request unless that
would take its cost over ``max_sample_cost``; a request over the cap alone is a
chunk of its own. One fold per (user, set) over the sorted narrow rows does it,
linear in the user's requests (a heavy user's pass through one task). The wide
columns (impressions) join back once, for the samples' groupBy by chunk, so no
row larger than a chunk is ever built from them.
"""

from __future__ import annotations

import datetime as dt

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from userwise import schemas as S
from userwise.pipelines.builder.ingest import day_of
from userwise.pipelines.config import Config
from userwise.schemas import EV, IMP, OVR, REQ, SEQ, Layout
from userwise.schemas.hashing import chain_column, sample_id_column

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


def bucket_of(units: Column, cfg: Config) -> Column:
    return F.floor(units / F.lit(cfg.skew_bucket_seconds * cfg.units_per_second)).cast("long")


def event_cols(layout: Layout) -> list[str]:
    return [f.name for f in S.event_fields(layout)]


def chunk_ids(cfg: Config, arr: Column) -> Column:
    """The chunk of each request of one (user, set): ``arr`` holds its requests in (req_time,
    req_id) order, structs with _b, _e (slice; ignored where _len is 0), _c (own cost) and
    _len; returns their chunk ids (array<int>, 0, 1, ...).

    Greedy: a chunk's cost is the span of its slices (max _e - min _b, the events it stores)
    plus the sum of _c, and a chunk closes only when the next request would take that cost
    over ``max_sample_cost``; a request over the cap alone is a chunk of its own. One fold
    (``F.aggregate``) records where each chunk starts."""
    cap = cfg.max_sample_cost

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

    return F.aggregate(arr, zero, step, lambda acc: run_ids(F.concat(F.array(F.lit(0)), acc["starts"]), acc["n"]))


def _value(v) -> Column:
    return v if isinstance(v, Column) else F.lit(v)


def sample_rows(cfg: Config, layout: Layout, seq: DataFrame, reqs: DataFrame,
                kind: str | Column, window_start: dt.date | Column | None, window_end: dt.date | Column,
                seq_map: dict[str, str], part: tuple[str, ...] = ()) -> DataFrame:
    """Assemble one row per (user, *part, chunk) in the samples schema.

    ``seq``: per (user, *part, chunk) its stored events, one SEQ_ array per key of
    ``seq_map`` (a chunk without a row stores none). ``reqs``: requests with chunk, lo,
    _b, _e (slice or null), plus the requests table's columns. ``kind`` and the window
    bounds are values, or columns over ``part`` where one frame holds several sample sets.
    """
    req_cols = [f.name for f in layout.stored_request_columns]
    imp_cols = [f.name for f in layout.impression_columns]
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
            *[F.flatten(ovr.getField(f"o{j}")).alias(OVR + sf.name)
              for j, sf in enumerate(layout.seq_fields)],
        ]
    r = g.select(*sel)
    out = r.join(seq, on=["user", *part, "chunk"], how="left")
    seq_types = {sf.name: sf.type for sf in layout.seq_fields}
    for n in seq_map:
        out = out.withColumn(SEQ + n, F.coalesce(F.col(SEQ + n), F.array().cast(
            S.arrow_to_spark(S.list_of(seq_types[n])))))
    # the event chain of the stored events (schemas.hashing), one struct read twice below
    out = out.withColumn("_chain", chain_column([(F.col(SEQ + sf.name), sf.type) for sf in S.chain_fields(layout)],
                                                cfg.chain_block))
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
        F.lit(cfg.chain_block).cast("int").alias("chain_block"),
        F.col("_chain.checkpoints").alias("chain_checkpoints"),
        F.col("_chain.end").alias("chain_end"),
    )
    out = out.withColumn("cost", (F.col("num_events") + F.col("num_impressions") + ovr_events).cast("long"))
    out = out.withColumn("sample_id", sample_id_column())
    return out.select(*[f.name for f in S.samples_schema(layout).fields])


SET = "_set"


def by_set(values: list):
    """A set's value as a column over ``_set`` (a literal when there is one set): one array
    literal indexed by the set, so the expression stays one node however many sets (a chain of
    CASE WHENs grew with them, in every place the plan reads it)."""
    if len(values) == 1:
        return values[0]
    return F.array(*[F.lit(v) for v in values])[F.col(SET)]


def let(value: Column, body) -> Column:
    """``body(v)`` with ``value`` evaluated once: a one-element transform binds it. Spark
    inlines a column used once into its consumer, also into a lambda that runs per element;
    a bound value is computed once per row wherever the body reads it."""
    return F.transform(F.array(value), body)[0]


def indexes(n: Column) -> Column:
    """0, 1, ..., n - 1 (empty for n = 0, where ``sequence(0, -1)`` would count down)."""
    return F.slice(F.sequence(F.lit(0), n), 1, n)


def run_ids(starts: Column, n: Column) -> Column:
    """Per position 0..n-1, the run it falls in, runs starting at ``starts`` (ascending, the
    first 0): run k repeated from its start up to the next one (or n)."""
    nxt = lambda k: F.when(k + 1 < F.size(starts), starts[k + 1]).otherwise(n)  # noqa: E731
    return F.flatten(F.transform(starts, lambda s, k: F.array_repeat(k, nxt(k) - s)))


def chunk_starts(ch: Column, n: Column) -> Column:
    """Where each chunk starts in a (user, set)'s requests: the positions whose chunk id
    (``ch``, ascending) differs from the one before, 0 first."""
    return F.filter(indexes(n), lambda j: F.when(j == 0, F.lit(True)).otherwise(ch[j] != ch[j - 1]))


def chunk_events(x: DataFrame) -> DataFrame:
    """Per (user, set) and chunk, its stored events ``_s``: the stream ``_S`` cut to the
    chunk's [lo, hi) (``_lh``: one struct per chunk); chunks that store none are left out."""
    c = x.select("user", SET, F.posexplode("_lh").alias("chunk", "_b"), "_S")
    c = c.where(F.col("_b.hi") > F.col("_b.lo"))
    sl = F.slice("_S", F.col("_b.lo").cast("int") + 1, (F.col("_b.hi") - F.col("_b.lo")).cast("int"))
    return c.select("user", SET, "chunk", sl.alias("_s"))


def events_before_each(times: Column, marks: Column) -> Column:
    """Per mark (``marks``: times, in any order), the number of ``times`` strictly before it,
    in the marks' order. Native array functions only (no lambda per time): in the sorted
    union of both, a mark's first occurrence is preceded by exactly the times and the marks
    smaller than it; less the marks smaller than it (its first occurrence in the sorted
    marks), the times. Each sorted array is bound once (:func:`let`), then one
    ``array_position`` per mark."""
    t = times.cast("array<bigint>")
    m = marks.cast("array<bigint>")
    return let(F.sort_array(F.concat(t, m)), lambda merged: let(F.sort_array(m), lambda ms: F.transform(
        m, lambda x: (F.array_position(merged, x) - F.array_position(ms, x)).cast("int"))))


def lean_sets(cfg: Config, layout: Layout, events: DataFrame, requests: DataFrame, sets: list[tuple],
              bounds: list[tuple[int | None, int]]) -> DataFrame:
    """Samples of several sets at once, ``requests`` keyed by ``_set`` (an index into ``sets``
    of (kind, window_start, window_end)); ``bounds``: per set, its [start, end) in time units
    (start None: from the beginning, the pretrain set). Every step is per (user, _set), so
    one Spark plan serves them all and one set is the same code.

    Visibility is decided by each event's arrival (docs/pointer.md): a request at t sees the
    events that arrived strictly before t, the stream in arrival order. With an arrival column
    the events carry it (``ev_arrival``, first in the sort key); without one an event arrives
    at its action time + ``availability_lag`` (D, :attr:`Config.lag_units`), a monotone shift
    of the action time, so the stream stays in action-time order and visibility is decided
    at D before each time instead: a request at t sees the events strictly before t - D, and
    a set's bounds move by D with it. Below, "time" is the arrival, or the action time with
    the bounds moved by D. Each user's events are collected once, in the stream's total order, and each
    (user, set) row slices its stream from them: the newest L events strictly before the
    set's start - D (its base: all a request of the set can see of the past) and the events
    in [start - D, end - D), cut where one sort of the user's events merged with every set's
    bounds places them. A request's seq_end (the events strictly before its time - D) comes
    from one sort of the set's events and requests merged (a request precedes events at its
    time - D), its
    chunk from :func:`chunk_ids`; as seq_end grows with the request order, a chunk's stored
    range runs from the begin of its first request that sees an event to the end of its
    last. Only keys and events go through these rows; the requests' wide columns join back
    once, for the samples' groupBy by chunk.

    What a heavy user costs: its events (narrow, in the build's range) are one row and each
    of its sets' request keys another, passed through one task, as the chunk fold needs
    anyway; nothing wide is ever grouped by more than a chunk."""
    L = cfg.max_seq_len
    lag = 0 if layout.arrivals else cfg.lag_units
    part = (SET,)
    keys = S.sort_key(layout)
    cols = event_cols(layout)
    ts = EV + "arrival" if layout.arrivals else EV + "ts"  # what visibility compares (first in keys)
    # visibility is decided at a time lag before each time: a request's, a set's bounds
    seen = [(None if b is None else b - lag, e - lag) for b, e in bounds]
    ev = events.select("user", *cols).where(F.col(ts) < F.lit(max(e for _, e in seen)))
    st = F.struct(*[F.col(k) for k in keys], *[F.col(c) for c in cols if c not in keys])
    per_user = ev.groupBy("user").agg(F.sort_array(F.collect_list(st)).alias("_E"))
    # Where the sets' bounds cut each user's events, so a set's base and own events are two
    # slices, not scans of all the events.
    cut_times = sorted({t for b in seen for t in b if t is not None})
    cut = {t: r for r, t in enumerate(cut_times)}
    cuts = events_before_each(F.col("_E").getField(ts), F.array(*[F.lit(t) for t in cut_times]))
    per_user = per_user.select("user", "_E", cuts.alias("_cuts"))
    ev_type = per_user.schema["_E"].dataType
    nar = requests.select("user", SET, "req_time", "req_id", "num_imps").groupBy("user", SET).agg(
        F.sort_array(F.collect_list(F.struct("req_time", "req_id", "num_imps"))).alias("_R"))
    x = nar.join(per_user, on="user", how="left")

    def events_before(times: list[int | None]) -> Column:
        """Per row, the user's events strictly before its set's bound (0 for no bound)."""
        r = by_set([-1 if t is None else cut[t] for t in times])
        r = r if isinstance(r, Column) else F.lit(r)
        return F.when(F.col("_E").isNull() | (r < 0), F.lit(0)).otherwise(F.col("_cuts")[r])

    c, d = events_before([b for b, _ in seen]), events_before([e for _, e in seen])
    e_all = F.coalesce(F.col("_E"), F.array().cast(ev_type))
    base = F.slice(e_all, F.greatest(c - F.lit(L), F.lit(0)) + 1, F.least(c, F.lit(L)))  # the newest L before
    own = F.slice(e_all, c + 1, d - c)
    x = x.select("user", SET, "_R", F.concat(base, own).alias("_S"))
    # seq_end: the set's events strictly before each request's time less the lag
    ends = events_before_each(F.col("_S").getField(ts), F.transform("_R", lambda r: r["req_time"] - F.lit(lag)))
    x = x.withColumn("_end", ends.cast("array<bigint>"))
    q = F.transform("_R", lambda r, j: F.struct(
        r["req_time"].alias("req_time"), r["req_id"].alias("req_id"),
        F.greatest(F.col("_end")[j] - F.lit(L), F.lit(0).cast("long")).alias("_b"),
        F.col("_end")[j].alias("_e"),
        F.least(F.col("_end")[j], F.lit(L).cast("long")).alias("_len"),
        r["num_imps"].cast("long").alias("_c")))
    x = x.select("user", SET, "_S", q.alias("_q"))
    x = x.withColumn("_ch", chunk_ids(cfg, F.col("_q")))
    n = F.size("_q")
    # where each chunk starts; requests that see no event (seq_end 0) come first
    x = x.select("*", chunk_starts(F.col("_ch"), n).alias("_st"), F.size(F.filter("_q", lambda r: r["_len"] == 0)).alias("_z"))

    def bound(k: Column):
        first = F.greatest(F.col("_st")[k], F.col("_z"))
        last = F.when(k + 1 < F.size("_st"), F.col("_st")[k + 1]).otherwise(n) - 1
        some = first <= last
        return F.struct(F.when(some, F.col("_q")[first]["_b"]).otherwise(F.lit(0).cast("long")).alias("lo"),
                        F.when(some, F.col("_q")[last]["_e"]).otherwise(F.lit(0).cast("long")).alias("hi"))

    x = keep(x.select("user", SET, "_S", "_q", "_ch",
                      F.transform("_st", lambda _, k: bound(k)).alias("_lh")))
    # per request: its chunk and slice (no slice: empty at the chunk's start)
    r = x.select("user", SET, F.explode(F.arrays_zip("_q", "_ch")).alias("_z"), "_lh")
    lh = F.col("_lh")[F.col("_z._ch")]
    has = F.col("_z._q._len") > 0
    reqs = r.select("user", SET, F.col("_z._q.req_id").alias("req_id"), F.col("_z._q.req_time").alias("req_time"),
                    F.col("_z._ch").alias("chunk"), lh["lo"].alias("lo"), lh["hi"].alias("hi"),
                    F.when(has, F.col("_z._q._b")).otherwise(lh["lo"]).alias("_b"),
                    F.when(has, F.col("_z._q._e")).otherwise(lh["lo"]).alias("_e"))
    # per chunk: its stored events, the stream's [lo, hi)
    seq_map = {sf.name: EV + sf.name for sf in layout.seq_fields}
    seq = chunk_events(x).select("user", SET, "chunk", *[F.col("_s").getField(col).alias(SEQ + name)
                                             for name, col in seq_map.items()])
    wide = requests.join(reqs, on=["user", *part, "req_id", "req_time"], how="inner")
    kind, ws, we = (by_set([s_[i] for s_ in sets]) for i in range(3))
    return sample_rows(cfg, layout, seq, wide, kind, ws, we, seq_map, part)
