"""The stack on an S3 API (moto's server on loopback, pipelines/tools/s3_store.py): Spark and
Delta write a table to s3a:// through hadoop-aws and the AWS SDK modules of the S3 jar set
(no SDK bundle) and read it back; pyarrow's S3 and delta-rs read the same files; a folder
rename on S3A; storage.create_exclusive's conditional write under racing writers; the store
going away and coming back; the server ending with the process that started it.

The suite's shared Spark session has neither the S3 jars nor the settings: the Spark part
runs in a process of its own (one JVM for the module).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from userwise.pipelines.runtime import delta_io, jars, storage

pytestmark = pytest.mark.slow

BUCKET = "userwise-test"
ROWS = 100  # per write; the table gets two (a create and an append)

# One Spark session on the store: a Delta table (partitioned, two commits) read back, a Parquet
# folder written by Spark's file committer (its commits rename: copies on S3A), then renamed as a
# whole with Hadoop's FileSystem API (as a published folder would be).
JOB = textwrap.dedent('''
    import json, sys
    from userwise.pipelines.runtime.spark import get_spark
    from pyspark.sql import functions as F

    conf, base, rows = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    spark = get_spark(master="local[2]", app="s3-store-test", ui=False, conf=conf)
    df = spark.range(0, rows, 1, 1).withColumn("g", F.col("id") % 3)
    df.write.format("delta").partitionBy("g").save(f"{base}/t")
    df.write.format("delta").mode("append").save(f"{base}/t")
    back = spark.read.format("delta").load(f"{base}/t")
    out = {"rows": back.count(), "sum": back.agg(F.sum("id")).first()[0]}
    df.write.parquet(f"{base}/pq")
    Path = spark._jvm.org.apache.hadoop.fs.Path
    src = Path(f"{base}/pq")
    fs = src.getFileSystem(spark._jsc.hadoopConfiguration())
    out["fs"] = fs.getClass().getName()
    out["renamed"] = bool(fs.rename(src, Path(f"{base}/published")))
    out["published_rows"] = spark.read.parquet(f"{base}/published").count()
    print("RESULT " + json.dumps(out), flush=True)
    spark.stop()
''')


@pytest.fixture(scope="module")
def store(s3_store):
    return s3_store


@pytest.fixture(scope="module")
def written(store, tmp_path_factory):
    """The Spark job's result (one JVM): its tables are under ``s3a://BUCKET/w``."""
    d = tmp_path_factory.mktemp("s3job")
    job = d / "job.py"
    job.write_text(JOB)
    conf = {**store.spark_conf(), "spark.sql.shuffle.partitions": "2",
            "spark.databricks.delta.snapshotPartitions": "1", "spark.default.parallelism": "2",
            "spark.driver.memory": "1g"}
    env = {**os.environ, **store.env(), "USERWISE_LOG_DIR": str(d)}
    r = subprocess.run([sys.executable, str(job), json.dumps(conf), store.url(BUCKET, "w"), str(ROWS)],
                       capture_output=True, text=True, env=env, timeout=600)
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
    if r.returncode != 0 or line is None:
        logs = sorted(str(p) for p in d.glob("spark-*.log"))
        pytest.fail(f"the Spark job on S3 exited {r.returncode}; Spark's log: {logs}; store log: {store.log}\n"
                    f"--- stdout:\n{r.stdout[-3000:]}\n--- stderr:\n{r.stderr[-5000:]}")
    return json.loads(line[len("RESULT "):])


def test_the_s3_jar_set_has_no_sdk_bundle_and_no_second_copy_of_a_spark_jar():
    """The connector's jars replace the SDK's 686 MB bundle with its modules, and leave out what
    pyspark ships (Netty, httpclient, slf4j...): two versions of a class on one class path."""
    import pyspark

    got = jars.S3.cached()
    if got is None:
        pytest.skip(f"the S3 jar set is not in the cache ({jars.S3.dest()}): make setup fetches it")
    names = [Path(p).name for p in got]
    assert not [n for n in names if n.startswith("bundle-")]
    assert {f"hadoop-aws-{jars.HADOOP_AWS_VERSION}.jar", f"s3-{jars.AWS_SDK_VERSION}.jar",
            f"apache-client-{jars.AWS_SDK_VERSION}.jar"} <= set(names)

    def artifact(n):  # netty-codec-http-4.2.13.Final.jar -> netty-codec-http
        return "-".join(p for p in n[:-4].split("-") if not p[:1].isdigit())

    spark_jars = {artifact(p.name) for p in (Path(pyspark.__file__).parent / "jars").glob("*.jar")}
    assert not {artifact(n) for n in names} & spark_jars
    assert sum(os.path.getsize(p) for p in got) < 30 << 20  # against 686 MB for the bundle


@pytest.mark.spark
def test_spark_writes_a_delta_table_to_s3a_and_reads_it_back(written):
    assert written["fs"] == "org.apache.hadoop.fs.s3a.S3AFileSystem"
    assert written["rows"] == 2 * ROWS
    assert written["sum"] == 2 * sum(range(ROWS))


