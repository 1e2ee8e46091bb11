"""The oracle itself, on hand-written rows whose answer is known by hand."""

from __future__ import annotations

import copy

import polars as pl
import pytest

from tests.support import edgegen as E
from tests.support import oracle as O
from userwise import schemas
from userwise.schemas import reasons as R

T = E.ms(E.day(2), 10)  # 2026-03-02 10:00 UTC
AS_OF = "2026-03-06"


def imp(uid, user, rid, rts, item, pos=0, click=0, like=0, ats=None):
    return {
        "user_id": user, "request_id": rid, "request_ts": rts,
        "action_ts": ats if ats is not None else rts, "item_id": item, "position": pos,
        "click": click, "like": like, "category": item % 7, "author": 1000 + item, "device": "ios",
        "hour": 10, "age_bucket": 1, "country": "DE", "score": 0.5, "row_uid": uid,
        "date": E.date_of(rts),
    }


def act(user, item, ts, bits, cat=None):
    return {"uid": user, "iid": item, "ts": ts, "bits": bits, "cat": item % 7 if cat is None else cat,
            "auth": 1000 + item, "date": E.date_of(ts)}


def run(tmp_path, rows, actions=None, L=3, rejected=(), max_seq_len=None, cfg=None, rejected_actions=(), lag=None):
    path = E._write(rows, E._imp_fields(False, False), tmp_path / "lean")
    apath = E._write(actions, E.ACT_FIELDS, tmp_path / "actions") if actions else None
    cfg = cfg or E.lean_config(actions=bool(actions), max_seq_len=L, history_length=2 * L)
    out = O.expected_pointwise(path, cfg, AS_OF, rejected, actions_path=apath, max_seq_len=max_seq_len,
                               rejected_actions=rejected_actions, lag=lag)
    return {r["row_uid"]: r for r in out.iter_rows(named=True)}


def test_ties_and_same_time_exclusion(tmp_path):
    rows = [
        # request a at T: actions at T+5s on positions 1 and 0 (written out of order)
        imp(1, 7, "a", T, 11, pos=1, click=1, ats=T + 5000),
        imp(2, 7, "a", T, 10, pos=0, like=1, ats=T + 5000),
        # requests b and c at T+1s: actions at T+5s too; same request time, ordered by request id
        imp(3, 7, "c", T + 1000, 13, click=1, like=1, ats=T + 5000),
        imp(4, 7, "b", T + 1000, 12, click=1, ats=T + 5000),
        # d at exactly T+5s sees none of them; its own dwell-0 click is not visible to e either
        imp(5, 7, "d", T + 5000, 14, click=1, ats=T + 5000),
        imp(6, 7, "e", T + 5000, 15),
        imp(7, 7, "f", T + 5001, 16),
    ]
    got = run(tmp_path, rows, L=10)
    for u in (1, 2, 3, 4, 5, 6):
        assert got[u]["seq_item"] == [], u
    assert got[7]["seq_item"] == [10, 11, 12, 13, 14]
    assert got[7]["seq_action"] == [2, 1, 1, 3, 1]
    assert got[7]["seq_ts"] == [T + 5000] * 5
    assert got[7]["seq_category"] == [10 % 7, 11 % 7, 12 % 7, 13 % 7, 14 % 7]
    assert got[7]["seq_author"] == [1010, 1011, 1012, 1013, 1014]


def test_truncation_keeps_newest(tmp_path):
    rows = [imp(k, 1, f"r{k}", T + k * 1000, 20 + k, click=1, ats=T + k * 1000 + 1) for k in range(6)]
    got = run(tmp_path, rows, L=3)
    assert got[5]["seq_item"] == [22, 23, 24]  # 5 events before r5: the newest 3
    assert got[3]["seq_item"] == [20, 21, 22]
    assert got[1]["seq_item"] == [20]
    assert run(tmp_path / "b", rows, L=3, max_seq_len=2)[5]["seq_item"] == [23, 24]


