"""Arrival times (docs/pointer.md, "What serving had"): the config, the layout, validate's
warnings, and on Spark: the daily jobs equal a range build on a log of late arrivals (the
history included), an arrival column equal to action time + availability_lag builds the
lag's samples, and an arrival column costs at most 2 more Spark jobs.

The round trip on late arrivals of every kind (against tests/support/oracle.py) is in
tests/builder/test_roundtrip.py (the ``arrival`` case); the leakage property draws arrival
delays (tests/reliability/test_leakage.py)."""

from __future__ import annotations

import copy
import datetime as dt

import pyarrow as pa
import pyarrow.dataset as ds
import pytest

from tests.builder.test_build import _daily_chain, _same, _table
from tests.support import edgegen as E
from tests.support.common import LEAN_CFG, fat_cfg
from userwise import schemas as S
from userwise.pipelines import config as C
from userwise.pipelines.builder import build as B
from userwise.pipelines.builder.validate import sample_problems
from userwise.schemas import reasons as R

M, N = 2, 1


def _cfg(arrival="action_ts", actions_arrival=None, **top):
    c = copy.deepcopy(LEAN_CFG)
    c.update(top)
    if arrival:
        c["columns"]["arrival_time"] = arrival
    if actions_arrival:
        c["columns"]["actions"] = {"user": "uid", "item": "iid", "time": "ts", "labels": "bits", "arrival": "arr",
                                   "item_features": ["cat", "auth"]}
    return c


def _schema(with_arrival: bool) -> pa.Schema:
    s = S.SYNTH_IMPRESSIONS.to_arrow()
    return s.append(pa.field("arrival_ts", pa.int64())) if with_arrival else s


# --------------------------------------------------------------------------
# config and layout (no JVM)
# --------------------------------------------------------------------------
def test_arrival_keys_parse_with_their_defaults_and_refuse_bad_values():
    c = C.parse(_cfg("arrival_ts", actions_arrival=True))
    assert c.arrivals and c.skew_units == 300_000 and c.null_arrival == "lag"
    assert c.actions.arrival == "arr" and C.parse(c.to_dict()) == c
    assert not C.parse(LEAN_CFG).arrivals
    assert C.parse(_cfg(None, actions_arrival=True)).arrivals  # the action log's alone
    assert C.parse(_cfg("arrival_ts", arrival_skew="30s", time_unit="s")).skew_units == 30
    for over, key, words in [({"null_arrival": "drop"}, "null_arrival", "not one of"),
                             ({"arrival_skew": "5 minutes"}, "arrival_skew", "with its unit"),
                             ({"arrival_skew": "1500us"}, "arrival_skew", "whole number")]:
        with pytest.raises(C.ConfigError) as e:
            C.parse(_cfg("arrival_ts", **over))
        assert e.value.key == key and words in str(e.value), (over, str(e.value))
    with pytest.raises(C.ConfigError) as e:
        C.parse({**fat_cfg(), "columns": {**fat_cfg()["columns"], "arrival_time": "request_ts"}})
    assert e.value.key == "columns.arrival_time" and "fat rows" in str(e.value)


def test_the_arrival_column_must_exist_and_be_a_time():
    with pytest.raises(C.ConfigError) as e:
        C.parse(_cfg("arival_ts")).layout(_schema(True))
    assert e.value.key == "columns.arrival_time" and "did you mean 'arrival_ts'" in str(e.value)
    with pytest.raises(C.ConfigError) as e:
        C.parse(_cfg("device")).layout(_schema(True))
    assert e.value.key == "columns.arrival_time" and "expected integer epoch" in str(e.value)


def test_without_an_arrival_column_the_layout_and_tables_are_todays():
    """No arrival column: no arrival field in any table, the roles and the order as without
    the feature; with one, exactly one field more per table (last), arrival leading the order,
    and the event chain over the same fields."""
    plain = C.parse(LEAN_CFG).layout(_schema(True))  # the column unmapped: carried through as any other
    arr = C.parse(_cfg("arrival_ts")).layout(_schema(True))
    assert "arrival_time" not in plain.roles() and "arrivals" not in plain.roles()
    assert [sf.name for sf in plain.seq_fields] == ["ts", "item", "category", "author", "action"]
    assert S.sort_key(plain)[0] == "ev_ts"
    for table in (S.samples_schema, S.events_schema, S.history_schema):
        names = table(plain).names
        assert not [n for n in names if n.endswith("_arrival")], (table, names)
        with_arrival = table(arr).names
        assert [n for n in with_arrival if n not in names] == [n for n in with_arrival if n.endswith("_arrival")]
        assert len(with_arrival) == len(names) + 1
    assert [sf.name for sf in arr.seq_fields] == ["ts", "item", "category", "author", "action", "arrival"]
    assert S.sort_key(arr) == ["ev_arrival"] + S.sort_key(plain)
    assert S.chain_fields(arr) == S.chain_fields(plain)
    assert arr.roles()["arrival_time"] == "arrival_ts"


