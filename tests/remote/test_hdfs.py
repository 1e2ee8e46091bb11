"""The data path from cluster storage, on a real HDFS (a MiniDFSCluster in its own JVM,
pipelines/tools/hdfs_store.py) shared by the module: build on it, preshard to it, stage
from it (killed and resumed; the store going away), the loader over the staged copy and
straight from the store."""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import socket
import subprocess
import sys
import time

import pyarrow.fs as pafs
import pytest

from tests.support.uwchain import shard_rows, table_rows
from userwise.pipelines import cli
from userwise.pipelines.records import state
from userwise.pipelines.runtime import delta_io, storage
from userwise.pipelines.shards import manifest as mf
from userwise.pipelines.shards import publish, stage
from userwise.pipelines.tools.hdfs_store import HdfsStore

PY = sys.executable
M, N = 2, 1
TABLES = ("requests", "events", "samples", "history", "history_log", "quarantine")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    s = HdfsStore(tmp_path_factory.mktemp("hdfs")).start()
    old = os.environ.get(storage.WEBHDFS_ENV)
    os.environ.update(s.env())
    yield s
    s.stop()
    if old is None:
        os.environ.pop(storage.WEBHDFS_ENV, None)
    else:
        os.environ[storage.WEBHDFS_ENV] = old


@pytest.fixture(scope="module")
def builds(spark, store, log, tmp_path_factory):
    """The same log built locally and on HDFS (its input copied there), through the CLI."""
    lg, cfg = log
    fs = store.fsspec()
    imp, act = (f"/in/{os.path.basename(p)}" for p in (lg.impressions, lg.actions))
    fs.put(lg.impressions, imp, recursive=True)
    fs.put(lg.actions, act, recursive=True)
    local = str(tmp_path_factory.mktemp("local") / "D")
    remote = f"{store.url}/out/D"
    reports = tmp_path_factory.mktemp("reports")
    for inp, act, out, name in ((lg.impressions, lg.actions, local, "local"),
                                (f"{store.url}{imp}", f"{store.url}{act}", remote, "remote")):
        rc = cli.main(["build", "--config", cfg, "--input", inp, "--actions", act, "--build-dir", out,
                       "--as-of", lg.as_of, "--incremental-days", str(M), "--window-days", str(N),
                       "--report", str(reports / f"{name}.json"), "--conf", "spark.hadoop.dfs.replication=1"])
        assert rc == 0
    return local, remote, {n: json.loads((reports / f"{n}.json").read_text()) for n in ("local", "remote")}


_rows = table_rows


@pytest.mark.spark
def test_remote_build_writes_every_table_there_and_equals_the_local_build(spark, store, builds, log):
    local, remote, reps = builds
    fs = store.fsspec()
    for t in TABLES:
        assert fs.exists(f"/out/D/{t}/_delta_log"), t
    assert fs.exists("/out/D/_userwise/build.json") and fs.exists("/out/D/_userwise/complete.json")
    assert not fs.exists("/out/D/_userwise/locks")  # released, and the folder the build made for it removed
    for t in TABLES:
        inputs = (log[0].impressions, log[0].actions)
        a, b = _rows(spark, local, t, inputs), _rows(spark, remote, t, inputs)
        assert a[0] == b[0] and (len(a[1]) > 0 or t == "quarantine"), t
        assert a == b, t
    # the report's byte counts read the store (not 0 for a remote folder)
    assert reps["remote"]["bytes_out"] > 0 and reps["remote"]["bytes_in"] > 0
    assert reps["remote"]["samples"] == reps["local"]["samples"]
    assert delta_io.table_bytes(delta_io.table_path(remote, "samples")) > 0  # delta-rs reads hdfs:// too


