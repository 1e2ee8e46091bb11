"""``max_sample_cost`` is a fill target: a user's requests (per sample set, in (req_time,
req_id) order) fill a chunk until the next one would take its cost (stored events +
impressions) over the cap; a request over the cap alone is a chunk of its own."""

from __future__ import annotations

import datetime as dt
import io
import random

import pytest

from tests.support.common import config
from userwise.pipelines import config as C
from userwise.pipelines.builder import build as B
from userwise.pipelines.builder import pointer
from userwise.pipelines.runtime import delta_io
from userwise.pipelines.tools import synth

pytestmark = pytest.mark.spark

L, CAP, DAYS = 10, 60, 2
START = dt.date(2026, 1, 1)


def _cost(rows: list[tuple]) -> int:
    """A chunk's cost from its requests (b, e, c, len): the span of their slices, the events
    it stores, plus their own costs (impressions, override events)."""
    sl = [(b, e) for b, e, _, n in rows if n > 0]
    span = max(e for _, e in sl) - min(b for b, _ in sl) if sl else 0
    return span + sum(c for _, _, c, _ in rows)


def _check_greedy(rows: list[tuple], chunks: list[int], cap: int, where) -> None:
    """The chunks of one (user, set), rows in order: runs 0, 1, ... of consecutive rows, each
    within the cap unless it holds one request, each closed only because the next row would
    overflow it. These properties pin the greedy fill down exactly."""
    assert chunks == sorted(chunks) and sorted(set(chunks)) == list(range(len(set(chunks)))), where
    runs = [[r for r, k in zip(rows, chunks) if k == i] for i in range(len(set(chunks)))]
    for i, run in enumerate(runs):
        assert _cost(run) <= cap or len(run) == 1, (where, i, run)
        if i + 1 < len(runs):
            assert _cost(run + runs[i + 1][:1]) > cap, (where, i, run, runs[i + 1][0])


def assign_chunks(cfg, reqs):
    """Add ``chunk`` to requests (user, _set, req_time, req_id, _b, _e, _c, _len), keeping every
    other column: :func:`pointer.chunk_ids` over each (user, _set)'s sorted rows, as the plans
    call it, exploded back."""
    from pyspark.sql import functions as F

    keys = ["user", "_set"]
    rest = [c for c in reqs.columns if c not in (*keys, "req_time", "req_id")]
    per = reqs.groupBy(*keys).agg(F.sort_array(F.collect_list(F.struct("req_time", "req_id", *rest))).alias("_r"))
    per = per.select(*keys, "_r", pointer.chunk_ids(cfg, F.col("_r")).alias("chunk"))
    z = per.select(*keys, F.explode(F.arrays_zip("_r", "chunk")).alias("_z"))
    return z.select(*keys, *[F.col("_z._r")[c].alias(c) for c in ("req_time", "req_id", *rest)],
                    F.col("_z.chunk").cast("int").alias("chunk"))


def test_assign_chunks_fills_greedily(spark):
    """Slices that jump back (fat overrides elsewhere in the stream), requests without a
    slice (b, e null or 0), a request over the cap, several users and sets in one frame."""
    rng = random.Random(7)
    cap = 30
    rows = []
    for user in (1, 2, 3):
        for s in (0, 1):
            t = 0
            for j in range(rng.randint(1, 40)):
                t += rng.choice([0, 1, 5])  # equal times: req_id orders them
                n = rng.choice([0, 0, 3, 5, 8])
                b = rng.randint(0, 30) if n else None
                c = 45 if (user, s, j) == (2, 1, 4) else rng.randint(0, 12)
                rows.append((user, s, t, f"r{j:02d}", b, None if b is None else b + n, c, n))
    df = spark.createDataFrame(rows, "user long, _set int, req_time long, req_id string, _b long, _e long, "
                                     "_c long, _len long")
    cfg = C.parse(config(5, max_sample_cost=cap))
    got = assign_chunks(cfg, df).toPandas()
    assert len(got) == len(rows)
    assert set(got.columns) == {"user", "_set", "req_time", "req_id", "_b", "_e", "_c", "_len", "chunk"}
    big = 0
    for (user, s), g in got.groupby(["user", "_set"]):
        g = g.sort_values(["req_time", "req_id"])
        reqs = [(0 if b != b else int(b), 0 if e != e else int(e), int(c), int(n))
                for b, e, c, n in zip(g._b, g._e, g._c, g._len)]
        _check_greedy(reqs, g.chunk.tolist(), cap, (user, s))
        big += sum(1 for k in set(g.chunk) if _cost([r for r, x in zip(reqs, g.chunk) if x == k]) > cap)
    assert big >= 1  # the request over the cap is a chunk of its own


