"""A user with 100K events and requests at L = 16,000 builds (Spark), pre-shards (Spark), stages,
loads and serves on the default local Spark, in bounded memory (issue #56, point 3).

The Spark half of tests/serve/test_long_user.py. The log is `userwise synth --shape production`
small: 20 users, 53 days of action log, then 4 days of impressions; the bot reads 3 requests a
day less and acts 25 x more than the preset (``PARAMS``), so that it holds ~108K events in ~34
requests. The build runs at L = 16,000 (history_length 2 L, max_sample_cost 20 L, synth's
scaling), M = 3, N = 1 (day 0 is pretrain, days 1-3 daily windows), in a fresh process on the
session ``get_spark()`` makes when nothing is configured (``local[2]``, ``spark.driver.memory``
4g: pipelines/runtime/spark.py), as ``userwise build`` and ``userwise preshard`` run it. Then
one node's set is staged, read by a :class:`~userwise.pipelines.loader.UserwiseLoader` (token
budget: the largest sample's cost) and every request of the heavy user is served in time order
through a :class:`~userwise.pipelines.serve.KVStore` (max_seq_len = L).

Checked against an independent computation (polars/numpy over the log's Parquet files, not
the build): the heavy user's stream in the pointer rule's total order, and per request the
count of its events strictly before the request time:

- every heavy request's pointers: ``seq_end - seq_begin == min(L, events before it)`` and the
  events it sees (ts, item, features, action bits) are the newest ones before it;
- the samples store the user's stream once per set: a sample's stored events are exactly
  those from its first request's ``seq_begin`` to its last one's ``seq_end``, at most L plus
  the set's new events, never requests x L;
- the loaded spans equal what serving holds (the newest L events before the request), the
  build's event chain equals the one serving computes, and each request's cached logits equal
  the full recompute over the whole held stream;
- no Spark task failed or spilled, and the flow's Python memory stays bounded.

The run prints (``-s``) its wall time by phase, the Python process's peak RSS, the driver JVM's
settings, heap and peak RSS, and Spark's spill. Measured on the shared 2-core development machine
(docs/operations.md#memory-of-a-long-user): 101 s in all (synth 1.5 s, Spark's start 8 s, build
45 s, preshard 11 s, stage 0.2 s, load 2.5 s, serving the 34 requests with their full recomputes
21 s; a quieter rerun: 62 s, build 28 s, preshard 5.5 s, memory the same); the driver JVM (``spark.driver.memory`` 4g: heap at most 3.6 GB) peaked at 1.4 GB of heap
used and 2.3 GB resident, the largest stage's execution memory 256 MB, 140 stages, no spill, no
failed task; the heavy user's 4 samples hold 17.6K-17.8K events each (71K for its 34 requests;
requests x L would be 544K), the largest row of the table; the Python process peaked at 1.2 GB
resident (VmHWM, tests/support/memory.py), 0.5 GB of it the imports.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.spark, pytest.mark.slow]

L, PAGE, START, DAYS, M = 16_000, 64, "2026-03-01", 4, 3
AS_OF = "2026-03-05"  # the day after the 4 days of impressions
BOUND_GROWTH_MB = 2048  # the Python process over its imports: generous (measured 0.7 GB, see the module doc)


def params():
    from userwise.pipelines.tools import synth as Y

    # the bot: 3 x the median request rate (~11 requests a day) and 25 x the action log: ~1,900 events a day,
    # ~108K over the 57 days, so the serving check runs ~34 requests, not the preset's ~360
    return dataclasses.replace(Y.SHAPES["production"], bot_factor=3.0, bot_action_factor=25.0)


def make_log(tmp: str) -> tuple[str, str, int]:
    """The synth log and its config at L; returns (log folder, config path, the heaviest user)."""
    import io

    import polars as pl
    import yaml

    from userwise.pipelines.tools import synth as Y

    log = os.path.join(tmp, "log")
    Y.synth(log, days=DAYS, users=20, items=5000, max_seq_len=1000, start=START, params=params(), seed=1,
            kinds=("lean", "actions"), log=io.StringIO())
    with open(os.path.join(log, "config.yaml")) as f:
        cfg = yaml.safe_load(f)
    cfg.update(max_seq_len=L, history_length=2 * L, max_sample_cost=20 * L)  # synth's scaling, at L
    cfg_path = os.path.join(tmp, "config.yaml")
    with open(cfg_path, "w") as f:
        yaml.safe_dump(cfg, f)
    acts = pl.read_parquet(os.path.join(log, "actions", "**", "*.parquet"), hive_partitioning=False)
    heavy = int(acts.group_by("uid").len().sort("len", descending=True)["uid"][0])
    return log, cfg_path, heavy


def user_stream(log: str, user: int):
    """The user's events from the log's files (not the build): the impressions' actions (a label > 0, at
    the action time, bit i for label i) and the action log, in the pointer rule's total order (action
    time, request time, request id, position, item, action bits; a log event's null request fields
    first); and its requests in time order. Returns (stream, requests) as polars frames."""
    import polars as pl

    lean = pl.read_parquet(os.path.join(log, "lean", "**", "*.parquet"), hive_partitioning=False) \
        .filter(pl.col("user_id") == user)
    acts = pl.read_parquet(os.path.join(log, "actions", "**", "*.parquet"), hive_partitioning=False) \
        .filter(pl.col("uid") == user)
    bits = (pl.col("click") > 0).cast(pl.Int64) | ((pl.col("like") > 0).cast(pl.Int64) * 2)
    imp = lean.filter((pl.col("click") > 0) | (pl.col("like") > 0)).select(
        pl.col("action_ts").alias("ts"), pl.col("request_ts").alias("rt"), pl.col("request_id").alias("rid"),
        pl.col("position").cast(pl.Int64).alias("pos"), pl.col("item_id").alias("item"), bits.alias("bits"),
        pl.col("category").cast(pl.Int64).alias("cat"), pl.col("author").cast(pl.Int64).alias("auth"))
    log_ev = acts.select(
        pl.col("ts"), pl.lit(None, pl.Int64).alias("rt"), pl.lit(None, pl.String).alias("rid"),
        pl.lit(None, pl.Int64).alias("pos"), pl.col("iid").alias("item"), pl.col("bits").cast(pl.Int64),
        pl.col("cat").cast(pl.Int64), pl.col("auth").cast(pl.Int64))
    stream = pl.concat([imp, log_ev]).sort(["ts", "rt", "rid", "pos", "item", "bits", "cat", "auth"],
                                           nulls_last=False)
    reqs = lean.group_by("request_id").agg(pl.col("request_ts").first()).sort(["request_ts", "request_id"])
    return stream, reqs


def spark_half(spark, tmp: str, log: str, cfg_path: str) -> dict:
    """`userwise build` and `userwise preshard` (1 node, 1 rank) through the library's functions."""
    import time

    from userwise.pipelines import api

    out: dict = {}
    t = time.time()
    rep = api.build(config=cfg_path, input=os.path.join(log, "lean"), actions=os.path.join(log, "actions"),
                    build_dir=os.path.join(tmp, "D"), as_of=AS_OF, incremental_days=M, window_days=1, spark=spark)
    out["build_s"] = time.time() - t
    out["reconciled"], out["quarantined"] = rep["reconciled"], sum((rep.get("quarantined") or {}).values())
    t = time.time()
    api.preshard(build_dir=os.path.join(tmp, "D"), shards=os.path.join(tmp, "S"), nodes=1, ranks_per_node=1,
                 spark=spark)
    out["preshard_s"] = time.time() - t
    return out


