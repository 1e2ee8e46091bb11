"""`userwise synth`: determinism, schemas, snapshot semantics, distributions, bad rows, configs, Delta."""

from __future__ import annotations

import bisect
import datetime as dt
import io
import json
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from userwise import schemas as S
from userwise.pipelines import config as C
from userwise.pipelines.builder import inputs
from userwise.pipelines.cli import main
from userwise.pipelines.tools import synth as Y

MS_2000 = int(dt.datetime(2000, 1, 1, tzinfo=dt.timezone.utc).timestamp() * 1000)


def gen(out: Path, **kw) -> dict:
    kw.setdefault("days", 3)
    kw.setdefault("users", 60)
    kw.setdefault("items", 500)
    return Y.synth(str(out), log=io.StringIO(), **kw)


def read(path: Path) -> pl.DataFrame:
    part = ds.partitioning(pa.schema([("date", pa.date32())]), flavor="hive")
    return pl.from_arrow(ds.dataset(str(path), format="parquet", partitioning=part).to_table())


def parquet_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.parquet"))


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """3 days, no bad rows, small L so that the cap bites."""
    out = tmp_path_factory.mktemp("clean")
    summary = gen(out, max_seq_len=5, seed=7)
    return out, summary


@pytest.fixture(scope="module")
def dirty(tmp_path_factory):
    out = tmp_path_factory.mktemp("dirty")
    summary = gen(out, days=2, users=120, bad_rows=0.05, seed=3)
    return out, summary


# ---------------------------------------------------------------------------
def test_deterministic_byte_for_byte(tmp_path):
    a = gen(tmp_path / "a", days=2, bad_rows=0.02, seed=11)
    b = gen(tmp_path / "b", days=2, bad_rows=0.02, seed=11)
    fa, fb = parquet_files(tmp_path / "a"), parquet_files(tmp_path / "b")
    assert [p.relative_to(tmp_path / "a") for p in fa] == [p.relative_to(tmp_path / "b") for p in fb]
    assert len(fa) == 6  # lean, fat, actions x 2 days
    for x, y in zip(fa, fb):
        assert x.read_bytes() == y.read_bytes(), x
    for f in ("bad_rows.json", "synth.json", "config.yaml", "config_fat.yaml"):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes()
    assert a == b
    gen(tmp_path / "c", days=2, bad_rows=0.02, seed=12)
    lean = "lean/date=2026-01-01/part-00000.parquet"
    assert (tmp_path / "c" / lean).read_bytes() != (tmp_path / "a" / lean).read_bytes()


def test_same_rows_whatever_the_chunking(tmp_path):
    """Randomness is seeded per block of users, so files split differently hold the same rows."""
    big = gen(tmp_path / "big", days=2, users=2 * Y.BLOCK + 5, items=300, kinds=("lean",))
    small = Y.synth(str(tmp_path / "small"), days=2, users=2 * Y.BLOCK + 5, items=300, kinds=("lean",),
                    chunk_mb=0.001, log=io.StringIO())
    assert len(parquet_files(tmp_path / "small")) == 6 and len(parquet_files(tmp_path / "big")) == 2
    assert big["rows"] == small["rows"]
    a, b = read(tmp_path / "big/lean"), read(tmp_path / "small/lean")
    key = ["request_id", "position"]
    assert a.sort(key).equals(b.sort(key))


def test_schemas_exact(clean):
    out, _ = clean
    for kind, table in (("lean", S.SYNTH_IMPRESSIONS), ("fat", S.SYNTH_FAT_IMPRESSIONS), ("actions", S.SYNTH_ACTIONS)):
        want = table.to_arrow()
        want = want.remove(want.get_field_index("date"))
        files = parquet_files(out / kind)
        assert files and all(p.parent.name.startswith("date=") for p in files)
        for p in files:
            got = pq.read_schema(p)
            assert got.equals(want, check_metadata=False), (p, got, want)
        # read back hive-style: every column with its exact type, `date` as date32
        sch = inputs.input_schema(str(out / kind))
        for f in table.to_arrow():
            assert sch.field(f.name).type == f.type, (kind, f.name)


