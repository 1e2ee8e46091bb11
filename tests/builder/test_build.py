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
from userwise.pipelines.builder import build as B
from userwise.pipelines.builder import daily
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
    return _daily_chain(spark, log, str(tmp_path_factory.mktemp("daily")))


def _daily_chain(spark, log, out: str) -> str:
    """``log`` day by day through the daily jobs into ``out``: each day's requests and history,
    the windows of the last M days, then the pretrain set."""
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


def test_tables_explain_themselves(spark, ranged, dailies, log):
    """Every column of every published table carries its schema doc as its Delta column
    comment, in the range build and after the daily jobs (replaceWhere reruns, the history's
    MERGE); the tables that hold an action mask name its bits, read back without Spark."""
    from deltalake import DeltaTable

    from userwise import schemas as S
    from userwise.pipelines.records import build_record
    from userwise.schemas.core import COMMENT

    labels = list(C.parse(log.config).action_labels)
    assert labels == ["click", "like"]
    for out in (ranged[0], dailies):
        _, layout, _ = build_record.load(out)
        schemas = {"requests": S.requests_schema(layout), "events": S.events_schema(layout),
                   "history": S.history_schema(layout), "samples": S.samples_schema(layout),
                   "quarantine": S.QUARANTINE, "history_log": S.HISTORY_LOG, "id_stats": S.ID_STATS}
        assert set(schemas) == set(S.BUILD_TABLES)
        for name, schema in schemas.items():
            t = DeltaTable(delta_io.table_path(out, name))
            got = {f.name: (f.metadata or {}).get(COMMENT) for f in t.schema().fields}
            assert got == {f.name: f.doc for f in schema.fields} and all(got.values()), (out, name)
            bits = t.metadata().configuration.get(S.ACTION_BITS)
            assert (bits is not None) == (name in ("requests", "events", "history", "samples")), (out, name)
            if bits is not None:
                assert S.action_bits(delta_io.table_path(out, name)) == labels
        assert S.action_bits(out) == labels
    described = spark.sql(f"DESCRIBE TABLE delta.`{delta_io.table_path(dailies, 'samples')}`").collect()
    assert {r.col_name: r.comment for r in described if r.col_name == "seq_action"} == \
        {"seq_action": S.samples_schema(build_record.load(dailies)[1]).field("seq_action").doc}
    # every stored event is an action of known labels; click and like both occur
    masks = pa.compute.unique(pa.compute.list_flatten(
        delta_io.read_small(delta_io.table_path(dailies, "samples"), ["seq_action"]).column("seq_action")))
    assert set(masks.to_pylist()) <= set(range(1, 1 << len(labels)))
    assert {n for m in masks.to_pylist() for n in S.decode_action(m, labels)} == set(labels)
    assert S.decode_action(3, labels) == ["click", "like"] and S.decode_action(2, labels) == ["like"]


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


def _files(out, table) -> int:
    """Data files of a table's current version (from its log)."""
    from deltalake import DeltaTable

    return len(DeltaTable(delta_io.table_path(out, table)).file_uris())