def test_empty_history_is_empty_list_not_null(tmp_path):
    got = run(tmp_path, [imp(1, 1, "a", T, 5), imp(2, 2, "b", T, 6, click=1)])
    for u in (1, 2):
        for col in ("seq_item", "seq_ts", "seq_action", "seq_category", "seq_author"):
            assert got[u][col] == [], (u, col)


def test_late_action_visible_from_its_time_on(tmp_path):
    late = E.ms(E.day(4), 0, 0, 1)
    rows = [
        imp(1, 1, "a", E.ms(E.day(2), 23, 59), 30, like=1, ats=late),
        imp(2, 1, "b", E.ms(E.day(3), 12), 31),
        imp(3, 1, "c", late, 32),
        imp(4, 1, "d", late + 1, 33),
    ]
    got = run(tmp_path, rows)
    assert [got[u]["seq_item"] for u in (1, 2, 3, 4)] == [[], [], [], [30]]
    assert got[4]["seq_ts"] == [late] and got[4]["seq_action"] == [2]


def test_a_lag_moves_what_a_request_sees_to_its_time_less_the_lag(tmp_path):
    """With availability_lag D a request at t sees the events with action_time + D < t: an
    event at exactly t - D is not visible (the tie), one a millisecond older is; the newest
    L of them; a late action from its time + D on; no history is still an empty list."""
    D = 2000
    late = E.ms(E.day(4), 0, 0, 1)
    rows = [
        imp(1, 1, "a", T, 10, click=1, ats=T),  # its own request time: never visible to a
        imp(2, 1, "b", T + D, 11, click=1, ats=T + D + 5),  # t - D == T: a's action is the tie
        imp(3, 1, "c", T + D + 1, 12),  # sees a's action
        imp(4, 1, "d", T + 2 * D + 5, 13, like=1, ats=late),  # t - D: b's action time (tie); liked days later
        imp(5, 1, "e", T + 2 * D + 6, 14, click=1, ats=T + 2 * D + 6),  # sees a and b
        imp(6, 1, "f", late + D, 15),  # the late like is the tie: sees a, b, e
        imp(7, 1, "g", late + D + 1, 16),  # sees it: the newest L = 3 of a, b, e, d
        imp(8, 2, "x", T + 10**6, 17),  # another user, no actions
    ]
    cfg = E.lean_config(max_seq_len=3, history_length=6, availability_lag="2s")
    assert O.lag_units(cfg) == D and O.lag_units(dict(cfg, time_unit="s")) == 2
    got = run(tmp_path, rows, cfg=cfg)
    assert [got[u]["seq_item"] for u in range(1, 9)] == [[], [], [10], [10], [10, 11], [10, 11, 14], [11, 14, 13], []]
    assert got[7]["seq_ts"] == [T + D + 5, T + 2 * D + 6, late] and got[7]["seq_action"] == [1, 1, 2]
    # D = 0 is the rule without a lag; an explicit lag overrides the config's
    plain = run(tmp_path / "b", rows, L=3)
    assert [plain[u]["seq_item"] for u in (2, 3, 6)] == [[10], [10], [11, 14, 13]]
    assert run(tmp_path / "c", rows, cfg=cfg, lag=0)[2]["seq_item"] == [10]


