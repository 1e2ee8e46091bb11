"""Tiny, deterministic impression logs full of edge cases, with their ground truth.

Every row is written on purpose (a few random "normal" users aside, seeded), so
each rejected row has exactly one reason and every tricky ordering case is known:

- ties in action time (same request, different requests, same request time),
  the same item twice in one request, a request at exactly the time of earlier
  actions, an action at exactly its own request time (dwell 0);
- empty histories, users with one request, a user who never acts;
- a heavy user whose requests exceed ``max_sample_cost`` (chunking) and a single
  request larger than the cap on its own;
- late actions (acted on a later UTC day, across window and pretrain
  boundaries, one after as-of);
- action-log events tied with impression actions (nulls first), tied among
  themselves (order by item, then by features), and one before all impressions;
- every kind of bad row (see ``REASON_COLUMNS``) and rows at or after as-of.

Reason names (the quarantine table's ``reason``) are the vocabulary's
(``userwise.schemas.reasons``), the names the build gives each fault.

Usage::

    log = make_lean(tmp_path, actions=True)
    log.impressions, log.actions, log.config, log.as_of, log.rejected, log.expected_uids
    fat = make_fat(tmp_path)            # fat-row variant with odd snapshots
    nan = make_lean(tmp_path, float_labels=True)   # `like` float64 with NaN / inf rows
    lag = make_lean(tmp_path, actions=True, lag=True)   # availability_lag LAG, a user of its edge cases
    arr = make_lean(tmp_path, actions=True, arrival=True)   # arrival columns: late arrivals of every kind
"""

from __future__ import annotations

import datetime as dt
import json
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds

from tests.support.common import config
from userwise.schemas import reasons as R

# the reasons these logs plant -> the column each names (None: a request-level or whole-row reason)
REASON_COLUMNS = {
    R.NULL_USER: "user_id",
    R.NULL_REQUEST: "request_id",
    R.NULL_TIME: "request_ts",
    R.NULL_ITEM: "item_id",
    R.BAD_TIME: "request_ts",
    R.ACTION_BEFORE_REQUEST: "action_ts",
    R.DUPLICATE_ROW: None,
    R.POSITION_CONFLICT: "position",
    R.REQUEST_USER_CONFLICT: "user_id",
    R.REQUEST_INCONSISTENT: None,
    R.BAD_LABEL: "like",
    R.SNAPSHOT_MISMATCH: None,
    R.ARRIVAL_BEFORE_ACTION: "arrival_ts",
    R.ARRIVAL_BEFORE_REQUEST: "arrival_ts",
}
ARRIVAL_COLUMN = "arrival_ts"  # make_lean(arrival=True): the impressions' arrival column ...
ACTION_ARRIVAL_COLUMN = "arr"  # ... and the action log's
ARRIVAL_USER = 320
# make_lean(arrival=True): every other action arrives this late (by row), so that late events are
# everywhere: at once, 1 ms, seconds, hours (across UTC days, windows and the pretrain boundary)
ARRIVAL_DELAYS = (0, 1, 3000, 2 * 3_600_000, 26 * 3_600_000)

UTC = dt.timezone.utc
DAY = 86_400_000
SEC = 1000
START = dt.date(2026, 3, 1)  # data: 2026-03-01 .. 2026-03-06
AS_OF = "2026-03-06"  # the last day (03-06) is at/after as-of
L = 6  # max_seq_len of the edge config
MAX_COST = 40
CHAIN_BLOCK = 4  # events per block of the event chain in the edge config
LAG = "2s"  # make_lean(lag=True): the availability lag of the edge config ...
LAG_MS = 2000  # ... in its time unit
HEAVY_USER = 200


def ms(d: dt.date, h: int = 0, m: int = 0, s: int = 0, milli: int = 0) -> int:
    t = dt.datetime(d.year, d.month, d.day, h, m, s, tzinfo=UTC)
    return int(t.timestamp()) * 1000 + milli


def day(i: int) -> dt.date:
    """Day i of the data, 1-based: day(1) == 2026-03-01."""
    return START + dt.timedelta(days=i - 1)


def date_of(ts: int) -> dt.date:
    return dt.datetime.fromtimestamp(ts / 1000, tz=UTC).date()


AS_OF_MS = ms(dt.date.fromisoformat(AS_OF))

IMP_FIELDS = [
    ("user_id", pa.int64()), ("request_id", pa.string()), ("request_ts", pa.int64()),
    ("action_ts", pa.int64()), ("item_id", pa.int64()), ("position", pa.int32()),
    ("click", pa.int8()), ("like", pa.int8()), ("category", pa.int32()), ("author", pa.int64()),
    ("device", pa.string()), ("hour", pa.int8()), ("age_bucket", pa.int8()), ("country", pa.string()),
    ("score", pa.float32()),
]
SNAP_FIELDS = [("hist_item_id", pa.int64()), ("hist_ts", pa.int64()), ("hist_category", pa.int32())]
ACT_FIELDS = [("uid", pa.int64()), ("iid", pa.int64()), ("ts", pa.int64()), ("bits", pa.int64()),
              ("cat", pa.int32()), ("auth", pa.int64())]