@pytest.mark.spark
def test_pyarrow_lists_and_reads_the_tables_files(store, written):
    url = store.url(BUCKET, "w/t")
    fs, root = storage.filesystem(url)
    assert isinstance(fs, pafs.S3FileSystem) and root == f"{BUCKET}/w/t"
    files = [i for i in fs.get_file_info(pafs.FileSelector(root, recursive=True)) if i.type == pafs.FileType.File]
    rel = sorted(i.path[len(root) + 1:] for i in files)
    assert "_delta_log/00000000000000000000.json" in rel and "_delta_log/00000000000000000001.json" in rel
    data = [r for r in rel if r.endswith(".parquet")]
    assert {r.split("/")[0] for r in data} == {"g=0", "g=1", "g=2"}
    assert sorted(storage.listdir(url)) == ["_delta_log", "g=0", "g=1", "g=2"]
    assert sum(pq.read_table(f"{root}/{r}", filesystem=fs).num_rows for r in data) == 2 * ROWS
    commit = [json.loads(x) for x in storage.read_bytes(f"{url}/_delta_log/00000000000000000001.json").splitlines()]
    assert any("commitInfo" in a and a["commitInfo"]["operation"] == "WRITE" for a in commit)
    assert storage.du(url) == sum(i.size for i in files if i.path.endswith(".parquet"))


@pytest.mark.spark
def test_delta_rs_reads_the_version_files_and_rows(store, written):
    from deltalake import DeltaTable

    url = store.url(BUCKET, "w/t")
    assert delta_io.version(None, url) == 1
    t = DeltaTable(url)
    uris = t.file_uris()
    assert len(uris) >= 3 and all(u.startswith(f"s3a://{BUCKET}/w/t/g=") for u in uris)
    sizes = [storage.info(u).size for u in uris]
    assert delta_io.table_bytes(url) == sum(sizes) > 0
    assert delta_io.table_bytes(url, version=0) < sum(sizes)
    assert isinstance(delta_io.arrow_filesystem(url), pafs.SubTreeFileSystem)  # bytes through pyarrow's S3
    tbl = delta_io.dataset(url).to_table()
    assert tbl.num_rows == 2 * ROWS and sum(tbl.column("id").to_pylist()) == 2 * sum(range(ROWS))
    assert delta_io.least(url, "g") == 0


@pytest.mark.spark
def test_a_folder_renamed_on_s3a_keeps_every_file_and_leaves_no_source(store, written):
    assert written["renamed"] and written["published_rows"] == ROWS
    assert not storage.exists(store.url(BUCKET, "w/pq"))
    names = storage.listdir(store.url(BUCKET, "w/published"))
    assert "_SUCCESS" in names and [n for n in names if n.startswith("part-")]


def test_racing_exclusive_creates_on_s3_have_exactly_one_winner(store):
    """storage.create_exclusive: PutObject with If-None-Match, 8 writers at once on each key."""
    writers, keys = 8, 12
    for k in range(keys):
        url = f"{'s3' if k % 2 else 's3a'}://{BUCKET}/locks/k{k}.lock"
        won: list[int] = []
        barrier = threading.Barrier(writers, timeout=30)

        def create(i, url=url, won=won, barrier=barrier):
            barrier.wait()
            if storage.create_exclusive(url, f"writer {i}".encode()):
                won.append(i)

        threads = [threading.Thread(target=create, args=(i,)) for i in range(writers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads)
        assert len(won) == 1, (url, won)
        assert storage.read_bytes(url) == f"writer {won[0]}".encode()
    assert not storage.create_exclusive(f"s3a://{BUCKET}/locks/k0.lock", b"again")


def test_exclusive_create_without_boto3_checks_then_writes(store, monkeypatch):
    monkeypatch.setattr(storage, "_s3_client", lambda *a: None)
    url = f"s3a://{BUCKET}/locks/no-boto3.lock"
    assert storage.create_exclusive(url, b"first")
    assert not storage.create_exclusive(url, b"second")
    assert storage.read_bytes(url) == b"first"


def _non_loopback_address() -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing interface
            addr = s.getsockname()[0]
        except OSError:
            return None
    return None if addr.startswith("127.") else addr


def test_the_store_listens_on_loopback_only(store):
    addr = _non_loopback_address()
    if addr is None:
        pytest.skip("this machine has no address besides loopback")
    with socket.socket() as s:
        s.settimeout(2)
        assert s.connect_ex((addr, store.port)) != 0


def test_the_server_ends_with_the_process_that_started_it(tmp_path):
    code = ("import sys, time\nfrom userwise.pipelines.tools.s3_store import S3Store\n"
            "s = S3Store(buckets=('owned',)).start()\nprint(s.proc.pid, s.port, flush=True)\ntime.sleep(600)\n")
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        pid, port = (int(x) for x in owner.stdout.readline().split())
        owner.send_signal(signal.SIGKILL)  # no close(), no cleanup: the owner just dies
        owner.wait(30)
        end = time.monotonic() + 15
        while time.monotonic() < end and _alive(pid):
            time.sleep(0.2)
        assert not _alive(pid)
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0
    finally:
        if owner.poll() is None:
            owner.kill()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    st = Path(f"/proc/{pid}/stat")  # a zombie is gone for our purpose
    return not (st.exists() and st.read_text().split(")")[-1].split()[0] == "Z")


def test_the_store_goes_away_and_comes_back_with_its_objects(store):
    """Last in this module: the store is down in the middle of it."""
    import boto3
    import botocore.exceptions
    from botocore.config import Config

    c = store.client()
    c.put_object(Bucket=BUCKET, Key="kept/a.txt", Body=b"kept")
    store.stop()
    down = boto3.client("s3", endpoint_url=store.endpoint, region_name="us-east-1",
                        aws_access_key_id="k", aws_secret_access_key="s",
                        config=Config(retries={"max_attempts": 1}, connect_timeout=2, read_timeout=2))
    with pytest.raises(botocore.exceptions.EndpointConnectionError):
        down.head_bucket(Bucket=BUCKET)
    store.start()
    assert storage.read_bytes(store.url(BUCKET, "kept/a.txt")) == b"kept"
    assert "kept" in storage.listdir(store.url(BUCKET))