@pytest.mark.spark
def test_expand_of_the_remote_build_to_hdfs_equals_the_local_one(spark, store, builds, tmp_path):
    import pyarrow.parquet as pq

    local, remote, _ = builds
    assert cli.main(["expand", "--build-dir", local, "--expanded", str(tmp_path / "P")]) == 0
    assert cli.main(["expand", "--build-dir", remote, "--expanded", f"{store.url}/expanded/P"]) == 0
    fs = store.arrow()
    names = sorted(i.base_name for i in fs.get_file_info(pafs.FileSelector("/expanded/P")))
    assert names and all(n.startswith("part-") and n.endswith(".parquet") for n in names)  # no _spark scratch left
    want = pq.read_table(str(tmp_path / "P"))
    got = pq.read_table("/expanded/P", filesystem=fs)
    assert got.schema == want.schema and got.num_rows == want.num_rows > 0
    def rows(t):  # every row as text, sorted: ties on the scalar columns and NaN compare as well
        return sorted(str(r) for r in t.to_pylist())

    assert rows(got) == rows(want)


@pytest.mark.spark
def test_backfill_and_the_daily_jobs_on_hdfs_equal_the_range_build(spark, store, builds, log):
    """Input and tables on HDFS: a backfill up to two days before as-of, then the daily jobs
    (requests, history, window) of the day before as-of and the pretrain job give the tables of
    the local range build over the same days (M=2, N=1)."""
    from pyspark.sql import functions as F

    local, _, _ = builds
    lg, cfg = log
    inp, act = (f"{store.url}/in/{os.path.basename(p)}" for p in (lg.impressions, lg.actions))
    out = f"{store.url}/daily/D"
    as_of = dt.date.fromisoformat(lg.as_of)
    last = as_of - dt.timedelta(days=1)
    first = min(delta_io.read(spark, delta_io.table_path(local, t)).agg(F.min("date")).first()[0]
                for t in ("requests", "events"))
    conf = ["--conf", "spark.hadoop.dfs.replication=1"]
    assert cli.main(["backfill", "--from", str(first), "--to", str(last - dt.timedelta(days=1)), "--config", cfg,
                     "--input", inp, "--actions", act, "--build-dir", out, "--incremental-days", str(M),
                     "--window-days", str(N), *conf]) == 0
    day = ["--config", cfg, "--build-dir", out, "--date", str(last), *conf]
    assert cli.main(["requests", *day, "--input", inp, "--actions", act]) == 0
    assert cli.main(["history", *day]) == 0
    assert cli.main(["window", *day, "--window-days", str(N)]) == 0
    assert cli.main(["pretrain", "--config", cfg, "--build-dir", out, "--as-of", str(as_of), "--incremental-days", str(M),
                     *conf]) == 0
    assert state.complete_state(out)["job"] == "pretrain"
    assert publish.is_published(out, "incremental", last - dt.timedelta(days=1))  # the backfill's own days
    keys = delta_io.read(spark, delta_io.table_path(local, "samples")).select("kind", "window_end").distinct()
    sets = " OR ".join(f"(kind = '{r.kind}' AND window_end = '{r.window_end}')" for r in keys.collect())
    inputs = (lg.impressions, lg.actions)
    assert storage.exists(delta_io.table_path(out, "quarantine"))
    for t, where in (("requests", None), ("events", None), ("history", None), ("samples", sets)):
        a, b = _rows(spark, local, t, inputs, where), _rows(spark, out, t, inputs, where)
        assert a[0] == b[0] and len(a[1]) > 0, t
        assert a == b, t


