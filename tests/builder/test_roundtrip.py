"""Acceptance: build -> expand reproduces the input exactly (docs/tables.md).

Each case builds one edge log (tests/support/edgegen.py) once through the product's CLI and
checks it against the independent oracle (tests/oracle.py), the ground truth of the
quarantine, the report, and the samples table's invariants read straight from Delta.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import io
import json
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest

from tests.support import edgegen as E
from tests.support import oracle as O
from userwise import schemas
from userwise.pipelines import cli
from userwise.pipelines.runtime import delta_io

# window settings: name -> (M = --incremental-days, N = --window-days), as-of 2026-03-06, data from 03-01
WINDOWS = {
    "pretrain": (0, 1),  # M=0: everything before as-of is pretrain
    "incremental": (6, 2),  # as-of - 6 days = 02-28 falls before all impressions: no pretrain requests
    "both": (4, 2),  # pretrain before 03-02, windows [03-02, 03-04) and [03-04, 03-06)
    "daily": (3, 1),  # N=1: pretrain before 03-03, windows 03-03, 03-04, 03-05
}
# Spark builds are slow (minutes each on a shared 2-core box): every window setting runs on the
# richest log (lean + action log), every other variant once, each on a different setting.
# CI time: five builds cover lean + action log (incremental only, both), fat rows (N=1 windows
# plus pretrain), pretrain only, and lean + action log with an availability lag (N=1 windows plus
# pretrain), and lean + action log with arrival columns (late arrivals of every kind, N=1 windows
# plus pretrain); tests/builder/test_build.py adds M=2/N=1 with the action log and a lean log without one.
CASES = [("actions", "incremental"), ("actions", "both"), ("fat", "daily"), ("nan", "pretrain"), ("lag", "daily"),
         ("arrival", "daily")]
IDS = [f"{v}-{w}" for v, w in CASES]


@dataclass
class Built:
    log: E.EdgeLog
    M: int
    N: int
    out: Path
    rc: int
    stderr: str
    report: dict | None


def error_lines(err: str) -> list[str]:
    """The user-facing error lines (progress lines on stderr aside)."""
    assert "Traceback" not in err, err
    return [ln for ln in err.splitlines() if ln.startswith("error:")]


def run_cli(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = cli.main([str(a) for a in argv])
    return rc, err.getvalue()


def build_argv(log: E.EdgeLog, out: Path, M: int, N: int, cfg: dict | None = None) -> list:
    cfg_path = E.write_config(cfg or log.config, out.parent / f"{out.name}.yaml")
    argv = ["build", "--config", cfg_path, "--input", log.impressions, "--build-dir", out, "--as-of", log.as_of,
            "--incremental-days", M, "--window-days", N, "--report", out.parent / f"{out.name}.json"]
    if log.actions:
        argv += ["--actions", log.actions]
    return argv


def read_delta(spark, path) -> pl.DataFrame:
    try:
        return pl.from_arrow(delta_io.read_small(str(path)))
    except Exception:  # a Delta feature delta-rs cannot read: fall back to Spark
        return pl.from_arrow(spark.read.format("delta").load(str(path)).toArrow())


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    d = tmp_path_factory.mktemp("edge")
    return {
        "lean": E.make_lean(d / "lean"),
        "actions": E.make_lean(d / "actions", actions=True),
        "fat": E.make_fat(d / "fat"),
        "nan": E.make_lean(d / "nan", float_labels=True),
        "lag": E.make_lean(d / "lag", actions=True, lag=True),
        "arrival": E.make_lean(d / "arrival", actions=True, arrival=True),
    }


@pytest.fixture(scope="module")
def builder(spark, logs, tmp_path_factory):
    """case -> Built, each case built once per module (the CLI reuses the active session)."""
    cache: dict = {}

    def get(variant: str, window: str) -> Built:
        key = (variant, window)
        if key not in cache:
            log = logs[variant]
            M, N = WINDOWS[window]
            out = tmp_path_factory.mktemp(f"build-{variant}-{window}") / "out"
            try:
                rc, err = run_cli(build_argv(log, out, M, N))
            except Exception as e:  # noqa: BLE001 (an unexpected crash: remember it, do not rebuild per test)
                rc, err = -1, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            rp = out.parent / "out.json"
            report = json.loads(rp.read_text()) if rp.exists() else None
            cache[key] = Built(log, M, N, out, rc, err, report)
        b = cache[key]
        assert b.rc == 0, f"build failed (rc {b.rc}): {b.stderr}"
        return b

    return get


@pytest.fixture(scope="module")
def expander(builder):
    cache: dict = {}

    def get(variant: str, window: str, max_seq_len: int | None = None) -> pl.DataFrame:
        key = (variant, window, max_seq_len)
        if key not in cache:
            b = builder(variant, window)
            dest = b.out.parent / f"expanded-{max_seq_len or 'L'}"
            argv = ["expand", "--build-dir", b.out, "--expanded", dest]
            if max_seq_len:
                argv += ["--max-seq-len", max_seq_len]
            try:
                rc, err = run_cli(argv)
            except Exception as e:  # noqa: BLE001
                rc, err = -1, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            cache[key] = O.read_parquet_dir(dest) if rc == 0 else f"expand failed (rc {rc}): {err}"
        got = cache[key]
        assert not isinstance(got, str), got
        return got

    return get


def oracle_for(log: E.EdgeLog, max_seq_len: int | None = None) -> pl.DataFrame:
    if log.fat:
        return O.expected_fat(log.impressions, log.config, log.as_of, log.rejected)
    return O.expected_pointwise(log.impressions, log.config, log.as_of, log.rejected,
                                actions_path=log.actions, max_seq_len=max_seq_len,
                                rejected_actions=[r for r, _ in log.rejected_actions], lag=log.lag)


def assert_same_rows(got: pl.DataFrame, want: pl.DataFrame, log: E.EdgeLog) -> None:
    inputs = O.read_parquet_dir(log.impressions).columns
    n = len(inputs)
    assert got.columns[:n] == inputs, f"input columns must come back first, in input order: {got.columns}"
    assert sorted(got.columns[n:]) == sorted(O.seq_columns(log.config)), got.columns[n:]
    diff = O.frame_diff(got.select(want.columns), want)
    assert diff == [], "\n".join(diff)


# --------------------------------------------------------------------------
# the round trip
# --------------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_roundtrip_matches_oracle(case, expander, builder):
    log = builder(*case).log
    assert_same_rows(expander(*case), oracle_for(log), log)


@pytest.mark.parametrize("case", [("lean", "both"), ("actions", "daily")], ids=["lean-both", "actions-daily"])
def test_expand_shorter_max_seq_len_keeps_newest(case, expander, builder):
    log = builder(*case).log
    assert_same_rows(expander(*case, max_seq_len=3), oracle_for(log, max_seq_len=3), log)


def test_expand_longer_max_seq_len_is_an_error(builder, tmp_path):
    b = builder("actions", "both")
    rc, err = run_cli(["expand", "--build-dir", b.out, "--expanded", tmp_path / "x",
                       "--max-seq-len", b.log.config["max_seq_len"] + 1])
    assert rc == 2
    assert len(error_lines(err)) == 1, err


# --------------------------------------------------------------------------
# report and quarantine
# --------------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_report_reconciles(case, builder):
    b = builder(*case)
    assert b.report is not None, "--report was given: the JSON report must be written"
    assert O.reconcile(b.report, b.log) == []
    for k, v in b.log.planted.items():  # fat: overrides, leaking_snapshots, null_snapshots
        assert b.report.get(k) == v, (k, b.report.get(k), v)


def _input_row(input_file: str, input_row: int) -> dict:
    p = unquote(input_file[len("file:"):]) if input_file.startswith("file:") else input_file
    while p.startswith("//"):
        p = p[1:]
    t = pq.read_table(p)
    return t.slice(input_row, 1).to_pylist()[0]


QCASES = [("actions", "both"), ("fat", "daily"), ("nan", "pretrain"), ("arrival", "daily")]


@pytest.mark.parametrize("case", QCASES, ids=[f"{v}-{w}" for v, w in QCASES])
def test_quarantine_holds_exactly_the_rejected_rows(case, builder, spark):
    b = builder(*case)
    log = b.log
    q = read_delta(spark, b.out / "quarantine")
    assert set(schemas.QUARANTINE.names) <= set(q.columns), q.columns
    assert set(q["source"]) <= {"impressions", "actions"}
    # every reason the build writes is in the vocabulary (schemas/reasons.py), documented there
    assert set(q["reason"]) <= set(schemas.REASONS), set(q["reason"]) - set(schemas.REASONS)
    imp = q.filter(pl.col("source") == "impressions")
    inputs = O.read_parquet_dir(log.impressions)
    by_uid = {r["row_uid"]: r for r in inputs.iter_rows(named=True)}
    got = Counter()
    for rec in imp.iter_rows(named=True):
        row = json.loads(rec["row"])
        assert set(inputs.columns) <= set(row), f"quarantined row JSON lacks columns: {set(inputs.columns) - set(row)}"
        uid = row["row_uid"]
        got[(uid, rec["reason"])] += 1
        src = by_uid[uid]
        for c in ("user_id", "request_id", "request_ts", "item_id", "position"):
            assert row[c] == src[c], (uid, c, row[c], src[c])
        col = log.columns.get(uid, E.REASON_COLUMNS.get(rec["reason"]))
        if rec["reason"].startswith("null_") or rec["reason"] in ("bad_label", "bad_time", "action_before_request",
                                                                  "arrival_before_action", "arrival_before_request"):
            assert rec["column"] == col, (rec["reason"], rec["column"])
        if src["request_ts"] is not None:
            assert rec["date"] == E.date_of(src["request_ts"]), (uid, rec["date"])
        assert rec["input_file"] and rec["input_row"] is not None and rec["input_row"] >= 0
        assert _input_row(rec["input_file"], rec["input_row"])["row_uid"] == uid
    assert got == Counter(log.quarantined)

    acts = q.filter(pl.col("source") == "actions")
    got_a = Counter()
    for rec in acts.iter_rows(named=True):
        row = json.loads(rec["row"])
        got_a[(row.get("uid"), row.get("iid"), row.get("ts"), rec["reason"])] += 1
    assert got_a == Counter((r["uid"], r["iid"], r["ts"], reason) for r, reason in log.rejected_actions)


def test_quarantine_share_limit_fails_the_build(spark, logs, tmp_path):
    log = logs["lean"]
    share = len(log.quarantined) / log.rows_read
    assert share > 0.02
    cfg = dict(log.config, max_quarantine_share=0.01)
    rc, err = run_cli(build_argv(log, tmp_path / "out", 4, 2, cfg=cfg))
    assert rc == 2
    lines = error_lines(err)
    assert len(lines) == 1 and "share" in lines[0], err


# --------------------------------------------------------------------------
# the samples table, read from Delta directly
# --------------------------------------------------------------------------
def _ms(d) -> int:
    return E.ms(d if isinstance(d, dt.date) else dt.date.fromisoformat(d))


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_samples_invariants(case, builder, spark):
    b = builder(*case)
    log, L, cap = b.log, b.log.config["max_seq_len"], b.log.config["max_sample_cost"]
    s = read_delta(spark, b.out / "samples")
    seq_cols = [c for c in s.columns if c.startswith("seq_") and c != "num_events"]
    imp_cols = [c for c in s.columns if c.startswith("imp__")]
    req_cols = [c for c in s.columns if c.startswith("req_") and not c.startswith("req__")]
    assert "imp__row_uid" in imp_cols and seq_cols and req_cols
    assert set(s["format_version"]) == {schemas.FORMAT_VERSION}
    assert s["sample_id"].n_unique() == s.height

    as_of = dt.date.fromisoformat(log.as_of)
    cut = as_of - dt.timedelta(days=b.M)
    kinds = set(s["kind"])
    if b.M == 0:
        assert kinds == {"pretrain"}
    elif b.M >= 6:
        assert kinds == {"incremental"}
    else:
        assert kinds == {"pretrain", "incremental"}

    uids, req_ids = Counter(), Counter()
    for r in s.iter_rows(named=True):
        n_req, n_imp, n_seq = r["num_requests"], r["num_impressions"], r["num_events"]
        where = f"sample user={r['user']} kind={r['kind']} window_end={r['window_end']} chunk={r['chunk']}"
        for c in seq_cols:
            assert len(r[c]) == n_seq, (where, c)
        for c in req_cols:
            assert len(r[c]) == n_req, (where, c)
        for c in imp_cols:
            assert len(r[c]) == n_imp, (where, c)
        assert sum(r["req_num_imps"]) == n_imp, where
        ovr = len(r.get("ovr_" + seq_cols[0][len("seq_"):]) or [])  # override events (fat)
        assert r["cost"] == n_seq + ovr + n_imp, where
        if n_req > 1:
            assert r["cost"] <= cap, where
        keys = list(zip(r["req_time"], r["req_id"]))
        assert keys == sorted(keys), f"{where}: requests not sorted by (req_time, req_id)"
        # windows
        ws, we = r["window_start"], r["window_end"]
        assert all(_ms(ws) <= t < _ms(we) for t in r["req_time"]), where
        if r["kind"] == "incremental":
            assert (we - ws).days == b.N and cut < we <= as_of, where
        else:
            assert we == cut, where
        # pointers
        begins, ends = r["req_seq_begin"], r["req_seq_end"]
        assert all(0 <= x <= y <= n_seq for x, y in zip(begins, ends)), where
        if log.fat:
            kinds_ = r["req_snapshot"]
            sl = [(x, y) for x, y, k in zip(begins, ends, kinds_) if k == 0]
        else:
            sl = list(zip(begins, ends))
            assert all(y - x <= L for x, y in sl), where
            # the stream's order: arrival order with an arrival column, else action time
            ts = r["seq_arrival"] if "seq_arrival" in r else r["seq_ts"]
            assert ts == sorted(ts), f"{where}: stored sequence not in arrival order"
        if sl:
            assert min(x for x, _ in sl) == 0 and max(y for _, y in sl) == n_seq, \
                f"{where}: stored sequence is not exactly the visible slices"
        else:
            assert n_seq == 0, where
        uids.update(r["imp__row_uid"])
        req_ids.update(r["req_id"])
    assert uids == Counter(log.expected_uids), "every accepted impression before as-of exactly once"
    assert max(req_ids.values()) == 1, "a request in two samples"

    chunks = s.group_by("kind", "window_end", "user").agg(pl.col("chunk").sort().alias("c"))
    for row in chunks.iter_rows(named=True):
        assert row["c"] == list(range(len(row["c"]))), row
    heavy = chunks.filter(pl.col("user") == log.heavy_user)
    assert heavy["c"].list.len().max() > 1, "the heavy user must be split into chunks"

    if log.fat:
        snaps = Counter(k for ks in s["req_snapshot"] for k in ks)
        assert snaps[1] == log.planted["overrides"] and snaps[2] == log.planted["null_snapshots"], snaps


@pytest.mark.parametrize("case", [("fat", "daily"), ("lag", "daily"), ("arrival", "daily")],
                         ids=["fat-daily", "lag-daily", "arrival-daily"])
def test_range_build_sets_equal_the_daily_jobs_one_set_at_a_time(case, builder, spark, tmp_path):
    """A range build writes the pretrain samples and every window's from one Spark plan and
    one commit (a fat set's stream is its own snapshots; a lean one with an availability lag
    takes its base, the newest L events before its start less the lag, from the events
    table). The daily jobs (`pretrain`, then `window` per window) write one set at a time, on
    a copy of the same build. Same rows, heavy user's chunks included."""
    import shutil

    from userwise.pipelines import config as C
    from userwise.pipelines.builder import daily

    b = builder(*case)
    sets = b.report["sets"]
    assert [s["kind"] for s in sets] == ["pretrain"] + ["incremental"] * (b.M // b.N)
    assert len({s["delta_version"] for s in sets}) == 1, sets  # one commit for all the sets
    copy = tmp_path / "out"
    shutil.copytree(b.out, copy)
    cfg = C.parse(b.log.config)
    T = dt.date.fromisoformat(b.log.as_of)
    one = [daily.pretrain(spark, cfg, str(copy), T, b.M)]
    for k in range(b.M // b.N):
        we = T - dt.timedelta(days=b.M - b.N * (k + 1))
        one.append(daily.window_day(spark, cfg, str(copy), we - dt.timedelta(days=1), b.N))
    assert [s["window_end"] for s in one] == [s["window_end"] for s in sets]
    for a, c in zip(sets, one):
        assert {k: v for k, v in a.items() if k != "delta_version"} == \
            {k: v for k, v in c.items() if k != "delta_version"}
    assert len({s["delta_version"] for s in one}) == len(one)  # the daily jobs: a commit each
    ranged = read_delta(spark, b.out / "samples").sort("sample_id")
    daily_rows = read_delta(spark, copy / "samples").sort("sample_id")
    assert ranged.height == daily_rows.height > 0 and ranged["chunk"].max() > 0
    assert ranged.equals(daily_rows)


def test_build_output_layout(builder):
    b = builder("actions", "both")
    for t in ("samples", "quarantine"):
        assert os.path.isdir(b.out / t / "_delta_log"), t


# --------------------------------------------------------------------------
# the event chain every sample carries (a serving cache checks its K/V against it)
# --------------------------------------------------------------------------
def _held_chain(row: dict, fields: list[str], block: int):
    """The Python chain (pipelines.serve.chain_of) of a sample row's stored events."""
    from userwise.pipelines.serve import chain_of

    ev = np.array([row[f] for f in fields], dtype=np.int64).T.reshape(row["num_events"], len(fields))
    return chain_of(ev, block=block, version=0)


def _chain_fields(out) -> list[str]:
    from userwise.pipelines.records import build_record

    return [schemas.SEQ + sf.name for sf in schemas.chain_fields(build_record.load(str(out))[1])]


CHAIN_CASES = [("actions", "both"), ("fat", "daily"), ("lag", "daily"), ("arrival", "daily")]


@pytest.mark.parametrize("case", CHAIN_CASES, ids=[f"{v}-{w}" for v, w in CHAIN_CASES])
def test_every_sample_carries_the_chain_of_its_stored_events(case, builder, spark):
    """The chain Spark computed for each sample (chain_checkpoints, chain_end) equals the
    serving side's chain_of over the sample's stored events (item, item features, action
    bits; fat rows: the snapshot's item and other roles but the time), block chain_block."""
    b = builder(*case)
    s = read_delta(spark, b.out / "samples")
    fields, block = _chain_fields(b.out), b.log.config["chain_block"]
    assert fields[0] == "seq_item" and not {"seq_ts", "seq_time", "seq_arrival"} & set(fields)
    assert set(s["chain_block"]) == {block}
    checkpoints = 0
    for r in s.iter_rows(named=True):
        held = _held_chain(r, fields, block)
        assert (r["chain_checkpoints"], r["chain_end"]) == (held.checkpoints.tolist(), held.end), r["sample_id"]
        checkpoints += len(r["chain_checkpoints"])
    assert checkpoints > 0 and (s["num_events"] == 0).any()


def test_an_event_inserted_in_the_past_changes_the_chain_from_its_block_on(builder, spark, tmp_path):
    """An event that arrives late, in the past of a user's stored events (added to the events
    table of a copy of the build, the window's job rerun), changes the sample's chain from the
    block that holds it on: a cache holding the old chain keeps exactly the complete blocks
    before it (longest_valid_prefix), and every other sample keeps its chain."""
    import shutil

    from pyspark.sql import functions as F

    from userwise.pipelines import config as C
    from userwise.pipelines.builder import daily
    from userwise.pipelines.serve import longest_valid_prefix

    b = builder("actions", "both")
    T, P = dt.date.fromisoformat(b.log.as_of), b.log.config["chain_block"]
    copy = tmp_path / "out"
    shutil.copytree(b.out, copy)
    fields = _chain_fields(copy)
    before = read_delta(spark, copy / "samples").filter(pl.col("window_end") == T)
    row = before.filter(pl.col("user") == b.log.heavy_user).sort("num_events", descending=True).row(0, named=True)
    # an event at the time of a stored event of its second block, seen after the first request
    k = max(P + 1, row["req_seq_end"][0])
    assert k < row["num_events"]
    events = delta_io.read(spark, str(copy / "events"))
    one = events.where((F.col("user") == row["user"]) & (F.col("ev_ts") == row["seq_ts"][k])).limit(1)
    one = one.select(*[F.lit(None).cast(f.dataType).alias(f.name) if f.name in ("ev_req_time", "ev_req_id", "ev_pos")
                       else (F.lit(9999).cast(f.dataType).alias(f.name) if f.name == "ev_item" else F.col(f.name))
                       for f in events.schema.fields])
    one.write.format("delta").mode("append").save(str(copy / "events"))
    daily.window_day(spark, C.parse(b.log.config), str(copy), T - dt.timedelta(days=1), b.N)
    after = read_delta(spark, copy / "samples").filter(pl.col("window_end") == T)
    new = after.filter((pl.col("user") == row["user"]) & (pl.col("chunk") == row["chunk"])).row(0, named=True)
    assert 9999 in new["seq_item"] and (new["chain_checkpoints"], new["chain_end"]) != \
        (row["chain_checkpoints"], row["chain_end"])
    old_c, new_c = _held_chain(row, fields, P), _held_chain(new, fields, P)
    assert (new["chain_checkpoints"], new["chain_end"]) == (new_c.checkpoints.tolist(), new_c.end)
    tuples = [list(zip(*[r[f] for f in fields + ["seq_ts"]])) for r in (row, new)]
    m = next(i for i, (x, y) in enumerate(zip(*tuples)) if x != y)  # where the two sequences part
    assert P <= m <= k and longest_valid_prefix(old_c, new_c) == P * (m // P)
    others = [(r["sample_id"], r["chain_checkpoints"], r["chain_end"])
              for r in before.filter(pl.col("user") != row["user"]).sort("sample_id").iter_rows(named=True)]
    assert others == [(r["sample_id"], r["chain_checkpoints"], r["chain_end"])
                      for r in after.filter(pl.col("user") != row["user"]).sort("sample_id").iter_rows(named=True)]


# --------------------------------------------------------------------------
# the loader's batches expand to the same rows as `userwise expand`
# --------------------------------------------------------------------------
@pytest.mark.parametrize("case", [("actions", "both"), ("fat", "daily")], ids=["actions-both", "fat-daily"])
def test_loader_batches_expand_like_spark_expand(case, expander, builder, spark, tmp_path):
    """build -> preshard -> loader (2 ranks, a worker each) -> expand_batch equals build -> `userwise expand`.

    Two independent paths from the same samples: Spark's expand_frame over the Delta
    table, and the loader's numpy/Arrow expansion of its jagged batches."""
    from userwise.pipelines.loader import UserwiseDataset, UserwiseLoader, expand_batch
    from userwise.pipelines.shards import preshard

    b = builder(*case)
    want = expander(*case)
    shards = tmp_path / "shards"
    preshard.preshard(spark, build_dir=str(b.out), shards=str(shards), nodes=1, ranks_per_node=2, row_group_rows=4)
    parts, chains = [], {}
    for rank in range(2):
        ds = UserwiseDataset(str(shards), rank=rank, world_size=2, batch_size=3, seed=5)
        for batch in UserwiseLoader(ds, num_workers=1):
            parts.append(expand_batch(batch))
            # the loader hands out each sample's event chain: a list per sample, and its end
            off = batch.numpy("chain_checkpoints.offsets")
            cps = batch.numpy("chain_checkpoints")
            for j, (sid, end) in enumerate(zip(batch.numpy("sample_id").tolist(), batch.numpy("chain_end").tolist())):
                chains[sid] = (cps[off[j]:off[j + 1]].tolist(), end)
    s = read_delta(spark, b.out / "samples")
    assert chains == {r["sample_id"]: (r["chain_checkpoints"], r["chain_end"]) for r in s.iter_rows(named=True)}
    import pyarrow as pa

    got = pl.from_arrow(pa.concat_tables(parts))
    assert got.columns == want.columns
    assert got.height == want.height > 0
    diff = O.frame_diff(got.select(want.columns), want)
    assert diff == [], "\n".join(diff)
    if b.log.fat:  # the case exercises overrides and null snapshots, not only slices
        assert b.log.planted["overrides"] > 0 and b.log.planted["null_snapshots"] > 0


def test_a_timestamp_request_time_keeps_its_copy_and_both_forms_round_trip(logs, builder, expander, tmp_path):
    """Format 2 stores the request key only as req_id and an int64 request time only as
    req_time; a timestamp request time keeps its req__ column (req_time is its conversion to
    time units). The same log with request_ts as a timestamp builds and expands to the same
    rows as with request_ts as epoch ms (the int64 build is the one checked against the
    oracle above), its request_ts coming back as a timestamp of the same instants."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.dataset as pds

    log = logs["actions"]
    part = pds.partitioning(pa.schema([pa.field("date", pa.string())]), flavor="hive")
    t = pds.dataset(log.impressions, format="parquet", partitioning=part).to_table()
    i = t.schema.get_field_index("request_ts")
    t = t.set_column(i, pa.field("request_ts", pa.timestamp("ms", tz="UTC")), t.column(i).cast(pa.timestamp("ms", tz="UTC")))
    ts_dir = tmp_path / "ts"
    pds.write_dataset(t, str(ts_dir), format="parquet", partitioning=part, basename_template="part-{i}.parquet")
    M, N = WINDOWS["both"]
    out = tmp_path / "out"
    rc, err = run_cli(build_argv(dataclasses.replace(log, impressions=str(ts_dir)), out, M, N))
    assert rc == 0, err
    ints = builder("actions", "both")
    cols_int = pq.read_schema(next(Path(ints.out, "samples").rglob("*.parquet"))).names
    cols_ts = pq.read_schema(next(Path(out, "samples").rglob("*.parquet"))).names
    assert "req__request_ts" in cols_ts and "req__request_ts" not in cols_int
    assert "req__request_id" not in cols_ts and "req__request_id" not in cols_int
    rc, err = run_cli(["expand", "--build-dir", out, "--expanded", tmp_path / "x"])
    assert rc == 0, err
    got = O.read_parquet_dir(tmp_path / "x").sort("row_uid")
    want = expander("actions", "both").sort("row_uid")
    assert got.columns == want.columns and got.height == want.height > 0
    assert got.schema["request_ts"] != want.schema["request_ts"]  # a timestamp, not epoch ms
    ms = pc.cast(got["request_ts"].to_arrow().cast(pa.timestamp("ms", tz="UTC")), pa.int64())
    assert ms.to_pylist() == want["request_ts"].to_list()
    assert got.drop("request_ts").equals(want.drop("request_ts"))