def cat_of(item: int) -> int:
    return item % 7


def auth_of(item: int) -> int:
    return 1000 + item // 3


def lean_config(actions: bool = False, **over) -> dict:
    """The test config (tests/support/common.py) at the edge logs' sizes (an event chain
    block of CHAIN_BLOCK events, so that short sequences hold checkpoints)."""
    cfg = config(L, max_sample_cost=MAX_COST, actions=actions, max_quarantine_share=0.5, chain_block=CHAIN_BLOCK)
    cfg.update(over)
    return cfg


def fat_config(**over) -> dict:
    cfg = config(L, max_sample_cost=MAX_COST, fat=True, max_quarantine_share=0.5, chain_block=CHAIN_BLOCK)
    cfg.update(over)
    return cfg


@dataclass
class EdgeLog:
    """Paths, config and ground truth of one generated log."""

    root: Path
    impressions: str
    actions: str | None
    config: dict
    as_of: str
    rejected: dict[int, str]  # row_uid -> reason; duplicates: uid of the extra copies (one copy is kept)
    quarantined: list[tuple[int, str]]  # one entry per quarantined input row (a multiset)
    expected_uids: set[int]  # row_uids expected in samples (request time < as_of, accepted)
    after_as_of_uids: set[int]
    rows_read: int
    rejected_actions: list[tuple[dict, str]] = field(default_factory=list)  # (whole row, reason)
    planted: dict = field(default_factory=dict)  # counts the report should show (fat: overrides, ...)
    heavy_user: int = HEAVY_USER
    fat: bool = False
    lag: int = 0  # the config's availability_lag, in its time unit
    columns: dict[int, str] = field(default_factory=dict)  # row_uid -> the column its reason names, where not
    # REASON_COLUMNS' (a bad_time of the arrival column)

    @property
    def dropped_uids(self) -> set[int]:
        """row_uids with no copy left in samples."""
        return set(self.rejected) - self.expected_uids

    def quarantine_counts(self) -> dict[str, int]:
        return dict(Counter(r for _, r in self.quarantined))


