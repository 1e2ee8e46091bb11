"""Fat rows: stitch a user's snapshots into one stream, losslessly.

Per sample set (pretrain, or one window; a range build computes all of them in one
plan, keyed by (user, set)) and user:
1. each request's snapshot (already proven identical across its impressions)
   is taken apart into events; an event's identity is its full tuple plus its
   occurrence number among equal tuples in the snapshot;
2. the distinct events, ordered by time, then (for equal times) by where the
   first snapshot holding them lists them, are the stitched stream; each gets
   its index;
3. a snapshot whose events sit at consecutive indexes, in order, is a slice
   [seq_begin, seq_end); any other one (edited history, reordered, clock
   skew) is kept whole as an override for its request. A wrong guess costs
   space, never correctness. Null snapshots come back null, empty ones empty.
Leaking snapshots (events at or after the request time) are reproduced as
given and counted.
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F

from userwise import schemas as S
from userwise.pipelines.builder.pointer import (
    SET,
    by_set,
    chunk_events,
    chunk_ids,
    chunk_starts,
    events_before_each,
    indexes,
    keep,
    let,
    run_ids,
    sample_rows,
)
from userwise.pipelines.config import Config
from userwise.pipelines.runtime import delta_io
from userwise.schemas import EV, SEQ, SNAP, Layout


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


def fat_samples(cfg: Config, layout: Layout, reqs: DataFrame, kind: str, window_start, window_end) -> DataFrame:
    """The samples of one set (pretrain, or one window) from its requests."""
    return fat_sets(cfg, layout, reqs.withColumn(SET, F.lit(0)), [(kind, window_start, window_end)])


def fat_sets(cfg: Config, layout: Layout, reqs: DataFrame, sets: list[tuple]) -> DataFrame:
    """The samples of several sets at once: ``reqs`` carries ``_set`` (an index into ``sets``
    of (kind, window_start, window_end)). A fat set's stream comes from its own requests'
    snapshots alone (no history), so the sets are independent: every step is keyed by
    (user, _set), and one Spark plan serves them all. One set is the same code
    (:func:`fat_samples`), so a range build and the daily jobs give the same rows.

    An array plan, as the lean one (:func:`pointer.lean_sets`): each (user, set) collects
    its requests' keys and snapshots once (narrow: the events' fields, no impressions), in
    (req_time, req_id) order, and finds everything from one sort of their events:

    1. every snapshot event (request j, position p) sorted by its fields, then (j, p): equal
       tuples sit together, the first of them held by the first snapshot; an event repeated
       within one snapshot (rare) takes its occurrence number there, and the events are
       sorted again with it (the identity is the full tuple plus that number);
    2. the distinct events, sorted by (time, j, p of their first holder), are the stream;
    3. each snapshot event's index in it is its identity's place; a snapshot is a slice when
       all its events share one index less position (then that is its begin), else an
       override: the distinct (request, index less position) pairs, as longs, tell which;
    4. the chunks from the same greedy fold as lean input (:func:`pointer.chunk_ids`), a
       chunk's stored range from its requests' least begin to their greatest end.

    Only keys, sizes, the stream and the overrides' snapshots leave these rows; the requests'
    wide columns join back once, without their snapshots, for the samples' groupBy by chunk.
    What a heavy user costs: per set, its snapshots' events are one row, sorted in one task,
    as the chunk fold needs anyway."""
    roles = _roles(layout)
    part = (SET,)
    fnames = [f"f_{r}" for r in roles]
    snaps = [SNAP + sf.name for sf in layout.seq_fields]  # the snapshot's lists (the roles')
    z_type = reqs.select(F.arrays_zip(*[F.col(SNAP + r).alias(r) for r in roles]).alias("z")).schema["z"].dataType
    per = reqs.groupBy("user", SET).agg(F.sort_array(F.collect_list(F.struct(
        "req_time", "req_id", "num_imps", *snaps))).alias("_R"))

    def zipped(r: Column) -> Column:
        """A request's snapshot events (its lists zipped; none for a null snapshot)."""
        z = F.arrays_zip(*[r[SNAP + x].alias(x) for x in roles])
        return F.coalesce(F.when(r[SNAP + roles[0]].isNotNull(), z), F.array().cast(z_type))

    def same(a: Column, b: Column, names: list[str]) -> Column:
        """Two events equal in ``names`` (nulls equal, as a groupBy compares them)."""
        eq = F.lit(True)
        for nm in names:
            eq = eq & a[nm].eqNullSafe(b[nm])
        return eq

    def ev(e: Column, occ: Column, j: Column, p: Column, names: list[str] = roles) -> Column:
        """An event: its fields (``names`` of ``e``), occurrence number, request and position."""
        return F.struct(*[e[r].alias(f) for r, f in zip(names, fnames)], occ.alias("occ"), j.alias("j"), p.alias("p"))

    def stitch(R0: Column) -> Column:
        # each request's events once (_z) and its snapshot's size (_sn, -1 for a null one)
        return let(F.transform(R0, lambda r: F.struct(
            r["req_time"].alias("req_time"), r["req_id"].alias("req_id"), r["num_imps"].alias("num_imps"),
            F.when(r[SNAP + roles[0]].isNull(), F.lit(-1)).otherwise(F.size(r[SNAP + roles[0]])).alias("_sn"),
            zipped(r).alias("_z"))), lambda R: stitched(R0, R))

    def stitched(R0: Column, R: Column) -> Column:
        nreq = F.size(R)
        # 1. every snapshot event: its fields, then its request's place j and its position p
        flat = F.flatten(F.transform(R, lambda r, j: F.transform(
            r["_z"], lambda e, p: ev(e, F.lit(0).cast("long"), j, p))))
        b0 = F.sort_array(flat)

        def from_b0(b: Column) -> Column:
            n = F.size(b)
            # 0: first of its tuple, 1: same tuple as the one before, another request, 2: same request
            rest = F.greatest(n - 1, F.lit(0))
            code = F.concat(F.slice(F.array(F.lit(0)), 1, F.least(n, F.lit(1))), F.zip_with(
                F.slice(b, 2, rest), F.slice(b, 1, rest), lambda x, y: F.when(~same(x, y, fnames), F.lit(0))
                .when(x["j"] != y["j"], F.lit(1)).otherwise(F.lit(2))))
            return let(code, lambda c: let(F.array_contains(c, 2), lambda dup: let(
                F.when(dup, occurrences(b, c)).otherwise(b),
                lambda bx: let(
                    F.when(dup, F.filter(indexes(n), lambda i: (i == 0) | ~same(bx[i], bx[i - 1], [*fnames, "occ"])))
                    .otherwise(F.filter(indexes(n), lambda i: c[i] == 0)),
                    lambda starts: stream_of(R0, R, nreq, bx, starts)))))

        return let(b0, from_b0)

    def occurrences(b: Column, c: Column) -> Column:
        """Each event's occurrence number among equal tuples of its snapshot; sorted again."""
        n = F.size(b)
        runs = F.filter(indexes(n), lambda i: c[i] <= 1)
        return let(runs, lambda s: let(run_ids(s, n), lambda rid: F.sort_array(F.transform(
            indexes(n), lambda i: ev(b[i], (i - s[rid[i]]).cast("long"), b[i]["j"], b[i]["p"], fnames)))))

    def stream_of(R0: Column, R: Column, nreq: Column, b: Column, starts: Column) -> Column:
        n = F.size(b)
        # 2. the distinct events (the first of each identity: its first holder) in stream order
        order = F.sort_array(F.transform(starts, lambda s, k: F.struct(
            b[s][fnames[roles.index("time")]].alias("t"), b[s]["j"].alias("j"), b[s]["p"].alias("p"),
            k.alias("k"))))
        return let(order, lambda o: let(
            F.transform(F.sort_array(F.transform(o, lambda x, i: F.struct(x["k"].alias("k"), i.alias("i")))),
                        lambda y: y["i"]),
            lambda place: let(run_ids(starts, n), lambda rid: slices(
                R0, R, nreq, b, rid, place,
                F.transform(o, lambda x: F.struct(*[b[starts[x["k"]]][f].alias(f) for f in fnames]))))))

    def slices(R0: Column, R: Column, nreq: Column, b: Column, rid: Column, place: Column,
               stream: Column) -> Column:
        # 3. per event, its request j and d = its index in the stream less its position, as one
        # long; a request is a slice when all its events share one d (then d is its begin)
        keys = F.sort_array(F.array_distinct(F.zip_with(b, rid, lambda e, r: (
            e["j"].cast("long") * F.lit(1 << 32) + (place[r] - e["p"]).cast("long") + F.lit(1 << 31)))))
        return let(keys, lambda k: let(
            events_before_each(F.transform(k, lambda x: F.shiftright(x, 32)), indexes(nreq + 1)),
            lambda first: requests_of(R0, R, k, first, stream)))

    def requests_of(R0: Column, R: Column, k: Column, first: Column, stream: Column) -> Column:
        """``k``: the distinct (j, d) keys, sorted; ``first``: per j, where its keys start."""
        def q(r: Column, j: Column) -> Column:
            m, sn = F.size(r["_z"]), r["_sn"]
            is_slice = (m > 0) & (first[j + 1] - first[j] == 1)
            # its begin, the d of its one key (read only for a slice: the key exists)
            begin = k[first[j]] - j.cast("long") * F.lit(1 << 32) - F.lit(1 << 31)
            kind = (F.when(sn < 0, F.lit(2)).when(sn == 0, F.lit(0)).when(is_slice, F.lit(0))
                    .otherwise(F.lit(1))).cast("byte")
            ok = (kind == 0) & (sn > 0)
            b_ = F.when(ok, begin)
            e_ = F.when(ok, begin + m.cast("long"))
            ovr = F.when(kind == 1, sn).otherwise(F.lit(0)).cast("int")
            return F.struct(r["req_time"].alias("req_time"), r["req_id"].alias("req_id"), b_.alias("_b"),
                            e_.alias("_e"), F.coalesce(e_ - b_, F.lit(0).cast("long")).alias("_len"),
                            (r["num_imps"] + ovr).cast("long").alias("_c"), kind.alias("_snap_kind"),
                            ovr.alias("_ovr_len"),
                            # an override keeps its snapshot's lists as given; the rest keep none
                            *[F.when(kind == 1, R0[j][c]).otherwise(F.array().cast(t)).alias(f"_ovr_{c[len(SNAP):]}")
                              for c, t in ovr_types.items()])

        return F.struct(stream.alias("_S"), F.transform(R, q).alias("_q"))

    ovr_types = {c: reqs.schema[c].dataType for c in snaps}
    x = per.select("user", SET, stitch(F.col("_R")).alias("_x"))
    x = x.select("user", SET, F.col("_x._S").alias("_S"), F.col("_x._q").alias("_q"))
    x = x.withColumn("_ch", chunk_ids(cfg, F.col("_q")))
    # 4. where each chunk starts; its stored range: its requests' least begin to greatest end
    n = F.size("_q")
    starts = chunk_starts(F.col("_ch"), n)

    def bound(s: Column, k: Column, st: Column) -> Column:
        nxt = F.when(k + 1 < F.size(st), st[k + 1]).otherwise(n)
        blk = F.slice("_q", s + 1, nxt - s)
        return F.struct(F.coalesce(F.array_min(blk["_b"]), F.lit(0).cast("long")).alias("lo"),
                        F.coalesce(F.array_max(blk["_e"]), F.lit(0).cast("long")).alias("hi"))

    x = keep(x.select("user", SET, "_S", "_q", "_ch",
                      let(starts, lambda st: F.transform(st, lambda s, k: bound(s, k, st))).alias("_lh")))
    # per request: its chunk, the chunk's range and its own slice and kind
    r = x.select("user", SET, F.explode(F.arrays_zip("_q", "_ch")).alias("_z"), "_lh")
    lh = F.col("_lh")[F.col("_z._ch")]
    r = r.select("user", SET, *[F.col(f"_z._q.{c}").alias(c) for c in ("req_id", "req_time", "_b", "_e")],
                 F.col("_z._ch").alias("chunk"), lh["lo"].alias("lo"), lh["hi"].alias("hi"),
                 F.col("_z._q._snap_kind").alias("_snap_kind"), F.col("_z._q._ovr_len").alias("_ovr_len"),
                 *[F.col(f"_z._q._ovr_{sf.name}").alias(f"_ovr_{sf.name}") for sf in layout.seq_fields])
    # per chunk: its stored events, the stream's [lo, hi)
    seq_map = {r_: f"f_{r_}" for r_ in roles}
    seq = chunk_events(x).select("user", SET, "chunk", *[F.col("_s")[f].alias(SEQ + name) for name, f in seq_map.items()])
    # the snapshots came with the narrow rows (an override's back with its request): the wide
    # rows join back without them
    wide = reqs.drop(*snaps).join(r, on=["user", *part, "req_id", "req_time"], how="inner")
    kind, ws, we = (by_set([s_[i] for s_ in sets]) for i in range(3))
    return sample_rows(cfg, layout, seq, wide, kind, ws, we, seq_map, part)


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


def snapshot_counts(spark, build_dir: str, sets: list[tuple[str, str]]) -> dict:
    """Overrides, null and leaking snapshots in the given sample sets."""
    samples = delta_io.read(spark, delta_io.table_path(build_dir, "samples"))
    cond = F.lit(False)
    for kind, we in sets:
        cond = cond | ((F.col("kind") == kind) & (F.col("window_end") == F.lit(we).cast("date")))
    s = samples.where(cond).agg(
        F.coalesce(F.sum(F.size(F.filter("req_snapshot", lambda v: v == 1))), F.lit(0)).alias("o"),
        F.coalesce(F.sum(F.size(F.filter("req_snapshot", lambda v: v == 2))), F.lit(0)).alias("n"),
    ).first()
    last = max((we for _, we in sets), default=None)
    reqs = delta_io.read(spark, delta_io.table_path(build_dir, "requests"))
    if last is not None:
        reqs = reqs.where(F.col("date") < F.lit(last).cast("date"))
    leak = reqs.where(F.exists(F.col(SNAP + "time"), lambda t: t.cast("long") >= F.col("req_time"))).count()
    return {"overrides": int(s["o"]), "null_snapshots": int(s["n"]), "leaking_snapshots": int(leak)}