def test_arrival_times_decide_visibility_and_order_the_stream(tmp_path):
    """docs/pointer.md's arrival example, L = 3: A acted at 10 and arrived at 11, B acted at 20
    and arrived at 50, C and E arrived at their action times 30 and 35; requests at 30, 40,
    51 see [A], [A, C, E], [C, E, B] (B appended: arrival order, not action order). Two
    events arriving together are ordered by action time; a null arrival arrives at its action
    time + the lag; an action-log event arriving before its action time is visible from then."""
    s = 1000
    rows = [
        imp(1, 1, "a", 5 * s + T, 10, click=1, ats=10 * s + T),
        imp(2, 1, "b", 15 * s + T, 20, click=1, ats=20 * s + T),
        imp(3, 1, "c", 25 * s + T, 30, click=1, ats=30 * s + T),
        imp(4, 1, "e", 35 * s + T, 35, click=1, ats=35 * s + T),
        imp(5, 1, "r1", 30 * s + T, 1),
        imp(6, 1, "r2", 40 * s + T, 2),
        imp(7, 1, "r3", 51 * s + T, 3),
        # user 2: two events arriving together (acted 12 and 11: stored 11, 12); a null arrival
        imp(8, 2, "f", T, 12, click=1, ats=12 * s + T),
        imp(9, 2, "g", T, 11, pos=1, like=1, ats=11 * s + T),
        imp(10, 2, "h", 30 * s + T, 13, click=1, ats=31 * s + T),
        imp(11, 2, "r4", 34 * s + T, 4),
        imp(12, 2, "r5", 34 * s + T + 1, 5),
    ]
    arrival = {1: 11, 2: 50, 3: 30, 4: 35, 8: 20, 9: 20, 10: None}
    for r in rows:
        r[E.ARRIVAL_COLUMN] = None if arrival.get(r["row_uid"]) is None else arrival[r["row_uid"]] * s + T
    acts = [dict(act(2, 14, 33 * s + T, 1), **{E.ACTION_ARRIVAL_COLUMN: 32 * s + T})]  # arrived before its action
    path = E._write(rows, E._imp_fields(False, False) + [(E.ARRIVAL_COLUMN, E.pa.int64())], tmp_path / "lean")
    apath = E._write(acts, E.ACT_FIELDS + [(E.ACTION_ARRIVAL_COLUMN, E.pa.int64())], tmp_path / "actions")
    cfg = E.arrival_config(actions=True, max_seq_len=3, history_length=6, availability_lag="3s")
    out = O.expected_pointwise(path, cfg, AS_OF, (), actions_path=apath)
    got = {r["row_uid"]: r for r in out.iter_rows(named=True)}
    assert [got[u]["seq_item"] for u in (5, 6, 7)] == [[10], [10, 30, 35], [30, 35, 20]]
    assert got[7]["seq_arrival"] == [30 * s + T, 35 * s + T, 50 * s + T]
    assert got[7]["seq_ts"] == [30 * s + T, 35 * s + T, 20 * s + T]  # action times: not monotone
    # user 2: 11 and 12 arrived at 20 (stored by action time); h's null arrives at 31 + 3 = 34:
    # not visible at 34 (the tie), visible a ms later; the action-log event arrived at 32
    assert got[11]["seq_item"] == [11, 12, 14] and got[11]["seq_arrival"] == [20 * s + T, 20 * s + T, 32 * s + T]
    assert got[12]["seq_item"] == [12, 14, 13] and got[12]["seq_arrival"][-1] == 34 * s + T
    # without the arrival columns: action time order, the lag's rule (r2 sees B, which serving did not have)
    plain = O.expected_pointwise(path, E.lean_config(actions=True, max_seq_len=3, history_length=6), AS_OF, (),
                                 actions_path=apath)
    assert "seq_arrival" not in plain.columns
    assert {r["row_uid"]: r["seq_item"] for r in plain.iter_rows(named=True)}[6] == [20, 30, 35]


def test_action_log_merge_nulls_first(tmp_path):
    rows = [
        imp(1, 1, "a", T, 40, click=1, ats=T + 5000),
        imp(2, 1, "b", T + 9000, 41),
        imp(3, 2, "x", T + 9000, 42),  # another user: sees only their own log event
    ]
    actions = [
        act(1, 50, T + 5000, 4, cat=2),  # same time as the impression action: first (null request time)
        act(1, 50, T + 5000, 4, cat=1),  # equal up to the features: ordered by features
        act(1, 49, T + 5000, 4),  # ordered by item before them
        act(1, 48, T - 10**8, 1),  # long before
        act(2, 60, T, 2),
        act(1, 51, T + 9000, 1),  # at b's request time: not visible to b
    ]
    got = run(tmp_path, rows, actions=actions, L=10)
    assert got[2]["seq_item"] == [48, 49, 50, 50, 40]
    assert got[2]["seq_category"] == [48 % 7, 49 % 7, 1, 2, 40 % 7]
    assert got[2]["seq_action"] == [1, 4, 4, 4, 1]
    assert got[1]["seq_item"] == [48]
    assert got[3]["seq_item"] == [60]
    # a quarantined log event contributes nothing
    bad = [act(1, 49, T + 5000, 4)]
    got = run(tmp_path / "b", rows, actions=actions, L=10, rejected_actions=bad)
    assert got[2]["seq_item"] == [48, 50, 50, 40]