def test_lean_and_fat_hold_the_same_rows(clean):
    out, _ = clean
    lean, fat = read(out / "lean"), read(out / "fat")
    key = ["request_id", "position"]
    assert fat.select(lean.columns).sort(key).equals(lean.sort(key))


# ---------------------------------------------------------------------------
def independent_snapshots(df: pl.DataFrame, L: int) -> dict:
    """Per row (request_id, position): the last L events strictly before its request, oldest first,
    by plain sorting of Python tuples, user by user."""
    out = {}
    for (uid,), g in df.group_by(["user_id"]):
        rows = g.to_dicts()
        ev = sorted(
            (r["action_ts"], r["request_ts"], r["request_id"], r["position"], r["item_id"],
             r["click"] | (r["like"] << 1), r["category"])
            for r in rows if r["click"] > 0 or r["like"] > 0
        )
        ats = [e[0] for e in ev]
        for r in rows:
            end = bisect.bisect_left(ats, r["request_ts"])  # strictly before
            snap = ev[max(0, end - L):end]
            out[(r["request_id"], r["position"])] = ([e[4] for e in snap], [e[0] for e in snap], [e[6] for e in snap])
    return out


def test_fat_snapshots_match_an_independent_computation(clean):
    out, summary = clean
    L = 5
    fat = read(out / "fat")
    want = independent_snapshots(fat, L)
    got = {(r["request_id"], r["position"]): (r["hist_item_id"], r["hist_ts"], r["hist_category"])
           for r in fat.iter_rows(named=True)}
    assert got.keys() == want.keys()
    mismatch = [k for k in want if got[k] != want[k]]
    assert not mismatch, mismatch[:5]

    # the cases the rule is about do occur in this data
    lens = fat["hist_item_id"].list.len()
    assert (lens == 0).sum() > 0 and (lens == L).sum() > 0 and ((lens > 0) & (lens < L)).sum() > 0
    assert fat.filter(pl.col("hist_item_id").is_null()).height == 0
    # every user's first request has an empty history
    first = fat.sort("request_ts", "request_id").group_by("user_id").first()
    assert (first["hist_item_id"].list.len() == 0).all()
    acts = fat.filter(pl.col("click") > 0)
    # ties: an action at its request's own millisecond (never visible to it), batched clicks
    assert acts.filter(pl.col("action_ts") == pl.col("request_ts")).height > 0
    assert acts.group_by("user_id", "action_ts").len().filter(pl.col("len") > 1).height > 0
    # late actions land on a later UTC day, and are seen from then on
    late = acts.filter(pl.col("action_ts") // Y.MS_PER_DAY > pl.col("request_ts") // Y.MS_PER_DAY)
    assert late.height > 0
    # snapshots span days: a request on day 2 sees actions of day 1
    d2 = fat.filter(pl.col("date") == dt.date(2026, 1, 2)).explode("hist_ts").drop_nulls("hist_ts")
    day2 = (dt.date(2026, 1, 2) - dt.date(1970, 1, 1)).days * Y.MS_PER_DAY
    assert (d2["hist_ts"] < day2).any()
    # oldest first
    assert fat.select(pl.col("hist_ts").list.eval(pl.element().diff().min() >= 0).list.first()).drop_nulls() \
        .to_series().all()


def test_action_log_is_not_in_the_snapshot(clean):
    out, _ = clean
    fat, acts = read(out / "fat"), read(out / "actions")
    assert acts.height > 0
    hist_ts = set(fat.explode("hist_ts")["hist_ts"].drop_nulls().to_list())
    imp_ts = set(fat.filter(pl.col("click") > 0)["action_ts"].to_list())
    assert hist_ts <= imp_ts


# ---------------------------------------------------------------------------
def test_distributions_roughly_right(clean):
    out, summary = clean
    df = read(out / "lean")
    ctr = df["click"].mean()
    assert 0.015 < ctr < 0.06, ctr
    assert 0 < df["like"].mean() < ctr / 3
    assert df.filter((pl.col("like") == 1) & (pl.col("click") == 0)).height == 0
    assert set(df["click"].unique()) <= {0, 1} and set(df["like"].unique()) <= {0, 1}
    per_req = df.group_by("request_id").agg(pl.len(), pl.col("position").sort(), pl.col("user_id").n_unique(),
                                            pl.col("request_ts").n_unique(), pl.col("device").n_unique(),
                                            pl.col("hour").n_unique())
    assert per_req["len"].min() >= 4 and per_req["len"].max() <= 50
    assert all(p.to_list() == list(range(n)) for p, n in zip(per_req["position"], per_req["len"]))
    for c in ("user_id", "request_ts", "device", "hour"):
        assert (per_req[c] == 1).all(), c
    per_user = df.group_by("user_id").agg(pl.len(), pl.col("age_bucket").n_unique(), pl.col("country").n_unique(),
                                          pl.col("request_id").n_unique().alias("requests"))
    assert (per_user["age_bucket"] == 1).all() and (per_user["country"] == 1).all()
    assert (per_user["requests"] == 1).any(), "some users have a single request"
    bot = per_user.filter(pl.col("user_id") == summary["bot_user_id"])["len"][0]
    assert bot > 50 * per_user["len"].median()
    assert bot == per_user["len"].max()
    per_item = df.group_by("item_id").agg(pl.col("category").n_unique(), pl.col("author").n_unique(), pl.len())
    assert (per_item["category"] == 1).all() and (per_item["author"] == 1).all()
    top = per_item.sort("len", descending=True)["len"]
    assert top[0] > 10 * top.median()  # Zipf head
    assert df["item_id"].max() > 500  # new items released during the run
    assert (df["action_ts"] >= df["request_ts"]).all()
    hours = ((df["request_ts"] % Y.MS_PER_DAY) // 3_600_000).cast(pl.Int8)
    assert (hours == df["hour"]).all()
    assert ((df["request_ts"] // Y.MS_PER_DAY).cast(pl.Int32) == df["date"].cast(pl.Int32)).all()
    # several requests of one user in one millisecond: rare, but there
    same = df.group_by("user_id", "request_ts").agg(pl.col("request_id").n_unique())
    assert (same["request_id"] > 1).any()


def test_impressions_target(tmp_path):
    s = gen(tmp_path / "t", days=1, impressions=60_000, users=2, kinds=("lean",))
    total = sum(s["rows"]["lean"].values())
    assert 30_000 < total < 120_000, total


# ---------------------------------------------------------------------------
def detect_bad(df: pl.DataFrame) -> dict:
    """Find each kind of malformed row in the data, independently of the generator."""
    rid_users = df.drop_nulls("user_id").group_by("request_id").agg(pl.col("user_id").n_unique().alias("u"))
    pos_items = df.drop_nulls("item_id").group_by("request_id", "position").agg(pl.col("item_id").n_unique()
                                                                                 .alias("i"))
    return {
        "null_user": df["user_id"].null_count(),
        "null_item": df["item_id"].null_count(),
        "null_time": df["request_ts"].null_count(),
        "bad_time": df.filter(pl.col("request_ts") < MS_2000).height,
        "action_before_request": df.filter((pl.col("click") > 0) & (pl.col("action_ts") < pl.col("request_ts")))
        .height,
        "duplicate_row": df.height - df.drop("score").unique().height,
        "request_user_conflict": df.join(rid_users.filter(pl.col("u") > 1), on="request_id", how="semi").height,
        "position_conflict": df.join(pos_items.filter(pl.col("i") > 1), on=["request_id", "position"],
                                     how="semi").height,
    }


def test_bad_rows_reconcile(dirty):
    out, summary = dirty
    truth = json.loads((out / "bad_rows.json").read_text())
    assert set(truth) == set(Y.BAD_REASONS)
    assert all(n > 0 for n in truth.values()), truth
    for kind in ("lean", "fat"):
        df = read(out / kind)
        assert detect_bad(df) == truth, kind
        share = sum(truth.values()) / df.height
        assert 0.03 < share < 0.07, share
        assert df["score"].is_nan().sum() == summary["benign"]["nan_score"] > 0
    # clean data has none of them
    clean_df = read(Path(str(out)) / "lean")
    assert clean_df.height == sum(summary["rows"]["lean"].values())


def test_no_bad_rows_by_default(clean):
    out, summary = clean
    assert all(v == 0 for v in detect_bad(read(out / "lean")).values())
    assert json.loads((out / "bad_rows.json").read_text()) == {r: 0 for r in Y.BAD_REASONS}


# ---------------------------------------------------------------------------
def test_configs_load_and_resolve(clean):
    out, _ = clean
    lean = C.load(out / "config.yaml")
    assert not lean.fat and lean.actions is not None
    assert (lean.max_seq_len, lean.history_length, lean.max_sample_cost, lean.time_unit, lean.seed) == \
        (5, 10, 100, "ms", 7)
    lay = lean.layout(inputs.input_schema(str(out / "lean")))
    roles = lay.roles()
    assert roles["user"] == "user_id" and roles["labels"] == ["click", "like"]
    assert roles["passthrough"] == ["date", "score"] or roles["passthrough"] == ["score", "date"]
    C.check_actions_columns(lean, inputs.input_schema(str(out / "actions")))
    fat = C.load(out / "config_fat.yaml")
    assert fat.fat and fat.actions is None
    flay = fat.layout(inputs.input_schema(str(out / "fat")))
    assert [s.name for s in flay.snapshot] == ["item", "time", "category"]


def test_max_sample_cost_splits_heavy_users():
    cfg = Y.make_config(50, 0, fat=False, actions=True)
    assert cfg["max_sample_cost"] == 1000 and cfg["history_length"] == 100
    # at the defaults the bot's impressions per day far exceed one chunk
    p = Y.SynthParams()
    assert p.bot_factor * p.requests_per_day_median * p.imps_min > 3 * cfg["max_sample_cost"]
    assert Y.make_config(1, 0, fat=True, actions=False)["max_sample_cost"] == 20


# ---------------------------------------------------------------------------
def test_delta_read_by_spark(tmp_path, spark):
    out = tmp_path / "d"
    s = gen(out, days=1, users=40, fmt="delta", bad_rows=0.02)
    for kind, table in (("lean", S.SYNTH_IMPRESSIONS), ("fat", S.SYNTH_FAT_IMPRESSIONS), ("actions", S.SYNTH_ACTIONS)):
        assert (out / kind / "_delta_log").is_dir()
        df = spark.read.format("delta").load(str(out / kind))
        assert df.count() == s["rows"][kind]["2026-01-01"]
        types = {f.name: f.dataType for f in df.schema.fields}
        for f in table.to_spark().fields:
            assert types[f.name] == f.dataType, (kind, f.name)
    lean = spark.read.format("delta").load(str(out / "lean"))
    assert lean.where("user_id is null").count() == s["bad_rows"]["null_user"]
    fat = spark.read.format("delta").load(str(out / "fat"))
    assert fat.selectExpr("sum(size(hist_item_id))").first()[0] > 0


def test_cli_one_day(tmp_path, capsys):
    out = tmp_path / "cli"
    rc = main(["synth", "--output", str(out), "--days", "1", "--users", "30", "--items", "200",
               "--max-seq-len", "8", "--format", "delta", "--seed", "5", "--start", "2026-03-01"])
    assert rc == 0
    err = capsys.readouterr().err
    assert "synth: 2026-03-01" in err and "MB" in err
    for kind in ("lean", "fat", "actions"):
        assert (out / kind / "date=2026-03-01").is_dir()
    assert C.load(out / "config.yaml").max_seq_len == 8
    # rerun into the same folder replaces it
    assert main(["synth", "--output", str(out), "--days", "1", "--users", "30", "--kinds", "lean"]) == 0
    assert not (out / "fat").exists() and not (out / "config_fat.yaml").exists()


def test_cli_errors(tmp_path, capsys):
    assert main(["synth", "--output", str(tmp_path / "x"), "--kinds", "lean,fatt"]) == 2
    assert "--kinds" in capsys.readouterr().err
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "mine.txt").write_text("x")
    assert main(["synth", "--output", str(tmp_path / "busy")]) == 2
    assert "not empty" in capsys.readouterr().err
