"""`userwise synth --arrivals`: an arrival time per event with a realistic delay: most within
seconds of the action, a tail of hours, a few of days (quantiles of the drawn delays and of
the written log); every other column the same as without it; the action log filed by arrival
day; config.yaml maps the arrival roles; the fat snapshots are what arrived before each
request (an independent computation in arrival order)."""

from __future__ import annotations

import bisect
import io
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.dataset as ds
import pytest

from userwise.pipelines import config as C
from userwise.pipelines.builder import inputs
from userwise.pipelines.cli import main
from userwise.pipelines.tools import synth as Y

SEC, HOUR, DAY = 1_000, Y.MS_PER_HOUR, Y.MS_PER_DAY


def gen(out: Path, **kw) -> dict:
    kw.setdefault("days", 3)
    kw.setdefault("users", 80)
    kw.setdefault("items", 500)
    return Y.synth(str(out), log=io.StringIO(), **kw)


def read(path: Path) -> pl.DataFrame:
    part = ds.partitioning(pa.schema([("date", pa.date32())]), flavor="hive")
    return pl.from_arrow(ds.dataset(str(path), format="parquet", partitioning=part).to_table())


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    """The same log with and without --arrivals (a day of action log before it, bad rows in it)."""
    root = tmp_path_factory.mktemp("arrivals")
    kw = dict(max_seq_len=5, seed=5, history_days=1, bad_rows=0.02)
    return gen(root / "with", arrivals=True, **kw), root / "with", gen(root / "without", **kw), root / "without"


def _shares(delay: np.ndarray) -> dict:
    return {"median": float(np.median(delay)), "p90": float(np.quantile(delay, 0.9)),
            "over_1h": float((delay > HOUR).mean()), "over_1d": float((delay > DAY).mean()),
            "min": int(delay.min()), "max": int(delay.max())}


def _realistic(s: dict, *, n: int) -> None:
    """Most within seconds, a tail of hours, a few of days (bounds a few standard errors wide at n)."""
    assert 0.4 * SEC <= s["median"] <= 1.6 * SEC, s
    assert s["p90"] <= 10 * SEC, s  # most within seconds
    assert 0.01 <= s["over_1h"] <= 0.05, s  # a tail of hours (4% log-uniform 1 min..12 h, and days)
    se = 4 * (0.004 / n) ** 0.5
    assert 0.004 - se - 0.001 <= s["over_1d"] <= 0.004 + se + 0.001 and s["over_1d"] > 0, s  # a few of days
    assert s["max"] <= 7 * DAY, s


def test_drawn_delays_have_the_documented_quantiles():
    p = Y.SynthParams()
    rng = np.random.default_rng(0)
    imp = Y.arrival_delays(rng, 400_000, p, ahead=False)
    _realistic(_shares(imp), n=len(imp))
    assert imp.min() >= 0  # an impression's own action never arrives before it was stamped
    acts = Y.arrival_delays(rng, 400_000, p, ahead=True)
    _realistic(_shares(acts), n=len(acts))
    early = acts[acts < 0]
    assert abs(len(early) / len(acts) - p.arrival_ahead_share) < 0.0006  # a clock ahead, rarely
    assert early.min() >= -p.arrival_ahead_ms
    # the parameters steer it: no tail without its shares
    none = Y.arrival_delays(rng, 100_000, Y.SynthParams(arrival_hours_share=0, arrival_days_share=0), ahead=False)
    assert none.max() < 5 * 60 * SEC


def test_the_log_carries_arrivals_with_that_distribution(logs):
    _, out, _, _ = logs
    lean, acts = read(out / "lean"), read(out / "actions")
    assert Y.ARRIVAL in lean.columns and Y.ARRIVAL in acts.columns
    clean = lean.filter(pl.col("request_id").str.contains("-x").not_() & (pl.col("request_ts") > 0))
    d = (clean[Y.ARRIVAL] - clean["action_ts"]).to_numpy()
    _realistic(_shares(d), n=len(d))
    assert (clean[Y.ARRIVAL] >= clean["request_ts"]).all()  # never before its own request
    da = (acts[Y.ARRIVAL] - acts["ts"]).to_numpy()
    assert da.min() >= -Y.SynthParams().arrival_ahead_ms and np.median(da) < 2 * SEC and da.max() > DAY
    assert (da > HOUR).mean() > 0.005