def test_validate_warns_about_each_kind_of_bad_arrival():
    t0 = E.ms(E.day(2), 10)
    rows = [  # (request_ts, action_ts, click, arrival)
        (t0, t0 + 1000, 1, t0 + 2000),  # fine
        (t0, t0 + 1000, 1, None),  # null
        (t0, t0 + 1000, 1, E.ms(dt.date(1999, 1, 1))),  # outside the sane range
        (t0, t0 + 600_000, 1, t0 + 60_000),  # 9 minutes before its action
        (t0, t0 + 1000, 1, t0 - 1),  # before its own request
        (t0, t0, 0, None),  # not an action: nothing to say
    ]
    table = pa.table({"request_ts": [r[0] for r in rows], "action_ts": [r[1] for r in rows],
                      "click": [r[2] for r in rows], "like": [0] * len(rows), "user_id": [1] * len(rows),
                      "request_id": [f"r{k}" for k in range(len(rows))],
                      "item_id": [1] * len(rows), "arrival_ts": pa.array([r[3] for r in rows], pa.int64())})
    c = C.parse(_cfg("arrival_ts", min_year=2000, max_year=2100))
    got = [p for p in sample_problems(c, table) if "arrival" in p]
    assert len(got) == 4, got
    assert "null arrival_time" in got[0] and "availability_lag" in got[0]
    assert "bad_time" in got[1] and "arrival_before_action" in got[2] and "arrival_before_request" in got[3]
    q = [p for p in sample_problems(C.parse(_cfg("arrival_ts", null_arrival="quarantine")), table) if "null" in p]
    assert q and "null_arrival_time" in q[0]
    assert not [p for p in sample_problems(C.parse(LEAN_CFG), table) if "arrival" in p]


# --------------------------------------------------------------------------
# Spark
# --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def log(tmp_path_factory):
    return E.make_lean(tmp_path_factory.mktemp("arrival"), actions=True, arrival=True)


@pytest.fixture(scope="module")
def ranged(spark, log, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("range"))
    rep = B.build(spark, C.parse(log.config), log.impressions, out, log.as_of, M, N, log.actions)
    return out, rep


@pytest.fixture(scope="module")
def dailies(spark, log, tmp_path_factory):
    """The arrival log day by day through the daily jobs (the action log filed by arrival day)."""
    return _daily_chain(spark, log, str(tmp_path_factory.mktemp("daily")))


@pytest.mark.spark
def test_daily_jobs_equal_the_range_build_on_late_arrivals(spark, ranged, dailies, log):
    """Ingested day by day (late impression actions filed under their request's day, the
    action log under its arrival's), the history merged day by day (by arrival) and each
    window taking its base from the events: the same requests, samples and history as the
    range build, which holds late arrivals in the samples and the history."""
    out, rep = ranged
    assert rep["reconciled"] and rep["arrivals_filled"] == 1 and rep["actions_arrivals_filled"] == 1
    for table, key in [("requests", ["date", "req_id"]), ("samples", ["sample_id"]), ("history", ["user"])]:
        _same(_table(spark, out, table, key), _table(spark, dailies, table, key))
    h = _table(spark, out, "history", ["user"])
    mine = h[h.user == E.ARRIVAL_USER].iloc[0]
    arrivals = list(mine.ev_arrival)
    assert arrivals == sorted(arrivals) and max(arrivals) < E.AS_OF_MS  # as of as-of: what had arrived
    assert 707 not in list(mine.ev_item) and 740 not in list(mine.ev_item)  # arrived after as-of
    items = list(mine.ev_item)
    assert items.index(704) < items.index(703)  # 703 acted first, arrived an hour later


def _with_arrival_at_lag(log: E.EdgeLog, root) -> tuple[str, str]:
    """The lag log with arrival columns equal to action time + LAG (null where no action)."""
    def rewrite(src, dst, col, time, acted):
        t = ds.dataset(src, format="parquet", partitioning="hive").to_table()
        vals = [a + E.LAG_MS if ok and a is not None else None for a, ok in zip(t.column(time).to_pylist(), acted(t))]
        t = t.append_column(col, pa.array(vals, pa.int64()))
        part = ds.partitioning(pa.schema([pa.field("date", pa.string())]), flavor="hive")
        order = [n for n in t.column_names if n != "date"] + ["date"]
        ds.write_dataset(t.select(order), str(dst), format="parquet", partitioning=part,
                         basename_template="part-{i}.parquet")
        return str(dst)

    imp = rewrite(log.impressions, root / "lean", E.ARRIVAL_COLUMN, "action_ts",
                  lambda t: [(c or 0) > 0 or (k or 0) > 0 for c, k in zip(t.column("click").to_pylist(),
                                                                          t.column("like").to_pylist())])
    act = rewrite(log.actions, root / "actions", E.ACTION_ARRIVAL_COLUMN, "ts",
                  lambda t: [ts is not None for ts in t.column("ts").to_pylist()])
    return imp, act


