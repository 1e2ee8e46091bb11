"""`userwise synth --shape production` (#56 point 1): long histories, measured and printed.

The preset runs at a small scale (hundreds of users, a week of action log instead of 53 days, two days of
impressions) with every other shape parameter as shipped; the history at request time grows with the days
of action log, so the bounds the issue sets at full scale (median >= 3K, a tail past 50K) are checked in
proportion. What synth prints is checked against a count made here from the files it wrote. No Spark.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import io
import json
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.dataset as ds
import pytest
import yaml

from tests.support import oracle as O
from userwise.pipelines.cli import main
from userwise.pipelines.errors import UserwiseError
from userwise.pipelines.tools import synth as Y

H, DAYS, USERS = 7, 2, 300
START = "2026-02-01"
FULL = Y.SHAPES["production"]
# the history at request time is about (days of action log before it) x (events a day): the full shape
# (53 days, then 7 of impressions: 56.5 days before the mean request) scaled to this run's span
SCALE = (H + DAYS / 2) / (FULL.history_days + 7 / 2)


def read(path: Path) -> pl.DataFrame:
    part = ds.partitioning(pa.schema([("date", pa.date32())]), flavor="hive")
    return pl.from_arrow(ds.dataset(str(path), format="parquet", partitioning=part).to_table())


@pytest.fixture(scope="module")
def prod(tmp_path_factory):
    """The CLI's own run of the preset (its --json report and the files)."""
    out = tmp_path_factory.mktemp("prod") / "log"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
        rc = main(["synth", "--output", str(out), "--shape", "production", "--history-days", str(H),
                   "--days", str(DAYS), "--users", str(USERS), "--start", START, "--kinds", "lean,actions",
                   "--json"])
    assert rc == 0
    return out, json.loads(buf.getvalue())


def history_at_request(lean: pl.DataFrame, actions: pl.DataFrame) -> np.ndarray:
    """Per request: the user's events strictly before it (impressions' actions and the action log), counted
    with numpy from the written files, user by user."""
    ev = pl.concat([
        lean.filter((pl.col("click") > 0) | (pl.col("like") > 0)).select(pl.col("user_id"), pl.col("action_ts").alias("t")),
        actions.select(pl.col("uid").alias("user_id"), pl.col("ts").alias("t")),
    ])
    times = {u: np.sort(g["t"].to_numpy()) for (u,), g in ev.group_by(["user_id"])}
    req = lean.select("user_id", "request_id", "request_ts").unique()
    return np.array([np.searchsorted(times.get(u, np.zeros(0, np.int64)), t, side="left")
                     for u, t in req.select("user_id", "request_ts").iter_rows()])


def test_the_preset_is_documented_and_production_shaped():
    assert FULL.history_days >= 21, "an action log spanning weeks before the impressions"
    assert (FULL.imps_min, FULL.imps_max) == (4, 40)
    assert FULL.fat_sees_actions
    text = (Path(__file__).parents[2] / "docs" / "synth.md").read_text()
    assert "--shape production" in text and "history at request time" in text.lower()


def test_printed_distribution_holds_the_shape_in_proportion(prod):
    out, rep = prod
    m = rep["measured"]
    h = m["history_at_request"]
    assert set(h) == {"p10", "median", "p90", "p99", "max"}
    assert 0 < h["p10"] <= h["median"] <= h["p90"] <= h["p99"] <= h["max"]
    assert h["median"] >= 3_000 * SCALE, (h, SCALE)
    assert h["p99"] >= 50_000 * SCALE, (h, SCALE)
    assert h["p99"] >= 10 * h["median"], "a heavy tail"
    assert 4.5 <= m["requests_per_user_day_without_bot"] <= 8, m
    assert m["impressions_per_request"]["min"] == 4 and m["impressions_per_request"]["max"] <= 40
    assert 0 < m["bot_share_of_requests"] < 0.1, "the bot is there, and does not crowd out the users"
    # the action log spans the history days before the first day of impressions, and the impressions do not
    start = dt.date.fromisoformat(START)
    act_days = sorted(p.name for p in (out / "actions").iterdir())
    lean_days = sorted(p.name for p in (out / "lean").iterdir())
    assert act_days[0] == f"date={start - dt.timedelta(days=H)}" and len(act_days) == H + DAYS
    assert lean_days == [f"date={start + dt.timedelta(days=d)}" for d in range(DAYS)]
    # the bot: requests and action-log events far above the median user's
    bot = rep["bot_user_id"]
    reqs = read(out / "lean").group_by("user_id").agg(pl.col("request_id").n_unique().alias("n"))
    acts = read(out / "actions").group_by("uid").len()
    assert reqs.filter(pl.col("user_id") == bot)["n"][0] > 10 * reqs["n"].median()
    assert acts.filter(pl.col("uid") == bot)["len"][0] > 20 * acts["len"].median()
    summary = json.loads((out / "synth.json").read_text())
    assert summary["measured"] == m and summary["args"]["shape"] == "production"
    assert summary["args"]["history_days"] == H


