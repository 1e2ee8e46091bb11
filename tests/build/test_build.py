"""Build semantics beyond the round trip: daily == range, idempotency, history
restore-and-replay, chunk caps, and cost that grows with data, not days."""

from __future__ import annotations

import datetime as dt
import io
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.support import edgegen
from userwise.pipelines import config as C
from userwise.pipelines.build import daily
from userwise.pipelines.build import range as B
from userwise.pipelines.errors import UserwiseError
from userwise.pipelines.runtime import delta_io

pytestmark = pytest.mark.spark

M, N = 2, 1


def _table(spark, out, name, order):
    df = delta_io.read(spark, delta_io.table_path(out, name))
    return df.toPandas().sort_values(order).reset_index(drop=True)


def _norm(x):
    """Comparable form: arrays to lists, NaN to a marker (NaN != NaN)."""
    if hasattr(x, "tolist"):
        x = x.tolist()
    if isinstance(x, (list, tuple)):
        return [_norm(v) for v in x]
    if isinstance(x, float) and x != x:
        return "NaN"
    return x


def _same(a, b):
    assert list(a.columns) == list(b.columns)
    assert len(a) == len(b)
    for c in a.columns:
        for x, y in zip(a[c], b[c]):
            assert _norm(x) == _norm(y), (c, x, y)


@pytest.fixture(scope="module")
def log(tmp_path_factory):
    return edgegen.make_lean(tmp_path_factory.mktemp("edge"), actions=True)


@pytest.fixture(scope="module")
def ranged(spark, log, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("range"))
    cfg = C.parse(log.config)
    rep = B.build(spark, cfg, log.impressions, out, log.as_of, M, N, log.actions)
    return out, rep


def _days(log):
    """Every UTC day with data in either source (the sane range), up to as-of."""
    dates = set()
    for src in (log.impressions, log.actions):
        dates |= {dt.date.fromisoformat(d.split("=")[1]) for d in os.listdir(src) if d.startswith("date=")}
    first = min(d for d in dates if d.year >= 2000)
    return [first + dt.timedelta(days=i) for i in range((dt.date.fromisoformat(log.as_of) - first).days)]


@pytest.fixture(scope="module")
def dailies(spark, log, tmp_path_factory):
    """The same log run day by day through the daily jobs."""
    out = str(tmp_path_factory.mktemp("daily"))
    cfg = C.parse(log.config)
    T = dt.date.fromisoformat(log.as_of)
    for d in _days(log):
        daily.requests_day(spark, cfg, log.impressions, out, d, log.actions)
        daily.history_day(spark, cfg, out, d)
        if d >= T - dt.timedelta(days=M):
            daily.window_day(spark, cfg, out, d, N)
    daily.pretrain(spark, cfg, out, T, M)
    return out


def test_range_reconciles(ranged, log):
    _, rep = ranged
    assert rep["reconciled"]
    assert rep["rows_read"] == log.rows_read
    assert rep["impressions_in_samples"] == len(log.expected_uids)


def test_daily_jobs_equal_range_build(spark, ranged, dailies):
    out, _ = ranged
    _same(_table(spark, out, "requests", ["date", "req_id"]), _table(spark, dailies, "requests", ["date", "req_id"]))
    _same(_table(spark, out, "samples", ["sample_id"]), _table(spark, dailies, "samples", ["sample_id"]))
    _same(_table(spark, out, "history", ["user"]), _table(spark, dailies, "history", ["user"]))


def test_chunks_respect_the_cap(spark, ranged, log):
    out, _ = ranged
    s = delta_io.read(spark, delta_io.table_path(out, "samples")).toPandas()
    cap = log.config["max_sample_cost"]
    over = s[(s.cost > cap) & (s.num_requests > 1)]
    assert over.empty, over[["user", "chunk", "cost", "num_requests"]]
    heavy = s[s.user == log.heavy_user]
    assert heavy.groupby(["kind", "window_end"]).size().max() > 1, "the heavy user must be split"
    # requests are never split: every (user, request) sits in exactly one sample
    seen = {}
    for _, row in s.iterrows():
        for rid in row.req_id:
            key = (row.user, rid)
            assert key not in seen, key
            seen[key] = row.sample_id
    # the pointer's invariants
    L = log.config["max_seq_len"]
    for _, row in s.iterrows():
        b, e, n = list(row.req_seq_begin), list(row.req_seq_end), len(row.seq_item)
        assert all(0 <= x <= y <= n and y - x <= L for x, y in zip(b, e))
        nonempty = [(x, y) for x, y in zip(b, e) if y > x]
        if n:
            assert min(x for x, _ in nonempty) == 0 and max(y for _, y in nonempty) == n
        keys = list(zip(row.req_time, row.req_id))
        assert keys == sorted(keys)


def test_rerun_same_day_changes_nothing(spark, log, dailies):
    cfg = C.parse(log.config)
    T = dt.date.fromisoformat(log.as_of)
    d = T - dt.timedelta(days=1)
    before = {t: _table(spark, dailies, t, k) for t, k in
              [("requests", ["date", "req_id"]), ("samples", ["sample_id"]), ("history", ["user"])]}
    daily.requests_day(spark, cfg, log.impressions, dailies, d, log.actions)
    daily.history_day(spark, cfg, dailies, d)
    daily.window_day(spark, cfg, dailies, d, N)
    for t, k in [("requests", ["date", "req_id"]), ("samples", ["sample_id"]), ("history", ["user"])]:
        _same(before[t], _table(spark, dailies, t, k))