def spark_measures(spark) -> dict:
    """The driver JVM's settings, heap and peak RSS, and every stage's spill and failed tasks (the UI's
    REST API: the session's status store)."""
    import urllib.request

    from pyspark import SparkContext

    sc = spark.sparkContext
    conf = {k: sc.getConf().get(k, None) for k in ("spark.master", "spark.driver.memory", "spark.executor.memory",
                                                   "spark.memory.fraction", "spark.sql.shuffle.partitions")}
    rt = spark._jvm.java.lang.Runtime.getRuntime()
    out = {"conf": conf, "jvm_heap_max_mb": rt.maxMemory() / 2**20, "jvm_heap_committed_mb": rt.totalMemory() / 2**20}
    proc = getattr(SparkContext._gateway, "proc", None)
    if proc is not None:
        with open(f"/proc/{proc.pid}/status") as f:
            st = dict(line.split(":", 1) for line in f if ":" in line)
        out["jvm_peak_rss_mb"] = int(st["VmHWM"].split()[0]) / 1024

    def rest(path):
        with urllib.request.urlopen(f"{sc.uiWebUrl}/api/v1/applications/{sc.applicationId}/{path}", timeout=30) as r:
            return json.loads(r.read())

    if sc.uiWebUrl:
        stages = rest("stages")
        out["stages"] = len(stages)
        out["failed_tasks"] = sum(s.get("numFailedTasks", 0) for s in stages)
        out["failed_stages"] = sum(s.get("status") == "FAILED" for s in stages)
        out["spilled_memory_bytes"] = sum(s.get("memoryBytesSpilled", 0) for s in stages)
        out["spilled_disk_bytes"] = sum(s.get("diskBytesSpilled", 0) for s in stages)
        out["peak_execution_memory_mb"] = max((s.get("peakExecutionMemory", 0) for s in stages), default=0) / 2**20
        peaks = [e.get("peakMemoryMetrics") or {} for e in rest("executors")]
        out["jvm_heap_peak_mb"] = max((p.get("JVMHeapMemory", 0) for p in peaks), default=0) / 2**20
    return out


