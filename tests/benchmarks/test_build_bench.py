"""The build benchmark end to end on a tiny log: it reports every figure the docs quote, times
the build's steps, and its least-plan reference aggregates every row of the log."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import polars as pl
import pytest
from deltalake import DeltaTable

from userwise.pipelines import config as C

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(REPO, "benchmarks", "build_bench.py")


@pytest.mark.spark
@pytest.mark.slow
def test_build_bench_runs_end_to_end_on_a_tiny_log(tmp_path):
    work, out = tmp_path / "work", tmp_path / "bench.json"
    r = subprocess.run([sys.executable, BENCH, "--sizes", "1500", "--reps", "1", "--bot-factor", "5", "--no-warmup",
                        "--no-plot", "--keep", "--workdir", str(work), "--json", str(out),
                        "--conf", "spark.sql.shuffle.partitions=2"],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    (row,) = res["sizes"]
    assert row["impressions"] > 1000 and 0 < row["bot_impressions"] < row["impressions"]
    for k in ("floor_s", "shuffle_s", "skeleton_s", "build_s"):
        assert row[k] > 0, k
    assert row["ratio"] == round(row["build_s"] / row["floor_s"], 1)
    assert row["skeleton_ratio"] == round(row["skeleton_s"] / row["floor_s"], 2)
    b = row["bytes"]
    assert b["fat_rows"] == row["impressions"] and b["disk_samples"] > 0 and b["mem_samples"] > 0
    assert b["disk_ratio"] == round(b["disk_fat_training_order"] / b["disk_samples"], 2)
    # the step profile covers the build: ingest, the sample sets, the history, the report,
    # each with the Spark jobs the UI saw under its job group
    steps = {s["step"]: s for s in row["steps"]}
    assert {"ingest_range", "report"} <= steps.keys(), steps.keys()
    assert any(n.endswith("samples") for n in steps) and any(n.startswith("history_") for n in steps), steps.keys()
    assert all(s["jobs"] > 0 for s in steps.values()), {n: s["jobs"] for n, s in steps.items()}
    assert 0.5 * row["build_s"] < sum(s["wall_s"] for s in steps.values()) <= row["build_s"]

    # the least plan's reference tables hold every input row: one request row per
    # (user, request) with its impressions (malformed rows too: the least plan checks
    # nothing), and every request in its user's one sample row
    d = work / "n1500"
    cfg = C.load(str(d / "log" / "config_fat.yaml"))
    rows = pl.read_parquet(str(d / "log" / "fat" / "**" / "*.parquet"))
    user, req = cfg.col("user"), cfg.col("request")
    requests = pl.from_arrow(DeltaTable(str(d / "skeleton" / "requests")).to_pyarrow_table())
    samples = pl.from_arrow(DeltaTable(str(d / "skeleton" / "samples")).to_pyarrow_table())
    want = rows.group_by(user, req).len().sort(user, req)
    got = requests.select(user, req, pl.col("num_imps").alias("len")).sort(user, req)
    assert got.height == want.height > 0
    assert got[user].to_list() == want[user].to_list()
    assert got["len"].to_list() == want["len"].cast(got["len"].dtype).to_list()
    assert requests["imps"].list.len().to_list() == requests["num_imps"].to_list()
    assert sorted(samples[user].to_list()) == sorted(rows[user].unique().to_list())
    assert samples["requests"].list.len().sum() == requests.height
