"""The build benchmark end to end on a tiny log: it reports every figure the docs quote, times
the build's steps, and runs both least-plan references (without and with the checks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(REPO, "benchmarks", "build_bench.py")


@pytest.mark.spark
@pytest.mark.slow
def test_build_bench_runs_end_to_end_on_a_tiny_log(tmp_path):
    work, out = tmp_path / "work", tmp_path / "bench.json"
    r = subprocess.run([sys.executable, BENCH, "--sections", "impression,sparse", "--kinds", "fat",
                        "--fat-sizes", "1500", "--days", "2", "--bot-share", "0.1", "--no-warmup", "--no-plot",
                        "--sparse-impressions", "600", "--sparse-spans", "20,60", "--sparse-users", "12",
                        "--workdir", str(work), "--json", str(out), "--conf", "spark.sql.shuffle.partitions=2"],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())["sections"]
    assert not [k for k, v in res.items() if "error" in v], res  # every section ran
    (s,) = res["impression"]["series"]
    (row,) = s["sizes"]
    assert row["impressions"] > 1000 and 0 < row["bot_impressions"] < row["impressions"]
    for k in ("floor_s", "skeleton_s", "checked_s", "tables_s", "build_s"):
        assert row[k] > 0, k
    assert row["build_vs_checked"] == round(row["build_s"] / row["checked_s"], 2)
    assert row["tables_vs_checked"] == round(row["tables_s"] / row["checked_s"], 2)
    assert row["jobs"] == sum(st["jobs"] for st in row["steps"]) > 0  # the job count beside the time
    assert row["ratio"] == round(row["build_s"] / row["floor_s"], 2)
    assert row["skeleton_ratio"] == round(row["skeleton_s"] / row["floor_s"], 2)
    assert row["checked_ratio"] == round(row["checked_s"] / row["floor_s"], 2)
    b = row["bytes"]
    assert b["fat_rows"] == row["impressions"] and b["disk_samples"] > 0 and b["mem_samples"] > 0
    assert b["disk_ratio"] == round(b["disk_fat_training_order"] / b["disk_samples"], 2)
    # the step profile covers the build: ingest, the sample sets, the history, the report,
    # each with the Spark jobs the UI saw under its job group
    steps = {st["step"]: st for st in row["steps"]}
    assert {"ingest_range", "report"} <= steps.keys(), steps.keys()
    assert any(n.endswith("samples") for n in steps) and any(n.startswith("history_") for n in steps), steps.keys()
    assert all(st["jobs"] > 0 for st in steps.values()), {n: st["jobs"] for n, st in steps.items()}
    # each figure is rounded to 0.01 s: the steps' sum may pass the build's by that rounding alone
    slack = 0.005 * (len(steps) + 1)
    assert 0.5 * row["build_s"] < sum(st["wall_s"] for st in steps.values()) <= row["build_s"] + slack
    assert s["slope_ratio"] is None and res["impression"]["verdicts"] == []  # one size: no slope to judge
    # the sparse calendar: each span built and counted, the files per table next to the days
    runs = res["sparse"]["runs"]
    assert [x["span_days"] for x in runs] == [20, 60]
    for x in runs:
        assert x["build_s"] > 0 and x["floor_s"] > 0 and x["dates_with_rows"] > 1
        assert {"requests", "events", "samples"} <= set(x["tables"]), x["tables"]
        assert all(v["files"] >= 1 for k, v in x["tables"].items() if k in ("requests", "events", "samples"))
    assert "VERDICT sparse calendar" in res["sparse"]["verdicts"][0]
