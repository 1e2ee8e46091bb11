"""The S3 store on loopback itself (moto's server, pipelines/tools/s3_store.py): the connector's
jar set (no SDK bundle, no second copy of a Spark jar); storage.create_exclusive's conditional
write under racing writers; the store listening on loopback only, going away and coming back,
and ending with the process that started it. The data path on it: tests/remote/test_s3.py."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from userwise.pipelines.runtime import jars, storage

pytestmark = pytest.mark.slow

BUCKET = "userwise-test"


@pytest.fixture(scope="module")
def store(s3_store):
    return s3_store


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