def test_years_of_log_build_in_the_same_number_of_jobs(spark, tmp_path, log):
    """Cost grows with the data, not with the number of days: 1 year and 3 years of log
    with the same M run the same number of Spark jobs and write the same few files per
    table (no partition per day); rerunning one day's requests job replaces exactly that
    day's rows, and date filters skip the files that cannot hold the date."""
    import pyarrow.dataset as pds

    cfg = C.parse({**log.config, "columns": {k: v for k, v in log.config["columns"].items() if k != "actions"}})
    sc = spark.sparkContext
    jobs, files = {}, {}
    for years in (1, 3):
        inp = _sparse_log(tmp_path / f"in{years}", years)
        out = str(tmp_path / f"out{years}")
        group = f"years-{years}"
        sc.setJobGroup(group, group)
        rep = B.build(spark, cfg, inp, out, "2026-01-10", 2, 1)
        assert rep["reconciled"] and rep["impressions_in_samples"] > 0
        jobs[years] = len(sc.statusTracker().getJobIdsForGroup(group))
        files[years] = {t: _files(out, t) for t in ("requests", "events", "quarantine")}
    sc.setJobGroup("", "")
    # Three times the days, about the same jobs (a few more files to list is all), and far
    # fewer jobs than days.
    assert jobs[3] <= jobs[1] * 1.1, jobs
    assert jobs[1] < 365 / 2, jobs
    # 41 and 122 days of data: at most one file per shuffle partition, whatever the days
    cap = int(spark.conf.get("spark.sql.shuffle.partitions"))
    assert files[3] == files[1] and all(n <= cap for n in files[3].values()), files

    out = str(tmp_path / "out3")
    days = sorted(r["date"] for r in delta_io.read(spark, delta_io.table_path(out, "requests"))
                  .select("date").distinct().collect())
    assert len(days) > 100
    day = days[len(days) // 2]

    def rows(table):
        df = delta_io.read(spark, delta_io.table_path(out, table))
        key = [f.name for f in df.schema.fields if f.dataType.typeName() != "array"]
        return df.toPandas().sort_values(key).reset_index(drop=True)

    before = {t: rows(t) for t in ("requests", "events")}
    daily.requests_day(spark, cfg, str(tmp_path / "in3"), out, day)
    for t in ("requests", "events"):
        after = rows(t)
        for on_day in (True, False):
            a, b = ((x[(x["date"] == day) == on_day]).reset_index(drop=True) for x in (before[t], after))
            assert len(a) > 0, (t, on_day)
            _same(a, b)
        # the day's own file, and the run it was cut from rewritten without it; a filter on
        # another date skips the day's file by its statistics
        assert _files(out, t) <= files[3][t] + 1
        ds = delta_io.dataset(delta_io.table_path(out, t))
        assert len(list(ds.get_fragments(filter=pds.field("date") == days[0]))) < len(list(ds.get_fragments()))


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


# --------------------------------------------------------------------------- a month of windows
MONTH_AS_OF = dt.date(2026, 2, 4)


def _month_log(root):
    """34 days of a few users: late actions, action-log events at midnight and at a request's
    own time, a user who is quiet for three weeks (its base crosses many windows), short
    sequences (L = 3, H = 5) and a low cost cap, so truncation and chunks happen daily."""
    import random

    rng = random.Random(31)
    g = edgegen._Log()
    start = MONTH_AS_OF - dt.timedelta(days=34)
    for i in range(34):
        d = start + dt.timedelta(days=i)
        for u in (1, 2, 3, 4):
            if u == 4 and 3 <= i < 25:
                continue
            for r in range(rng.randint(2, 4) if u == 1 else rng.randint(0, 2)):
                rts = edgegen.ms(d, rng.randint(0, 23), rng.randint(0, 59))
                items = [(rng.randint(1, 40), int(rng.random() < 0.5), int(rng.random() < 0.2),
                          rng.choice([1500, 1500, 1500, 86_400_000])) for _ in range(rng.randint(1, 3))]
                g.request(u, f"u{u}-{i}-{r}", rts, items)
                if rng.random() < 0.2:
                    g.act(u, rng.randint(1, 40), rts, 1)  # at the request's own time: not visible to it
            if rng.random() < 0.3:
                g.act(u, rng.randint(1, 40), edgegen.ms(d), 2)  # exactly midnight: in the day it starts
    imp = edgegen._write(g.rows, edgegen._imp_fields(False, False), root / "lean")
    act = edgegen._write(g.actions, edgegen.ACT_FIELDS, root / "actions")
    cfg = edgegen.lean_config(True, max_seq_len=3, history_length=5, max_sample_cost=14)
    return imp, act, cfg


MONTH_RUNS = [(2, 1), (30, 1), (30, 3)]


@pytest.fixture(scope="module")
def month(spark, tmp_path_factory):
    """The month log built with M=2/N=1, M=30/N=1 and M=30/N=3; Spark jobs of each build."""
    root = tmp_path_factory.mktemp("month")
    imp, act, cfg_d = _month_log(root)
    cfg = C.parse(cfg_d)
    sc = spark.sparkContext
    outs, jobs, reps = {}, {}, {}
    for m, n in MONTH_RUNS:
        group = f"month-{m}-{n}"
        out = str(root / f"out-{m}-{n}")
        sc.setJobGroup(group, group)
        try:
            reps[(m, n)] = B.build(spark, cfg, imp, out, MONTH_AS_OF.isoformat(), m, n, act)
        finally:
            sc.setJobGroup("", "")
        jobs[(m, n)] = len(sc.statusTracker().getJobIdsForGroup(group))
        outs[(m, n)] = out
    return dict(root=root, imp=imp, act=act, cfg_d=cfg_d, cfg=cfg, outs=outs, jobs=jobs, reps=reps)


def test_a_month_of_windows_runs_the_jobs_of_two_days(month):
    """M = 30 windows of one day (and of three) run within 10% of the Spark jobs of M = 2."""
    jobs = month["jobs"]
    print("spark jobs by (M, N):", jobs)
    assert jobs[(30, 1)] <= jobs[(2, 1)] * 1.1, jobs
    assert jobs[(30, 3)] <= jobs[(2, 1)] * 1.1, jobs
    assert [s["window_end"] for s in month["reps"][(30, 1)]["sets"]][1:] == [
        (MONTH_AS_OF - dt.timedelta(days=29 - k)).isoformat() for k in range(30)]


@pytest.mark.parametrize("mn", [(30, 1), (30, 3)], ids=["M30-N1", "M30-N3"])
def test_a_month_of_windows_round_trips_to_the_oracle(month, mn, tmp_path):
    from tests.support import oracle as O
    from userwise.pipelines import cli

    rep = month["reps"][mn]
    assert rep["reconciled"] and rep["quarantined"] == {}
    assert rep["extra_chunks"] > 0, "the cost cap must split some samples"
    dest = tmp_path / "expanded"
    assert cli.main(["expand", "--build-dir", month["outs"][mn], "--expanded", str(dest)]) == 0
    got = O.read_parquet_dir(dest)
    want = O.expected_pointwise(month["imp"], month["cfg_d"], MONTH_AS_OF.isoformat(), [],
                                actions_path=month["act"], rejected_actions=[])
    assert len(got) == len(want) > 0
    assert O.frame_diff(got.select(want.columns), want) == []


def test_daily_window_and_history_jobs_equal_the_month_build(spark, month, tmp_path):
    """On a copy of the M=30/N=1 build: window_day of three dates (the first window, the
    day the quiet user returns, the last) rewrites its set with the same rows; the history
    derived as of T-6 and MERGEd day by day to T-1 equals the build's; rerunning an old
    history date gives it again."""
    import shutil

    src = month["outs"][(30, 1)]
    dst = str(tmp_path / "copy")
    shutil.copytree(src, dst)
    cfg = month["cfg"]
    T = MONTH_AS_OF
    dates = [T - dt.timedelta(days=30), T - dt.timedelta(days=34 - 25), T - dt.timedelta(days=1)]
    for d in dates:
        daily.window_day(spark, cfg, dst, d, 1)
    for d in dates:
        we = d + dt.timedelta(days=1)
        want = delta_io.read(spark, delta_io.table_path(src, "samples")).where(f"window_end = '{we}'")
        got = delta_io.read(spark, delta_io.table_path(dst, "samples")).where(f"window_end = '{we}'")
        a, b = (x.toPandas().sort_values("sample_id").reset_index(drop=True) for x in (want, got))
        assert len(a) > 0
        _same(a, b)
    from userwise.pipelines.builder.history import History
    from userwise.pipelines.records import build_record

    _, layout, _ = build_record.load(dst)
    History(spark, cfg, layout, dst).derive(T - dt.timedelta(days=6), since=dt.date(1970, 1, 1))
    for k in range(5, 0, -1):
        out = daily.history_day(spark, cfg, dst, T - dt.timedelta(days=k))
        assert out["replayed"] == []
    _same(_table(spark, src, "history", ["user"]), _table(spark, dst, "history", ["user"]))
    out = daily.history_day(spark, cfg, dst, T - dt.timedelta(days=4))
    assert out["replayed"] == [(T - dt.timedelta(days=k)).isoformat() for k in (3, 2, 1)]
    _same(_table(spark, src, "history", ["user"]), _table(spark, dst, "history", ["user"]))


def test_backfill_of_the_month_in_one_go_equals_the_range_build(spark, month, tmp_path):
    """`userwise backfill` over all 34 days writes its tables in one go: every daily window
    the range build (M=30, N=1) has, the same rows; the same requests and history; and the
    Spark jobs of a 3-day backfill."""
    from userwise.pipelines.manage import backfill

    T = MONTH_AS_OF
    sc = spark.sparkContext
    jobs, outs = {}, {}
    for first in (T - dt.timedelta(days=34), T - dt.timedelta(days=3)):
        group = f"backfill-{first}"
        out = str(tmp_path / f"bf-{first}")
        sc.setJobGroup(group, group)
        try:
            res = backfill.backfill(spark, month["cfg"], date_from=first, date_to=T - dt.timedelta(days=1),
                                    input_path=month["imp"], build_dir=out, actions_path=month["act"],
                                    log=lambda _: None)
        finally:
            sc.setJobGroup("", "")
        assert len(res["built"]) == (T - first).days and res["skipped"] == []
        jobs[(T - first).days] = len(sc.statusTracker().getJobIdsForGroup(group))
        outs[(T - first).days] = out
    print("backfill spark jobs by days:", jobs)
    assert jobs[34] <= jobs[3] * 1.1, jobs
    src, bf = month["outs"][(30, 1)], outs[34]
    _same(_table(spark, src, "requests", ["date", "req_id"]), _table(spark, bf, "requests", ["date", "req_id"]))
    _same(_table(spark, src, "history", ["user"]), _table(spark, bf, "history", ["user"]))
    ends = [(T - dt.timedelta(days=k)).isoformat() for k in range(30)]
    where = f"kind = 'incremental' AND window_end IN ({', '.join(repr(e) for e in ends)})"
    a, b = (delta_io.read(spark, delta_io.table_path(o, "samples")).where(where).toPandas()
            .sort_values("sample_id").reset_index(drop=True) for o in (src, bf))
    assert len(a) > 0 and sorted(set(a.window_end.astype(str))) == sorted(ends)
    _same(a, b)
