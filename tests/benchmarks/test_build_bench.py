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


def _bench():
    import importlib.util

    spec = importlib.util.spec_from_file_location("build_bench", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


@pytest.fixture(scope="module")
def small_build(spark, tmp_path_factory):
    """A small lean log with its action log and a bot user, built once (M = days - 1, N = 1,
    a cap that splits heavy users): the references are compared with this build."""
    import datetime as dt
    import io
    import types

    from tests.support.common import config
    from userwise.pipelines import config as C
    from userwise.pipelines.builder import build as B
    from userwise.pipelines.tools import synth

    tmp = tmp_path_factory.mktemp("bench")
    L, days, start = 10, 3, dt.date(2026, 1, 1)
    synth.synth(str(tmp / "log"), start=start.isoformat(), days=days, users=8, max_seq_len=L,
                kinds=("lean", "actions"), params=synth.SynthParams(bot_factor=20), log=io.StringIO())
    cfg = C.parse(config(L, max_sample_cost=60, actions=True, history_length=15))
    log = {"input": str(tmp / "log" / "lean"), "actions": str(tmp / "log" / "actions")}
    as_of = start + dt.timedelta(days=days)
    rep = B.build(spark, cfg, log["input"], str(tmp / "build"), as_of.isoformat(), days - 1, 1, log["actions"])
    return types.SimpleNamespace(bench=_bench(), cfg=cfg, log=log, tmp=tmp, days=days, as_of=as_of,
                                 boundary=as_of - dt.timedelta(days=days - 1), report=rep)


@pytest.mark.spark
def test_the_tables_least_plan_stores_what_the_build_stores(spark, small_build):
    """The tables least plan bounds the build from below only if it writes what the build
    writes: a samples row for every (user, sample set) the build has, none more, each with a
    stream holding every event each of the build's chunks of that set stores (the build keeps
    no more: only what its requests see), and the same history."""
    import collections

    from deltalake import DeltaTable

    b = small_build
    tmp_path, days, boundary = b.tmp, b.days, b.boundary
    b.bench.tables_run(spark, b.cfg, b.log, str(tmp_path / "tables"), b.as_of.isoformat(), days - 1, 1)

    def rows(table: str, cols: list[str]) -> list[dict]:
        return DeltaTable(str(table)).to_pyarrow_table(columns=cols).to_pylist()

    least = {(r["user"], r["_set"]): collections.Counter(e["ev_ts"] for e in r["stream"])
             for r in rows(tmp_path / "tables" / "samples", ["user", "_set", "stream"])}
    built = rows(tmp_path / "build" / "samples", ["kind", "window_end", "user", "chunk", "seq_ts"])
    key = {(r["user"], 0 if r["kind"] == "pretrain" else (r["window_end"] - boundary).days) for r in built}
    assert key == set(least) and len({k[1] for k in key}) == days, (sorted(key), sorted(least))
    assert sum(r["chunk"] > 0 for r in built) > 0  # the cap splits heavy users: chunks are covered too
    for r in built:
        k = (r["user"], 0 if r["kind"] == "pretrain" else (r["window_end"] - boundary).days)
        assert not collections.Counter(r["seq_ts"]) - least[k], (k, r["chunk"])
    hist = {r["user"]: sorted(e["ev_ts"] for e in r["events"]) for r in rows(tmp_path / "tables" / "history",
                                                                             ["user", "events"])}
    want = {r["user"]: sorted(r["ev_ts"]) for r in rows(tmp_path / "build" / "history", ["user", "ev_ts"])}
    assert {u: h for u, h in hist.items() if h} == want


@pytest.mark.spark
def test_the_pointwise_job_gives_every_impression_the_history_expand_gives(spark, small_build):
    """The build is compared with the point-wise job it replaces only if both produce the same
    thing: the job's rows are the log's impressions, every one once, each with every input
    column and the history (every sequence field) that ``userwise expand`` gives it from the
    build's samples."""
    from userwise.pipelines.builder import expand
    from userwise.pipelines.records import build_record

    b = small_build
    assert b.report["reconciled"] and not sum(b.report["quarantined"].values())  # a clean log: nothing rejected
    b.bench.pointwise_run(spark, b.cfg, b.log, str(b.tmp / "pointwise"))
    cfg, layout, _ = build_record.load(str(b.tmp / "build"))
    exp = expand.expand_frame(cfg, layout, expand.read_samples(spark, str(b.tmp / "build")))
    pw = spark.read.parquet(str(b.tmp / "pointwise"))
    assert sorted(pw.columns) == sorted(exp.columns)
    pw = pw.select(*exp.columns)
    n = spark.read.parquet(b.log["input"]).count()
    assert exp.count() == pw.count() == n > 0
    assert exp.exceptAll(pw).count() == 0 and pw.exceptAll(exp).count() == 0
    seq = [c for c in exp.columns if c.startswith("seq_")]
    assert {"seq_ts", "seq_item", "seq_action"} <= set(seq)
    lens = [r[0] for r in pw.selectExpr(f"size({seq[0]})").collect()]
    assert 0 in lens and max(lens) == cfg.max_seq_len  # empty histories and full ones, both compared


def test_the_skew_verdict_judges_the_slope_and_prints_the_cost_per_impression_at_the_largest_size():
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import build_bench

    def series(build_s: list[float], bot: int) -> dict:
        sizes = [{"impressions": n, "bot_impressions": bot, "build_s": b} for n, b in zip((2_000_000, 4_000_000), build_s)]
        slope = (build_s[1] - build_s[0]) / 2_000_000 * 1e6
        return {"kind": "lean", "sizes": sizes, "build_us_per_imp": slope, "floor_us_per_imp": 1.0, "slope_ratio": slope}

    # the slope of two sizes doubles with the bot (20 s to 40 s of difference), the largest size costs 1.25x
    (v,) = build_bench.skew_verdicts([(series([60.0, 100.0], 1000), series([60.0, 80.0], 0))], 0.2)
    assert "NOT met" in v and "2.00x" in v and "at the largest size 1.25x" in v, v
    (v,) = build_bench.skew_verdicts([(series([60.0, 82.0], 1000), series([60.0, 80.0], 0))], 0.2)
    assert "NOT met" not in v and "1.10x" in v and "at the largest size 1.02x" in v, v


def test_the_crossover_is_where_build_over_job_crosses_one():
    """The crossover L is interpolated in log L between the two lengths whose ratios straddle 1;
    none when every length is on one side."""
    import math

    bench = _bench()
    rows = [{"L": 50, "ratio": 2.0}, {"L": 200, "ratio": 1.5}, {"L": 1000, "ratio": 0.5}, {"L": 4000, "ratio": 0.2}]
    x = bench.crossover(rows)
    # 1.5 -> 0.5 between 200 and 1000: halfway in log L
    assert x == pytest.approx(math.sqrt(200 * 1000))
    assert bench.crossover([{"L": 50, "ratio": 2.0}, {"L": 200, "ratio": 1.2}]) is None
    assert bench.crossover([{"L": 1000, "ratio": 0.5}, {"L": 200, "ratio": 1.0}]) == pytest.approx(200)


def test_the_length_config_scales_its_caps_with_L(tmp_path):
    """Each L of the length section builds with the history and sample cost that scale with it
    (2 L, 20 L: docs/design/repeated-bases.md), so no length meets a cap the others do not."""
    import yaml

    from tests.support.common import config

    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config(50, actions=True)))
    cfg = _bench().length_config(str(path), 4000)
    assert (cfg.max_seq_len, cfg.history_length, cfg.max_sample_cost) == (4000, 8000, 80000)
    small = _bench().length_config(str(path), 50)
    assert (small.max_seq_len, small.history_length, small.max_sample_cost) == (50, 2000, 20000)