def sample_checks(spark, tmp: str, heavy: int) -> dict:
    """The samples table's shape (one aggregate row) and the heavy user's rows (a handful)."""
    from pyspark.sql import functions as F

    s = spark.read.format("delta").load(os.path.join(tmp, "D", "samples"))
    agg = s.agg(F.count("*").alias("rows"), F.max("num_events").alias("max_events"), F.max("cost").alias("max_cost"),
                F.sum("num_events").alias("stored"), F.sum("num_requests").alias("requests")).first().asDict()
    rows = s.where(F.col("user") == heavy).select(
        "kind", F.col("window_end").cast("string").alias("window_end"), "chunk", "num_events", "cost", "seq_ts",
        "seq_item", "seq_category", "seq_author", "seq_action", "req_id", "req_time", "req_seq_begin",
        "req_seq_end").toArrow().to_pylist()
    return {"table": agg, "heavy_rows": rows}


def check_heavy_samples(rows: list[dict], stream, reqs) -> dict:
    """Each heavy request's pointers and events against the independent stream; each sample stores its
    requests' events once (from the first seq_begin to the last seq_end)."""
    import numpy as np

    ts = stream["ts"].to_numpy()
    cols = {c: stream[c].to_numpy() for c in ("ts", "item", "cat", "auth", "bits")}
    names = {"ts": "seq_ts", "item": "seq_item", "cat": "seq_category", "auth": "seq_author", "bits": "seq_action"}
    want_time = dict(zip(reqs["request_id"].to_list(), reqs["request_ts"].to_list()))
    seen, bad, bound_ok, once_ok = [], [], True, True
    for row in rows:
        got = {c: np.asarray(row[names[c]]) for c in cols}
        counts = np.searchsorted(ts, np.asarray(row["req_time"]), side="left")  # events strictly before
        b, e = np.asarray(row["req_seq_begin"]), np.asarray(row["req_seq_end"])
        for j, rid in enumerate(row["req_id"]):
            c = int(counts[j])
            seen.append(rid)
            ok = want_time[rid] == row["req_time"][j] and int(e[j] - b[j]) == min(L, c)
            ok = ok and all(np.array_equal(got[k][b[j]:e[j]], cols[k][c - (e[j] - b[j]):c]) for k in cols)
            if not ok:
                bad.append(rid)
        first, last = int(counts[0]), int(counts[-1])
        once_ok &= row["num_events"] == int(e.max() - b.min()) == last - max(0, first - L)
        bound_ok &= row["num_events"] <= L + (last - first)  # the base (<= L) + the set's new events
    return {"requests_checked": len(seen), "bad_requests": bad, "all_requests": sorted(seen) == sorted(want_time),
            "stored_once": bool(once_ok), "stored_bound": bool(bound_ok)}