@pytest.fixture(scope="module")
def synth_samples(spark, tmp_path_factory):
    """A synthetic lean log with its action log and bot user (about 240 requests a day, 6k
    impressions), built with a small cap: pretrain before the last day, one daily window."""
    d = tmp_path_factory.mktemp("synth")
    s = synth.synth(str(d / "log"), start=START.isoformat(), days=DAYS, users=10, max_seq_len=L,
                    kinds=("lean", "actions"), params=synth.SynthParams(bot_factor=60), log=io.StringIO())
    cfg = C.parse(config(L, max_sample_cost=CAP, actions=True))
    out = str(d / "out")
    as_of = START + dt.timedelta(days=DAYS)
    B.build(spark, cfg, str(d / "log" / "lean"), out, as_of.isoformat(), DAYS - 1, 1, str(d / "log" / "actions"))
    cols = ["kind", "window_end", "user", "chunk", "cost", "num_events", "num_impressions", "num_requests",
            "req_time", "req_seq_begin", "req_seq_end", "req_num_imps", "seq_ts"]
    df = delta_io.read(spark, delta_io.table_path(out, "samples")).select(*cols).toPandas()
    return df, s["bot_user_id"]


def test_chunk_cost_is_stored_events_plus_impressions(synth_samples):
    s, bot = synth_samples
    assert (s.cost == s.num_events + s.num_impressions).all()
    assert (s.num_impressions == s.req_num_imps.map(sum)).all()
    over = s[(s.cost > CAP) & (s.num_requests > 1)]
    assert over.empty, over[["user", "chunk", "cost", "num_requests"]]
    per_set = s[s.user == bot].groupby(["kind", "window_end"]).size()
    assert len(per_set) == 2 and per_set.min() > 10, per_set  # the bot fills many chunks in both sets


def test_a_chunk_closes_only_when_the_next_request_would_overflow(synth_samples):
    """For consecutive chunks k, k+1 of a user in a set: chunk k's cost plus what the first
    request r of chunk k+1 would add (its impressions and the events of its slice past
    chunk k's end) exceeds the cap. Lean streams are in time order and a request's slice
    ends at the events strictly before it, so chunk k ends at the events before its last
    request time t, and r's events past it are those of its slice at or after t (all of
    them when the slice is full, L events: then the gap may hold more, so that sum is a
    lower bound, which must exceed the cap on this log just the same)."""
    s, bot = synth_samples
    pairs = 0
    for (kind, we, user), g in s.groupby(["kind", "window_end", "user"]):
        g = g.sort_values("chunk")
        assert g.chunk.tolist() == list(range(len(g)))
        rows = list(g.itertuples())
        for a, nxt in zip(rows, rows[1:]):
            assert a.req_time[-1] <= nxt.req_time[0]  # chunks follow the requests' order
            t = max(a.req_time)
            b, e, k = nxt.req_seq_begin[0], nxt.req_seq_end[0], nxt.req_num_imps[0]
            new_events = sum(1 for ts in nxt.seq_ts[b:e] if ts >= t)
            would = a.cost + k + new_events
            assert would > CAP, (kind, we, user, a.chunk, a.cost, k, new_events)
            pairs += 1
    assert pairs > 20
    # the fill: the bot's chunks (all but each set's last) average well above half the cap
    bots = s[s.user == bot].sort_values(["kind", "window_end", "chunk"])
    full = bots.groupby(["kind", "window_end"]).apply(lambda g: g.cost.iloc[:-1].mean(), include_groups=False)
    assert (full > 0.75 * CAP).all(), full