def test_rejected_duplicates_and_after_as_of(tmp_path):
    as_of_ms = O.as_of_units(AS_OF, "ms")
    dup = imp(1, 1, "a", T, 70, click=1, ats=T + 1)
    rows = [
        dup, dict(dup), dict(dup),  # exact copies: one event, not three
        imp(2, 1, "b", T, 71, pos=1, click=1, ats=T + 1),  # rejected: no event
        imp(3, 1, "z", as_of_ms, 72, click=1),  # at as-of: not built, no event
        imp(4, 1, "y", as_of_ms - 2, 73, click=1, ats=as_of_ms - 2),  # built; its action is before as-of
        imp(5, 1, "c", as_of_ms - 1, 74),
    ]
    got = run(tmp_path, rows, L=10, rejected={1: "duplicate_row", 2: "position_conflict"})
    assert set(got) == {1, 4, 5}
    assert got[5]["seq_item"] == [70, 73]
    assert got[4]["seq_item"] == [70]
    # a plain set of uids drops every copy
    assert set(run(tmp_path / "b", rows, L=10, rejected={1, 2})) == {4, 5}


def test_action_labels_and_default_action_time(tmp_path):
    rows = [imp(1, 1, "a", T, 80, click=0, like=1, ats=T + 10**6), imp(2, 1, "b", T + 1, 81)]
    cfg = E.lean_config(max_seq_len=3, history_length=6)
    del cfg["columns"]["action_time"]  # the action is then at its request time T
    cfg["columns"]["action_labels"] = ["like"]
    got = run(tmp_path, rows, cfg=cfg)
    assert got[2]["seq_ts"] == [T] and got[2]["seq_action"] == [1]  # bit 0 = like, the only action label


def test_columns_kept_in_input_order(tmp_path):
    rows = [imp(1, 1, "a", T, 5)]
    path = E._write(rows, E._imp_fields(False, False), tmp_path / "lean")
    out = O.expected_pointwise(path, E.lean_config(), AS_OF, set())
    inputs = O.read_parquet_dir(path).columns
    assert out.columns == inputs + ["seq_ts", "seq_item", "seq_category", "seq_author", "seq_action"]
    assert out.schema["date"] == pl.Date and out.schema["seq_category"] == pl.List(pl.Int32)


def test_frame_diff_finds_differences():
    a = pl.DataFrame({"row_uid": [2, 1], "x": [float("nan"), 1.0], "l": [[1], []]})
    assert O.frame_diff(a, a.sort("row_uid")) == []
    b = a.with_columns(pl.Series("l", [[1], [0]]))
    assert any("l at row_uid=1" in d for d in O.frame_diff(b, a))
    assert O.frame_diff(a.drop("x"), a)
    assert O.frame_diff(a.head(1), a)


# --------------------------------------------------------------------------
# the generated edge log: ground truth and cross-checks
# --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    d = tmp_path_factory.mktemp("edge")
    return {
        "lean": E.make_lean(d / "lean", actions=True),
        "nan": E.make_lean(d / "nan", float_labels=True),
        "fat": E.make_fat(d / "fat"),
        "arrival": E.make_lean(d / "arrival", actions=True, arrival=True),
    }


