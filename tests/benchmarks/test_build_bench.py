"""The build benchmark's least-plan reference does the aggregations it stands for, over every row."""

from __future__ import annotations

import dataclasses
import importlib.util
import os

import polars as pl
from deltalake import DeltaTable

from userwise.pipelines import config as C
from userwise.pipelines.tools.synth import SynthParams

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bench():
    spec = importlib.util.spec_from_file_location("build_bench", os.path.join(REPO, "benchmarks", "build_bench.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_least_plan_writes_one_row_per_request_and_per_user_as_delta(spark, tmp_path):
    bb = _bench()
    log = str(tmp_path / "log")
    bb.make_log(log, 1500, 2, 10, 3, params=dataclasses.replace(SynthParams(), bot_factor=5.0))
    cfg = C.load(os.path.join(log, "config_fat.yaml"))
    out = str(tmp_path / "least")
    assert bb.skeleton_run(spark, cfg, os.path.join(log, "fat"), out) > 0

    rows = pl.read_parquet(os.path.join(log, "fat", "**", "*.parquet"))
    user, req = cfg.col("user"), cfg.col("request")
    requests = pl.from_arrow(DeltaTable(os.path.join(out, "requests")).to_pyarrow_table())
    samples = pl.from_arrow(DeltaTable(os.path.join(out, "samples")).to_pyarrow_table())
    # every input row is one impression of exactly one request row (malformed rows included:
    # the least plan checks nothing), and every request sits in its user's one sample row
    want = rows.group_by(user, req).len().sort(user, req)
    got = requests.select(user, req, pl.col("num_imps").alias("len")).sort(user, req)
    assert got.height == want.height > 0
    assert got[user].to_list() == want[user].to_list()
    assert got["len"].to_list() == want["len"].cast(got["len"].dtype).to_list()
    assert requests["imps"].list.len().to_list() == requests["num_imps"].to_list()
    assert sorted(samples[user].to_list()) == sorted(rows[user].unique().to_list())
    assert samples["requests"].list.len().sum() == requests.height
