"""The data path on S3: the HDFS module's remote path (tests/remote/test_hdfs.py) run against an
S3 API (moto's server on loopback, pipelines/tools/s3_store.py), every table and shard set on
``s3a://``. Each Spark command runs in a process of its own, as a user runs it: the ``AWS_*``
variables in its environment and the S3 connector's settings (the jar set, the endpoint, Delta's
S3 log store) as ``--conf``; the local references run in the suite's session.

Build, expand, backfill (the daily chain: requests, history, window, preshard and publish per
day), stage, the loader and forget; publish copies objects in (no folder
rename: the store has none), its marker and the day's record last.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import subprocess
import sys

import pyarrow.fs as pafs
import pytest

from tests.support.uwchain import FAST_CONF, SUBMIT_JVM, shard_rows
from userwise.pipelines import cli
from userwise.pipelines.records import published, writer_lock
from userwise.pipelines.runtime import delta_io, storage
from userwise.pipelines.shards import manifest as mf
from userwise.pipelines.shards import publish

pytestmark = pytest.mark.slow

PY = sys.executable
M, N = 2, 1
BUCKET = "userwise-e2e"
TABLES = ("requests", "events", "samples", "history", "history_log", "quarantine")


@pytest.fixture(scope="module")
def store(s3_store):
    return s3_store


def run(store, *args, spark: bool = True) -> subprocess.CompletedProcess:
    """``userwise ARGS`` in a process of its own against the store (Spark commands get the
    store's settings as ``--conf``)."""
    conf = {**store.spark_conf(), **FAST_CONF, **SUBMIT_JVM, "spark.driver.memory": "1g"} if spark else {}
    flags = [x for k, v in conf.items() for x in ("--conf", f"{k}={v}")]
    r = subprocess.run([PY, "-m", "userwise.pipelines.cli", *args, *flags], capture_output=True, text=True,
                       env={**os.environ, **store.env()}, timeout=900)
    assert r.returncode == 0, f"userwise {args[0]} exited {r.returncode}:\n{r.stderr[-4000:]}"
    return r


def _upload(store, local: str, url: str) -> str:
    fs, root = storage.filesystem(url)
    pafs.copy_files(local, root, destination_filesystem=fs)
    return url


@pytest.fixture(scope="module")
def builds(spark, store, log, tmp_path_factory):
    """The same log built locally (in the suite's session) and on S3 (its input copied there)."""
    lg, cfg = log
    inp = _upload(store, lg.impressions, store.url(BUCKET, f"in/{os.path.basename(lg.impressions)}"))
    act = _upload(store, lg.actions, store.url(BUCKET, f"in/{os.path.basename(lg.actions)}"))
    local = str(tmp_path_factory.mktemp("local") / "D")
    remote = store.url(BUCKET, "out/D")
    reports = tmp_path_factory.mktemp("reports")
    common = ["--as-of", lg.as_of, "--incremental-days", str(M), "--window-days", str(N)]
    assert cli.main(["build", "--config", cfg, "--input", lg.impressions, "--actions", lg.actions,
                     "--build-dir", local, *common, "--report", str(reports / "local.json")]) == 0
    run(store, "build", "--config", cfg, "--input", inp, "--actions", act, "--build-dir", remote, *common,
        "--report", str(reports / "remote.json"))
    return local, remote, inp, act, {n: json.loads((reports / f"{n}.json").read_text()) for n in ("local", "remote")}


def _rows(out: str, name: str, inputs, where=None) -> tuple[list[str], list[str]]:
    """(columns, every row as text, sorted) of a table read with delta-rs (local or S3), the input
    files' locations cut to the input's own folder; ``where``: a row filter (a function of a dict)."""
    cut = re.compile(r"[^\s'\"]*/(" + "|".join(re.escape(os.path.basename(str(p))) for p in inputs) + r")/")
    t = delta_io.dataset(delta_io.table_path(out, name)).to_table()
    if name == "history_log":  # when it ran
        t = t.select([f.name for f in t.schema if not str(f.type).startswith("timestamp")])
    rows = [r for r in t.to_pylist() if where is None or where(r)]
    return t.column_names, sorted(cut.sub(r"<in>/\1/", str(tuple(str(v) for v in r.values()))) for r in rows)


@pytest.mark.spark
def test_a_build_on_s3_writes_every_table_there_and_equals_the_local_build(store, builds, log):
    local, remote, _, _, reps = builds
    for t in TABLES:
        assert storage.exists(f"{remote}/{t}/_delta_log/{0:020d}.json"), t
    assert storage.exists(f"{remote}/_userwise/build.json") and storage.exists(f"{remote}/_userwise/complete.json")
    assert not [n for n in storage.listdir(writer_lock.lock_dir(remote)) if n.endswith(".lock")]  # released
    inputs = (log[0].impressions, log[0].actions)
    for t in TABLES:
        a, b = _rows(local, t, inputs), _rows(remote, t, inputs)
        assert a[0] == b[0] and (len(a[1]) > 0 or t == "quarantine"), t
        assert a == b, t
    assert reps["remote"]["bytes_in"] > 0 and reps["remote"]["bytes_out"] > 0
    assert reps["remote"]["samples"] == reps["local"]["samples"] and reps["remote"]["reconciled"]


@pytest.mark.spark
def test_pyarrow_and_delta_rs_read_the_tables_spark_wrote_on_s3(store, builds):
    """The Python side of a table on S3: delta-rs' log (versions, files), byte counts through
    pyarrow's S3, listing, and the rows (delta_io reads S3 through pyarrow's S3)."""
    from deltalake import DeltaTable

    local, remote, *_ = builds
    url = delta_io.table_path(remote, "samples")
    assert delta_io.version(None, url) == delta_io.version(None, delta_io.table_path(local, "samples")) >= 0
    uris = DeltaTable(url).file_uris()
    assert uris and all(u.startswith(f"{url}/") for u in uris)
    assert delta_io.table_bytes(url) == sum(storage.info(u).size for u in uris) > 0
    assert isinstance(delta_io.arrow_filesystem(url), pafs.SubTreeFileSystem)
    assert "_delta_log" in storage.listdir(url) and storage.du(url) >= delta_io.table_bytes(url)
    commit = storage.read_bytes(f"{url}/_delta_log/{0:020d}.json").decode().splitlines()
    assert any('"commitInfo"' in ln for ln in commit)
    assert delta_io.dataset(url).to_table().num_rows == delta_io.dataset(
        delta_io.table_path(local, "samples")).to_table().num_rows > 0


@pytest.mark.spark
def test_expand_of_the_s3_build_to_s3_equals_the_local_one(store, builds, tmp_path):
    import pyarrow.parquet as pq

    local, remote, *_ = builds
    assert cli.main(["expand", "--build-dir", local, "--expanded", str(tmp_path / "P")]) == 0
    run(store, "expand", "--build-dir", remote, "--expanded", store.url(BUCKET, "expanded/P"))
    fs, root = storage.filesystem(store.url(BUCKET, "expanded/P"))
    names = sorted(i.base_name for i in fs.get_file_info(pafs.FileSelector(root)))
    assert names and all(n.startswith("part-") and n.endswith(".parquet") for n in names)
    want, got = pq.read_table(str(tmp_path / "P")), pq.read_table(root, filesystem=fs)
    assert got.schema == want.schema and got.num_rows == want.num_rows > 0
    assert sorted(str(r) for r in got.to_pylist()) == sorted(str(r) for r in want.to_pylist())


@pytest.fixture(scope="module")
def daily(store, builds, log):
    """A backfill on S3 over every day before as-of, each day pre-sharded and published onto S3:
    the daily chain (requests, history, window, preshard, publish) as the DAG runs it, on the store."""
    local, _, inp, act, _ = builds
    lg, cfg = log
    out, shards = store.url(BUCKET, "daily/D"), store.url(BUCKET, "daily/S")
    as_of = dt.date.fromisoformat(lg.as_of)
    last = as_of - dt.timedelta(days=1)
    first = min(min(delta_io.dataset(delta_io.table_path(local, t)).to_table(columns=["date"])
                    .column("date").to_pylist()) for t in ("requests", "events"))
    run(store, "backfill", "--from", str(first), "--to", str(last), "--config", cfg, "--input", inp,
        "--actions", act, "--build-dir", out, "--shards", shards, "--incremental-days", str(M),
        "--window-days", str(N), "--nodes", "2", "--ranks-per-node", "1")
    return out, shards, [first + dt.timedelta(days=i) for i in range((last - first).days + 1)]


@pytest.mark.spark
def test_backfill_on_s3_equals_the_range_build_and_publishes_every_day(store, builds, log, daily):
    local, *_ = builds
    out, shards, days = daily
    for d in days:
        assert publish.is_published(out, "incremental", d, shards), d
        root = publish.set_root(shards, publish.set_key("incremental", date=d))
        assert storage.exists(storage.join(root, publish.MARKER))
    assert not storage.exists(storage.join(shards, "_staging", "incremental", days[0].isoformat()))
    assert [n for n in storage.listdir(storage.join(shards, "incremental")) if ".old-" in n] == []
    sets = {(r["kind"], str(r["window_end"])) for r in  # the range build's daily windows
            delta_io.dataset(delta_io.table_path(local, "samples")).to_table(columns=["kind", "window_end"]).to_pylist()
            if r["kind"] == "incremental"}
    inputs = (log[0].impressions, log[0].actions)
    for t, where in (("requests", None), ("events", None), ("history", None),
                     ("samples", lambda r: (r["kind"], str(r["window_end"])) in sets)):
        a, b = _rows(local, t, inputs, where), _rows(out, t, inputs, where)
        assert a[0] == b[0] and len(a[1]) > 0, t
        assert a == b, t


def _batches(root, node=None, **kw):
    from userwise.pipelines.loader import UserwiseDataset, UserwiseLoader, expand_batch

    ds = UserwiseDataset(root, node=node, rank=0, world_size=1, seed=5, **{"batch_size": 3, **kw})
    return [[str(r) for r in expand_batch(b).to_pylist()] for b in UserwiseLoader(ds, num_workers=0)]


@pytest.mark.spark
def test_a_published_set_on_s3_stages_and_loads_as_the_local_preshard_of_the_same_window(
        store, builds, daily, tmp_path):
    local, *_ = builds
    out, shards, days = daily
    day = max(d for d in days if publish.is_published(out, "incremental", d, shards))
    root = publish.set_root(shards, publish.set_key("incremental", date=day))
    lset = str(tmp_path / "S")
    assert cli.main(["preshard", "--build-dir", local, "--shards", lset, "--nodes", "2", "--ranks-per-node", "1",
                     "--kind", "incremental", "--window", publish.window_of(day)[1].isoformat()]) == 0
    assert shard_rows(root) == shard_rows(lset) and shard_rows(lset)
    run(store, "stage", "--shards", root, "--node", "0", "--staged", str(tmp_path / "nvme"), "--workers", "2",
        spark=False)
    assert mf.verify(str(tmp_path / "nvme"), node=0)["files"] > 0
    want = _batches(lset, node=0)
    assert want and _batches(str(tmp_path / "nvme")) == want
    assert _batches(root, node=0) == want  # straight from the store: the slow path


def test_publish_on_s3_copies_the_set_in_without_a_folder_rename(store, monkeypatch):
    """publish and republish on S3: no rename of a folder (S3 has none); the staged set is
    gone, the old set's files that the new one lacks are deleted, marker and record last."""
    from userwise import schemas
    from userwise.pipelines.records import state
    from userwise.pipelines.shards import preshard
    from userwise.pipelines.tools.shardgen import build_samples, layout

    real = storage.rename
    monkeypatch.setattr(storage, "rename", lambda a, b: pytest.fail(f"a rename on S3: {a} -> {b}")
                        if not storage.renames_folders(a) else real(a, b))
    out, shards = store.url(BUCKET, "pub/D"), store.url(BUCKET, "pub/S")
    storage.write_bytes(f"{out}/samples/_delta_log/{0:020d}.json", b"{}")
    state.finish(out, "build")
    key = publish.set_key("incremental", date="2026-01-04")
    final = publish.set_root(shards, key)
    for seed, users in ((1, 60), (2, 20)):  # the second set has fewer files
        preshard.preshard_arrow(build_samples(seed=seed, users=users), publish.staging_root(shards, key),
                                schema=schemas.shard_schema(layout()).to_arrow(), nodes=2, ranks_per_node=2,
                                seed=4, compression="none")
        want = shard_rows(publish.staging_root(shards, key))
        rec = publish.publish(out, date="2026-01-04", shards=shards)
        assert rec["shards"]["root"] == final and publish.is_published(out, "incremental", "2026-01-04", shards)
        assert not storage.exists(publish.staging_root(shards, key))
        assert shard_rows(final) == want
        listed = {p for s in mf.load(final)["shards"] for p, _, _ in mf.shard_files(s)}
        fs, base = storage.filesystem(final)
        files = {i.path[len(base) + 1:] for i in fs.get_file_info(pafs.FileSelector(base, recursive=True))
                 if i.type == pafs.FileType.File}
        assert files == listed | {mf.MANIFEST, publish.MARKER}
        assert json.loads(storage.read_bytes(storage.join(final, publish.MARKER))) == published.read(
            out, "incremental", "2026-01-04")


def test_the_writer_lock_on_s3_is_a_conditional_write(store):
    out = store.url(BUCKET, "locktest")
    with writer_lock.WriterLock(out, "build"):
        with pytest.raises(writer_lock.LockedError, match="is being written by"):
            writer_lock.WriterLock(out, "backfill").acquire()
    with writer_lock.WriterLock(out, "backfill"):
        pass


@pytest.mark.spark
def test_forget_on_s3_removes_the_users_from_every_table_and_published_set(store, builds, daily, log, tmp_path):
    out, shards, days = daily
    samples = delta_io.dataset(delta_io.table_path(out, "samples")).to_table(columns=["user"])
    users = sorted(set(samples.column("user").to_pylist()))[:2]
    sets = [publish.set_root(shards, publish.set_key("incremental", date=d)) for d in days
            if publish.is_published(out, "incremental", d, shards)]
    before = {r: shard_rows(r, drop=users) for r in sets}
    assert any(shard_rows(r) != before[r] for r in sets)  # the users are in some set
    f = tmp_path / "users.txt"
    f.write_text("\n".join(map(str, users)) + "\n")
    run(store, "forget", "--build-dir", out, "--users", str(f), "--shards", shards)
    for t in ("requests", "events", "samples", "history"):
        left = delta_io.dataset(delta_io.table_path(out, t)).to_table(columns=["user"]).column("user").to_pylist()
        assert not set(left) & set(users), t
    for r in sets:
        assert shard_rows(r) == before[r], r
    for d in days:  # still published: marker and record carry the new manifest's checksum
        assert publish.is_published(out, "incremental", d, shards), d
    fs, base = storage.filesystem(shards)
    left = [i.path for i in fs.get_file_info(pafs.FileSelector(base, recursive=True)) if ".forget-" in i.path]
    assert left == []


def test_the_dags_settings_and_sensors_on_s3(store, builds):
    """The DAGs' side of S3 (their Spark jobs are the commands above): paths stay s3a:// URLs
    (staging roots from publish's layout), the jars include the S3 connector's, the sensors
    poke the store."""
    import importlib
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "airflow"))
    common = importlib.import_module("userwise_dag_common")
    _, remote, inp, *_ = builds
    base = store.url(BUCKET, "")
    file_cfg = common.load_file()
    st = common.resolve(file_cfg, {"input": inp, "build_dir": remote, "shards": f"{base}/dagS",
                                   "config": f"{base}/conf.yaml"}, {"date": "2026-01-04"}, dt.date(2026, 1, 4))
    assert st["build_dir"] == remote and st["input"] == inp
    assert st["incremental_staging"] == f"{base}/dagS/_staging/incremental/2026-01-05"
    assert st["input_partition"] == f"{inp}/date=2026-01-04"
    names = [os.path.basename(j) for j in st["jars"].split(",")]
    assert "hadoop-aws-3.5.0.jar" in names and "delta-storage-4.4.0.jar" in names
    days = sorted(n.split("=", 1)[1] for n in storage.listdir(inp) if n.startswith("date="))
    assert common.input_ready({**st, "input_partition": f"{inp}/date={days[0]}"})
    assert not common.input_ready({**st, "input_partition": f"{inp}/date=1999-01-01"})
    assert not common.day_published({**st, "date": "1999-01-01"})