def test_every_other_column_is_as_without_arrivals(logs):
    s_with, out, s_without, base = logs
    key = ["request_id", "position", "item_id", "user_id"]
    a, b = read(out / "lean"), read(base / "lean")
    assert a.drop(Y.ARRIVAL).sort(key, nulls_last=True).equals(b.sort(key, nulls_last=True))
    akey = ["uid", "ts", "iid", "bits"]
    a, b = read(out / "actions"), read(base / "actions")
    assert a.drop(Y.ARRIVAL, "date").sort(akey).equals(b.drop("date").sort(akey))
    assert s_with["bad_rows"] == s_without["bad_rows"] and s_with["args"]["arrivals"] is True
    assert Y.ARRIVAL not in read(base / "lean").columns


def test_the_action_log_is_filed_by_arrival_day(logs):
    _, out, _, base = logs
    acts = read(out / "actions")
    day = (acts[Y.ARRIVAL] // DAY).cast(pl.Int32).cast(pl.Date)
    assert (acts["date"] == day).all()
    assert (acts["date"] != (acts["ts"] // DAY).cast(pl.Int32).cast(pl.Date)).any()  # some arrive on a later day
    plain = read(base / "actions")
    assert (plain["date"] == (plain["ts"] // DAY).cast(pl.Int32).cast(pl.Date)).all()


def test_config_maps_the_arrival_columns(logs):
    _, out, _, base = logs
    cfg = C.load(out / "config.yaml")
    assert cfg.col("arrival_time") == Y.ARRIVAL and cfg.actions.arrival == Y.ARRIVAL and cfg.arrivals
    cfg.layout(inputs.input_schema(str(out / "lean")))
    C.check_actions_columns(cfg, inputs.input_schema(str(out / "actions")))
    assert not C.load(base / "config.yaml").arrivals
    assert not C.load(out / "config_fat.yaml").arrivals  # fat rows' snapshots are what each request saw


def independent_snapshots(df: pl.DataFrame, L: int) -> dict:
    """Per row (request_id, position): the last L of its user's events (the impressions' own
    actions) that arrived strictly before its request, in arrival order (arrival, action time,
    request time, request id, position, item, bits), by plain sorting of Python tuples."""
    out = {}
    for (_,), g in df.group_by(["user_id"]):
        rows = g.to_dicts()
        ev = sorted((r[Y.ARRIVAL], r["action_ts"], r["request_ts"], r["request_id"], r["position"], r["item_id"],
                     r["click"] | (r["like"] << 1)) for r in rows if r["click"] > 0 or r["like"] > 0)
        arr = [e[0] for e in ev]
        for r in rows:
            end = bisect.bisect_left(arr, r["request_ts"])  # arrived strictly before
            snap = ev[max(0, end - L):end]
            out[(r["request_id"], r["position"])] = ([e[5] for e in snap], [e[1] for e in snap])
    return out


def test_fat_snapshots_hold_what_arrived_before_each_request(tmp_path):
    gen(tmp_path, arrivals=True, max_seq_len=5, seed=9, kinds=("lean", "fat"))
    lean, fat = read(tmp_path / "lean"), read(tmp_path / "fat")
    assert Y.ARRIVAL not in fat.columns
    want = independent_snapshots(lean, 5)
    got = {(r["request_id"], r["position"]): (r["hist_item_id"], r["hist_ts"]) for r in fat.iter_rows(named=True)}
    assert got.keys() == want.keys()
    bad = [k for k in want if got[k] != want[k]]
    assert not bad, bad[:3]
    # late arrivals change what a request saw: some snapshot is not in action-time order
    assert fat.select(pl.col("hist_ts").list.eval(pl.element().diff().min() < 0).list.first()).to_series().any()


def test_cli_flag(tmp_path, capsys):
    assert main(["synth", "--output", str(tmp_path / "o"), "--days", "1", "--users", "20", "--kinds",
                 "lean,actions", "--arrivals", "--quiet"]) == 0
    assert Y.ARRIVAL in read(tmp_path / "o" / "lean").columns
    assert C.load(tmp_path / "o" / "config.yaml").arrivals