def test_lock_on_hdfs_is_exclusive(store):
    from userwise.pipelines.records import writer_lock

    out = f"{store.url}/locktest"
    with writer_lock.WriterLock(out, "build"):
        with pytest.raises(writer_lock.LockedError, match="is being written by"):
            writer_lock.WriterLock(out, "backfill").acquire()
    with writer_lock.WriterLock(out, "backfill"):  # released: free again
        pass
    # a killed holder's lock (its pid gone on this host) is taken over
    dead = subprocess.run([PY, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    lock = f"{writer_lock.lock_dir(out)}/{writer_lock.EXCLUSIVE}"
    storage.write_bytes(lock, json.dumps({"job": "build", "pid": int(dead.stdout), "host": socket.gethostname(),
                                          "started_ts": time.time()}).encode())
    with writer_lock.WriterLock(out, "window") as w:
        assert json.loads(storage.read_bytes(lock))["job"] == "window" and w.held
    assert not storage.exists(lock)


@pytest.fixture(scope="module")
def shard_sets(spark, store, builds, tmp_path_factory):
    local, remote, _ = builds
    lset = str(tmp_path_factory.mktemp("lshards") / "S")
    rset = f"{store.url}/shards/S"
    for src, dst in ((local, lset), (remote, rset)):
        assert cli.main(["preshard", "--build-dir", src, "--shards", dst, "--nodes", "2", "--ranks-per-node", "1",
                         "--row-group-rows", "4", "--compression", "none"]) == 0
    return lset, rset


def _batches(root, node=None, **kw):
    """The loader's batches over a shard set: the schema, and each batch as its rows in order, as
    text (the score column holds NaN, which pyarrow's equality never equals)."""
    from userwise.pipelines.loader import UserwiseDataset, UserwiseLoader, expand_batch

    ds = UserwiseDataset(root, node=node, rank=0, world_size=1, seed=5, **{"batch_size": 3, **kw})
    out = [expand_batch(b) for b in UserwiseLoader(ds, num_workers=0)]
    return out[0].schema, [[str(r) for r in t.to_pylist()] for t in out]


@pytest.mark.spark
def test_preshard_to_hdfs_stage_killed_and_resumed_loader_equals_local(store, shard_sets, tmp_path):
    lset, rset = shard_sets
    m = mf.load(rset)  # the manifest is on the store
    assert store.fsspec().exists("/shards/S/manifest.json")
    files = [f for s in mf.node_shards(m, 0) for f in mf.shard_files(s)]
    total = sum(s for _, s, _ in files)
    dest = tmp_path / "nvme"
    # slow enough to be killed part-way: about 3 s for the node
    p = subprocess.Popen([PY, "-m", "userwise.pipelines.cli", "stage", "--shards", rset, "--node", "0", "--staged",
                          str(dest), "--workers", "1", "--limit-mbps", str(round(total / 3e6, 4))],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline:
        if any((dest / r).exists() for r, _, _ in files):
            break
        time.sleep(0.01)
    p.kill()
    p.wait()
    assert not (dest / "manifest.json").exists()
    rep = stage.stage(rset, 0, str(dest), workers=4, out=open(os.devnull, "w"))
    assert rep["skipped"] + rep["resumed"] >= 1 and rep["bytes"] < total
    assert mf.verify(str(dest), node=0)["files"] == len(files)
    want = _batches(lset, node=0)
    assert len(want[1]) > 1 and all(want[1])
    assert _batches(str(dest)) == want  # batch for batch
    # the slow path: the loader straight from the store gives the same batches
    assert _batches(rset, node=0) == want
    budget = dict(batch_size=None, token_budget=60)  # reads the cost column of every shard first
    assert _batches(rset, node=0, **budget) == _batches(lset, node=0, **budget)


@pytest.fixture(scope="module")
def big_set(store, tmp_path_factory):
    """A synthetic shard set of a few MB on the store (no Spark): preshard's Arrow writer."""
    from userwise import schemas
    from userwise.pipelines.shards import preshard
    from userwise.pipelines.tools.shardgen import build_samples, layout

    root = f"{store.url}/big/S"
    preshard.preshard_arrow(build_samples(seed=1, users=400), root, schema=schemas.shard_schema(layout()).to_arrow(),
                            nodes=1, ranks_per_node=2, seed=4, compression="none", target_shard_mb=1.0)
    return root


def test_ranged_parallel_stage_verifies(big_set, tmp_path):
    m = mf.load(big_set)
    files = [f for s in mf.node_shards(m, 0) for f in mf.shard_files(s)]
    assert max(s for _, s, _ in files) > 128 << 10  # several ranges of 64 KiB
    rep = stage.stage(big_set, 0, str(tmp_path / "d"), workers=4, range_mb=0.0625, out=open(os.devnull, "w"))
    assert rep["copied"] == len(files) and rep["mb_per_s"] > 0
    assert mf.verify(str(tmp_path / "d"), node=0)["files"] == len(files)
    assert not list((tmp_path / "d").rglob("*.part*"))


def test_store_gone_mid_stage_one_error_then_rerun_resumes(store, big_set, tmp_path):
    m = mf.load(big_set)
    files = [f for s in mf.node_shards(m, 0) for f in mf.shard_files(s)]
    total = sum(s for _, s, _ in files)
    dest = tmp_path / "d"
    p = subprocess.Popen([PY, "-m", "userwise.pipelines.cli", "stage", "--shards", big_set, "--node", "0",
                          "--staged", str(dest), "--workers", "2", "--range-mb", "0.0625",
                          "--limit-mbps", str(round(total / 8e6, 4))],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while time.time() < deadline and not (list(dest.rglob("*.ranges")) or list(dest.rglob("*.parquet"))):
        time.sleep(0.01)  # until some range or file is finished
    store.stop()
    try:
        out, err = p.communicate(timeout=120)
    finally:
        store.start()
    assert p.returncode == 2, err[-2000:]
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "the store stopped answering" in lines[0] and "run the same command again" in lines[0]
    assert "Traceback" not in err
    assert not (dest / "manifest.json").exists()
    rep = stage.stage(big_set, 0, str(dest), workers=2, range_mb=0.0625, out=open(os.devnull, "w"))
    assert rep["bytes"] < total and rep["skipped"] + rep["resumed"] >= 1
    assert mf.verify(str(dest), node=0)["files"] == len(files)


def test_publish_moves_a_set_into_place_on_hdfs(store):
    """publish on HDFS: the staged set moves in with one folder rename, the marker and the day's
    record are written last; a republish swaps the set again."""
    from userwise import schemas
    from userwise.pipelines.shards import preshard, publish
    from userwise.pipelines.tools.shardgen import build_samples, layout

    out, shards = f"{store.url}/pub/D", f"{store.url}/pub/S"
    storage.write_bytes(f"{out}/samples/_delta_log/{0:020d}.json", b"{}")  # a samples table at version 0
    from userwise.pipelines.records import state

    state.finish(out, "build")  # what a finished build leaves last: publish records its versions
    key = publish.set_key("incremental", date="2026-01-04")
    for seed in (1, 2):
        preshard.preshard_arrow(build_samples(seed=seed), publish.staging_root(shards, key),
                                schema=schemas.shard_schema(layout()).to_arrow(), nodes=1, ranks_per_node=1,
                                seed=4, compression="none")
        rec = publish.publish(out, date="2026-01-04", shards=shards)
        assert rec["shards"]["root"] == f"{shards}/{key}" and rec["tables"] == {"samples": 0}
        assert publish.is_published(out, "incremental", "2026-01-04", shards)
        assert not storage.exists(publish.staging_root(shards, key))
        assert mf.load(f"{shards}/{key}")["seed"] == 4
    assert [n for n in storage.listdir(f"{shards}/incremental") if ".old-" in n] == []
    publish.unpublish(out, "incremental", "2026-01-04", shards)
    assert not publish.is_published(out, "incremental", "2026-01-04", shards)


@pytest.mark.spark
def test_demo_remote_mode_keeps_every_output_on_hdfs_and_stages_node_0(spark, store, tmp_path, capsys):
    """`demo --remote hdfs://...` on the module's store (smallest sizes, no fat build): tables,
    reports, expanded rows and shards land on HDFS, nothing of them locally; stage's copy of node
    0 verifies and the loader's epoch over it yields batches. A base that exists or a URL without
    one is refused with one error line, before anything is written."""
    from userwise.pipelines.tools import demo

    base, out = f"{store.url}/uwdemo", tmp_path / "demo"
    assert demo.main(["--output", str(out), "--remote", store.url]) == 2  # no base folder
    assert demo.main(["--output", str(out), "--users", "12", "--days", "3", "--max-seq-len", "8", "--skip-fat",
                      "--remote", base]) == 0
    printed = capsys.readouterr()
    fs = store.fsspec()
    for t in TABLES:
        assert fs.exists(f"/uwdemo/build/{t}/_delta_log"), t
    assert fs.exists("/uwdemo/build/_userwise/build.json") and fs.exists("/uwdemo/shards/manifest.json")
    assert json.loads(fs.cat("/uwdemo/report_lean.json"))["samples"] > 0
    assert any(n.endswith(".parquet") for n in fs.ls("/uwdemo/expanded", detail=False))
    assert sorted(os.listdir(out)) == ["nvme", "synth"]  # the logs made here and the staged copy only
    m = mf.load(f"{base}/shards")
    files = [f for s in mf.node_shards(m, 0) for f in mf.shard_files(s)]
    assert mf.verify(str(out / "nvme" / "node0"), node=0)["files"] == len(files) > 0
    batches = re.search(r"^(\d+) batches;", printed.out, re.MULTILINE)
    assert batches and int(batches.group(1)) > 0, printed.out[-2000:]
    assert demo.main(["--output", str(out), "--remote", base]) == 2  # it exists now
    err = capsys.readouterr().err.splitlines()
    assert len([ln for ln in err if ln.startswith("error:")]) == 1 and "does not exist yet" in err[-1]
    assert (out / "nvme" / "node0" / "manifest.json").exists()  # the refused run changed nothing


def test_conf_reaches_the_session_builder(tmp_path, capsys):
    """`--conf key=value` (repeatable) is what get_spark applies last; a malformed one is a usage error."""
    from userwise.pipelines.runtime import spark as spark_runtime

    rc = cli.main(["expand", "--build-dir", str(tmp_path / "none"), "--expanded", str(tmp_path / "x"),
                   "--conf", "spark.hadoop.fs.s3a.endpoint=http://127.0.0.1:9000", "--conf", "spark.a=b=c"])
    assert rc == 2 and capsys.readouterr().err.startswith("error: ")
    assert spark_runtime.CLI_CONF == {"spark.hadoop.fs.s3a.endpoint": "http://127.0.0.1:9000", "spark.a": "b=c"}
    with pytest.raises(SystemExit) as e:
        cli.main(["expand", "--build-dir", "s", "--expanded", "o", "--conf", "novalue"])
    assert e.value.code == 2
    spark_runtime.CLI_CONF.clear()


_shard_rows = shard_rows


@pytest.mark.spark
def test_forget_on_hdfs_removes_the_users_from_every_table_and_shard_set(spark, store, builds, shard_sets, log):
    """`userwise forget` on the HDFS build folder, with the users file and the shard sets on HDFS
    too: the users' rows leave every table (the other rows are the local build's) and the shard
    set, which is rewritten in place and verifies. Runs last: it changes the module's remote build."""
    from pyspark.sql import functions as F

    local, remote, _ = builds
    lset, rset = shard_sets
    lg, _ = log
    users = [401, 402]  # users with samples and with quarantined rows of their own
    storage.write_bytes(f"{store.url}/forget/users.txt", b"# to forget\n401\n\n402\n")
    before = _shard_rows(rset)
    assert before == _shard_rows(lset)  # preshard of either build: the same rows
    assert cli.main(["forget", "--build-dir", remote, "--users", f"{store.url}/forget/users.txt",
                     "--shards", f"{store.url}/shards"]) == 0
    assert state.complete_state(remote)["job"] == "forget"
    inputs = (lg.impressions, lg.actions)
    keep = "user NOT IN (401, 402)"
    for t in ("requests", "events", "history", "samples"):
        gone = delta_io.read(spark, delta_io.table_path(remote, t)).where(~F.expr(keep)).count()
        a = _rows(spark, local, t, inputs, keep)
        assert gone == 0 and len(a[1]) < len(_rows(spark, local, t, inputs)[1]), t  # they had rows
        assert _rows(spark, remote, t, inputs) == a, t
    theirs = "(source = 'actions' AND get_json_object(row, '$.uid') IN ('401', '402')) OR " \
             "(source <> 'actions' AND get_json_object(row, '$.user_id') IN ('401', '402'))"
    q = _rows(spark, local, "quarantine", inputs, f"NOT coalesce({theirs}, false)")  # rows without a user stay
    assert len(q[1]) < len(_rows(spark, local, "quarantine", inputs)[1])
    assert _rows(spark, remote, "quarantine", inputs) == q
    # the shard set on HDFS: rewritten without them, verified, no swap folders left
    mf.verify(rset)
    after = _shard_rows(rset)
    assert len(after) < len(before) and after == _shard_rows(lset, drop=users)
    assert sorted(storage.listdir(f"{store.url}/shards")) == ["S"]
