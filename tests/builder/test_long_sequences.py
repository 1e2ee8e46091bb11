"""Correct at long L (#56 point 2): build + expand equals the independent oracle at L = 4,000.

The log is `userwise synth --shape production` (weeks of action log before the impressions, every surface
in the fat snapshots) made small: five users with 2.5K to 18K events each (the bot the longest), 470
impressions on two days. Both builds use daily windows (M = 2, N = 1) and a max_sample_cost just above
L, so that the users with long histories are cut into several chunks a day:

- lean rows with the action log and an availability lag of 2 h: the expanded rows equal the oracle's
  (tests/support/oracle.py), which restates the pointer rule in plain Python;
- fat rows whose snapshots hold up to 4,000 events: they come back exactly as given, every snapshot
  stored as a slice of the user's stitched stream (no override).
"""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path

import polars as pl
import pytest
import yaml

from tests.builder.test_roundtrip import read_delta, run_cli
from tests.support import edgegen as E
from tests.support import oracle as O
from userwise.pipelines.tools import synth as Y

pytestmark = [pytest.mark.spark, pytest.mark.slow]

L = 4000
CAP = L + 200  # a chunk holds a few requests of a long history: the heavy users split several times a day
LAG = "2h"
AS_OF = "2026-03-03"  # the day after the two days of impressions
KEY = ["request_id", "position"]
PARAMS = dataclasses.replace(Y.SHAPES["production"], history_days=30, action_log_rate=40.0, bot_factor=4.0,
                             bot_action_factor=1.0, imps_extra_mean=4.0, imps_max=12)
"""The production shape, small: 30 days of a denser action log and fewer, shorter requests."""


@pytest.fixture(scope="module")
def log(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("long") / "log"
    s = Y.synth(str(out), days=2, users=5, items=2000, max_seq_len=L, start="2026-03-01", params=PARAMS, seed=3,
                log=io.StringIO())
    assert s["measured"]["history_at_request"]["max"] > 3 * L  # the log is what this module is about
    return out


def _build(log: Path, cfg: dict, inputs: list, name: str) -> tuple[Path, dict]:
    out = log.parent / name
    cfg_path = E.write_config(cfg, log.parent / f"{name}.yaml")
    rc, err = run_cli(["build", "--config", cfg_path, *inputs, "--build-dir", out, "--as-of", AS_OF,
                       "--incremental-days", 2, "--window-days", 1, "--report", log.parent / f"{name}.json"])
    assert rc == 0, f"build failed: {err}"
    dest = log.parent / f"{name}-expanded"
    rc, err = run_cli(["expand", "--build-dir", out, "--expanded", dest])
    assert rc == 0, f"expand failed: {err}"
    return out, json.loads((log.parent / f"{name}.json").read_text())


@pytest.fixture(scope="module")
def lean_cfg(log) -> dict:
    cfg = yaml.safe_load((log / "config.yaml").read_text())
    return {**cfg, "max_sample_cost": CAP, "availability_lag": LAG}


@pytest.fixture(scope="module")
def lean(spark, log, lean_cfg):
    return _build(log, lean_cfg, ["--input", log / "lean", "--actions", log / "actions"], "lean")


@pytest.fixture(scope="module")
def fat(spark, log):
    cfg = {**yaml.safe_load((log / "config_fat.yaml").read_text()), "max_sample_cost": CAP}
    return _build(log, cfg, ["--input", log / "fat"], "fat")


def assert_same(got: pl.DataFrame, want: pl.DataFrame) -> None:
    got, want = got.select(want.columns).sort(KEY), want.sort(KEY)
    if got.equals(want):
        return
    n = pl.int_range(pl.len()).alias(O.UID)
    diff = O.frame_diff(got.with_columns(n), want.with_columns(n))
    assert diff == [], "\n".join(diff)


def test_lean_at_long_L_with_a_lag_and_daily_windows_equals_the_oracle(lean, log, lean_cfg):
    out, report = lean
    got = O.read_parquet_dir(out.parent / "lean-expanded")
    want = O.expected_pointwise(log / "lean", lean_cfg, AS_OF, set(), actions_path=log / "actions")
    assert got.height == want.height == 470
    assert_same(got, want)
    lens = want["seq_item"].list.len()
    assert lens.max() == L and (lens == L).sum() > want.height // 2, "histories are cut at L"
    # the lag is in force: without it some histories would differ
    no_lag = O.expected_pointwise(log / "lean", lean_cfg, AS_OF, set(), actions_path=log / "actions", lag=0)
    assert not no_lag.sort(KEY)["seq_ts"].equals(want.sort(KEY)["seq_ts"])
    assert report["reconciled"] is True


def test_heavy_users_are_cut_into_several_chunks_a_day(lean, spark):
    out, report = lean
    s = read_delta(spark, out / "samples")
    assert set(s["kind"]) == {"incremental"} and s["window_end"].n_unique() == 2  # N = 1: one set a day
    chunks = s.group_by("window_end", "user").agg(pl.col("chunk").max() + 1)
    assert chunks["chunk"].max() >= 3, chunks
    assert report["extra_chunks"] > 0
    assert (s["num_events"] <= CAP).all()
    # a sample stores one base of at most L events plus the new ones of its requests, never requests x L
    assert s["num_events"].sum() < s["num_requests"].sum() * L / 4


def test_fat_rows_with_long_snapshots_come_back_as_given(fat, log, spark):
    out, report = fat
    got = O.read_parquet_dir(out.parent / "fat-expanded")
    want = O.read_parquet_dir(log / "fat")
    assert got.height == want.height == 470
    assert want["hist_item_id"].list.len().max() == L
    assert_same(got, want)
    assert report.get("overrides") == 0, "every long snapshot is a slice of the stitched stream"
    s = read_delta(spark, out / "samples")
    assert s.group_by("window_end", "user").agg(pl.col("chunk").max())["chunk"].max() >= 2