def _jobs(spark, group, run):
    sc = spark.sparkContext
    sc.setJobGroup(group, group)
    try:
        rep = run()
    finally:
        sc.setJobGroup("", "")
    return rep, len(sc.statusTracker().getJobIdsForGroup(group))


@pytest.mark.spark
def test_an_arrival_at_action_time_plus_the_lag_builds_the_lags_samples_in_at_most_two_more_jobs(
        spark, tmp_path):
    """Arrival = action time + D is what a log without an arrival column means: the same samples
    (less seq_arrival: every pointer, chunk, stored event and chain), and the arrival column
    costs at most 2 more Spark jobs than the lag alone."""
    lag = E.make_lean(tmp_path / "lag", actions=True, lag=True)
    imp, act = _with_arrival_at_lag(lag, tmp_path / "arr")
    cfg_arr = copy.deepcopy(lag.config)
    cfg_arr["columns"]["arrival_time"] = E.ARRIVAL_COLUMN
    cfg_arr["columns"]["actions"] = dict(cfg_arr["columns"]["actions"], arrival=E.ACTION_ARRIVAL_COLUMN)
    a, b = str(tmp_path / "out-lag"), str(tmp_path / "out-arr")
    rep_lag, jobs_lag = _jobs(spark, "lag", lambda: B.build(spark, C.parse(lag.config), lag.impressions, a,
                                                            lag.as_of, 3, 1, lag.actions))
    rep_arr, jobs_arr = _jobs(spark, "arr", lambda: B.build(spark, C.parse(cfg_arr), imp, b, lag.as_of, 3, 1, act))
    assert rep_lag["reconciled"] and rep_arr["reconciled"]
    assert rep_arr["impressions_in_samples"] == rep_lag["impressions_in_samples"] > 0
    print("spark jobs: lag", jobs_lag, "arrival column", jobs_arr)
    assert jobs_arr <= jobs_lag + 2, (jobs_lag, jobs_arr)
    want = _table(spark, a, "samples", ["sample_id"])
    got = _table(spark, b, "samples", ["sample_id"])
    assert "seq_arrival" in got.columns and "seq_arrival" not in want.columns
    for arr, ts in zip(got.seq_arrival, got.seq_ts):
        assert [x - E.LAG_MS for x in arr] == list(ts)
    got = got.drop(columns=["seq_arrival", S.IMP + E.ARRIVAL_COLUMN])
    _same(want, got)


@pytest.mark.spark
def test_null_arrival_quarantine_policy_quarantines_null_arrivals_and_reconciles(spark, tmp_path):
    """``null_arrival: quarantine``: an action (of the impressions or the action log) without an
    arrival is quarantined as null_arrival_time, a row without an action keeps its null; the
    counts reconcile."""
    t = E.ms(E.day(4), 10)
    g = E._Log()
    g.request(1, "a", t, [(10, 1, 0, E.SEC)], arrival=t + 2 * E.SEC)
    g.request(1, "b", t + 60 * E.SEC, [(11, 1, 0, E.SEC)], arrival=None, reason=R.NULL_ARRIVAL_TIME)
    g.request(1, "c", t + 120 * E.SEC, [(12, 0, 0, 0)], arrival=None)
    g.act(1, 13, t + 30 * E.SEC, 1, arrival=None)
    g.act(1, 14, t + 31 * E.SEC, 1, arrival=t + 31 * E.SEC)
    imp = E._write(g.rows, E._imp_fields(False, False) + [(E.ARRIVAL_COLUMN, pa.int64())], tmp_path / "lean")
    act = E._write(g.actions, E.ACT_FIELDS + [(E.ACTION_ARRIVAL_COLUMN, pa.int64())], tmp_path / "actions")
    cfg = E.arrival_config(actions=True, null_arrival="quarantine", max_quarantine_share=1.0)
    out = str(tmp_path / "out")
    rep = B.build(spark, C.parse(cfg), imp, out, E.AS_OF, 1, 1, act)
    assert rep["reconciled"] and rep["quarantined"] == {R.NULL_ARRIVAL_TIME: 1}, rep["quarantined"]
    assert rep["actions_quarantined"] == {R.NULL_ARRIVAL_TIME: 1} and rep["arrivals_filled"] == 0
    s = _table(spark, out, "samples", ["sample_id"])
    assert list(s.iloc[0].seq_item) == [10, 14]  # b's click and action 13 are out