def serve_half(tmp: str, heavy: int, stream) -> dict:
    """Stage node 0, load every set, serve the heavy user's requests in time order."""
    import time

    import numpy as np
    import torch

    from tests.support.serving import serve_and_recompute
    from userwise.pipelines import api
    from userwise.pipelines.loader import UserwiseDataset, UserwiseLoader
    from userwise.pipelines.serve import Candidates, Events, KVStore, chain_of
    from userwise.pipelines.shards import manifest
    from userwise.pipelines.train import ReferenceRanker, UserBatch

    out: dict = {}
    t = time.time()
    staged = os.path.join(tmp, "staged")
    api.stage(shards=os.path.join(tmp, "S"), node=0, staged=staged, workers=2, progress=None)
    out["stage_s"] = time.time() - t
    m = manifest.load(staged)
    out["sets"] = [x["id"] for x in m["sets"]]
    budget = max_sample_cost(staged)  # every sample fits: none is left to a batch of its own
    t = time.time()
    ds = UserwiseDataset(staged, token_budget=budget, world_size=1, rank=0, device="cpu")
    heavy_reqs, chains_ok, delivered = [], True, 0
    for b in UserwiseLoader(ds, num_workers=1, zero_copy=False):
        users = b.numpy("user").tolist()
        delivered += len(users)
        if heavy not in users:
            continue
        ub = UserBatch.from_jagged(b)
        sp = ub.spans
        i = users.index(heavy)
        a, z = int(sp.seq_offsets[i]), int(sp.seq_offsets[i + 1])
        ev = Events(ub.ev_item[a:z], ub.ev_side[a:z], ub.ev_action[a:z])
        ch = chain_of(ev, block=int(b.numpy("chain_block")[i]), version="v")
        co = b.numpy("chain_checkpoints.offsets")
        chains_ok &= bool(np.array_equal(ch.checkpoints, b.numpy("chain_checkpoints")[co[i]:co[i + 1]])
                          and int(ch.end) == int(b.numpy("chain_end")[i]))
        rt = b.numpy("req_time")
        for r in range(sp.num_requests):
            if int(sp.req_sample[r]) != i:
                continue
            mask = sp.imp_req == r
            lo, hi = int(sp.req_begin[r]), int(sp.req_end[r])
            heavy_reqs.append((int(rt[r]), Events(ub.ev_item[lo:hi], ub.ev_side[lo:hi], ub.ev_action[lo:hi]),
                               Candidates(ub.tgt_item[mask], ub.tgt_side[mask])))
    out["load_s"] = time.time() - t
    out["token_budget"], out["delivered"], out["chains_equal"] = budget, delivered, chains_ok

    t = time.time()
    heavy_reqs.sort(key=lambda x: x[0])
    ts = stream["ts"].to_numpy()
    held = Events(torch.tensor(stream["item"].to_numpy()),
                  torch.tensor(np.stack([stream["cat"].to_numpy(), stream["auth"].to_numpy()], 1)),
                  torch.tensor(stream["bits"].to_numpy()))
    torch.manual_seed(0)
    model = ReferenceRanker(dim=16, heads=2, layers=1, encoder="window", window=64).eval()
    store = KVStore(page_size=PAGE, device_bytes=64 << 20, device="cpu", max_seq_len=L)
    worst, lengths, served_from, spans_ok = 0.0, [], [], True
    for when, span, cands in heavy_reqs:
        n = int(np.searchsorted(ts, when, side="left"))
        cur = held[:n]  # what serving holds at the request: every event before it
        v = cur[max(0, n - L):]
        spans_ok &= bool(torch.equal(span.item, v.item) and torch.equal(span.side, v.side)
                         and torch.equal(span.action, v.action))
        cached, ref, held_len = serve_and_recompute(store, model, heavy, cur, cands, max_seq_len=L, page_size=PAGE)
        served_from.append(held_len)
        worst = max(worst, float((cached - ref).abs().max() / ref.abs().max().clamp(min=1e-6)))
        lengths.append(n)
    store.check()
    s = store.stats()
    out.update(serve_s=time.time() - t, worst_rel=worst, lengths=lengths, served_from=served_from,
               spans_equal=spans_ok, reuse=s["reuse"], user_bytes=store.user_bytes(lengths[-1], "device"))
    return out


def max_sample_cost(staged: str) -> int:
    """The largest staged sample's cost (the loader's token budget that fits every sample)."""
    import glob

    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    return max(int(pc.max(pq.read_table(f, columns=["cost"]).column("cost")).as_py() or 0)
               for f in glob.glob(os.path.join(staged, "**", "*.parquet"), recursive=True))