class _Log:
    """Accumulates rows; every row gets a fresh row_uid unless it is an exact copy."""

    def __init__(self):
        self.rows: list[dict] = []
        self.bad: list[tuple[int, str]] = []  # (uid, reason) per quarantined row
        self.next_uid = 1
        self.actions: list[dict] = []
        self.bad_actions: list[tuple[dict, str]] = []
        self.columns: dict[int, str] = {}

    def imp(self, user, rid, rts, item, pos, click=0, like=0, dwell=1500, *, ats=None, device="ios",
            hour=None, age=3, country="DE", score=0.5, date=None, reason=None, arrival=...):
        row = {
            "user_id": user, "request_id": rid, "request_ts": rts,
            "action_ts": ats if ats is not None else (rts + dwell if rts is not None else None),
            "item_id": item, "position": pos, "click": click, "like": like,
            "category": cat_of(item) if item is not None else 3,
            "author": auth_of(item) if item is not None else 1000,
            "device": device,
            "hour": hour if hour is not None else ((rts // 3_600_000) % 24 if rts is not None else 0),
            "age_bucket": age, "country": country, "score": score,
            "row_uid": self.next_uid,
            "date": date or (date_of(rts) if rts is not None else day(2)),
        }
        if arrival is not ...:  # an explicit arrival (None included); else make_lean(arrival=True) draws one
            row[ARRIVAL_COLUMN] = arrival
        self.next_uid += 1
        self.rows.append(row)
        if reason:
            self.bad.append((row["row_uid"], reason))
        return row

    def request(self, user, rid, rts, items, **kw):
        """items: list of (item, click, like, dwell); positions 0.."""
        return [self.imp(user, rid, rts, it, p, c, lk, dw, **kw) for p, (it, c, lk, dw) in enumerate(items)]

    def copy(self, row, reason=R.DUPLICATE_ROW):
        r = dict(row)
        self.rows.append(r)
        self.bad.append((r["row_uid"], reason))

    def act(self, uid, iid, ts, bits, cat=None, auth=None, reason=None, arrival=...):
        row = {"uid": uid, "iid": iid, "ts": ts, "bits": bits,
               "cat": cat if cat is not None else (cat_of(iid) if iid is not None else 0),
               "auth": auth if auth is not None else (auth_of(iid) if iid is not None else 1000),
               "date": date_of(ts) if ts is not None else day(2)}
        if arrival is not ...:
            row[ACTION_ARRIVAL_COLUMN] = arrival
        self.actions.append(row)
        if reason:
            self.bad_actions.append((row, reason))


def _normal_users(g: _Log, rng: random.Random) -> None:
    devices = ["ios", "android", "web"]
    for u in range(1, 25):
        n_req = rng.randint(1, 5)
        age, country = rng.randint(1, 6), rng.choice(["DE", "FR", "US"])
        for k in range(n_req):
            d = day(rng.randint(1, 6))
            rts = ms(d, rng.randint(0, 23), rng.randint(0, 59), rng.randint(0, 59), rng.randint(0, 999))
            items = []
            for _ in range(rng.randint(1, 3)):
                c = int(rng.random() < 0.4)
                lk = int(rng.random() < 0.15)
                items.append((rng.randint(100, 160), c, lk, rng.randint(0, 60) * SEC))
            score = rng.choice([0.25, 0.5, None, float("nan")])
            g.request(u, f"u{u}-{k}", rts, items, device=rng.choice(devices), age=age, country=country,
                      score=score)
    # one request only; and a user who never acts
    g.request(100, "one-100", ms(day(3), 8), [(101, 1, 0, 2 * SEC)])
    for k in range(3):
        g.request(101, f"never-{k}", ms(day(k + 1), 9), [(102, 0, 0, 0), (103, 0, 0, 0)])


def _heavy_user(g: _Log, rng: random.Random) -> None:
    u = HEAVY_USER
    for k in range(30):
        d = day(1 + k % 5)
        rts = ms(d, 6 + k // 5, (k * 7) % 60, k % 60)
        items = [(rng.randint(100, 160), int(rng.random() < 0.6), int(rng.random() < 0.2), (k % 4) * SEC)
                 for _ in range(3)]
        g.request(u, f"h-{k:02d}", rts, items, device="web", age=2, country="US")
    # one request bigger than max_sample_cost on its own: a chunk of a single request
    g.request(u, "h-big", ms(day(4), 20), [(100 + i % 60, int(i % 5 == 0), 0, SEC) for i in range(45)],
              device="web", age=2, country="US")
    # at / after as-of
    g.request(u, "h-late", ms(day(6), 1), [(150, 1, 1, SEC)], device="web", age=2, country="US")


def _ties_user(g: _Log) -> None:
    u = 300
    g.request(u, "t-first", ms(day(1), 7), [(20, 0, 0, 0)])  # empty history
    t0 = ms(day(2), 10)
    # four actions at t0+5s in one request: ordered by position; item 11 twice
    g.request(u, "t-b", t0, [(11, 1, 0, 5 * SEC), (12, 1, 0, 5 * SEC), (11, 1, 0, 5 * SEC), (13, 0, 1, 5 * SEC)])
    # same action time, later request time; two requests at the same time ordered by request id
    g.request(u, "t-c", t0 + SEC, [(15, 1, 0, 4 * SEC)])
    g.request(u, "t-a", t0 + SEC, [(14, 1, 1, 4 * SEC)])
    # requests at exactly the time of those actions: see none of them; dwell 0: an action at its own time
    g.request(u, "t-d", t0 + 5 * SEC, [(16, 1, 0, 0)])
    g.request(u, "t-e", t0 + 5 * SEC, [(17, 0, 0, 0)])
    # one ms later: sees everything (8 events > L: the oldest are cut)
    g.request(u, "t-f", t0 + 5 * SEC + 1, [(18, 0, 0, 0), (19, 1, 0, 0)])
    g.request(u, "t-g", ms(day(5), 10), [(21, 0, 0, 0)])
    # action-log events tied with the impression actions at t0+5s (null request fields: first),
    # tied among themselves (by item, then features), and one before all impressions
    g.act(u, 17, t0 + 5 * SEC, 1, cat=2)
    g.act(u, 17, t0 + 5 * SEC, 1, cat=1)
    g.act(u, 9, t0 + 5 * SEC, 2)
    g.act(u, 8, ms(dt.date(2026, 2, 27), 12), 3)
    g.act(u, 22, t0 + 5 * SEC + 1, 1)  # at exactly t-f's request time: not visible to t-f


def _late_user(g: _Log) -> None:
    u = 301
    g.request(u, "l-1", ms(day(1), 23, 59), [(30, 1, 0, 90 * SEC)])  # acted 2026-03-02 00:00:30
    g.request(u, "l-2", ms(day(2), 0, 0, 30), [(31, 0, 0, 0)])  # exactly then: not visible
    g.request(u, "l-3", ms(day(2), 0, 0, 31), [(32, 0, 0, 0)])  # sees it
    g.request(u, "l-4", ms(day(2), 23, 59, 59), [(33, 0, 1, 0)], ats=ms(day(4), 0, 0, 1))  # liked 2 days later
    g.request(u, "l-5", ms(day(3), 12), [(34, 1, 0, 3 * SEC)])
    g.request(u, "l-6", ms(day(4), 0, 0, 1), [(35, 0, 0, 0)])  # at the late like's time: not visible
    g.request(u, "l-7", ms(day(4), 0, 0, 2), [(36, 0, 0, 0)])
    g.request(u, "l-8", AS_OF_MS - 1, [(37, 1, 0, 5 * SEC)])  # last ms before as-of; acted after as-of
    g.request(u, "l-9", AS_OF_MS, [(38, 1, 0, 0)])  # exactly as-of: left for later
    g.request(u, "l-10", AS_OF_MS + 12 * 3_600_000, [(39, 1, 0, 0)])
    g.act(u, 40, AS_OF_MS + 1, 1)


def _fat_users(g: _Log) -> None:
    # single-impression requests, each clicked 2s later: the fat variant edits some snapshots
    u = 302
    base = ms(day(3), 9)
    for k in range(12):
        g.request(u, f"f-{k:02d}", base + k * 600 * SEC, [(50 + k, 1, 0, 2 * SEC)], device="android")
    g.request(u, "f-12", base + 12 * 600 * SEC, [(70, 1, 0, SEC), (71, 0, 0, 0), (72, 1, 0, SEC)],
              device="android")
    for k in (13, 14):
        g.request(u, f"f-{k}", base + k * 600 * SEC, [(60 + k, 1, 0, 2 * SEC)], device="android")
    u = 303
    for k in range(5):
        g.request(u, f"e-{k}", ms(day(2), 15, k), [(80 + k, 1, 0, SEC)])


def _lag_user(g: _Log, D: int) -> None:
    """The edge cases of an availability lag of D ms: actions at exactly a request's time - D
    (not visible), a window's first requests that see events from before its start (03-04)
    less D, a late action, an action-log event at a request's time - D."""
    u = 310
    t = ms(day(2), 11)
    g.request(u, "lag-00", t, [(600, 1, 0, 0), (601, 1, 1, 0)])  # empty history; acted at its own time
    g.request(u, "lag-01", t + D, [(602, 1, 0, 5)])  # its time - D: lag-00's actions, the tie
    g.request(u, "lag-02", t + D + 1, [(603, 0, 0, 0)])  # sees them
    s = ms(day(4))  # a window's start: its base is the newest L events before s - D
    g.request(u, "lag-03", s - D, [(604, 1, 0, 0)])  # acted at s - D, in the window before
    g.request(u, "lag-04", s - 1, [(605, 1, 0, 0)])  # acted at s - 1 ms
    g.request(u, "lag-05", s, [(606, 0, 0, 0)])  # the window's first: lag-03's action is the tie
    g.request(u, "lag-06", s + 1, [(607, 0, 0, 0)])  # sees lag-03's, not lag-04's
    g.request(u, "lag-07", s - 1 + D, [(608, 0, 0, 0)])  # lag-04's is the tie
    g.request(u, "lag-08", s + D, [(609, 0, 0, 0)])  # sees lag-04's
    late = ms(day(5), 0, 0, 1)
    g.request(u, "lag-09", ms(day(4), 12), [(610, 0, 1, 0)], ats=late)  # liked the next day
    g.request(u, "lag-10", late + D, [(611, 0, 0, 0)])  # the tie
    g.request(u, "lag-11", late + D + 1, [(612, 0, 0, 0)])  # sees it
    g.act(u, 613, ms(day(5), 12) - D, 1)  # an action-log event at lag-12's time - D: not visible
    g.request(u, "lag-12", ms(day(5), 12), [(614, 0, 0, 0)])
    g.request(u, "lag-13", ms(day(5), 12) + 1, [(615, 0, 0, 0)])


def _arrival_user(g: _Log, D: int) -> None:
    """Late arrivals of every kind (user ARRIVAL_USER, items 700..; the config's lag is D ms,
    the default arrival_skew 5 minutes): each request's comment says what it sees of them."""
    u = ARRIVAL_USER
    t = ms(day(2), 10)
    # seconds late: acted at t+1s, arrived at t+4s
    g.request(u, "ar-00", t, [(700, 1, 0, SEC)], arrival=t + 4 * SEC)
    g.request(u, "ar-01", t + 2 * SEC, [(720, 0, 0, 0)], arrival=None)  # acted before, not arrived: sees nothing
    g.request(u, "ar-02", t + 4 * SEC, [(721, 0, 0, 0)], arrival=None)  # arrived at exactly its time: not visible
    g.request(u, "ar-03", t + 4 * SEC + 1, [(722, 0, 0, 0)], arrival=None)  # sees 700
    # two events arriving at one time: ordered by action time (702 acted after 701)
    g.request(u, "ar-04", t + 10 * SEC, [(701, 1, 0, SEC)], arrival=t + 20 * SEC)
    g.request(u, "ar-05", t + 12 * SEC, [(702, 0, 1, 0)], arrival=t + 20 * SEC)
    g.request(u, "ar-06", t + 20 * SEC + 1, [(723, 0, 0, 0)], arrival=None)  # sees 700, 701, 702
    # arriving after a later action: 703 acted first, arrives an hour later; 704 arrives at once
    g.request(u, "ar-07", t + 30 * SEC, [(703, 1, 0, SEC)], arrival=t + 3_600_000)
    g.request(u, "ar-08", t + 40 * SEC, [(704, 1, 0, SEC)], arrival=t + 42 * SEC)
    g.request(u, "ar-09", t + 50 * SEC, [(724, 0, 0, 0)], arrival=None)  # sees 704, not 703
    g.request(u, "ar-10", t + 3_600_000 + 1, [(725, 0, 0, 0)], arrival=None)  # ... 704, then 703
    # hours late across the pretrain boundary (03-03 with M=3, N=1): acted 03-02 23:00:01, arrived 03-03 00:30
    g.request(u, "ar-11", ms(day(2), 23), [(705, 1, 0, SEC)], arrival=ms(day(3), 0, 30))
    g.request(u, "ar-12", ms(day(3), 0, 10), [(726, 0, 0, 0)], arrival=None)  # a window's first: not yet
    g.request(u, "ar-13", ms(day(3), 0, 31), [(727, 0, 0, 0)], arrival=None)  # sees 705
    # hours late across a window boundary: acted 03-03 22:00:05, arrived 03-04 03:00
    g.request(u, "ar-14", ms(day(3), 22), [(706, 1, 0, 5 * SEC)], arrival=ms(day(4), 3))
    g.request(u, "ar-15", ms(day(3), 23), [(728, 0, 0, 0)], arrival=None)  # not yet
    g.request(u, "ar-16", ms(day(4), 1), [(729, 0, 0, 0)], arrival=None)  # the next window's base lacks it
    g.request(u, "ar-17", ms(day(4), 3), [(730, 0, 0, 0)], arrival=None)  # the tie
    g.request(u, "ar-18", ms(day(4), 3) + 1, [(731, 0, 0, 0)], arrival=None)  # sees 706
    # arriving after as-of: in no sample
    g.request(u, "ar-19", ms(day(5), 20), [(707, 1, 0, SEC)], arrival=AS_OF_MS + 3_600_000)
    g.act(u, 740, ms(day(5), 21), 1, arrival=AS_OF_MS + 2 * 3_600_000)
    g.request(u, "ar-20", ms(day(5), 23), [(732, 0, 0, 0)], arrival=None)  # sees neither
    # arriving before its action time (within arrival_skew): an action-log event acted at 10:00:00
    # that arrived at 09:59:30, and an impression's click at 11:01 that arrived at 11:00:30
    g.act(u, 741, ms(day(5), 10), 2, arrival=ms(day(5), 9, 59, 30))
    g.request(u, "ar-21", ms(day(5), 9, 59, 30), [(733, 0, 0, 0)], arrival=None)  # the tie: not visible
    g.request(u, "ar-22", ms(day(5), 9, 59, 45), [(734, 0, 0, 0)], arrival=None)  # sees 741 (acted after it!)
    g.request(u, "ar-23", ms(day(5), 11), [(708, 1, 0, 60 * SEC)], arrival=ms(day(5), 11, 0, 30))
    g.request(u, "ar-24", ms(day(5), 11, 0, 45), [(735, 0, 0, 0)], arrival=None)  # sees 708
    # a null arrival (null_arrival: lag): arrives at its action time + D
    g.request(u, "ar-25", ms(day(5), 12), [(709, 1, 0, SEC)], arrival=None)
    g.act(u, 742, ms(day(5), 12, 0, 2), 1, arrival=None)
    g.request(u, "ar-26", ms(day(5), 12, 0, 1) + D, [(736, 0, 0, 0)], arrival=None)  # 709's tie
    g.request(u, "ar-27", ms(day(5), 12, 0, 2) + D, [(737, 0, 0, 0)], arrival=None)  # 709, 742's tie
    g.request(u, "ar-28", ms(day(5), 12, 0, 2) + D + 1, [(738, 0, 0, 0)], arrival=None)  # 709, 742
    # bad arrivals (items 750..: in no sequence)
    b = ms(day(4), 15)
    g.imp(u, "ar-b0", b, 750, 0, 1, 0, 10 * 60 * SEC, arrival=b + 60 * SEC, reason=R.ARRIVAL_BEFORE_ACTION)
    bt = g.imp(u, "ar-b0", b, 751, 1, 1, 0, SEC, arrival=ms(dt.date(1999, 6, 1)), reason=R.BAD_TIME)
    g.columns[bt["row_uid"]] = ARRIVAL_COLUMN
    g.imp(u, "ar-b0", b, 752, 2, 1, 0, SEC, arrival=b - 1, reason=R.ARRIVAL_BEFORE_REQUEST)
    g.imp(u, "ar-b0", b, 753, 3, 0, 0, 0, arrival=ms(dt.date(1999, 6, 1)))  # no action: its arrival means nothing
    g.request(u, "ar-b1", b + 3_600_000, [(739, 0, 0, 0)], arrival=None)  # sees none of 750..752
    g.act(u, 754, b + 10 * 60 * SEC, 1, arrival=b, reason=R.ARRIVAL_BEFORE_ACTION)
    g.act(u, 755, b, 1, arrival=ms(dt.date(2200, 1, 1)), reason=R.BAD_TIME)


def _bad_rows(g: _Log) -> None:
    # items 510.. are used by no other user: a leaked bad row shows up in a sequence
    t = ms(day(2), 14)
    g.request(None, "b-nulluser", t, [(510, 1, 0, SEC)], reason=R.NULL_USER)
    g.request(401, "g401-1", t - 3_600_000, [(511, 1, 0, SEC)])
    g.imp(401, None, t, 512, 0, 1, 0, SEC, reason=R.NULL_REQUEST)
    g.imp(401, "b-nullts", None, 513, 0, 1, 0, ats=t, date=day(2), reason=R.NULL_TIME)
    g.request(401, "g401-2", t + 3_600_000, [(514, 0, 0, 0)])
    # null item and an action before its request, inside otherwise good requests
    g.imp(402, "g402-1", t, 515, 0, 1, 0, SEC)
    g.imp(402, "g402-1", t, None, 1, 1, 0, SEC, reason=R.NULL_ITEM)
    g.imp(402, "g402-1", t, 516, 2, 0, 0)
    g.imp(402, "g402-2", t + 60 * SEC, 517, 0, 1, 0, SEC)
    g.imp(402, "g402-2", t + 60 * SEC, 518, 1, 1, 0, ats=t + 59 * SEC, reason=R.ACTION_BEFORE_REQUEST)
    g.request(402, "g402-3", t + 3_600_000, [(519, 0, 0, 0)])
    # request time outside the sane range (year < 2000)
    old = ms(dt.date(1999, 12, 31), 12)
    g.request(403, "b-1999", old, [(520, 1, 0, SEC), (521, 1, 1, SEC)], reason=R.BAD_TIME)
    g.request(403, "g403-1", t, [(522, 0, 0, 0)])
    # a request time far ahead of the clock (max_year null: more than a day ahead is broken)
    g.request(403, "b-2200", ms(dt.date(2200, 1, 1), 12), [(597, 0, 0, 0)], reason=R.BAD_TIME)
    # exact duplicates: one copy kept, the extra copies quarantined (a clicked row: one event, not three)
    a = g.imp(404, "g404-1", t, 523, 0, 1, 0, SEC)
    b = g.imp(404, "g404-1", t, 524, 1, 0, 0, 0)
    for row in (a, a, b):
        g.copy(row)
    g.request(404, "g404-2", t + 600 * SEC, [(525, 0, 0, 0)])
    # two different rows at one (request, position): both out; the rest of the request stays
    g.imp(405, "g405-1", t, 526, 0, 1, 0, SEC)
    g.imp(405, "g405-1", t, 527, 1, 1, 0, SEC, reason=R.POSITION_CONFLICT)
    g.imp(405, "g405-1", t, 528, 1, 0, 0, SEC, reason=R.POSITION_CONFLICT)
    g.imp(405, "g405-1", t, 529, 2, 0, 0, 0)
    g.request(405, "g405-2", t + 600 * SEC, [(530, 0, 0, 0)])
    # one request id, two users: the whole request out
    g.imp(406, "b-shared", t, 531, 0, 1, 0, SEC, reason=R.REQUEST_USER_CONFLICT)
    g.imp(407, "b-shared", t, 532, 1, 1, 0, SEC, reason=R.REQUEST_USER_CONFLICT)
    g.request(406, "g406-1", t + 600 * SEC, [(533, 0, 0, 0)])
    g.request(407, "g407-1", t + 600 * SEC, [(534, 0, 0, 0)])
    # rows of one request disagreeing on a request-level column: the whole request out
    base = dict(device="ios", hour=14, age=3, country="DE")
    for k, (col, other) in enumerate([("rts", None), ("device", "web"), ("hour", 15), ("age", 4),
                                      ("country", "FR")]):
        rid, rts = f"b-incons-{k}", t + k * 60 * SEC
        g.imp(408, rid, rts, 535 + k, 0, 1, 0, SEC, reason=R.REQUEST_INCONSISTENT, **base)
        kw = dict(base)
        if col != "rts":
            kw[col] = other
        g.imp(408, rid, rts + (SEC if col == "rts" else 0), 540 + k, 1, 1, 0, SEC,
              reason=R.REQUEST_INCONSISTENT, **kw)
    g.request(408, "g408-1", t + 3_600_000, [(545, 0, 0, 0)])


def _bad_actions(g: _Log) -> None:
    t = ms(day(2), 13)
    g.act(None, 550, t, 1, reason=R.NULL_USER)
    g.act(402, None, t, 1, reason=R.NULL_ITEM)
    g.act(402, 551, ms(dt.date(1999, 6, 1)), 1, reason=R.BAD_TIME)
    g.act(402, 552, t, 2)  # a good one


def _float_label_rows(g: _Log) -> None:
    t = ms(day(3), 14)
    g.imp(409, "b-nan", t, 555, 0, 1, float("nan"), SEC, reason=R.BAD_LABEL)
    g.imp(409, "g409-1", t + 60 * SEC, 556, 0, 1, 0, SEC)
    g.imp(409, "g409-1", t + 60 * SEC, 557, 1, 1, float("inf"), SEC, reason=R.BAD_LABEL)
    g.imp(409, "g409-2", t + 120 * SEC, 558, 0, 0, float("-inf"), 0, reason=R.BAD_LABEL)
    g.request(409, "g409-3", t + 3_600_000, [(559, 0, 1.0, 0)])


def _generate(float_labels: bool = False, seed: int = 7, lag: int = 0, arrival: bool = False) -> _Log:
    g = _Log()
    rng = random.Random(seed)
    _normal_users(g, rng)
    _heavy_user(g, rng)
    _ties_user(g)
    _late_user(g)
    if lag:
        _lag_user(g, lag)
    if arrival:
        _arrival_user(g, lag)
    _fat_users(g)
    _bad_rows(g)
    _bad_actions(g)
    if float_labels:
        _float_label_rows(g)
    return g


# --------------------------------------------------------------------------
# writing
# --------------------------------------------------------------------------
def _write(rows: list[dict], fields, path: Path) -> str:
    arrays = [pa.array([r[n] for r in rows], type=t) for n, t in fields]
    arrays.append(pa.array([r["date"].isoformat() for r in rows], type=pa.string()))
    schema = pa.schema([pa.field(n, t, nullable=(n != "row_uid")) for n, t in fields]
                       + [pa.field("date", pa.string())])
    table = pa.Table.from_arrays(arrays, schema=schema)
    part = ds.partitioning(pa.schema([pa.field("date", pa.string())]), flavor="hive")
    ds.write_dataset(table, str(path), format="parquet", partitioning=part,
                     existing_data_behavior="overwrite_or_ignore", basename_template="part-{i}.parquet")
    return str(path)


def _imp_fields(float_labels: bool, fat: bool):
    f = [(n, pa.float64() if (n == "like" and float_labels) else t) for n, t in IMP_FIELDS]
    f.append(("row_uid", pa.int64()))
    if fat:
        f += [(n, pa.list_(pa.field("element", t, nullable=True))) for n, t in SNAP_FIELDS]
    return f


def _truth(g: _Log):
    bad = dict(g.bad)  # uid -> reason
    dup_uids = {u for u, r in g.bad if r == R.DUPLICATE_ROW}
    expected, after = set(), set()
    for r in g.rows:
        u = r["row_uid"]
        if u in bad and u not in dup_uids:
            continue
        (expected if r["request_ts"] < AS_OF_MS else after).add(u)
    return bad, expected, after


def _with_arrivals(g: _Log) -> tuple[list[dict], list[dict]]:
    """The rows with arrival columns: the explicit ones kept; every other action arrives
    ARRIVAL_DELAYS[k % 5] after its action time (k: its row), a row without an action has none.
    The action log is filed by arrival day (``date``)."""
    rows, by_uid = [], {}  # exact copies share their row_uid, and so their arrival
    for k, r in enumerate(g.rows):
        r = dict(r)
        if ARRIVAL_COLUMN not in r:
            acted = (r["click"] or 0) > 0 or (r["like"] or 0) > 0
            by_uid.setdefault(r["row_uid"], r["action_ts"] + ARRIVAL_DELAYS[k % 5]
                              if acted and r["action_ts"] is not None else None)
            r[ARRIVAL_COLUMN] = by_uid[r["row_uid"]]
        rows.append(r)
    acts, new = [], {}
    for k, a in enumerate(g.actions):
        b = dict(a)
        if ACTION_ARRIVAL_COLUMN not in b:
            b[ACTION_ARRIVAL_COLUMN] = b["ts"] + ARRIVAL_DELAYS[k % 5] if b["ts"] is not None else None
        if b[ACTION_ARRIVAL_COLUMN] is not None and 1999 < date_of(b[ACTION_ARRIVAL_COLUMN]).year < 2200:
            b["date"] = date_of(b[ACTION_ARRIVAL_COLUMN])
        acts.append(b)
        new[id(a)] = b
    g.bad_actions = [(new[id(a)], reason) for a, reason in g.bad_actions]
    return rows, acts


def arrival_config(actions: bool = False, **over) -> dict:
    """The edge config with arrival columns (``columns.arrival_time``, ``columns.actions.arrival``)
    and the availability lag LAG (for the actions without an arrival)."""
    cfg = lean_config(actions, **{"availability_lag": LAG, **over})
    cfg["columns"] = dict(cfg["columns"], arrival_time=ARRIVAL_COLUMN)
    if actions:
        cfg["columns"]["actions"] = dict(cfg["columns"]["actions"], arrival=ACTION_ARRIVAL_COLUMN)
    return cfg


def make_lean(root, *, actions: bool = False, float_labels: bool = False, lag: bool = False, arrival: bool = False,
              **cfg_over) -> EdgeLog:
    """The lean log (with its action log); ``lag``: with the availability lag LAG in the
    config and a user whose rows hold its edge cases (``_lag_user``); ``arrival``: with arrival
    columns (:func:`arrival_config`, lag LAG), a user of late arrivals of every kind
    (``_arrival_user``) and every other action arriving late (:data:`ARRIVAL_DELAYS`)."""
    root = Path(root)
    if lag or arrival:
        cfg_over = {"availability_lag": LAG, **cfg_over}
    g = _generate(float_labels, lag=LAG_MS if (lag or arrival) else 0, arrival=arrival)
    rows = [dict(r) for r in g.rows]
    acts = g.actions
    if arrival:
        rows, acts = _with_arrivals(g)  # the rejected action rows too, as written (with their arrival)
    if float_labels:
        for r in rows:
            r["like"] = float(r["like"])
    imp_fields = _imp_fields(float_labels, False) + ([(ARRIVAL_COLUMN, pa.int64())] if arrival else [])
    act_fields = ACT_FIELDS + ([(ACTION_ARRIVAL_COLUMN, pa.int64())] if arrival else [])
    imp = _write(rows, imp_fields, root / "lean")
    act = _write(acts, act_fields, root / "actions") if actions else None
    bad, expected, after = _truth(g)
    config = arrival_config(actions, **cfg_over) if arrival else lean_config(actions, **cfg_over)
    return EdgeLog(
        root=root, impressions=imp, actions=act, config=config, as_of=AS_OF,
        rejected=bad, quarantined=list(g.bad), expected_uids=expected, after_as_of_uids=after,
        rows_read=len(rows), rejected_actions=list(g.bad_actions) if actions else [],
        lag=LAG_MS if (lag or arrival) else 0,
        # the actions whose null arrival is taken as action time + lag (null_arrival: lag): ar-25's, 742
        planted=({"arrivals_filled": 1} | ({"actions_arrivals_filled": 1} if actions else {})) if arrival else {},
        columns=g.columns,
    )


# --------------------------------------------------------------------------
# fat rows: the clean log with the legacy snapshot per impression
# --------------------------------------------------------------------------
def _streams(rows: list[dict]) -> dict:
    """user -> events (action_ts, request_ts, request_id, position, item, bits, category) in stream order."""
    out: dict = {}
    for r in rows:
        bits = (1 if r["click"] > 0 else 0) | (2 if r["like"] > 0 else 0)
        if bits:
            out.setdefault(r["user_id"], []).append(
                (r["action_ts"], r["request_ts"], r["request_id"], r["position"], r["item_id"], bits,
                 r["category"]))
    for ev in out.values():
        ev.sort()
    return out


def _snap(events, upto_excl: int, cut: int, inclusive: bool = False):
    seen = [e for e in events if (e[0] <= upto_excl if inclusive else e[0] < upto_excl)]
    seen = seen[max(0, len(seen) - cut):] if cut else []
    return seen


def make_fat(root, **cfg_over) -> EdgeLog:
    """The clean lean log (accepted rows, one copy of duplicates, rows after as-of kept) with
    snapshots hist_item_id / hist_ts / hist_category: the last L actions strictly before the
    request time, oldest first. Odd ones (single-impression requests of user 302/303):
    f-04 leaks (holds its own click), f-08 is edited (an event removed from the middle: an
    override), f-06 is null, e-03 is an empty list despite a history, user 301 and f-10 use a
    cut-off of 3; f-12's impressions carry different snapshots (snapshot_mismatch)."""
    root = Path(root)
    g = _generate(False)
    bad = dict(g.bad)
    seen_uid = set()
    rows = []
    for r in g.rows:
        u = r["row_uid"]
        if u in bad and bad[u] != R.DUPLICATE_ROW:
            continue
        if u in seen_uid:
            continue
        seen_uid.add(u)
        rows.append(dict(r))
    streams = _streams(rows)
    mismatch: dict[int, str] = {}
    for r in rows:
        ev = streams.get(r["user_id"], [])
        rid = r["request_id"]
        cut = 3 if (r["user_id"] == 301 or rid == "f-10") else L
        snap = _snap(ev, r["request_ts"], cut)
        if rid == "f-04":
            snap = _snap(ev, r["action_ts"], L, inclusive=True)  # leaks its own click
            assert snap and snap[-1][0] >= r["request_ts"]
        elif rid == "f-08":
            assert len(snap) == L
            snap = snap[:2] + snap[3:]
        elif rid == "e-3":
            assert snap
            snap = []
        elif rid == "f-12" and r["position"] == 2:
            snap = snap[1:]
            mismatch[r["row_uid"]] = R.SNAPSHOT_MISMATCH
        if rid == "f-06":
            r["hist_item_id"] = r["hist_ts"] = r["hist_category"] = None
        else:
            r["hist_item_id"] = [e[4] for e in snap]
            r["hist_ts"] = [e[0] for e in snap]
            r["hist_category"] = [e[6] for e in snap]
    for r in rows:
        if r["request_id"] == "f-12":
            mismatch[r["row_uid"]] = R.SNAPSHOT_MISMATCH
    path = _write(rows, _imp_fields(False, True), root / "fat")
    expected, after = set(), set()
    for r in rows:
        if r["row_uid"] in mismatch:
            continue
        (expected if r["request_ts"] < AS_OF_MS else after).add(r["row_uid"])
    return EdgeLog(
        root=root, impressions=path, actions=None, config=fat_config(**cfg_over), as_of=AS_OF,
        rejected=mismatch, quarantined=sorted(mismatch.items()), expected_uids=expected,
        after_as_of_uids=after, rows_read=len(rows),
        planted={"overrides": 1, "leaking_snapshots": 1, "null_snapshots": 1}, fat=True,
    )


def write_config(cfg: dict, path) -> str:
    """YAML is a superset of JSON: the config dict written as JSON is valid YAML."""
    Path(path).write_text(json.dumps(cfg, indent=1))
    return str(path)