def test_rerun_older_history_date_derives_the_history_from_events(spark, log, dailies):
    """Rerunning an old date derives the history as of the newest logged date from the
    events table in one job (no restore, no replay, no time travel): the same table."""
    cfg = C.parse(log.config)
    before = _table(spark, dailies, "history", ["user"])
    days = _days(log)
    out = daily.history_day(spark, cfg, dailies, days[1])
    assert out["replayed"] == [d.isoformat() for d in days[2:]]
    _same(before, _table(spark, dailies, "history", ["user"]))
    logged = delta_io.read(spark, delta_io.table_path(dailies, "history_log")).toPandas()
    assert sorted(logged.date) == days
    # the rerun date and every later one are held by the one version the derivation wrote
    v = dict(zip(logged.date, logged.version))
    current = delta_io.version(spark, delta_io.table_path(dailies, "history"))
    assert {int(v[d]) for d in days[1:]} == {current}
    assert all(int(v[d]) < current for d in days[:1])


def test_window_days_must_divide():
    with pytest.raises(UserwiseError, match="does not divide"):
        B.windows(dt.date(2026, 1, 10), 5, 2)
    assert len(B.windows(dt.date(2026, 1, 10), 4, 2)) == 2


def _sparse_log(path, years: int):
    """A few requests a month over ``years`` years, ending on 2026-01-10."""
    rows = []
    end = dt.date(2026, 1, 10)
    start = end - dt.timedelta(days=365 * years)
    d, k = start, 0
    while d < end:
        t = edgegen.ms(d, 12)
        for u in (1, 2):
            k += 1
            rows.append(dict(date=d, user_id=u, request_id=f"r{k}", request_ts=t, action_ts=t + 1000,
                             item_id=k % 50, position=0, click=1, like=0, category=1, author=2,
                             device="ios", hour=12, age_bucket=1, country="de", score=0.5))
        d += dt.timedelta(days=9)
    from userwise import schemas as S

    t = pa.Table.from_pylist(rows, schema=S.SYNTH_IMPRESSIONS.to_arrow())
    pq.write_to_dataset(t, str(path), partition_cols=["date"])
    return str(path)


def test_years_of_log_build_in_the_same_number_of_jobs(spark, tmp_path, log):
    """Cost grows with the data, not with the number of days: 1 year and 3 years of log
    with the same M run the same number of Spark jobs."""
    cfg = C.parse({**log.config, "columns": {k: v for k, v in log.config["columns"].items() if k != "actions"}})
    sc = spark.sparkContext
    jobs = {}
    for years in (1, 3):
        inp = _sparse_log(tmp_path / f"in{years}", years)
        group = f"years-{years}"
        sc.setJobGroup(group, group)
        rep = B.build(spark, cfg, inp, str(tmp_path / f"out{years}"), "2026-01-10", 2, 1)
        assert rep["reconciled"] and rep["impressions_in_samples"] > 0
        jobs[years] = len(sc.statusTracker().getJobIdsForGroup(group))
    sc.setJobGroup("", "")
    # Three times the days, about the same jobs (a few more files to list is all), and far
    # fewer jobs than days.
    assert jobs[3] <= jobs[1] * 1.1, jobs
    assert jobs[1] < 365 / 2, jobs


def test_synthetic_fat_log_report_storage_ratio_and_one_file_per_set(spark, tmp_path):
    """On the synthetic fat-row log the report's storage ratio (fat-row bytes as written /
    user-wise sample bytes) is above 1. A fat range build writes all its sets from one plan;
    rebalanced by set, a small set is one file, not one file per task and set."""
    from userwise.pipelines.tools.synth import synth

    syn = tmp_path / "syn"
    synth(str(syn), days=3, users=40, kinds=("fat",), seed=3, log=io.StringIO())
    cfg = C.load(str(syn / "config_fat.yaml"))
    out = tmp_path / "out"
    # at test sizes AQE would fold every stage into one task, and any write into one file per set
    key = "spark.sql.adaptive.coalescePartitions.enabled"
    was = spark.conf.get(key)
    spark.conf.set(key, "false")
    try:
        rep = B.build(spark, cfg, str(syn / "fat"), str(out), "2026-01-04", 2, 1)
    finally:
        spark.conf.set(key, was)
    assert rep["reconciled"] and rep["impressions_in_samples"] > 0
    assert [(s["kind"], s["window_end"]) for s in rep["sets"]] == [
        ("pretrain", "2026-01-02"), ("incremental", "2026-01-03"), ("incremental", "2026-01-04")]
    assert rep["storage_ratio"] > 1, json.dumps({k: rep[k] for k in ("bytes_in", "bytes_out", "storage_ratio")})
    for s in rep["sets"]:
        part = out / "samples" / f"kind={s['kind']}" / f"window_end={s['window_end']}"
        assert len(list(part.glob("*.parquet"))) == 1, sorted(p.name for p in part.iterdir())