def flow(tmp: str) -> dict:
    """The whole flow in this (fresh) process; returns what the test checks and reports."""
    import time

    import torch

    from tests.support.memory import peak_mb
    from userwise.pipelines.runtime.spark import get_spark

    torch.set_num_threads(1)
    t0 = time.time()
    out: dict = {"base_mb": peak_mb()}
    log, cfg_path, heavy = make_log(tmp)
    stream, reqs = user_stream(log, heavy)
    out.update(heavy=heavy, heavy_events=stream.height, heavy_requests=reqs.height, synth_s=time.time() - t0)
    t = time.time()
    spark = get_spark()  # what `userwise build` makes with nothing configured: local[2], its stated memory
    out["spark_start_s"] = time.time() - t
    out.update(spark_half(spark, tmp, log, cfg_path))
    sc = sample_checks(spark, tmp, heavy)
    out["table"] = sc["table"]
    out["heavy_rows"] = [{k: r[k] for k in ("kind", "window_end", "chunk", "num_events", "cost")} | {
        "requests": len(r["req_id"])} for r in sc["heavy_rows"]]
    out.update(check_heavy_samples(sc["heavy_rows"], stream, reqs))
    del sc
    out["spark"] = spark_measures(spark)
    spark.stop()
    out["spark_mb"] = peak_mb()
    out.update(serve_half(tmp, heavy, stream))
    out.update(peak_mb=peak_mb(), wall_s=time.time() - t0)
    return out


def test_a_user_with_100k_events_at_l_16000_builds_preshards_stages_loads_and_serves(tmp_path):
    code = ("import json, sys; from tests.builder.test_long_user_build import flow; "
            "print(json.dumps(flow(sys.argv[1])))")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k != "JAVA_TOOL_OPTIONS"}  # the JVM as a user gets it
    env["OMP_NUM_THREADS"] = "1"
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, cwd=root,
                       env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    print(json.dumps({k: v for k, v in out.items() if k not in ("lengths", "served_from")}, indent=1))

    assert out["heavy_events"] > 100_000 and out["heavy_requests"] >= 20, "the log is what this test is about"
    assert out["reconciled"] and out["quarantined"] == 0
    # the build's pointers: every heavy request sees exactly its newest min(L, history) events
    assert out["all_requests"] and out["requests_checked"] == out["heavy_requests"] and out["bad_requests"] == []
    assert max(out["lengths"]) > 100_000 - 2_500  # the last requests have ~100K events before them
    # one stored stream per (user, set): the base of at most L plus the set's new events, never requests x L
    assert out["stored_once"] and out["stored_bound"]
    rows = out["heavy_rows"]
    assert {r["kind"] for r in rows} == {"pretrain", "incremental"} and len(rows) >= M + 1
    assert max(r["num_events"] for r in rows) == out["table"]["max_events"] < L + 3_000
    assert sum(r["num_events"] for r in rows) < out["heavy_requests"] * L / 5
    # Spark: no task failed or spilled at the default local memory
    sp = out["spark"]
    assert sp["conf"]["spark.driver.memory"] == "4g" and sp["conf"]["spark.master"] == "local[2]"
    assert sp["failed_tasks"] == 0 and sp["failed_stages"] == 0
    assert sp["spilled_memory_bytes"] == 0 and sp["spilled_disk_bytes"] == 0
    # loaded, then served in time order: a prefill, then each request extends the state held for the one before
    assert out["delivered"] == out["table"]["rows"] and out["chains_equal"] and out["spans_equal"]
    assert out["lengths"] == sorted(out["lengths"]) and len(out["lengths"]) == out["heavy_requests"]
    assert out["served_from"] == [0] + out["lengths"][:-1]
    assert out["reuse"]["miss"] == 1 and out["reuse"]["full"] == out["heavy_requests"] - 1
    assert out["worst_rel"] < 1e-5  # cached equals recompute (float32)
    growth = out["peak_mb"] - out["base_mb"]
    assert growth < BOUND_GROWTH_MB, f"the flow took {growth:.0f} MB over its imports' {out['base_mb']:.0f} MB"
