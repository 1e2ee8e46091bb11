"""`userwise synth`: a synthetic point-wise impression log, lean and fat.

What it writes into ``OUT`` (see docs/synth.md):

- ``lean/``    impressions (:data:`schemas.SYNTH_IMPRESSIONS`), one row each;
- ``fat/``     the same rows, each carrying its user's sequence snapshot
  (:data:`schemas.SYNTH_FAT_IMPRESSIONS`), as a legacy point-wise sample log would;
- ``actions/`` a separate action log from other surfaces (:data:`schemas.SYNTH_ACTIONS`);
- ``config.yaml`` (lean, with ``columns.actions``) and ``config_fat.yaml`` (fat);
- ``bad_rows.json``: ``{reason: rows}`` of the malformed rows injected by ``--bad-rows``;
- ``synth.json``: the arguments, the parameters, row counts and who the bot is.

Before anything is written, the arguments are checked against their bounds (:data:`MAX_USERS`,
...) and the output's estimated size against the free space where it goes; it is written into a
``.synth-partial-*`` folder inside ``OUT`` and moved in place at the end, so a failed or interrupted
run leaves ``OUT`` as it was (an earlier synth output there is replaced only by a finished one).

Every kind is hive-partitioned by ``date`` (``date=YYYY-MM-DD/part-CCCCC.parquet``,
the UTC day of ``request_ts`` / ``ts``; the column lives in the path, not in the
files), as Parquet or as a Delta table (the same files plus a ``_delta_log``
written by ``deltalake``, no Spark).

How it scales: users are cut into blocks of :data:`BLOCK` users; every random
draw comes from a generator seeded by ``(seed, stream, day, block)``, so the
data do not depend on how blocks are grouped into files, and the same seed and
arguments give byte-identical Parquet files. The loop is chunk of blocks ->
day -> block; each (block, day) is generated with vectorised numpy, and the fat
snapshot is computed from a per-block carry of the newest L actions, so memory
is bounded by the chunk size, not by the number of rows.

The fat snapshot follows the pointer rule (docs/pointer.md): a user's stream is the
impressions with click>0 or like>0, each an event at ``action_ts``, in the
order (action_ts, request_ts, request_id, position, item_id, bits); an
impression's snapshot is the last L events with ``action_ts < request_ts``,
oldest first, ``[]`` when none. Injected bad rows add no events; the action
log is not part of the snapshot.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import math
import os
import shutil
import sys
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import yaml

from userwise import schemas as S
from userwise.pipelines import console
from userwise.pipelines.errors import DATE_RANGE, MAX_DAYS, UserwiseError
from userwise.pipelines.runtime import progress
from userwise.schemas import reasons as R

MS_PER_HOUR = 3_600_000
MS_PER_DAY = 86_400_000
BLOCK = 1024
"""Users per random-number block: the unit of determinism (never change it lightly)."""

KINDS = ("lean", "fat", "actions")
# Bounds of the arguments (days: pipelines.errors.MAX_DAYS, 100 years, keeps the snapshot's sort keys below
# 2^42 ms; the start: DATE_RANGE, four-digit years, so request ids sort as their dates)
MAX_USERS = 1_000_000_000
"""Request ids hold the user id in 10 digits."""
MAX_ITEMS = 100_000_000
"""The popularity table holds a few numbers per item in memory (about 3 GB at this bound)."""
MAX_SEQ_LEN = 10_000
"""L of the fat snapshots (the product's default is 1,000)."""
# Bytes per row on disk (zstd Parquet), measured on a 3,000-user, 2-day log (lean 14.9, fat 17.3 at L 50
# and 18.5 at L 500, actions 12.3) and rounded down: the free-space check refuses only what surely
# does not fit.
_DISK_BYTES_PER_ROW = {"lean": 12, "fat": 14, "actions": 10}
# The injected faults, named by the quarantine reason the build gives them (schemas/reasons.py)
BAD_REASONS = (
    R.NULL_USER,  # user_id is null
    R.NULL_ITEM,  # item_id is null
    R.NULL_TIME,  # request_ts is null
    R.BAD_TIME,  # request_ts in the 1990s (before config min_year 2000)
    R.ACTION_BEFORE_REQUEST,  # click=1 and action_ts < request_ts
    R.DUPLICATE_ROW,  # an exact copy of a clean, unclicked row
    R.REQUEST_USER_CONFLICT,  # one request_id with two users (2 injected rows per case)
    R.POSITION_CONFLICT,  # two rows with one (request_id, position), different items (2 rows)
)
# Streams of the seed sequence: (seed, stream, day, block)
_USERS, _DAY, _ACTIONS, _BAD, _ITEMS, _HISTORY = 1, 2, 3, 4, 5, 6
# --arrivals: their own streams, so the other columns stay as they are with or without them
_ARRIVALS, _HISTORY_ARRIVALS = 7, 8


@dataclass(frozen=True)
class SynthParams:
    """Distribution parameters of the generator, and the public statistics behind them.

    Sources (numbers as published):

    - RecFlow (Kuaishou, ICLR 2025, openreview vVHc8bGRns): 38M exposed
      interactions of 42K users on ~9M items from 9.3M requests in 37 days,
      i.e. ~4.1 exposures per request and ~6 requests per user per day.
    - KuaiRand (Kuaishou, CIKM 2022, arXiv 2208.08696): 12 feedback signals
      (click, like, view time...) per exposure, two weeks, "each user has
      thousands of historical interactions on average".
    - MIND (Microsoft News, ACL 2020): 1M users, ~160K news, >15M impression
      logs in 6 weeks (~15 impressions per user); every impression holds a
      list of shown news with clicked / not-clicked labels.
    - Taobao UserBehavior (Tianchi): ~1M users, ~100M behaviours (pv, cart,
      fav, buy) from 2017-11-25 to 2017-12-03 (9 days), ~11 per user per
      day; every behaviour carries an item category id.
    """

    # -- items ----------------------------------------------------------------
    zipf_s: float = 1.1
    """Item popularity P(rank r) ~ r^-s over the starting catalogue (--items).
    Web/video popularity is Zipf-like with s near 1; ~9M items for 38M
    interactions in RecFlow means a long tail that most items barely reach."""
    new_items_per_day: float = 0.01
    """New items released each day, as a share of --items (ids after the catalogue)."""
    fresh_share: float = 0.10
    """Share of impressions drawn uniformly from the items released in the last
    `fresh_days` days: fresh content is over-exposed in short-video feeds."""
    fresh_days: int = 3
    items_per_category: int = 50
    """Categories = ceil(items / 50). Taobao's rows carry a category id; short-video
    logs carry a (coarser) tag / category per item."""
    items_per_author: int = 20
    """Authors (creators) = ceil(items / 20)."""

    # -- users ----------------------------------------------------------------
    requests_per_day_median: float = 4.0
    """Median requests per active user per day; the lognormal's mean is
    median * exp(sigma^2 / 2) = 6.6, near RecFlow's ~6 requests per user per day."""
    requests_per_day_sigma: float = 1.0
    """Lognormal sigma of a user's request rate (heavy tail: p99 ~ 10x the median)."""
    heavy_share: float = 0.01
    """Share of heavy users, whose rate is multiplied by `heavy_factor`."""
    heavy_factor: float = 10.0
    bot_factor: float = 300.0
    """One bot-like user requests bot_factor x the median rate (~1,200 a day), around
    the clock, orders of magnitude above the rest (what skew handling must survive)."""
    bot_action_factor: float = 1.0
    """The bot's action-log rate, as a multiple of `action_log_rate` x its request rate."""
    one_shot_share: float = 0.05
    """Share of users with exactly one request in the whole run (cold users)."""
    same_ms_request: float = 0.003
    """Probability that a request repeats the previous request's millisecond (a double
    fire of the client): rare ties of request_ts within one user."""
    diurnal: tuple[float, ...] = (
        2, 1.5, 1, 1, 1, 1.5, 3, 5, 6, 6, 6, 7, 8, 7, 6, 6, 6, 7, 8, 9, 10, 9, 6, 3,
    )
    """Relative request weight per UTC hour (the bot ignores it)."""

    # -- requests -------------------------------------------------------------
    imps_min: int = 4
    """At least 4 impressions per request (RecFlow: ~4.1 exposures per request)."""
    imps_max: int = 50
    """At most 50 (news pages list dozens of items: MIND's impression lists)."""
    imps_extra_mean: float = 8.0
    """Impressions = 4 + NegBin(mean 8, shape 1.5), clipped to 50: mean ~12, long tail."""
    imps_extra_shape: float = 1.5

    # -- labels ---------------------------------------------------------------
    ctr: float = 0.03
    """Mean click-through per impression (feeds and news logs: a few percent)."""
    ctr_user_sigma: float = 0.5
    """Lognormal (mean 1) click propensity per user."""
    position_decay: float = 0.2
    """Click probability ~ (1 + position)^-decay, normalised to keep the mean at `ctr`."""
    like_given_click: float = 0.12
    """like only after a click and rarer by ~an order of magnitude (KuaiRand's
    secondary signals are much sparser than clicks)."""

    # -- time -----------------------------------------------------------------
    dwell_median_ms: float = 20_000.0
    """Lognormal dwell before a click's action is logged (median 20 s)."""
    dwell_sigma: float = 1.0
    zero_dwell: float = 0.02
    """Share of clicks logged in the request's own millisecond (action_ts == request_ts)."""
    batch_dwell: float = 0.05
    """Share of requests whose clicks are reported in one batch: one action_ts for all
    (ties in the stream, broken by position)."""
    late: float = 0.01
    """Share of clicks logged 1 to 36 hours late (often on a later UTC day)."""
    exposure_ms_per_position: float = 700.0
    """Unclicked rows: action_ts = request_ts + position * 0.7 s + Exp(0.5 s) (scrolled past)."""

    # -- arrival (``--arrivals``): when each event reached the serving store ----------------
    arrival_median_ms: float = 800.0
    """Most events arrive within seconds of their action: a lognormal delay, median 0.8 s (p90 ~2.9 s,
    p99 ~8 s), the path from the client through the event queue to the store."""
    arrival_sigma: float = 1.0
    arrival_hours_share: float = 0.04
    """A tail of hours: a retried partition, a phone offline for a while; delay log-uniform in
    ``arrival_hours_ms``."""
    arrival_hours_ms: tuple[float, float] = (60_000.0, 12 * 3_600_000.0)
    arrival_days_share: float = 0.004
    """A few of days: a phone offline for days, a backfilled source; delay uniform in ``arrival_days_ms``."""
    arrival_days_ms: tuple[float, float] = (86_400_000.0, 7 * 86_400_000.0)
    arrival_ahead_share: float = 0.002
    """The action log only: a client clock that runs ahead stamps ``ts`` after the event arrived; arrival
    precedes ``ts`` by up to ``arrival_ahead_ms``. The impressions' own actions always arrive at or after
    their ``action_ts`` (so never before their request)."""
    arrival_ahead_ms: float = 2_000.0

    # -- the separate action log ----------------------------------------------
    action_log_rate: float = 0.3
    """Events per day in the action log, as a share of the user's request rate."""
    action_log_like: float = 0.1
    history_days: int = 0
    """Days of action log alone before the first day of impressions (--start): the history the users
    built on other surfaces before the impressions begin (``--history-days``)."""
    fat_sees_actions: bool = False
    """The fat snapshots hold the action log's events too (one history from every surface, as a
    production sample log does); otherwise only the impressions' own actions."""

    # -- features -------------------------------------------------------------
    devices: tuple[str, ...] = ("android", "ios", "web", "pad")
    device_weights: tuple[float, ...] = (0.55, 0.3, 0.1, 0.05)
    device_stickiness: float = 0.9
    countries: tuple[str, ...] = (
        "CN", "US", "IN", "BR", "ID", "JP", "DE", "GB", "FR", "MX", "KR", "RU", "TR", "VN", "IT", "ES",
    )
    age_buckets: int = 8

    def to_dict(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}


SHAPES = {
    "default": SynthParams(),
    # Long histories (docs/synth.md#production-shape): 53 days of action log before the impressions at 7 x the
    # request rate (~45 events per user-day; KuaiRand-27K users hold ~11.8K events each), requests at a median
    # of 3.6 per user-day (mean ~6 with the heavy users, RecFlow's ~6), 4 to 40 impressions each. A history
    # at request time then has a median over 3K events (requests weigh active users more), the heavy users
    # (1%, 10x) make the tail past 50K, and the bot (25x the median rate, 3x the action log: ~100 requests and
    # ~2K events a day, ~110K events in all) is the longest history without crowding out a small log's requests.
    "production": SynthParams(
        requests_per_day_median=3.6, imps_max=40, bot_factor=25.0, bot_action_factor=3.0, action_log_rate=7.0,
        history_days=53, fat_sees_actions=True,
    ),
}
"""The presets of ``--shape``: every distribution parameter, by name."""


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------
def _rng(seed: int, *stream: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed, *stream]))