def test_printed_distribution_is_the_measured_one(prod):
    out, rep = prod
    hist = history_at_request(read(out / "lean"), read(out / "actions"))
    assert len(hist) == rep["measured"]["requests"]
    h = rep["measured"]["history_at_request"]
    assert h["max"] == hist.max()
    for k, q in (("p10", 0.1), ("median", 0.5), ("p90", 0.9), ("p99", 0.99)):
        want = int(np.quantile(hist, q, method="inverted_cdf"))
        if want < Y._Stats.EXACT:
            assert h[k] == want, (k, h[k], want)
        else:
            assert abs(h[k] - want) <= 0.006 * want, (k, h[k], want)


def test_text_output_prints_the_distribution(tmp_path, capsys):
    assert main(["synth", "--output", str(tmp_path / "t"), "--shape", "production", "--history-days", "2",
                 "--days", "1", "--users", "20", "--kinds", "lean,actions"]) == 0
    out = capsys.readouterr().out
    assert "history at request time" in out
    for k in ("p10", "median", "p90", "p99"):
        assert f"{k} " in out, out


def test_impression_days_do_not_depend_on_history_days(tmp_path):
    """History days draw from their own random stream: a longer action log adds days before --start and
    changes none of the days from --start on."""
    kw = dict(days=1, users=30, items=300, shape="production", kinds=("lean", "actions"), log=io.StringIO())
    Y.synth(str(tmp_path / "a"), history_days=1, **kw)
    Y.synth(str(tmp_path / "b"), history_days=3, **kw)
    for kind in ("lean", "actions"):
        f = f"{kind}/date=2026-01-01/part-00000.parquet"
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), kind
    assert len(list((tmp_path / "b" / "actions").iterdir())) == 4


def test_fat_snapshots_hold_the_action_log_as_the_lean_build_sees_it(tmp_path):
    """In the production shape a fat row's snapshot is the last L events of every surface: exactly what the
    independent oracle gives for the lean rows with the action log (tests/support/oracle.py)."""
    L = 40
    out = tmp_path / "f"
    s = Y.synth(str(out), days=1, users=12, items=300, shape="production", history_days=2, max_seq_len=L,
                start="2026-01-05", log=io.StringIO())
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    assert cfg["columns"]["actions"]
    want = O.expected_pointwise(out / "lean", cfg, "2026-01-06", set(), actions_path=out / "actions")
    fat = O.read_parquet_dir(out / "fat")
    key = ["request_id", "position"]
    got = fat.sort(key)
    want = want.sort(key)
    assert got.height == want.height > 0
    assert got["hist_item_id"].to_list() == want["seq_item"].to_list()
    assert got["hist_ts"].to_list() == want["seq_ts"].to_list()
    assert got["hist_category"].to_list() == want["seq_category"].to_list()
    lens = got["hist_item_id"].list.len()
    assert (lens == L).mean() > 0.8, "long snapshots: most rows hold L events"
    assert s["measured"]["history_at_request"]["median"] > L


def test_history_days_out_of_range_is_one_error(tmp_path, capsys):
    rc = main(["synth", "--output", str(tmp_path / "x"), "--shape", "production", "--start", "1000-01-10"])
    assert rc == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("error: --history-days 53") and "--start" in err[0], err
    assert not (tmp_path / "x").exists()
    with pytest.raises(UserwiseError) as e:
        Y.synth(str(tmp_path / "y"), shape="long", log=io.StringIO())
    assert "--shape long" in str(e.value) and "production" in str(e.value)
