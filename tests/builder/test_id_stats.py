"""The build's id statistics (``id_stats``, #58 point 1) against an independent count of the
input log (pandas over the Parquet files, no Spark): per set and id column, every id's lookups,
requests, first day, new-id flag, rank and tier; the report's summary equals the table's sums;
the daily jobs write the same rows as the range build."""

from __future__ import annotations

import datetime as dt

import pandas as pd
import pyarrow.dataset as pds
import pytest

from userwise.pipelines import config as C
from userwise.pipelines.builder import build as B
from userwise.pipelines.builder import daily
from userwise.pipelines.runtime import delta_io

pytestmark = pytest.mark.spark

AS_OF = dt.date(2026, 1, 4)
M, N = 2, 1
HOT, WARM = 5, 20
IDS = ["category", "device", "country"]
ROLES = {"item_id": "item", "category": "item_feature", "device": "context_feature", "country": "user_feature"}


def _write_log(root) -> str:
    """3 days of 12 users' requests (3 to 8 impressions each) over a Zipf catalogue of 80 items
    that grows each day, so the windows hold ids no earlier day carried."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(58)
    cols = {k: [] for k in ("user_id", "request_id", "request_ts", "item_id", "position", "click", "category",
                            "device", "country")}
    t0 = int(dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc).timestamp() * 1000)
    for day in range(3):
        for u in range(12):
            for r in range(int(rng.integers(2, 10))):
                ts = t0 + day * 86_400_000 + int(rng.integers(0, 86_400_000))
                device = str(rng.choice(["ios", "android", "web"] + (["tv"] if day == 2 else [])))
                for pos in range(int(rng.integers(3, 9))):
                    item = int(rng.zipf(1.3) % (50 + 15 * day))
                    cols["user_id"].append(u)
                    cols["request_id"].append(f"{day}-{u}-{r}")
                    cols["request_ts"].append(ts)
                    cols["item_id"].append(item)
                    cols["position"].append(pos)
                    cols["click"].append(int(rng.random() < 0.2))
                    cols["category"].append(item % 7)
                    cols["device"].append(device)
                    cols["country"].append(f"c{u % 4 + (day == 2 and u == 0)}")
    pq.write_table(pa.table(cols), str(root / "log.parquet"))
    return str(root / "log.parquet")


@pytest.fixture(scope="module")
def log(tmp_path_factory):
    root = tmp_path_factory.mktemp("ids")
    cfg = C.parse({"columns": {"user": "user_id", "request": "request_id", "request_time": "request_ts",
                               "item": "item_id", "position": "position", "labels": ["click"],
                               "item_features": ["category"], "context_features": ["device"],
                               "user_features": ["country"], "id_features": IDS},
                   "max_seq_len": 5, "max_sample_cost": 200, "hot_budget": HOT, "warm_budget": WARM})
    return _write_log(root), cfg


@pytest.fixture(scope="module")
def ranged(spark, log, tmp_path_factory):
    inp, cfg = log
    out = str(tmp_path_factory.mktemp("range"))
    return out, B.build(spark, cfg, inp, out, AS_OF.isoformat(), M, N)


def _stats(out) -> pd.DataFrame:
    t = delta_io.dataset(delta_io.table_path(out, "id_stats")).to_table().to_pandas()
    t["window_end"] = t["window_end"].astype(str)
    return t.sort_values(["kind", "window_end", "column", "rank"]).reset_index(drop=True)


def _oracle(inp: str) -> pd.DataFrame:
    """The expected rows, counted from the input log's rows (every row is accepted here)."""
    df = pds.dataset(inp, format="parquet").to_table().to_pandas()
    df["day"] = pd.to_datetime(df["request_ts"], unit="ms", utc=True).dt.date
    df = df[df["day"] < AS_OF]
    first_day = min(df["day"])
    boundary = AS_OF - dt.timedelta(days=M)
    sets = [("pretrain", first_day, boundary)] + [
        ("incremental", boundary + dt.timedelta(days=k), boundary + dt.timedelta(days=k + 1)) for k in range(M)]
    rows = []
    for col, role in ROLES.items():
        ids = df[col].astype(str)
        first = df.assign(_id=ids).groupby("_id")["day"].min()
        for kind, start, end in sets:
            part = df[(df["day"] >= (start if kind == "incremental" else first_day)) & (df["day"] < end)]
            part = part.assign(_id=part[col].astype(str))
            g = part.groupby("_id").agg(lookups=("_id", "size"), requests=("request_id", "nunique")).reset_index()
            g = g.sort_values(["lookups", "_id"], ascending=[False, True]).reset_index(drop=True)
            for r, x in enumerate(g.itertuples(), start=1):
                fd = first[x._1]
                rows.append({"kind": kind, "window_start": start, "window_end": str(end), "role": role,
                             "column": col, "id": x._1, "lookups": x.lookups, "requests": x.requests,
                             "first_date": fd, "first_seen": fd >= start, "rank": r,
                             "tier": "hot" if r <= HOT else "warm" if r <= HOT + WARM else "cold"})
    out = pd.DataFrame(rows)
    return out.sort_values(["kind", "window_end", "column", "rank"]).reset_index(drop=True)