def _mix(x: np.ndarray, salt: int) -> np.ndarray:
    """A fixed 64-bit hash (splitmix64 finaliser): side-info as a pure function of the id."""
    with np.errstate(over="ignore"):
        z = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15 ^ salt)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def _segments(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenated ranges [starts[i], starts[i] + lengths[i]) as one index array."""
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    offs = np.cumsum(lengths) - lengths
    return np.arange(total, dtype=np.int64) - np.repeat(offs - starts, lengths)


def _within(counts: np.ndarray) -> np.ndarray:
    """0..c-1 for each group of size c, concatenated."""
    return _segments(np.zeros(len(counts), np.int64), counts)


def _lpad(a: np.ndarray, width: int) -> pa.Array:
    return pc.utf8_lpad(pc.cast(pa.array(a, pa.int64()), pa.string()), width, "0")


def _file_schema(table: S.TableSchema) -> pa.Schema:
    sch = table.to_arrow()
    return sch.remove(sch.get_field_index("date"))


LEAN_SCHEMA = _file_schema(S.SYNTH_IMPRESSIONS)
FAT_SCHEMA = _file_schema(S.SYNTH_FAT_IMPRESSIONS)
ACTIONS_SCHEMA = _file_schema(S.SYNTH_ACTIONS)
ARRIVAL = "arrival_ts"
"""The column ``--arrivals`` adds to the lean impressions and the action log: when the event (an
impression's own action, an action-log event) arrived at the serving store, epoch ms."""
LEAN_ARRIVALS_SCHEMA = LEAN_SCHEMA.append(pa.field(ARRIVAL, pa.int64(), False))
ACTIONS_ARRIVALS_SCHEMA = ACTIONS_SCHEMA.append(pa.field(ARRIVAL, pa.int64(), False))


def arrival_delays(rng: np.random.Generator, n: int, p: "SynthParams", *, ahead: bool) -> np.ndarray:
    """``n`` arrival delays (ms, int64: arrival - action time) drawn from ``p``'s mixture: a
    lognormal of seconds, a share of hours (log-uniform), a share of days (uniform), and with
    ``ahead`` (the action log) a share that arrives before its stamped time (a clock ahead).

    Example::

        d = arrival_delays(np.random.default_rng(0), 100_000, SynthParams(), ahead=False)
        np.median(d) < 1_000, (d > 3_600_000).mean()
    """
    u = rng.random(n)
    fast = rng.lognormal(math.log(p.arrival_median_ms), p.arrival_sigma, n)
    lo, hi = p.arrival_hours_ms
    hours = np.exp(rng.uniform(math.log(lo), math.log(hi), n))
    days = rng.uniform(*p.arrival_days_ms, n)
    back = -rng.uniform(0.0, p.arrival_ahead_ms, n)
    a, b = p.arrival_days_share, p.arrival_days_share + p.arrival_hours_share
    c = b + (p.arrival_ahead_share if ahead else 0.0)
    d = np.where(u < a, days, np.where(u < b, hours, np.where(u < c, back, fast)))
    return np.round(d).astype(np.int64)


# ---------------------------------------------------------------------------
# the world: users and items (functions of the seed and the arguments)
# ---------------------------------------------------------------------------
@dataclass
class World:
    seed: int
    params: SynthParams
    start_ms: int  # first day's 00:00 UTC, epoch ms
    days: int
    n_users: int
    n_items: int
    bot: int  # the bot's user index (user_id = index + 1)
    max_seq_len: int
    arrivals: bool = False  # --arrivals: an arrival time per event (lean impressions, action log, fat snapshots)

    def __post_init__(self):
        p = self.params
        ranks = np.arange(1, self.n_items + 1, dtype=np.float64)
        self.cdf = np.cumsum(ranks ** -p.zipf_s)
        self.cdf /= self.cdf[-1]
        self.perm = _rng(self.seed, _ITEMS).permutation(self.n_items)
        self.new_per_day = max(1, math.ceil(self.n_items * p.new_items_per_day))
        total_items = self.n_items + self.days * self.new_per_day
        self.n_categories = max(1, math.ceil(total_items / p.items_per_category))
        self.n_authors = max(1, math.ceil(total_items / p.items_per_author))
        dw = np.asarray(p.diurnal, np.float64)
        self.diurnal = dw / dw.sum()
        pos = np.arange(p.imps_min + p.imps_extra_mean)
        self.pos_norm = float(np.mean((1.0 + pos) ** -p.position_decay))

    @property
    def n_blocks(self) -> int:
        return -(-self.n_users // BLOCK)

    def day_ms(self, d: int) -> int:
        return self.start_ms + d * MS_PER_DAY

    def date(self, d: int) -> dt.date:
        return dt.date(1970, 1, 1) + dt.timedelta(milliseconds=self.day_ms(d))

    # -- items --------------------------------------------------------------
    def sample_items(self, rng: np.random.Generator, n: int, d: int) -> np.ndarray:
        p = self.params
        fresh = rng.random(n) < p.fresh_share
        rank = np.searchsorted(self.cdf, rng.random(n), side="right")
        rank = np.minimum(rank, self.n_items - 1)
        if d < 0:  # a history day (before --start): new items are released from the first day of impressions on
            return self.perm[rank].astype(np.int64) + 1
        lo = max(0, d - p.fresh_days + 1) * self.new_per_day
        hi = (d + 1) * self.new_per_day
        new = self.n_items + rng.integers(lo, hi, n)
        return np.where(fresh, new, self.perm[rank]).astype(np.int64) + 1  # item ids start at 1

    def category(self, item_id: np.ndarray) -> np.ndarray:
        return (_mix(item_id, 0xCA7) % np.uint64(self.n_categories)).astype(np.int32)

    def author(self, item_id: np.ndarray) -> np.ndarray:
        return (_mix(item_id, 0xA07) % np.uint64(self.n_authors)).astype(np.int64) + 1

    # -- users ----------------------------------------------------------------
    def users(self, b: int) -> dict:
        """Constant per-user attributes of block b (a fixed number of draws per user)."""
        p = self.params
        u0, u1 = b * BLOCK, min((b + 1) * BLOCK, self.n_users)
        n = u1 - u0
        rng = _rng(self.seed, _USERS, b)
        heavy = rng.random(n) < p.heavy_share
        one_shot = (rng.random(n) < p.one_shot_share) & ~heavy
        rate = rng.lognormal(math.log(p.requests_per_day_median), p.requests_per_day_sigma, n)
        rate = np.where(heavy, rate * p.heavy_factor, rate)
        one_shot_day = rng.integers(0, self.days, n)
        s = p.ctr_user_sigma
        prop = rng.lognormal(-s * s / 2, s, n)
        device = rng.choice(len(p.devices), n, p=np.asarray(p.device_weights) / sum(p.device_weights))
        age = rng.integers(0, p.age_buckets, n).astype(np.int8)
        cw = 1.0 / np.arange(1, len(p.countries) + 1)
        country = rng.choice(len(p.countries), n, p=cw / cw.sum())
        idx = np.arange(u0, u1)
        bot = idx == self.bot
        rate = np.where(bot, p.bot_factor * p.requests_per_day_median, rate)
        heavy &= ~bot
        one_shot &= ~bot
        return dict(u0=u0, n=n, heavy=heavy, one_shot=one_shot, one_shot_day=one_shot_day, rate=rate,
                    prop=prop, device=device, age=age, country=country, bot=bot)


def expected_impressions_per_user_day(p: SynthParams, days: int) -> float:
    """Mean impressions of one ordinary user per day (bot excluded)."""
    lognorm_mean = p.requests_per_day_median * math.exp(p.requests_per_day_sigma ** 2 / 2)
    rate = (1 - p.heavy_share - p.one_shot_share * (1 - p.heavy_share)) * lognorm_mean \
        + p.heavy_share * p.heavy_factor * lognorm_mean + p.one_shot_share * (1 - p.heavy_share) / days
    rng = np.random.default_rng(0)
    nb_p = p.imps_extra_shape / (p.imps_extra_shape + p.imps_extra_mean)
    imps = np.clip(p.imps_min + rng.negative_binomial(p.imps_extra_shape, nb_p, 200_000), p.imps_min, p.imps_max)
    return rate * float(imps.mean())


# ---------------------------------------------------------------------------
# one (block, day)
# ---------------------------------------------------------------------------
def gen_impressions(w: World, U: dict, d: int) -> dict:
    """The clean impressions of one block and day, sorted by (user, request_ts, request, position)."""
    p = w.params
    rng = _rng(w.seed, _DAY, d, U["u0"] // BLOCK)
    n = U["n"]
    n_req = rng.poisson(U["rate"])
    n_req = np.where(U["one_shot"], (U["one_shot_day"] == d).astype(np.int64), n_req)
    R = int(n_req.sum())
    ru = np.repeat(np.arange(n), n_req)  # local user of each request
    hour = rng.choice(24, R, p=w.diurnal)
    hour = np.where(U["bot"][ru], rng.integers(0, 24, R), hour)
    ms = hour.astype(np.int64) * MS_PER_HOUR + rng.integers(0, MS_PER_HOUR, R)
    order = np.lexsort((ms, ru))
    ms = ms[order]
    same = rng.random(R) < p.same_ms_request
    same[1:] &= ru[1:] == ru[:-1]
    if R:
        same[0] = False
    src = np.maximum.accumulate(np.where(same, 0, np.arange(R)))
    ms = ms[src]
    k = _within(n_req)
    if R and int(k.max()) >= 1_000_000:
        raise UserwiseError("synth: a user has over 999,999 requests in a day; lower bot_factor")
    rts = w.day_ms(d) + ms
    dev = np.where(rng.random(R) < p.device_stickiness, U["device"][ru], rng.integers(0, len(p.devices), R))
    nb_p = p.imps_extra_shape / (p.imps_extra_shape + p.imps_extra_mean)
    n_imp = np.clip(p.imps_min + rng.negative_binomial(p.imps_extra_shape, nb_p, R), p.imps_min, p.imps_max)
    batch = rng.random(R) < p.batch_dwell
    batch_dwell = rng.lognormal(math.log(p.dwell_median_ms), p.dwell_sigma, R)

    N = int(n_imp.sum())
    rq = np.repeat(np.arange(R), n_imp)  # request of each row
    pos = _within(n_imp)
    item = w.sample_items(rng, N, d)
    u = ru[rq]
    pclick = np.clip(p.ctr * U["prop"][u] * (1.0 + pos) ** -p.position_decay / w.pos_norm, 0.0, 0.9)
    click = rng.random(N) < pclick
    like = click & (rng.random(N) < p.like_given_click)
    dwell = rng.lognormal(math.log(p.dwell_median_ms), p.dwell_sigma, N)
    dwell = np.where(batch[rq], batch_dwell[rq], dwell)
    dwell = np.where(rng.random(N) < p.zero_dwell, 0.0, dwell)
    dwell = np.where(rng.random(N) < p.late, rng.uniform(1 * MS_PER_HOUR, 36 * MS_PER_HOUR, N), dwell)
    exposure = pos * p.exposure_ms_per_position + rng.exponential(500.0, N)
    dwell = np.where(click, dwell, exposure).astype(np.int64)
    noise = rng.normal(0.0, 1.0, N)
    score = (1.0 / (1.0 + np.exp(-(np.log(pclick / (1 - pclick)) + noise)))).astype(np.float32)
    ats = rts[rq] + dwell
    if w.arrivals:  # drawn from their own stream: every other column is the same without --arrivals
        arr = ats + np.maximum(arrival_delays(_rng(w.seed, _ARRIVALS, 0, d, U["u0"] // BLOCK), N, p, ahead=False), 0)
    else:
        arr = ats
    return dict(
        R=R, N=N, req_user=ru, req_k=k, req_ts=rts, req_hour=(ms // MS_PER_HOUR).astype(np.int8), req_dev=dev,
        rq=rq, user=u, pos=pos.astype(np.int32), item=item, click=click.astype(np.int8),
        like=like.astype(np.int8), action_ts=ats, arrival_ts=arr, score=score,
    )


def request_ids(w: World, U: dict, d: int, local_user: np.ndarray, k: np.ndarray, tag: str = "-") -> pa.Array:
    """d<YYYYMMDD>-u<user_id:010>-<k:06>: unique, and for one user sorted like (date, k)."""
    prefix = "d" + w.date(d).strftime("%Y%m%d") + "-u"
    return pc.binary_join_element_wise(prefix, _lpad(U["u0"] + local_user + 1, 10), tag, _lpad(k, 6), "")


def lean_columns(w: World, U: dict, d: int, g: dict) -> dict:
    rq, u = g["rq"], g["user"]
    p = w.params
    rid = request_ids(w, U, d, g["req_user"], g["req_k"])
    return {
        "user_id": pa.array(U["u0"] + u + 1, pa.int64()),
        "request_id": rid.take(pa.array(rq)),
        "request_ts": pa.array(g["req_ts"][rq], pa.int64()),
        "action_ts": pa.array(g["action_ts"], pa.int64()),
        "item_id": pa.array(g["item"], pa.int64()),
        "position": pa.array(g["pos"], pa.int32()),
        "click": pa.array(g["click"], pa.int8()),
        "like": pa.array(g["like"], pa.int8()),
        "category": pa.array(w.category(g["item"]), pa.int32()),
        "author": pa.array(w.author(g["item"]), pa.int64()),
        "device": pa.array(p.devices).take(pa.array(g["req_dev"][rq])),
        "hour": pa.array(g["req_hour"][rq], pa.int8()),
        "age_bucket": pa.array(U["age"][u], pa.int8()),
        "country": pa.array(p.countries).take(pa.array(U["country"][u])),
        "score": pa.array(g["score"], pa.float32()),
        ARRIVAL: pa.array(g["arrival_ts"], pa.int64()),
    }


_NULL = np.iinfo(np.int64).min  # an action-log event's request fields: null, first in the stream's order


class Carry:
    """Per block: the user's events that later requests may still see, in stream order.

    Events (local user, arrival, action_ts, request_ts, request key, position, item, bits,
    category), in arrival order; the arrival is the action_ts without ``--arrivals``, so
    the order is then (action_ts, ...) as before. The request key orders request_ids of
    one user as strings do; an action-log event has null (smallest) request fields, so it
    comes first among events of one millisecond, as in the product's order. A request
    sees the events that arrived strictly before it. After each day only the newest L
    events that arrived before the next day starts and every event arriving at or after
    it (late actions, late arrivals) are kept; ``before`` counts, per user, the events
    dropped (all of them before any later request), so that a request's whole history is
    counted.
    """

    COLS = ("user", "arr", "ats", "rts", "rkey", "pos", "item", "bits", "cat")

    def __init__(self, n_users: int):
        self.ev = {c: np.zeros(0, np.int64) for c in self.COLS}
        self.before = np.zeros(n_users, np.int64)

    def add_day(self, w: World, d: int, g: dict | None, acts: dict | None, L: int, n_users: int):
        """Add the day's events (the impressions' actions of ``g``, the action log's ``acts``); return the
        sorted events and per request of ``g`` the (start, length) of its snapshot in them and its whole
        history's length (events strictly before its request)."""
        parts = [self.ev]
        if g is not None:
            act = (g["click"] > 0) | (g["like"] > 0)
            rq = g["rq"][act]
            date_num = (w.day_ms(d) // MS_PER_DAY)
            parts.append({
                "user": g["user"][act].astype(np.int64),
                "arr": g["arrival_ts"][act],
                "ats": g["action_ts"][act],
                "rts": g["req_ts"][rq],
                "rkey": date_num * 1_000_000 + g["req_k"][rq],
                "pos": g["pos"][act].astype(np.int64),
                "item": g["item"][act],
                "bits": (g["click"][act].astype(np.int64) | (g["like"][act].astype(np.int64) << 1)),
                "cat": w.category(g["item"][act]).astype(np.int64),
            })
        if acts is not None:
            null = np.full(len(acts["ts"]), _NULL, np.int64)
            parts.append({"user": acts["user"].astype(np.int64), "arr": acts["arrival_ts"], "ats": acts["ts"],
                          "rts": null, "rkey": null,
                          "pos": null, "item": acts["item"], "bits": acts["bits"].astype(np.int64),
                          "cat": w.category(acts["item"]).astype(np.int64)})
        ev = {c: np.concatenate([p[c] for p in parts]) for c in self.COLS}
        order = np.lexsort(tuple(ev[c] for c in reversed(self.COLS)))
        ev = {c: v[order] for c, v in ev.items()}
        base = w.start_ms - (w.params.history_days + 1) * MS_PER_DAY  # keys stay positive below 2^42 ms
        key = (ev["user"] << 42) + (ev["arr"] - base)
        ukey = np.arange(n_users, dtype=np.int64) << 42
        ubeg = np.searchsorted(key, ukey, side="left")
        req_start = req_len = hist = np.zeros(0, np.int64)
        if g is not None:
            ru = g["req_user"].astype(np.int64)
            req_end = np.searchsorted(key, (ru << 42) + (g["req_ts"] - base), side="left")
            req_start = np.maximum(ubeg[ru], req_end - L)
            req_len = req_end - req_start
            hist = self.before[ru] + (req_end - ubeg[ru])
        # trim: keep events at/after the next day, and the last L before it per user
        nb = np.searchsorted(key, ukey + (w.day_ms(d + 1) - base), side="left")
        keep = np.arange(len(key)) >= (nb[ev["user"]] - L)
        self.before += np.bincount(ev["user"][~keep], minlength=n_users)
        self.ev = {c: v[keep] for c, v in ev.items()}
        return ev, req_start, req_len, hist


def fat_columns(ev: dict, req_start: np.ndarray, req_len: np.ndarray, rq: np.ndarray) -> dict:
    starts, lens = req_start[rq], req_len[rq]
    idx = _segments(starts, lens)
    offsets = pa.array(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))

    def lst(values, t):
        return pa.ListArray.from_arrays(offsets, pa.array(values, t), type=S.list_of(t))

    return {
        "hist_item_id": lst(ev["item"][idx], pa.int64()),
        "hist_ts": lst(ev["ats"][idx], pa.int64()),
        "hist_category": lst(ev["cat"][idx].astype(np.int32), pa.int32()),
    }


def inject_bad(w: World, U: dict, d: int, g: dict, lean: dict, fat: dict | None, share: float,
               counts: dict) -> tuple[dict, dict | None, int]:
    """Append malformed rows (their own request ids, except exact duplicates) and shuffle
    them in; clean rows are never altered except `score` (NaN, benign). Returns the
    number of NaN scores."""
    N = g["N"]
    if share <= 0 or N == 0:
        return lean, fat, 0
    rng = _rng(w.seed, _BAD, d, U["u0"] // BLOCK)
    rows_per_injection = 1 + 2 / len(BAD_REASONS)  # two reasons add two rows each
    n_inj = int(rng.binomial(N, share / (1 - share) / rows_per_injection))
    reason = rng.integers(0, len(BAD_REASONS), n_inj)
    tmpl = rng.integers(0, N, n_inj)
    unclicked = np.flatnonzero(g["click"] == 0)
    dup_src = unclicked[rng.integers(0, len(unclicked), n_inj)] if len(unclicked) else tmpl
    nan_score = rng.random(N) < share / 4
    two = np.isin(reason, [BAD_REASONS.index(R.REQUEST_USER_CONFLICT), BAD_REASONS.index(R.POSITION_CONFLICT)])
    # rows: one per injection, plus a second for the two-row reasons
    inj = np.concatenate([np.arange(n_inj), np.flatnonzero(two)])
    second = np.concatenate([np.zeros(n_inj, bool), np.ones(int(two.sum()), bool)])
    order = np.argsort(inj, kind="stable")
    inj, second = inj[order], second[order]
    why = reason[inj]
    r = {name: why == i for i, name in enumerate(BAD_REASONS)}
    src = np.where(r[R.DUPLICATE_ROW], dup_src[inj], tmpl[inj])
    n_bad = len(inj)

    out = {c: a.take(pa.array(src)) for c, a in lean.items()}
    # fresh request ids (own requests), except exact duplicates which keep theirs
    rid_new = request_ids(w, U, d, g["user"][src], inj, tag="-x")
    out["request_id"] = pc.if_else(pa.array(r[R.DUPLICATE_ROW]), out["request_id"], rid_new)
    z8 = pa.array(np.zeros(n_bad, np.int8))
    keep_labels = pa.array(r[R.DUPLICATE_ROW])
    out["click"] = pc.if_else(keep_labels, out["click"], pa.array(r[R.ACTION_BEFORE_REQUEST].astype(np.int8)))
    out["like"] = pc.if_else(keep_labels, out["like"], z8)
    uid = U["u0"] + g["user"][src] + 1
    other = np.where(uid % w.n_users + 1 == uid, uid, uid % w.n_users + 1)  # another user (if any)
    uid = np.where(r[R.REQUEST_USER_CONFLICT] & second, other, uid)
    out["user_id"] = pa.array(uid, pa.int64(), mask=r[R.NULL_USER])
    out["item_id"] = pa.array(out["item_id"].to_numpy(zero_copy_only=False)
                              + (r[R.POSITION_CONFLICT] & second), pa.int64(), mask=r[R.NULL_ITEM])
    rts = g["req_ts"][g["rq"][src]]
    rts = np.where(r[R.BAD_TIME], rts - 36 * 365 * MS_PER_DAY, rts)  # the 1990s
    ats = out["action_ts"].to_numpy()
    ats = np.where(r[R.BAD_TIME], rts, ats)
    ats = np.where(r[R.ACTION_BEFORE_REQUEST], rts - rng.integers(1, 600_000, n_bad), ats)
    out["request_ts"] = pa.array(rts, pa.int64(), mask=r[R.NULL_TIME])
    out["action_ts"] = pa.array(ats, pa.int64())
    posn = out["position"].to_numpy()
    posn = np.where(r[R.REQUEST_USER_CONFLICT] & second, 1, np.where(r[R.REQUEST_USER_CONFLICT], 0, posn))
    posn = np.where(r[R.POSITION_CONFLICT], 0, posn)
    out["position"] = pa.array(posn.astype(np.int32))
    out["category"] = pc.if_else(pa.array(r[R.POSITION_CONFLICT] & second),
                                 pa.array(w.category(out["item_id"].fill_null(0).to_numpy())), out["category"])
    out["author"] = pc.if_else(pa.array(r[R.POSITION_CONFLICT] & second),
                               pa.array(w.author(out["item_id"].fill_null(0).to_numpy())), out["author"])
    for name in BAD_REASONS:
        counts[name] = counts.get(name, 0) + int(r[name].sum())

    lean = dict(lean)
    lean["score"] = pc.if_else(pa.array(nan_score), pa.scalar(float("nan"), pa.float32()), lean["score"])
    # shuffle the bad rows in among the clean ones, deterministically
    place = np.concatenate([np.arange(N, dtype=np.float64), rng.random(n_bad) * N])
    perm = pa.array(np.argsort(place, kind="stable"))
    merged = {c: pa.concat_arrays([lean[c], out[c]]).take(perm) for c in lean}
    fmerged = None
    if fat is not None:
        fmerged = {c: pa.concat_arrays([a, a.take(pa.array(src))]).take(perm) for c, a in fat.items()}
    return merged, fmerged, int(nan_score.sum())


def gen_actions(w: World, U: dict, d: int) -> dict:
    """The action-log events of one block and day (a history day when d < 0), sorted by (user, ts)."""
    p = w.params
    # history days draw from their own stream, counted back from --start: the days of impressions draw the
    # same events whatever --history-days is
    rng = _rng(w.seed, _ACTIONS, d, U["u0"] // BLOCK) if d >= 0 else _rng(w.seed, _HISTORY, -d, U["u0"] // BLOCK)
    rate = U["rate"] * np.where(U["bot"], p.action_log_rate * p.bot_action_factor, p.action_log_rate)
    n = np.where(U["one_shot"], 0, rng.poisson(rate))
    M = int(n.sum())
    u = np.repeat(np.arange(U["n"]), n)
    hour = rng.choice(24, M, p=w.diurnal)
    ts = w.day_ms(d) + hour * MS_PER_HOUR + rng.integers(0, MS_PER_HOUR, M)
    order = np.lexsort((ts, u))
    ts = ts[order]
    item = w.sample_items(rng, M, d)
    bits = np.where(rng.random(M) < p.action_log_like, 3, 1)
    arr = ts
    if w.arrivals:
        arng = _rng(w.seed, _ARRIVALS, 1, d, U["u0"] // BLOCK) if d >= 0 else \
            _rng(w.seed, _HISTORY_ARRIVALS, -d, U["u0"] // BLOCK)
        arr = ts + arrival_delays(arng, M, p, ahead=True)
    return {"user": u, "item": item, "ts": ts, "bits": bits, "arrival_ts": arr}


def action_columns(w: World, U: dict, a: dict) -> dict:
    item = a["item"]
    return {
        "uid": pa.array(U["u0"] + a["user"] + 1, pa.int64()),
        "iid": pa.array(item, pa.int64()),
        "ts": pa.array(a["ts"], pa.int64()),
        "bits": pa.array(a["bits"], pa.int64()),
        "cat": pa.array(w.category(item), pa.int32()),
        "auth": pa.array(w.author(item), pa.int64()),
        ARRIVAL: pa.array(a["arrival_ts"], pa.int64()),
    }


# ---------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------
def _table(cols_list: list[dict], schema: pa.Schema) -> pa.Table:
    arrays = [pa.concat_arrays([c[f.name] for c in cols_list]) for f in schema]
    return pa.Table.from_arrays(arrays, schema=schema)


def _filed(w: World, kind: str, d: int, chunk: int, t: pa.Table):
    """(date, rows, file name) of one (chunk, day)'s table: all of it under its day, except the action log
    with ``--arrivals``, filed by the UTC day its events arrived (the build's daily job takes the action-log
    rows that arrived that day): the rows of day ``d`` that arrived on another day go to that day's folder
    in a file named after ``d`` as well."""
    if not t.num_rows:
        return
    name = f"part-{chunk:05d}"
    if not (w.arrivals and kind == "actions"):
        yield w.date(d), t, name
        return
    day = (t.column(ARRIVAL).to_numpy() - w.day_ms(0)) // MS_PER_DAY  # days from --start, d for most rows
    for a in np.unique(day).tolist():
        yield w.date(a), t.filter(pa.array(day == a)), name if a == d else f"{name}-{w.date(d):%Y%m%d}"


def _write(out: str, kind: str, date: dt.date, name: str, table: pa.Table) -> int:
    folder = os.path.join(out, kind, f"date={date.isoformat()}")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{name}.parquet")
    pq.write_table(table, path, compression="zstd", row_group_size=256 * 1024, write_statistics=True)
    return os.path.getsize(path)


def make_config(L: int, seed: int, fat: bool, actions: bool, *, arrivals: bool = False) -> dict:
    """The config file written beside the data (passes config.load and .layout); ``arrivals``: the lean
    log's and the action log's :data:`ARRIVAL` mapped to the arrival role."""
    cols: dict = {
        "user": "user_id", "request": "request_id", "request_time": "request_ts", "action_time": "action_ts",
        "item": "item_id", "position": "position", "labels": ["click", "like"],
        "item_features": ["category", "author"], "context_features": ["device", "hour"],
        "user_features": ["age_bucket", "country"],
    }
    if fat:
        cols["sequence"] = {"item": "hist_item_id", "time": "hist_ts", "category": "hist_category"}
    elif actions:
        cols["actions"] = {"user": "uid", "item": "iid", "time": "ts", "labels": "bits",
                           "item_features": ["cat", "auth"]}
    if arrivals and not fat:
        cols["arrival_time"] = ARRIVAL
        if actions:
            cols["actions"]["arrival"] = ARRIVAL
    return {
        "columns": cols,
        "time_unit": "ms",
        "max_seq_len": L,
        "history_length": 2 * L,
        # 20 L (at least L + 1): at the defaults heavy users and the bot split into several chunks
        "max_sample_cost": max(20 * L, L + 1),
        "seed": seed,
        # the log starts in 2026: the injected `bad_time` rows (the 1990s) fall before it
        "min_year": 2000,
    }


def synth(out: str, *, start: str = "2026-01-01", days: int = 3, users: int = 200, items: int = 5000,
          impressions: int | None = None, max_seq_len: int = 50, fmt: str = "parquet",
          kinds: tuple[str, ...] = KINDS, bad_rows: float = 0.0, seed: int = 0,
          params: SynthParams | None = None, chunk_mb: float = 256.0, log=None, shape: str = "default",
          history_days: int | None = None, arrivals: bool = False) -> dict:
    """Generate the logs into `out` and return the summary (also written to synth.json).

    ``shape`` names the preset of :data:`SHAPES` (``params`` replaces it); ``history_days``, when given,
    replaces its ``history_days``. The summary's ``measured`` holds what the requests look like (history at
    request time: p10, median, p90, p99, max). ``arrivals``: the lean impressions and the action log carry
    :data:`ARRIVAL` (when each event arrived, delays from :func:`arrival_delays`), config.yaml maps it, and
    the fat snapshots and the measured history hold the events that arrived before each request.

    Example::

        synth("/tmp/syn", days=1, users=100, fmt="delta", bad_rows=0.01)
        synth("/tmp/long", days=7, users=500, shape="production", kinds=("lean", "actions"))
    """
    if shape not in SHAPES:
        raise UserwiseError(f"--shape {shape}: use one of {', '.join(SHAPES)}")
    p = params or SHAPES[shape]
    if history_days is not None:
        if not 0 <= history_days <= MAX_DAYS:
            raise UserwiseError(f"--history-days {history_days:,}: give 0 to {MAX_DAYS:,}")
        p = dataclasses.replace(p, history_days=history_days)
    log = log or sys.stderr
    if seed < 0:
        raise UserwiseError(f"--seed {seed}: use a non-negative integer")
    if not 0 <= bad_rows < 0.5:
        raise UserwiseError(f"--bad-rows {bad_rows}: use a share in [0, 0.5)")
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise UserwiseError(f"--kinds {','.join(kinds)}: use a comma list of {', '.join(KINDS)}")
    if fmt not in ("parquet", "delta"):
        raise UserwiseError(f"--format {fmt}: use parquet or delta")
    for flag, v, hi in (("--days", days, MAX_DAYS), ("--items", items, MAX_ITEMS),
                        ("--max-seq-len", max_seq_len, MAX_SEQ_LEN)):
        if not 1 <= v <= hi:
            raise UserwiseError(f"{flag} {v:,}: give 1 to {hi:,}")
    if impressions is not None:
        if impressions < 1:
            raise UserwiseError(f"--impressions {impressions}: must be at least 1")
        per_user = expected_impressions_per_user_day(p, days) * days
        bot = p.bot_factor * p.requests_per_day_median * days * (p.imps_min + p.imps_extra_mean)
        users = max(10, round(max(impressions - bot, 0) / per_user))
    if users < 2:
        raise UserwiseError(f"--users {users}: need at least 2 (one of them is the bot)")
    if users > MAX_USERS:
        raise UserwiseError((f"--impressions {impressions:,} needs {users:,} users" if impressions is not None
                             else f"--users {users:,}") + f": give at most {MAX_USERS:,} users")
    try:
        start_day = dt.date.fromisoformat(start)
    except (TypeError, ValueError):
        raise UserwiseError(f"--start {start!r}: give a date YYYY-MM-DD") from None
    if not DATE_RANGE[0] <= start_day.isoformat() <= DATE_RANGE[1]:
        raise UserwiseError(f"--start {start}: give a date from {DATE_RANGE[0]} to {DATE_RANGE[1]}")
    start_ms = (start_day - dt.date(1970, 1, 1)).days * MS_PER_DAY
    H = p.history_days
    if H and (days + H > MAX_DAYS or (start_day - dt.date.fromisoformat(DATE_RANGE[0])).days < H):
        raise UserwiseError(f"--history-days {H:,} with --days {days:,} from --start {start}: the log must span at "
                            f"most {MAX_DAYS:,} days from {DATE_RANGE[0]} on; give fewer days or a later --start")
    _check_output(out)
    need, free = _estimated_bytes(p, users, days, kinds), _free_bytes(out)
    if need > free:
        raise UserwiseError(f"synth would write about {_size(need)} into {out}, more than the {_size(free)} free "
                            "there: give fewer --users, --days or --impressions, or another --output")
    w = World(seed=seed, params=p, start_ms=start_ms, days=days, n_users=users, n_items=items,
              bot=users // 2, max_seq_len=max_seq_len, arrivals=bool(arrivals))
    work, created = _start(out)
    try:
        summary = _generate(work, w, p, shape_name=shape if params is None else "custom", start=start, days=days, users=users, items=items, impressions=impressions,
                            max_seq_len=max_seq_len, fmt=fmt, kinds=kinds, bad_rows=bad_rows, seed=seed,
                            chunk_mb=chunk_mb, log=log)
        _publish(work, out)
    except BaseException:  # an interrupt too: nothing half-written stays, what was there before does
        _discard(work, created)
        raise
    return summary


def _generate(out: str, w: World, p: SynthParams, *, shape_name, start, days, users, items, impressions, max_seq_len, fmt,
              kinds, bad_rows, seed, chunk_mb, log) -> dict:
    """Write the whole output into ``out`` (a fresh folder) and return the summary."""
    # chunk = a group of blocks per file, sized by estimated bytes per (chunk, day)
    rows_per_block_day = BLOCK * expected_impressions_per_user_day(p, days)
    bytes_per_row = 400 + (48 * max_seq_len if "fat" in kinds else 0)  # measured peak per row, roughly
    carry_bytes = BLOCK * max_seq_len * 64 if "fat" in kinds else 0  # the newest L events of each user
    blocks_per_chunk = max(1, int(chunk_mb * 2**20 / (rows_per_block_day * bytes_per_row + carry_bytes)))
    n_chunks = -(-w.n_blocks // blocks_per_chunk)
    H = p.history_days
    imps = "lean" in kinds or "fat" in kinds
    # the history a request has: its user's impressions' actions, and the action log where the output holds it
    # (written, or inside the fat snapshots); the fat snapshots hold it when the shape says so
    hist_acts = "actions" in kinds or ("fat" in kinds and p.fat_sees_actions)
    snap_acts = p.fat_sees_actions
    counter = imps and ("fat" not in kinds or snap_acts != hist_acts)  # a carry of its own to count the history
    need_acts = "actions" in kinds or (imps and hist_acts)

    rows = {k: {} for k in kinds}
    mb = {k: {} for k in kinds}
    counts: dict[str, int] = {}
    benign = 0
    stats = _Stats()
    for c in range(n_chunks):
        blocks = range(c * blocks_per_chunk, min((c + 1) * blocks_per_chunk, w.n_blocks))
        userinfo = {b: w.users(b) for b in blocks}
        snap = {b: Carry(userinfo[b]["n"]) for b in blocks} if "fat" in kinds else {}
        count = {b: Carry(userinfo[b]["n"]) for b in blocks} if counter else {}
        for d in range(-H, days):
            date = w.date(d).isoformat()
            lean_parts, fat_parts, act_parts = [], [], []
            for b in blocks:
                U = userinfo[b]
                acts = gen_actions(w, U, d) if need_acts else None
                g = gen_impressions(w, U, d) if imps and d >= 0 else None
                fat = hist = None
                if b in snap:
                    ev, rs, rl, hist = snap[b].add_day(w, d, g, acts if snap_acts else None, max_seq_len, U["n"])
                    if g is not None:
                        fat = fat_columns(ev, rs, rl, g["rq"])
                if b in count:
                    hist = count[b].add_day(w, d, g, acts if hist_acts else None, 0, U["n"])[3]
                if g is not None:
                    stats.add(U, g, hist)
                    lean = lean_columns(w, U, d, g)
                    lean, fat, nb = inject_bad(w, U, d, g, lean, fat, bad_rows, counts)
                    benign += nb
                    lean_parts.append(lean)
                    if fat is not None:
                        fat_parts.append({**lean, **fat})
                if "actions" in kinds:
                    act_parts.append(action_columns(w, U, acts))
            line = []
            lean_schema, actions_schema = ((LEAN_ARRIVALS_SCHEMA, ACTIONS_ARRIVALS_SCHEMA) if w.arrivals
                                           else (LEAN_SCHEMA, ACTIONS_SCHEMA))
            for kind, parts, schema in (("lean", lean_parts, lean_schema), ("fat", fat_parts, FAT_SCHEMA),
                                        ("actions", act_parts, actions_schema)):
                if kind not in kinds or (d < 0 and kind != "actions"):
                    continue
                t = _table(parts, schema)
                size = 0
                for day, part, name in _filed(w, kind, d, c, t):  # the action log with arrivals: by arrival day
                    n_b = _write(out, kind, day, name, part)
                    size += n_b
                    rows[kind][day.isoformat()] = rows[kind].get(day.isoformat(), 0) + part.num_rows
                    mb[kind][day.isoformat()] = mb[kind].get(day.isoformat(), 0.0) + n_b / 2**20
                if not t.num_rows:
                    rows[kind][date] = rows[kind].get(date, 0)
                    mb[kind][date] = mb[kind].get(date, 0.0)
                line.append(f"{kind} {t.num_rows:,} rows {size / 2**20:.1f} MB")
            if line:
                print(f"synth: {date} chunk {c + 1}/{n_chunks}: " + ", ".join(line), file=log, flush=True)

    for date in sorted({x for k in kinds for x in rows[k]}):
        have = [k for k in kinds if date in rows[k]]
        if have:
            print(f"synth: {date} total: " + ", ".join(
                f"{k} {rows[k].get(date, 0):,} rows {mb[k].get(date, 0):.1f} MB" for k in have), file=log)
    shape = stats.summary(users, days)

    if fmt == "delta":
        _to_delta(out, kinds)
    summary = {
        "format": fmt,
        "args": dict(start=start, days=days, users=users, items=items, impressions=impressions,
                     max_seq_len=max_seq_len, kinds=list(kinds), bad_rows=bad_rows, seed=seed, shape=shape_name,
                     history_days=H, arrivals=w.arrivals),
        "params": p.to_dict(),
        "users": users,
        "bot_user_id": w.bot + 1,
        "heavy_user_ids": _heavy_ids(w),
        "rows": rows,
        "bad_rows": {r: counts.get(r, 0) for r in BAD_REASONS},
        "benign": {"nan_score": benign},
        "measured": shape,
    }
    with open(os.path.join(out, "bad_rows.json"), "w") as f:
        json.dump(summary["bad_rows"], f, indent=1, sort_keys=True)
    with open(os.path.join(out, "synth.json"), "w") as f:
        json.dump(summary, f, indent=1, sort_keys=True)
    if "lean" in kinds:
        _write_yaml(os.path.join(out, "config.yaml"), make_config(max_seq_len, seed, False, "actions" in kinds,
                                                                  arrivals=w.arrivals))
    if "fat" in kinds:
        _write_yaml(os.path.join(out, "config_fat.yaml"), make_config(max_seq_len, seed, True, False))
    return summary


class _Stats:
    """What the clean requests look like, gathered block by block in fixed memory: the history at request time
    (events of the user strictly before the request) in bins exact below :attr:`EXACT` and 1/:attr:`STEPS` of an
    octave wide above it (quantiles within 0.6%), requests (the bot's apart) and impressions per request."""

    EXACT = 4096
    STEPS = 128

    def __init__(self):
        self.bins = np.zeros(self.EXACT + self.STEPS * 64, np.int64)
        self.max = 0
        self.requests = self.bot_requests = self.impressions = 0
        self.imps_min, self.imps_max = math.inf, 0

    def add(self, U: dict, g: dict, hist: np.ndarray | None) -> None:
        R = g["R"]
        if R == 0:
            return
        self.requests += R
        self.bot_requests += int(U["bot"][g["req_user"]].sum())
        self.impressions += g["N"]
        per = np.bincount(g["rq"], minlength=R)
        self.imps_min, self.imps_max = min(self.imps_min, int(per.min())), max(self.imps_max, int(per.max()))
        if hist is None:
            return
        h = np.asarray(hist, np.int64)
        big = h >= self.EXACT
        b = h.copy()
        b[big] = self.EXACT + np.floor(self.STEPS * np.log2(h[big] / self.EXACT)).astype(np.int64)
        self.bins += np.bincount(b, minlength=len(self.bins))
        self.max = max(self.max, int(h.max()))

    def quantile(self, q: float) -> int:
        """The smallest history h with at least a share q of the requests at or below it (to 0.6% above 4,096)."""
        cum = np.cumsum(self.bins)
        b = int(np.searchsorted(cum, max(1, math.ceil(q * cum[-1])), side="left"))
        return b if b < self.EXACT else min(self.max, math.ceil(self.EXACT * 2 ** ((b - self.EXACT) / self.STEPS)))

    def summary(self, users: int, days: int) -> dict | None:
        if not self.requests:
            return None
        out = {
            "requests": self.requests,
            "requests_per_user_day": round(self.requests / (users * days), 2),
            "requests_per_user_day_without_bot": round((self.requests - self.bot_requests) / (max(users - 1, 1) * days), 2),
            "bot_share_of_requests": round(self.bot_requests / self.requests, 4),
            "impressions_per_request": {"min": self.imps_min, "mean": round(self.impressions / self.requests, 2),
                                        "max": self.imps_max},
        }
        if self.bins.sum():
            out["history_at_request"] = {"p10": self.quantile(0.10), "median": self.quantile(0.5),
                                         "p90": self.quantile(0.90), "p99": self.quantile(0.99), "max": self.max}
        return out


def shape_line(m: dict) -> str:
    """One line of what :class:`_Stats` measured."""
    i = m["impressions_per_request"]
    line = (f"{m['requests']:,} requests, {m['requests_per_user_day_without_bot']:.1f} per user-day without the bot "
            f"(the bot {m['bot_share_of_requests']:.1%} of them), impressions per request {i['min']} to {i['max']} "
            f"(mean {i['mean']:.1f})")
    h = m.get("history_at_request")
    if h:
        line += "; history at request time (events): " + ", ".join(
            f"{k} {h[k]:,}" for k in ("p10", "median", "p90", "p99", "max"))
    return line


def _heavy_ids(w: World) -> list[int]:
    out = []
    for b in range(w.n_blocks):
        U = w.users(b)
        out += (np.flatnonzero(U["heavy"]) + U["u0"] + 1).tolist()
    return out


def _write_yaml(path: str, cfg: dict) -> None:
    head = "# Written by `userwise synth`; run: userwise build --config <this file> --input <the data>\n"
    with open(path, "w") as f:
        f.write(head + yaml.safe_dump(cfg, sort_keys=False))


def _check_output(out: str) -> None:
    """``out`` may be written: missing, an empty folder, or an earlier synth output (replaced at the end)."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise UserwiseError(f"--output {out} is a file; give a folder")
    if os.path.isdir(out) and os.listdir(out) and not os.path.exists(os.path.join(out, "synth.json")):
        raise UserwiseError(f"--output {out} is not empty and not an earlier synth output; give a new folder")


_OUTPUTS = (*KINDS, "config.yaml", "config_fat.yaml", "bad_rows.json", "synth.json")
_PARTIAL = ".synth-partial-"


def _start(out: str) -> tuple[str, list[str]]:
    """Create ``out`` (and its missing parents) and a fresh work folder in it; returns the work folder and
    the folders created (deepest first), so a failed run removes exactly what it made."""
    import tempfile

    created, d = [], os.path.abspath(out)
    while not os.path.exists(d):
        created.append(d)
        d = os.path.dirname(d)
    os.makedirs(out, exist_ok=True)
    return tempfile.mkdtemp(prefix=_PARTIAL, dir=out), created


def _publish(work: str, out: str) -> None:
    """Put the finished output in place: an earlier synth output's files go, the new ones move in."""
    for name in _OUTPUTS:
        old = os.path.join(out, name)
        if os.path.isdir(old) and not os.path.islink(old):
            shutil.rmtree(old)
        elif os.path.lexists(old):
            os.remove(old)
    for name in os.listdir(work):
        os.rename(os.path.join(work, name), os.path.join(out, name))
    os.rmdir(work)


def _discard(work: str, created: list[str]) -> None:
    """After a failure: remove the work folder and the folders this run created, nothing else."""
    shutil.rmtree(work, ignore_errors=True)
    for d in created:
        try:
            os.rmdir(d)  # only while empty: never what someone else put there meanwhile
        except OSError:
            break


def _estimated_bytes(p: SynthParams, users: int, days: int, kinds) -> int:
    """What the output takes on disk, about (from the expected rows and :data:`_DISK_BYTES_PER_ROW`)."""
    mean_imps = p.imps_min + p.imps_extra_mean
    imps = users * days * expected_impressions_per_user_day(p, days) \
        + p.bot_factor * p.requests_per_day_median * days * mean_imps
    acts = (days + p.history_days) * p.action_log_rate * p.requests_per_day_median * (
        users * math.exp(p.requests_per_day_sigma ** 2 / 2) + p.bot_factor * p.bot_action_factor)
    rows = {"lean": imps, "fat": imps, "actions": acts}
    return int(sum(rows[k] * _DISK_BYTES_PER_ROW[k] for k in kinds))


def _free_bytes(out: str) -> int:
    """Free bytes on the file system ``out`` is (or will be) on."""
    d = os.path.abspath(out)
    while not os.path.exists(d):
        d = os.path.dirname(d)
    return shutil.disk_usage(d).free


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{n:,.0f} B"
        n /= 1000
    return ""


def _to_delta(out: str, kinds) -> None:
    """Turn each hive-partitioned Parquet folder into a Delta table in place (delta-rs)."""
    from deltalake import Schema, convert_to_deltalake

    part = Schema.from_arrow(pa.schema([pa.field("date", pa.date32())]))
    for k in kinds:
        path = os.path.join(out, k)
        if os.path.isdir(path):
            convert_to_deltalake(path, partition_by=part, partition_strategy="hive")


def cli(args) -> int:
    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    s = synth(args.output, start=args.start, days=args.days, users=args.users, items=args.items,
              impressions=args.impressions, max_seq_len=args.max_seq_len, fmt=args.format, kinds=kinds,
              bad_rows=args.bad_rows, seed=args.seed, log=open(os.devnull, "w") if progress.QUIET else None,
              shape=getattr(args, "shape", "default"), history_days=getattr(args, "history_days", None),
              arrivals=getattr(args, "arrivals", False))
    total = {k: sum(v.values()) for k, v in s["rows"].items()}
    rep = {"output": args.output, "format": args.format, "rows": total, "users": s["users"],
           "bot_user_id": s["bot_user_id"], "measured": s["measured"]}
    console.emit(rep, f"synth: wrote {args.output} ({args.format}): "
                 + ", ".join(f"{k} {n:,} rows" for k, n in total.items())
                 + f"; {s['users']:,} users, bot user_id {s['bot_user_id']}"
                 + (f"\nsynth: {shape_line(s['measured'])}" if s["measured"] else ""))
    return 0
