"""benchmarks/bases_report.py on a hand-countable log: 2 users, 3 daily sets, L = 2.

User 1: action-log events a, b, c on 2025-12-31 (01:00, 02:00, 03:00) and d on 2026-01-01 10:00;
requests on 01-01 12:00 and 01-02 12:00 (one unclicked impression each). User 2: no history; a
request on 01-02 08:00 with two impressions, one clicked a second later (event e), and one on
01-03 09:00. As of 2026-01-04, M = 3, N = 1:

- 01-01: user 1 sees a b c d (E = 4), stores [c, d]: base c (before the day), own d;
- 01-02: user 1 stores [c, d] again, both base, both stored the day before; user 2's request
  sees nothing (E = 0), so its sample stores no event;
- 01-03: user 2 sees e (E = 1), stores [e], base, not stored the day before (no event then).

Stored 5, distinct 3 (c, d, e), events in the log 5.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from userwise.pipelines.tools import synth as syn

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(REPO, "benchmarks", "bases_report.py")
sys.path.insert(0, os.path.join(REPO, "benchmarks"))


def _ms(day: str, h: int, s: int = 0) -> int:
    t = dt.datetime.fromisoformat(day).replace(tzinfo=dt.timezone.utc) + dt.timedelta(hours=h, seconds=s)
    return int(t.timestamp() * 1000)


def _write(root, kind: str, day: str, rows: list[dict], schema: pa.Schema) -> None:
    d = root / kind / f"date={day}"
    d.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), d / "part-0.parquet")


def _imp(user: int, rid: str, day: str, h: int, pos: int, click: int) -> dict:
    t = _ms(day, h)
    return {"user_id": user, "request_id": rid, "request_ts": t, "action_ts": t + 1000, "item_id": 7 + pos,
            "position": pos, "click": click, "like": 0, "category": 1, "author": 2, "device": "ios", "hour": h,
            "age_bucket": 1, "country": "DE", "score": 0.5}


def _act(user: int, day: str, h: int) -> dict:
    return {"uid": user, "iid": 9, "ts": _ms(day, h), "bits": 1, "cat": 1, "auth": 2}


@pytest.fixture()
def tiny_log(tmp_path):
    log = tmp_path / "log"
    _write(log, "lean", "2026-01-01", [_imp(1, "r1", "2026-01-01", 12, 0, 0)], syn.LEAN_SCHEMA)
    _write(log, "lean", "2026-01-02", [_imp(1, "r2", "2026-01-02", 12, 0, 0), _imp(2, "r3", "2026-01-02", 8, 0, 1),
                                       _imp(2, "r3", "2026-01-02", 8, 1, 0)], syn.LEAN_SCHEMA)
    _write(log, "lean", "2026-01-03", [_imp(2, "r4", "2026-01-03", 9, 0, 0)], syn.LEAN_SCHEMA)
    _write(log, "actions", "2025-12-31", [_act(1, "2025-12-31", h) for h in (1, 2, 3)], syn.ACTIONS_SCHEMA)
    _write(log, "actions", "2026-01-01", [_act(1, "2026-01-01", 10)], syn.ACTIONS_SCHEMA)
    syn._write_yaml(str(log / "config.yaml"), syn.make_config(2, 0, fat=False, actions=True))
    return log


def test_bases_report_counts_a_hand_countable_log(tiny_log, tmp_path):
    out = tmp_path / "r.json"
    r = subprocess.run([sys.executable, BENCH, "--log", str(tiny_log), "--lengths", "2", "--incremental-days", "3",
                        "--as-of", "2026-01-04", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    (run,) = res["runs"]
    assert (run["stored_events"], run["distinct_events"], run["log_events"]) == (5, 3, 5)
    assert run["stored_over_distinct"] == pytest.approx(5 / 3, abs=1e-3)
    sets = [{k: s[k] for k in ("events", "base", "own", "requests", "impressions", "rows", "users", "prev_day",
                               "any_earlier")} for s in run["sets"]]
    assert sets == [
        dict(events=2, base=1, own=1, requests=1, impressions=1, rows=1, users=1, prev_day=0, any_earlier=0),
        dict(events=2, base=2, own=0, requests=2, impressions=3, rows=2, users=2, prev_day=2, any_earlier=2),
        dict(events=1, base=1, own=0, requests=1, impressions=1, rows=1, users=1, prev_day=0, any_earlier=0),
    ]
    b = res["widths"]["bytes"]
    # the lean shard schema: seq_ts, seq_item, seq_author, seq_action int64, seq_category int32, a checkpoint / 64
    assert b["event"] == pytest.approx(8 * 4 + 4 + 8 / 64)
    day2 = run["sets"][1]
    assert day2["bytes"] == round(2 * b["event"] + 2 * b["request"] + 3 * b["impression"] + 2 * b["row"])
    assert day2["prev_day_bytes"] == round(2 * b["event"])
    staged = sum(s["bytes"] for s in run["sets"])
    assert run["prev_day_share"] == pytest.approx(2 * b["event"] / staged, rel=1e-3)
    assert run["own_events"] == 1 and run["samples_events_option1"] == 1


def test_chunks_follow_the_greedy_fill_and_repeat_the_base():
    """E = 10..13, one impression each, L = 5, cap 8: the first chunk takes two requests (span 6 + 2),
    the third would make span 7 + 3 > 8, so a second chunk starts at its begin 12 - 5 = 7 and
    stores [7, 13): events 7..10 again, 4 repeats. A request seeing nothing stores nothing."""
    import numpy as np
    from bases_report import chunks

    E, n = np.array([10, 11, 12, 13]), np.ones(4, dtype=np.int64)
    assert chunks(E, n, 5, 8) == [(5, 11), (7, 13)]
    assert chunks(E, n, 5, 100) == [(5, 13)]
    assert chunks(np.array([0, 0]), np.ones(2, dtype=np.int64), 5, 100) == [(0, 0)]
    assert chunks(np.array([0, 3]), np.ones(2, dtype=np.int64), 5, 100) == [(0, 3)]