def test_id_stats_equal_an_independent_count(ranged, log):
    """Every row of the table equals the count over the input log, and a window's new ids are
    exactly those no earlier day carried; the report's per-set summary sums the table."""
    out, rep = ranged
    got, want = _stats(out), _oracle(log[0])
    assert list(got.columns) == list(want.columns)
    assert len(got) == len(want)
    for c in want.columns:
        assert got[c].tolist() == want[c].tolist(), c
    # the log has new ids in the windows and old ones, and all three tiers
    inc = got[got["kind"] == "incremental"]
    assert inc["first_seen"].any() and not inc["first_seen"].all()
    assert set(got["tier"]) == {"hot", "warm", "cold"}
    assert got[got["kind"] == "pretrain"]["first_seen"].all()
    for s in rep["sets"]:
        part = got[(got["kind"] == s["kind"]) & (got["window_end"] == s["window_end"])]
        assert list(s["ids"]) == list(ROLES)
        for col, summ in s["ids"].items():
            p = part[part["column"] == col]
            assert summ["role"] == ROLES[col]
            assert (summ["distinct"], summ["lookups"], summ["requests"], summ["first_seen"]) == \
                (len(p), p["lookups"].sum(), p["requests"].sum(), p["first_seen"].sum())
            assert summ["first_seen_lookups"] == p[p["first_seen"]]["lookups"].sum()
            for tier in ("hot", "warm", "cold"):
                assert (summ[tier], summ[tier + "_lookups"]) == \
                    ((p["tier"] == tier).sum(), p[p["tier"] == tier]["lookups"].sum())
        # item lookups are the set's impressions
        assert s["ids"]["item_id"]["lookups"] == s["impressions"]
    # the trainer's side reads them without Spark, most looked-up first (integer ids as integers)
    from userwise.pipelines.train import read_id_stats

    boundary = str(AS_OF - dt.timedelta(days=M))
    for col in ("item_id", "device"):
        w = want[(want["kind"] == "incremental") & (want["window_end"] == str(AS_OF)) & (want["column"] == col)]
        ids, lookups = read_id_stats(out, "incremental", str(AS_OF), col)
        assert [str(x) for x in ids] == w["id"].tolist() and lookups.tolist() == w["lookups"].tolist()
        assert ids.dtype.kind == ("i" if col == "item_id" else "U")
    hot, _ = read_id_stats(out, "pretrain", boundary, "item_id", tier="hot")
    w = want[(want["kind"] == "pretrain") & (want["column"] == "item_id") & (want["tier"] == "hot")]
    assert hot.tolist() == [int(x) for x in w["id"]] and len(hot) == HOT


def test_daily_jobs_write_the_range_builds_id_stats(spark, ranged, log, tmp_path):
    """The requests jobs day by day, then each window's job and the pretrain job, write the
    same id_stats rows as the range build (one code path: steps.set_samples)."""
    inp, cfg = log
    out = str(tmp_path / "daily")
    first = AS_OF - dt.timedelta(days=3)
    for k in range(3):
        d = first + dt.timedelta(days=k)
        daily.requests_day(spark, cfg, inp, out, d)
        if d >= AS_OF - dt.timedelta(days=M):
            rep = daily.window_day(spark, cfg, out, d, N)
            assert set(rep["ids"]) == set(ROLES)
    daily.pretrain(spark, cfg, out, AS_OF, M)
    a, b = _stats(ranged[0]), _stats(out)
    assert len(a) == len(b) > 0
    for c in a.columns:
        assert a[c].tolist() == b[c].tolist(), c