def test_every_reason_is_planted(logs):
    """Every reason but null_arrival_time (a policy's, tests/builder/test_arrival.py) is planted."""
    planted = set(logs["lean"].quarantine_counts()) | set(logs["nan"].quarantine_counts()) | \
        set(logs["fat"].quarantine_counts()) | set(logs["arrival"].quarantine_counts())
    assert planted == set(E.REASON_COLUMNS)
    assert planted <= set(schemas.REASONS)  # the vocabulary's names, as the build gives them
    assert {r for _, r in logs["lean"].rejected_actions} == {R.NULL_USER, R.NULL_ITEM, R.BAD_TIME}


def test_ground_truth_counts(logs):
    for name, log in logs.items():
        df = O.read_parquet_dir(log.impressions)
        assert df.height == log.rows_read, name
        assert log.rows_read == len(log.expected_uids) + len(log.quarantined) + len(log.after_as_of_uids)
        assert not (log.expected_uids & log.after_as_of_uids)
        exp = (O.expected_fat(log.impressions, log.config, log.as_of, log.rejected) if log.fat else
               O.expected_pointwise(log.impressions, log.config, log.as_of, log.rejected))
        assert sorted(exp["row_uid"].to_list()) == sorted(log.expected_uids), name
        # the heavy user's requests exceed the cost cap; some rows are left for later
        heavy = exp.filter(pl.col("user_id") == log.heavy_user)
        assert heavy.height > log.config["max_sample_cost"]
        assert log.after_as_of_uids


def test_bad_rows_contribute_no_actions(logs):
    log = logs["lean"]
    out = O.expected_pointwise(log.impressions, log.config, log.as_of, log.rejected)
    all_rows = O.read_parquet_dir(log.impressions)
    bad_items = set(all_rows.filter(pl.col("row_uid").is_in(list(log.dropped_uids)))["item_id"].drop_nulls())
    # the bad rows' items are used by no accepted row: they must never appear in a sequence
    only_bad = bad_items - set(out["item_id"])
    seen = {i for s in out["seq_item"] for i in s}
    assert len(only_bad) >= 10 and not only_bad & seen


def test_fat_snapshots_match_the_lean_oracle(logs):
    """Two independent computations of the point-in-time history agree (edgegen's legacy
    snapshots vs the oracle's stream), except for the deliberately odd snapshots."""
    lean = E.make_lean(logs["lean"].root / "plain")
    lo = O.expected_pointwise(lean.impressions, lean.config, lean.as_of, lean.rejected)
    fat = logs["fat"]
    fo = O.expected_fat(fat.impressions, fat.config, fat.as_of, fat.rejected)
    j = fo.join(lo.select("row_uid", "seq_item", "seq_ts", "seq_category"), on="row_uid", how="inner")
    assert j.height == fo.height
    odd = {"f-04", "f-06", "f-08", "f-10", "e-3"}
    differ = j.filter(
        (pl.col("hist_item_id") != pl.col("seq_item")).fill_null(True)
        | (pl.col("hist_ts") != pl.col("seq_ts")).fill_null(True)
        | (pl.col("hist_category") != pl.col("seq_category")).fill_null(True)
    )
    assert set(differ["request_id"]) == odd | set(j.filter(pl.col("user_id") == 301)
                                                  .filter(pl.col("seq_item").list.len() > 3)["request_id"])
    assert fo.filter(pl.col("hist_item_id").is_null())["request_id"].to_list() == ["f-06"]


def test_reconcile(logs):
    log = logs["lean"]
    good = O.expected_report(log)
    good["actions"] = {"quarantined": {"null_user": 1, "null_item": 1, "bad_time": 1}}
    assert O.reconcile(good, log) == []
    bad = copy.deepcopy(good)
    bad["quarantined"]["duplicate_row"] += 1
    bad["rows_read"] += 1
    assert O.reconcile(bad, log)
    assert O.reconcile({"rows_read": 1}, log)
    bad = copy.deepcopy(good)
    bad["actions"]["quarantined"] = {}
    assert O.reconcile(bad, log)
    flat = copy.deepcopy(bad)
    flat["actions_quarantined"] = good["actions"]["quarantined"]
    assert O.reconcile(flat, log) == []
