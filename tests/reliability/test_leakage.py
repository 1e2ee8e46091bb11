"""Leakage, as a property: over random small logs, no impression sees the future or its own request.

Each example draws a tiny lean log (a few users and requests, items 1..4) whose times come
from a handful of values so that ties happen everywhere: request times at 00:00:00.000,
00:00:00.001, 12:00 and 23:59:59.999 of four days, actions 0 ms, 1 ms, half a day, a day
less 1 ms, a day or a day and 1 ms after their request (late actions land on later days,
across window boundaries and after as-of, on the time of other requests). A user has one
request, another has more impressions than ``max_sample_cost`` (chunks), rows are duplicated,
input rows are shuffled, and some logs come with an action log whose events tie with the
impressions' actions. The logs of the long-L test have a long L (:data:`LONG_L`, production's
thousands): the heavy user then also has L - 2 to L + 1 action-log events (in tied pairs) the day
before the first request day, so that her histories reach L exactly around the truncation
boundary, and each of her requests is a chunk of its own. The log is built (M = 1 or 2 days of
one-day windows after a pretrain set) and expanded in-process on the shared Spark session, and then:

(a) every expanded impression's history holds only events strictly before its request
    time less the availability lag D (drawn: none, 1 ms or half a day, so that actions tie
    with request times less D too), and none of its own request: each request's impressions
    carry a token of their own in the item feature ``author``, which the history's
    ``seq_author`` shows;
(b) the expanded rows equal the independent oracle's (tests/support/oracle.py);
(c) the counts reconcile against the ground truth (the report's ``reconciled`` and each term).

Some logs come with arrival columns (docs/pointer.md, "What serving had"): each action arrives
a drawn delay after its action time (0, 1 ms, half a day, a day and 1 ms; 1 ms or a minute
before it, within ``arrival_skew``; null: at its action time + the lag; never before its own
request, where it is moved to exactly that time), and then:

(a) holds for the arrival: every history event arrived strictly before its request's time;
(d) a perturbation of every event that arrived at or after a time T never changes what a
    request at or before T sees: user 2 is copied whole as user 102 (requests ``p...``), the
    copy's events that arrived at or after T (one of user 2's request times) get other items
    and later arrivals, and one more event arrives at exactly T; each copied request at or
    before T sees exactly what its original sees.

The test command runs a few derandomized examples (a few seconds of Spark each);
``USERWISE_HYPOTHESIS_EXAMPLES=200`` runs more (CONTRIBUTING.md, "Tests").
"""

from __future__ import annotations

import datetime as dt
import json
import os
from collections import Counter

import pyarrow as pa
import pyarrow.dataset as ds
import pytest
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

from tests.builder.test_roundtrip import assert_same_rows, build_argv, oracle_for, run_cli
from tests.support import edgegen as E
from tests.support import oracle as O
from tests.support.common import config
from userwise.schemas import reasons as R

EXAMPLES = int(os.environ.get("USERWISE_HYPOTHESIS_EXAMPLES", "4"))