@pytest.mark.spark
@pytest.mark.slow
def test_the_length_section_runs_one_process_per_L(tmp_path):
    """The length section end to end on a tiny production-shaped log: the L runs in a process of
    its own, and every figure the docs quote is there and consistent."""
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, BENCH, "--sections", "length", "--lengths", "30", "--length-users", "12",
                        "--length-days", "2", "--length-history-days", "3", "--no-plot", "--workdir",
                        str(tmp_path / "work"), "--json", str(out), "--conf", "spark.sql.shuffle.partitions=2"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    sec = json.loads(out.read_text())["sections"]["length"]
    assert "error" not in sec, sec
    (x,) = sec["lengths"]
    assert x["L"] == 30 and x["m"] == 1 and x["impressions"] > 0
    assert x["fat_rows"] == x["impressions"]  # the point-wise job writes every impression once
    for k in ("floor_s", "pointwise_s", "build_s", "tables_s", "pointwise_bytes", "build_bytes", "samples_bytes",
              "fat_training_order_bytes", "distinct_events", "samples_events", "fat_events"):
        assert x[k] > 0, k
    assert x["ratio"] == round(x["build_s"] / x["pointwise_s"], 3)
    assert x["samples_vs_distinct"] == round(x["samples_events"] / x["distinct_events"], 2)
    assert x["fat_events"] > x["samples_events"]  # every impression repeats its history point-wise
    assert sec["crossover_L"] is None and sec["verdicts"] == []  # one length: no crossover, no target at L=30


@pytest.mark.spark
@pytest.mark.slow
def test_the_cost_sections_build_each_variant_side_by_side(tmp_path):
    """The arrival and id_stats sections on a tiny log: each builds its two variants (an arrival
    column or none; the id statistics or none), counts the Spark jobs of each, and judges the
    ratio of the two builds; the id statistics left out write no id_stats table."""
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, BENCH, "--sections", "arrival,id_stats", "--sizes", "3000", "--days", "2",
                        "--cost-reps", "1", "--no-warmup", "--no-ui", "--no-plot", "--keep", "--workdir",
                        str(tmp_path / "work"), "--json", str(out), "--conf", "spark.sql.shuffle.partitions=2"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())["sections"]
    for name, (a, b) in {"arrival": ("without arrival", "with arrival"),
                         "id_stats": ("without id_stats", "with id_stats")}.items():
        sec = res[name]
        assert "error" not in sec, sec
        x, y = sec["builds"][a], sec["builds"][b]
        assert x["build_s"] > 0 and y["build_s"] > 0 and x["jobs"] > 0 and y["jobs"] > 0
        assert sec["ratio"] == round(y["build_s"] / x["build_s"], 3)
        assert sec["extra_jobs"] == y["jobs"] - x["jobs"]
        assert f"VERDICT {name.replace('_', ' ') if name == 'arrival' else 'id_stats'} cost" in sec["verdicts"][0]
    assert res["id_stats"]["extra_jobs"] > 0  # leaving the statistics out is seen: fewer jobs
    assert not (tmp_path / "work" / "cost-without id_stats" / "id_stats").exists()
    assert (tmp_path / "work" / "cost-with id_stats" / "id_stats" / "_delta_log").is_dir()
