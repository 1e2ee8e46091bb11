"""The data path from cluster storage, on a real HDFS (a MiniDFSCluster in its own JVM,
tests/support/remote_store.py) shared by the module: build on it, preshard to it, stage
from it (killed and resumed; the store going away), the loader over the staged copy and
straight from the store."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.fs as pafs
import pytest
import yaml

from tests.support import edgegen
from tests.support.remote_store import HdfsStore
from userwise.pipelines import cli
from userwise.pipelines.runtime import delta_io, storage
from userwise.pipelines.shards import manifest as mf
from userwise.pipelines.shards import stage

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
def log(tmp_path_factory):
    lg = edgegen.make_lean(tmp_path_factory.mktemp("edge"), actions=True)
    cfg = tmp_path_factory.mktemp("cfg") / "config.yaml"
    cfg.write_text(yaml.safe_dump(lg.config))
    return lg, str(cfg)


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
        rc = cli.main(["build", "--config", cfg, "--input", inp, "--actions", act, "--output", out,
                       "--as-of", lg.as_of, "--pretrain-days", str(M), "--window-days", str(N),
                       "--report", str(reports / f"{name}.json"), "--conf", "spark.hadoop.dfs.replication=1"])
        assert rc == 0
    return local, remote, {n: json.loads((reports / f"{n}.json").read_text()) for n in ("local", "remote")}


def _rows(spark, out, name, inputs):
    """(columns, every row as text, sorted): a table's content, whatever its file order, with the
    input files' locations (quarantined rows name their file) cut to the input's own folder."""
    cut = re.compile(r"[^\s'\"]*/(" + "|".join(re.escape(os.path.basename(p)) for p in inputs) + r")/")
    df = delta_io.read(spark, delta_io.table_path(out, name))
    pdf = df.select([f.name for f in df.schema if not f.dataType.typeName().startswith("timestamp")]  # when it ran
                    if name == "history_log" else df.columns).toPandas()
    return list(pdf.columns), sorted(cut.sub(r"<in>/\1/", str(tuple(str(v) for v in r)))
                                     for r in pdf.itertuples(index=False))


@pytest.mark.spark
def test_remote_build_writes_every_table_there_and_equals_the_local_build(spark, store, builds, log):
    local, remote, reps = builds
    fs = store.fsspec()
    for t in TABLES:
        assert fs.exists(f"/out/D/{t}/_delta_log"), t
    assert fs.exists("/out/D/_userwise/build.json") and fs.exists("/out/D/_userwise/complete.json")
    assert not [n for n in fs.ls("/out/D/_userwise/locks", detail=False) if n.endswith(".lock")]  # released
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
    assert cli.main(["expand", "--samples", local, "--output", str(tmp_path / "P")]) == 0
    assert cli.main(["expand", "--samples", remote, "--output", f"{store.url}/expanded/P"]) == 0
    fs = store.arrow()
    names = sorted(i.base_name for i in fs.get_file_info(pafs.FileSelector("/expanded/P")))
    assert names and all(n.startswith("part-") and n.endswith(".parquet") for n in names)  # no _spark scratch left
    want = pq.read_table(str(tmp_path / "P"))
    got = pq.read_table("/expanded/P", filesystem=fs)
    assert got.schema == want.schema and got.num_rows == want.num_rows > 0
    def rows(t):  # every row as text, sorted: ties on the scalar columns and NaN compare as well
        return sorted(str(r) for r in t.to_pylist())

    assert rows(got) == rows(want)


def test_lock_on_hdfs_is_exclusive(store):
    from userwise.pipelines.build import writer_lock

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
        assert cli.main(["preshard", "--samples", src, "--output", dst, "--nodes", "2", "--ranks-per-node", "1",
                         "--row-group-rows", "4", "--compression", "none"]) == 0
    return lset, rset


def _batches(root, node=None):
    from userwise.pipelines.loader import UserwiseDataset, UserwiseLoader, expand_batch

    ds = UserwiseDataset(root, node=node, rank=0, world_size=1, batch_size=3, seed=5)
    return pa.concat_tables([expand_batch(b) for b in UserwiseLoader(ds, num_workers=0)])


@pytest.mark.spark
@pytest.mark.xfail(reason="#30 open: the HDFS preshard -> killed stage -> loader comparison fails in CI; "
                          "the loader read straight from HDFS was only checked by hand", strict=False)
def test_preshard_to_hdfs_stage_killed_and_resumed_loader_equals_local(store, shard_sets, tmp_path):
    lset, rset = shard_sets
    m = mf.load(rset)  # the manifest is on the store
    assert store.fsspec().exists("/shards/S/manifest.json")
    files = [f for s in mf.node_shards(m, 0) for f in mf.shard_files(s)]
    total = sum(s for _, s, _ in files)
    dest = tmp_path / "nvme"
    # slow enough to be killed part-way: about 3 s for the node
    p = subprocess.Popen([PY, "-m", "userwise.pipelines.cli", "stage", "--shards", rset, "--node", "0", "--dest",
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
    assert want.num_rows > 0
    assert _batches(str(dest)).equals(want)
    # the slow path: the loader straight from the store gives the same batches
    assert _batches(rset, node=0).equals(want)


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
                          "--dest", str(dest), "--workers", "2", "--range-mb", "0.0625",
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
    from userwise.pipelines.build import completion

    completion.finish(out, "build")  # what a finished build leaves last: publish records its versions
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


def test_conf_reaches_the_session_builder(tmp_path, capsys):
    """`--conf key=value` (repeatable) is what get_spark applies last; a malformed one is a usage error."""
    from userwise.pipelines.runtime import spark as spark_runtime

    rc = cli.main(["expand", "--samples", str(tmp_path / "none"), "--output", str(tmp_path / "x"),
                   "--conf", "spark.hadoop.fs.s3a.endpoint=http://127.0.0.1:9000", "--conf", "spark.a=b=c"])
    assert rc == 2 and capsys.readouterr().err.startswith("error: ")
    assert spark_runtime.CLI_CONF == {"spark.hadoop.fs.s3a.endpoint": "http://127.0.0.1:9000", "spark.a": "b=c"}
    with pytest.raises(SystemExit) as e:
        cli.main(["expand", "--samples", "s", "--output", "o", "--conf", "novalue"])
    assert e.value.code == 2
    spark_runtime.CLI_CONF.clear()