AS_OF = dt.date(2026, 3, 6)
DAYS = [AS_OF - dt.timedelta(days=k) for k in (3, 2, 1, 0)]  # the last one: at/after as-of
DAY = E.DAY
TIMES_OF_DAY = [0, 1, DAY // 2, DAY - 1]
DWELLS = [0, 1, DAY // 2, DAY - 1, DAY, DAY + 1]
ACTION_LOG_TOKEN = 0  # `auth` of action-log events; requests' tokens start at 1
LAGS = {0: 0, 1: "1ms", DAY // 2: "12h"}  # availability lags (ms) and how the config writes them
LONG_L = 4000
ARRIVAL_DELAYS = [0, 1, DAY // 2, DAY + 1, -1, -60_000, None]  # after the action time (None: null, the lag)
ARRIVAL, ACTION_ARRIVAL = E.ARRIVAL_COLUMN, E.ACTION_ARRIVAL_COLUMN
CLONE = 100  # user 2's copy is user 102, its requests' tokens 1000 more


def _acted(r: dict) -> bool:
    return bool(r["click"] or r["like"])


def with_arrivals(draw, rows: list[dict], acts: list[dict] | None, lag: int) -> int:
    """Arrival columns on ``rows`` and ``acts`` (drawn delays, per row_uid so that copies stay
    exact), and user 2's perturbed copy (see the module doc); returns T."""
    for a in acts or []:
        d = draw(st.sampled_from(ARRIVAL_DELAYS), label="action-log arrival delay")
        a[ACTION_ARRIVAL] = None if d is None else a["ts"] + d
    by_uid = {}
    for r in rows:
        if r["row_uid"] not in by_uid:
            d = draw(st.sampled_from(ARRIVAL_DELAYS), label="arrival delay") if _acted(r) else None
            by_uid[r["row_uid"]] = None if d is None else max(r["request_ts"], r["action_ts"] + d)
        r[ARRIVAL] = by_uid[r["row_uid"]]

    def arrived(arrival, at):  # a null arrives at its action time + the lag
        return at + lag if arrival is None else arrival

    # T: one of user 2's request times, or the arrival of one of her events that arrived after
    # its action time; a request of hers (and of the copy) at exactly T is added
    mine = [r for r in rows if r["user_id"] == 2]
    late = {arrived(r[ARRIVAL], r["action_ts"]) for r in mine if _acted(r)} \
        | {arrived(a[ACTION_ARRIVAL], a["ts"]) for a in acts or [] if a["uid"] == 2}
    T = draw(st.sampled_from(sorted({r["request_ts"] for r in mine} | late)), label="T")
    token = max(r["author"] for r in rows) + 1
    rows.append(dict(mine[0], request_id=f"r{token}", request_ts=T, action_ts=T, item_id=1, position=0, click=0,
                     like=0, category=1, author=token, hour=(T // 3_600_000) % 24,
                     row_uid=max(r["row_uid"] for r in rows) + 1, **{ARRIVAL: None}))

    uid = max(r["row_uid"] for r in rows)
    seen = set()
    for r in [r for r in rows if r["user_id"] == 2]:
        if r["row_uid"] in seen:
            continue
        seen.add(r["row_uid"])
        uid += 1
        c = dict(r, user_id=2 + CLONE, request_id="p" + r["request_id"], author=r["author"] + 1000, row_uid=uid)
        if _acted(r) and arrived(r[ARRIVAL], r["action_ts"]) >= T:
            c["item_id"] = r["item_id"] + 10
            c[ARRIVAL] = arrived(r[ARRIVAL], r["action_ts"]) + 1
        rows.append(c)
    for a in [a for a in acts or [] if a["uid"] == 2]:
        c = dict(a, uid=2 + CLONE)
        if arrived(a[ACTION_ARRIVAL], a["ts"]) >= T:
            c["iid"] = a["iid"] + 10
            c[ACTION_ARRIVAL] = arrived(a[ACTION_ARRIVAL], a["ts"]) + 1
        acts.append(c)
    if acts is not None:
        acts.append({"uid": 2 + CLONE, "iid": 20, "ts": T, "bits": 1, "cat": 2, "auth": ACTION_LOG_TOKEN,
                     ACTION_ARRIVAL: T})
    return T


def _ms(d: dt.date, t: int) -> int:
    return E.ms(d) + t


@st.composite
def lean_logs(draw, long: bool = False):
    """(rows, action-log rows, L, max_sample_cost, M, uid of each extra copy, lag in ms); L = LONG_L when
    ``long``."""
    L = draw(st.integers(2, 3), label="max_seq_len")
    cap = draw(st.integers(L + 1, L + 4), label="max_sample_cost")
    M = draw(st.sampled_from([1, 2]), label="incremental_days")
    n_users = draw(st.integers(2, 4), label="users")
    rows: list[dict] = []
    acts: list[dict] = []
    token = 0
    for u in range(1, n_users + 1):
        age, country = draw(st.integers(1, 3)), draw(st.sampled_from(["DE", "US"]))
        # user 1: a single request; user 2: more impressions than any cap (4 requests of 2-3)
        # (on one day before as-of, so that one set holds them all)
        n_req = 1 if u == 1 else 4 if u == 2 else draw(st.integers(1, 4))
        heavy_day = draw(st.sampled_from(DAYS[:-1]))
        for _ in range(n_req):
            token += 1
            rts = _ms(heavy_day if u == 2 else draw(st.sampled_from(DAYS)), draw(st.sampled_from(TIMES_OF_DAY)))
            device = draw(st.sampled_from(["ios", "web"]))
            n_imp = draw(st.integers(2, 3)) if u == 2 else draw(st.integers(1, 3))
            for pos in range(n_imp):
                item = draw(st.integers(1, 4))
                rows.append({
                    "user_id": u, "request_id": f"r{token}", "request_ts": rts,
                    "action_ts": rts + draw(st.sampled_from(DWELLS)),
                    "item_id": item, "position": pos,
                    "click": int(draw(st.booleans())), "like": int(draw(st.integers(0, 3)) == 0),
                    "category": item % 3, "author": token, "device": device,
                    "hour": (rts // 3_600_000) % 24, "age_bucket": age, "country": country, "score": 0.5,
                    "row_uid": len(rows) + 1,
                })
        for _ in range(draw(st.integers(0, 2))):
            item = draw(st.integers(1, 4))
            acts.append({"uid": u, "iid": item,
                         "ts": _ms(draw(st.sampled_from(DAYS)), draw(st.sampled_from(TIMES_OF_DAY + DWELLS))),
                         "bits": draw(st.integers(1, 3)), "cat": item % 3, "auth": ACTION_LOG_TOKEN})
    # exact copies of rows before as-of (one copy stays; the others are quarantined as duplicates)
    before = [r for r in rows if r["request_ts"] < E.ms(AS_OF)]
    copies = draw(st.lists(st.sampled_from(before), max_size=3), label="duplicated rows")
    rows = draw(st.permutations(rows + [dict(r) for r in copies]), label="input order")
    with_actions = bool(acts) and draw(st.booleans(), label="with action log")
    lag = draw(st.sampled_from(sorted(LAGS)), label="availability_lag (ms)")  # last: the draws before stay
    if long:
        # the heavy user's long history, the day before the first request day: her newest L events are cut
        # around the boundary, and each of her requests is a chunk of its own
        cap, L = cap - L + LONG_L, LONG_L
        acts = acts if with_actions else []
        with_actions = True
        first = min(DAYS[:-1]) - dt.timedelta(days=1)
        for k in range(L + draw(st.integers(-2, 1), label="long history less L")):
            item = 1 + k % 4
            acts.append({"uid": 2, "iid": item, "ts": _ms(first, k // 2), "bits": 1 + k % 3, "cat": item % 3,
                         "auth": ACTION_LOG_TOKEN})
    acts = acts if with_actions else None
    T = None
    if not long and draw(st.integers(0, 3), label="arrival columns") > 0:
        T = with_arrivals(draw, rows, acts, lag)
    return rows, acts, L, cap, M, [r["row_uid"] for r in copies], lag, T


def features(rows: list[dict], acts: list[dict] | None, copies: list[int], lag: int = 0, L: int = 2,
             T: int | None = None) -> set[str]:
    """The edge cases a drawn log holds (plain Python over the rows, for coverage)."""
    as_of = E.ms(AS_OF)
    acted = [r for r in rows if r["click"] or r["like"]]
    seen_at = {(r["user_id"], r["request_ts"] - lag) for r in rows}
    times = [r["request_ts"] for r in rows] + [r["action_ts"] for r in acted] + [a["ts"] for a in acts or []]
    per_user = Counter(r["user_id"] for r in {r["request_id"]: r for r in rows}.values())
    out = {
        "duplicated rows": bool(copies),
        "action log": acts is not None,
        "a user with one request": 1 in per_user.values(),
        "late actions": any(E.date_of(r["action_ts"]) > E.date_of(r["request_ts"]) for r in acted),
        "actions after as-of": any(r["action_ts"] >= as_of > r["request_ts"] for r in acted),
        "action at its request time": any(r["action_ts"] == r["request_ts"] for r in acted),
        "ties in time": len(times) > len(set(times)),
        "an action at another request's time": bool({r["action_ts"] for r in acted}
                                                    & {r["request_ts"] for r in rows}),
        "two actions in one request": any(n > 1 for n in Counter(r["request_id"] for r in acted).values()),
        "a history": any(a["user_id"] == r["user_id"] and a["action_ts"] < r["request_ts"] - lag
                         and r["request_ts"] < as_of for a in acted for r in rows),
        "a lag": lag > 0,
        "long L": L == LONG_L,
        "no lag": lag == 0,
        "an action at a request's time less the lag": lag > 0 and bool(
            ({(r["user_id"], r["action_ts"]) for r in acted} | {(a["uid"], a["ts"]) for a in acts or []}) & seen_at),
        "arrival columns": T is not None,
        "an arrival hours late": T is not None and any(
            r[ARRIVAL] is not None and r[ARRIVAL] - r["action_ts"] >= DAY // 2 for r in acted),
        "an arrival before its action time": T is not None and any(
            r[ARRIVAL] is not None and r[ARRIVAL] < r["action_ts"] for r in acted),
        "an arrival at its own request's time": T is not None and any(
            r[ARRIVAL] == r["request_ts"] and r[ARRIVAL] != r["action_ts"] for r in acted),
        "a null arrival": T is not None and any(r[ARRIVAL] is None for r in acted),
        # the tie of visibility, with or without an arrival column: an event that arrived (at its
        # action time + the lag, or at its arrival) at exactly a request's time
        "an event arriving at exactly a request's time": bool(
            ({(r["user_id"], r["action_ts"] + lag if r.get(ARRIVAL) is None else r[ARRIVAL]) for r in acted}
             | {(a["uid"], a["ts"] + lag if a.get(ACTION_ARRIVAL) is None else a[ACTION_ARRIVAL]) for a in acts or []})
            & {(r["user_id"], r["request_ts"]) for r in rows}),
        "an action before T that arrived at or after it": T is not None and any(
            r["user_id"] == 2 and r["action_ts"] < T <= (r[ARRIVAL] if r[ARRIVAL] is not None else r["action_ts"] + lag)
            for r in acted),
    }
    return {k for k, v in out.items() if v}


def _write(rows: list[dict], fields, path) -> str:
    """Rows as hive-partitioned Parquet by the UTC day of ``time_col``, with edgegen's types."""
    schema = pa.schema([pa.field(n, t) for n, t in fields])
    t = pa.Table.from_pylist(rows, schema=schema)
    time_col = "request_ts" if "request_ts" in schema.names else "ts"
    times = t.column(time_col).to_pylist()
    if ACTION_ARRIVAL in schema.names:  # an action log with arrivals is filed by arrival day
        times = [a if a is not None else v for a, v in zip(t.column(ACTION_ARRIVAL).to_pylist(), times)]
    dates = [E.date_of(v).isoformat() for v in times]
    t = t.append_column("date", pa.array(dates, pa.string()))
    part = ds.partitioning(pa.schema([pa.field("date", pa.string())]), flavor="hive")
    ds.write_dataset(t, str(path), format="parquet", partitioning=part, basename_template="part-{i}.parquet")
    return str(path)


def _edge_log(root, rows, acts, L, cap, copies, lag=0, arrivals=False) -> E.EdgeLog:
    imp_fields = E.IMP_FIELDS + [("row_uid", pa.int64())] + ([(ARRIVAL, pa.int64())] if arrivals else [])
    act_fields = E.ACT_FIELDS + ([(ACTION_ARRIVAL, pa.int64())] if arrivals else [])
    cfg = config(L, max_sample_cost=cap, actions=acts is not None, history_length=L, max_quarantine_share=1.0,
                 availability_lag=LAGS[lag])
    if arrivals:
        cfg["columns"]["arrival_time"] = ARRIVAL
        if acts is not None:
            cfg["columns"]["actions"] = dict(cfg["columns"]["actions"], arrival=ACTION_ARRIVAL)
    as_of_ms = E.ms(AS_OF)
    return E.EdgeLog(
        root=root, impressions=_write(rows, imp_fields, root / "impressions"),
        actions=_write(acts, act_fields, root / "actions") if acts is not None else None,
        config=cfg, as_of=AS_OF.isoformat(),
        rejected={u: R.DUPLICATE_ROW for u in copies}, quarantined=[(u, R.DUPLICATE_ROW) for u in copies],
        expected_uids={r["row_uid"] for r in rows if r["request_ts"] < as_of_ms},
        after_as_of_uids={r["row_uid"] for r in rows if r["request_ts"] >= as_of_ms},
        rows_read=len(rows), lag=lag,
    )


def check_no_leak(got, lag: int = 0) -> Counter:
    """(a): from the expanded rows alone. Returns counts of what the histories held. With
    ``seq_arrival`` (an arrival column), every event arrived strictly before the request time."""
    seen = Counter()
    arr = "seq_arrival" in got.columns
    cols = ["request_ts", "author", "seq_ts", "seq_author", "seq_item"] + (["seq_arrival"] if arr else [])
    for r in got.select(cols).iter_rows(named=True):
        where = f"impression of request token {r['author']} at {r['request_ts']}"
        assert len(r["seq_ts"]) == len(r["seq_author"]) == len(r["seq_item"]), where
        if arr:
            late = [t for t in r["seq_arrival"] if t >= r["request_ts"]]
            assert not late, f"{where} sees events that arrived at or after its request time: {late}"
            seen["arrived after their action time + the lag"] += sum(
                a > t + lag for a, t in zip(r["seq_arrival"], r["seq_ts"]))
        else:
            late = [t for t in r["seq_ts"] if t >= r["request_ts"] - lag]
            assert not late, f"{where} sees events at or after its request time less the lag {lag}: {late}"
        assert r["author"] not in r["seq_author"], f"{where} sees an action of its own request"
        seen["impressions"] += 1
        seen["with history"] += bool(r["seq_ts"])
        seen["action-log events"] += sum(a == ACTION_LOG_TOKEN for a in r["seq_author"])
    return seen


@pytest.mark.spark
@pytest.mark.slow
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None, print_blob=True,
          phases=[Phase.explicit, Phase.generate], suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(drawn=lean_logs())
def test_no_leak_and_build_expand_equals_oracle(drawn, spark, tmp_path_factory):
    check_drawn(drawn, tmp_path_factory)


@pytest.mark.spark
@pytest.mark.slow
@settings(max_examples=max(1, EXAMPLES // 4), deadline=None, derandomize=True, database=None, print_blob=True,
          phases=[Phase.explicit, Phase.generate], suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(drawn=lean_logs(long=True))
def test_no_leak_and_build_expand_equals_oracle_at_long_L(drawn, spark, tmp_path_factory):
    """The same property at L = 4,000 (a quarter as many examples, one by default: a long example costs
    about three short ones): the heavy user's newest L events are cut around the boundary."""
    assert drawn[2] == LONG_L
    check_drawn(drawn, tmp_path_factory)


def check_drawn(drawn, tmp_path_factory) -> None:
    """(a), (b) and (c) on one drawn log, built and expanded on the shared Spark session, and
    (d) when it has arrival columns."""
    rows, acts, L, cap, M, copies, lag, T = drawn
    for f in features(rows, acts, copies, lag, L, T):
        event(f)
    root = tmp_path_factory.mktemp("leak")
    log = _edge_log(root, rows, acts, L, cap, copies, lag, arrivals=T is not None)
    out = root / "out"
    rc, err = run_cli(build_argv(log, out, M, 1))
    assert rc == 0, f"build failed: {err}"
    report = json.loads((root / "out.json").read_text())
    dest = root / "expanded"
    rc, err = run_cli(["expand", "--build-dir", out, "--expanded", dest])
    assert rc == 0, f"expand failed: {err}"
    got = O.read_parquet_dir(dest)

    seen = check_no_leak(got, lag)  # (a)
    assert seen["impressions"] == len(log.expected_uids)
    if L == LONG_L:
        assert max(got["seq_ts"].list.len()) >= L - 2, "the heavy user's long history reaches the expanded rows"
    assert_same_rows(got, oracle_for(log), log)  # (b)
    assert report["reconciled"] is True and O.reconcile(report, log) == []  # (c)
    assert report["extra_chunks"] > 0, "user 2's impressions exceed max_sample_cost: it must be split"
    if T is not None:
        assert check_perturbation(got, T) > 0  # (d)


SEEN = ["seq_ts", "seq_item", "seq_action", "seq_arrival"]


def check_perturbation(got, T: int) -> int:
    """(d): every copied request (user 102) at or before T sees what its original (user 2) sees;
    returns how many impressions it compared."""
    key = lambda r: (r["request_id"].removeprefix("p"), r["position"])  # noqa: E731
    orig = {key(r): r for r in got.filter(got["user_id"] == 2).select("request_id", "position", *SEEN)
            .iter_rows(named=True)}
    n = 0
    for r in got.filter((got["user_id"] == 2 + CLONE) & (got["request_ts"] <= T)).select(
            "request_id", "position", "request_ts", *SEEN).iter_rows(named=True):
        o = orig[key(r)]
        assert [r[c] for c in SEEN] == [o[c] for c in SEEN], \
            f"request {r['request_id']} at {r['request_ts']} <= T {T} sees a perturbed event: {r} != {o}"
        n += 1
    return n


def test_the_drawn_logs_hold_every_edge_case():
    """As many derandomized draws as the test command builds cover every edge case between them
    (the tie of an action at a request's time less a lag is the roundtrip's ``lag`` log's; here
    any event arriving at exactly a request's time, by the lag or by an arrival column)."""
    seen = Counter()

    @settings(max_examples=EXAMPLES, derandomize=True, database=None, phases=[Phase.generate],
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(drawn=lean_logs())
    def tally(drawn):
        rows, acts, _, _, _, copies, lag, T = drawn
        seen.update(features(rows, acts, copies, lag, T=T))

    tally()
    want = {"duplicated rows", "action log", "a user with one request", "late actions", "actions after as-of",
            "action at its request time", "ties in time", "an action at another request's time",
            "two actions in one request", "a history", "a lag", "no lag", "an event arriving at exactly a request's time",
            "arrival columns", "an arrival hours late", "an arrival before its action time",
            "an arrival at its own request's time", "a null arrival", "an action before T that arrived at or after it"}
    assert want <= set(seen), f"never drawn: {want - set(seen)}"


def test_the_leak_check_can_fail():
    """check_no_leak rejects a history with an event at the request time (less the lag), and one
    of its own request."""
    import polars as pl

    ok = {"request_ts": [10], "author": [3], "seq_ts": [[5, 9]], "seq_author": [[1, 2]], "seq_item": [[1, 1]]}
    assert check_no_leak(pl.DataFrame(ok))["with history"] == 1
    with pytest.raises(AssertionError, match="at or after"):
        check_no_leak(pl.DataFrame(dict(ok, seq_ts=[[5, 10]])))
    with pytest.raises(AssertionError, match="own request"):
        check_no_leak(pl.DataFrame(dict(ok, seq_author=[[1, 3]])))
    assert check_no_leak(pl.DataFrame(dict(ok, seq_ts=[[5, 8]])), lag=1)["with history"] == 1
    with pytest.raises(AssertionError, match="less the lag 1"):
        check_no_leak(pl.DataFrame(ok), lag=1)  # the event at 9 is at the request's time less the lag
