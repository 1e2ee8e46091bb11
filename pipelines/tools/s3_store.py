"""An S3 API on one machine: moto's server mode in a process of its own, on loopback (the
tests' S3 store, and a stand-in for a bucket where no cloud is at hand).

:class:`S3Store` starts ``moto``'s S3 server (the ``test`` extra: ``moto[s3]`` and Flask) on
127.0.0.1 and a free port, creates its buckets, and gives what each client needs to reach it:

- :meth:`S3Store.env`: the standard ``AWS_*`` variables (keys, region, ``AWS_ENDPOINT_URL``,
  ``AWS_ALLOW_HTTP``), which pyarrow's S3 filesystem (``pipelines/runtime/storage.py``),
  delta-rs (``pipelines/runtime/delta_io.py``) and boto3 read;
- :meth:`S3Store.spark_conf`: the ``spark.hadoop.fs.s3a.*`` settings of Spark's S3 connector,
  ``spark.jars`` with Delta's jars and the connector's (:data:`userwise.pipelines.runtime.jars.S3`,
  fetched into the jar cache by ``make setup``), and Delta's S3 log store.

The server lives at most as long as the process that started it: it polls its parent and
exits when that is gone (a killed test run leaves no server behind), and :meth:`S3Store.close`
ends it. :meth:`S3Store.stop` / :meth:`S3Store.start` model a store that goes away and comes
back: the server closes its port and drops every open connection, while the objects stay
in its memory; it comes back on the same port with the same buckets and objects. Only
:meth:`S3Store.close` (or the end of the parent) loses them: moto keeps nothing on disk.

Conditional writes: moto answers ``PutObject`` with ``If-None-Match: *`` (create once, 412
when the key exists), but checks and writes in two steps on its request threads, so two
racing creates could both win. The server here runs conditional writes one at a time, which
makes them atomic as S3's are (``storage.create_exclusive`` relies on it).

Example::

    store = S3Store(buckets=("warehouse",)).start()
    os.environ.update(store.env())
    spark = get_spark(conf=store.spark_conf())
    spark.range(3).write.format("delta").save(store.url("warehouse", "t"))
    store.close()

``python -m userwise.pipelines.tools.s3_store`` fetches the connector's jars and prints them with
the Spark settings for AWS's S3 (:func:`s3a_conf`, region ``$AWS_REGION``).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from userwise.pipelines.errors import EXIT_USER, StoreError
from userwise.pipelines.runtime import jars

HOST = "127.0.0.1"  # loopback only: the store is never reachable from another machine
REGION = "us-east-1"
ACCESS_KEY = "userwise-test"  # moto accepts any key; these name the store's in its requests
SECRET_KEY = "userwise-test-secret"
ENV_CREDENTIALS = "software.amazon.awssdk.auth.credentials.EnvironmentVariableCredentialsProvider"
# Delta's log store for S3: a commit is a put-if-absent made safe by a lock in the one driver
# that writes the table (Delta's default for s3/s3a/s3n too; named here so that it shows).
LOG_STORE = "io.delta.storage.S3SingleDriverLogStore"
_OFFLINE, _ONLINE = signal.SIGUSR1, signal.SIGUSR2  # to the server: close its port / open it again


def ensure_jars(verbose: bool = True, delta: bool = False) -> list[str]:
    """Spark's S3 connector jars (hadoop-aws and its AWS SDK modules), fetched into the cache if
    needed; ``delta``: Delta's first (``spark.jars`` names both: it replaces the session's default)."""
    try:
        return (jars.ensure(verbose=verbose) if delta else []) + jars.fetch(jars.S3, verbose=verbose)
    except jars.JarsError as e:
        raise StoreError(str(e)) from None


def s3a_conf(endpoint: str | None = None, region: str = REGION) -> dict[str, str]:
    """Spark's settings for S3 through the ``s3a://`` connector, credentials from the ``AWS_*``
    variables of the driver's (and executors') environment; ``endpoint``: an S3 API other than
    AWS's (path-style requests, plain http when it says ``http://``)."""
    conf = {
        "spark.jars": ",".join(ensure_jars(verbose=False, delta=True)),
        "spark.hadoop.fs.s3a.aws.credentials.provider": ENV_CREDENTIALS,
        "spark.hadoop.fs.s3a.endpoint.region": region,
        "spark.delta.logStore.s3a.impl": LOG_STORE,
        "spark.delta.logStore.s3.impl": LOG_STORE,
    }
    if endpoint:
        conf.update({
            "spark.hadoop.fs.s3a.endpoint": endpoint,
            "spark.hadoop.fs.s3a.path.style.access": "true",
            "spark.hadoop.fs.s3a.connection.ssl.enabled": str(endpoint.startswith("https://")).lower(),
        })
    return conf


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((HOST, port)) == 0


class S3Store:
    """moto's S3 server in a process of its own, on a fixed loopback port (a restart comes back
    at the same endpoint); ``log``: a file for the server's output, every request's line with
    it (default: none)."""

    def __init__(self, buckets: tuple[str, ...] = ("userwise",), port: int | None = None,
                 log: str | Path | None = None):
        self.buckets = tuple(buckets)
        self.port = port or _free_port()
        self.endpoint = f"http://{HOST}:{self.port}"
        self.log = Path(log) if log else None
        self.proc: subprocess.Popen | None = None

    def url(self, bucket: str | None = None, path: str = "") -> str:
        """``s3a://bucket/path`` (the first bucket by default)."""
        return f"s3a://{bucket or self.buckets[0]}/{path.lstrip('/')}".rstrip("/")

    def start(self, timeout: float = 60.0) -> "S3Store":
        """Start the server (or bring a stopped one back) and create the buckets that are missing."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(_ONLINE)
        else:
            self._spawn()
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise StoreError(f"the S3 server exited ({self.proc.returncode})"
                                 + (f"; see {self.log}" if self.log else ": start it with log= to see why"))
            if _listening(self.port):
                self._make_buckets()
                return self
            time.sleep(0.1)
        self.close()
        raise StoreError(f"the S3 server did not answer on {self.endpoint} in {timeout:.0f} s")

    def _spawn(self) -> None:
        try:
            import moto  # noqa: F401
            import moto.server  # noqa: F401  (Flask: moto's server mode)
        except ImportError as e:
            raise StoreError(f"moto's S3 server is not installed ({e}): pip install 'moto[s3]' flask flask-cors "
                             "(the test extra: pip install -e '.[test]')") from None
        cmd = [sys.executable, "-m", "userwise.pipelines.tools.s3_store", "--serve", str(self.port),
               "--parent", str(os.getpid())] + (["--requests"] if self.log else [])
        out = open(self.log, "ab") if self.log else subprocess.DEVNULL
        try:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                         env={**os.environ, "MOTO_PORT": str(self.port)})
        finally:
            if self.log:
                out.close()

    def _make_buckets(self) -> None:
        c = self.client()
        have = {b["Name"] for b in c.list_buckets().get("Buckets", [])}
        for b in self.buckets:
            if b not in have:
                c.create_bucket(Bucket=b)

    def stop(self, timeout: float = 30.0) -> None:
        """The store goes away: its port closes and open connections drop; the objects stay
        (:meth:`start` brings them back)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(_OFFLINE)
        end = time.monotonic() + timeout
        while _listening(self.port):
            if time.monotonic() > end or self.proc.poll() is not None:
                break
            time.sleep(0.05)

    def close(self) -> None:
        """End the server (its objects with it)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self.proc = None

    def __enter__(self) -> "S3Store":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def env(self) -> dict[str, str]:
        """The ``AWS_*`` variables pyarrow, delta-rs and boto3 need to reach the store."""
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_REGION": REGION,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ALLOW_HTTP": "true",  # delta-rs (object_store) refuses plain http without it
            "AWS_EC2_METADATA_DISABLED": "true",  # no instance-metadata probe for credentials
        }

    def spark_conf(self) -> dict[str, str]:
        """Spark's settings for this store (:func:`s3a_conf` with its endpoint); the session's
        process also needs :meth:`env` (the credentials come from there)."""
        return s3a_conf(self.endpoint)

    def client(self):
        """A boto3 S3 client of the store."""
        import boto3
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=self.endpoint, region_name=REGION, aws_access_key_id=ACCESS_KEY,
                            aws_secret_access_key=SECRET_KEY,
                            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 2},
                                          connect_timeout=5, read_timeout=60))


# The server process -------------------------------------------------------------------------

def _conditional_writes_one_at_a_time(app):
    """moto checks ``If-None-Match`` / ``If-Match`` and writes in two steps: run such requests
    one at a time so that each is atomic (as S3's are) against the others."""
    import threading

    lock = threading.Lock()

    def wrapped(environ, start_response):
        if environ.get("REQUEST_METHOD") in ("PUT", "POST") and (
                "HTTP_IF_NONE_MATCH" in environ or "HTTP_IF_MATCH" in environ):
            with lock:
                return list(app(environ, start_response))
        return app(environ, start_response)

    return wrapped


def _serve(port: int, parent: int, requests: bool = False) -> None:
    """Serve S3 on ``HOST:port`` until the parent process is gone; SIGUSR1 closes the port and
    the open connections (the objects stay), SIGUSR2 opens it again; ``requests``: log each."""
    import logging
    import threading

    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import make_server

    logging.basicConfig(level=logging.INFO if requests else logging.ERROR, format="%(message)s")
    logging.getLogger("werkzeug").setLevel(logging.INFO if requests else logging.ERROR)
    app = _conditional_writes_one_at_a_time(DomainDispatcherApplication(create_backend_app))
    wanted = {"online": True}
    changed = threading.Event()

    def on_signal(signum, _frame):
        wanted["online"] = signum == _ONLINE
        changed.set()

    signal.signal(_OFFLINE, on_signal)
    signal.signal(_ONLINE, on_signal)
    server = None
    conns: set = set()

    def online():
        srv = make_server(HOST, port, app, threaded=True, request_handler=MotoRequestHandler)
        accept, close = srv.get_request, srv.shutdown_request

        def get_request():
            sock, addr = accept()
            conns.add(sock)
            return sock, addr

        def shutdown_request(sock):
            conns.discard(sock)
            close(sock)

        srv.get_request, srv.shutdown_request = get_request, shutdown_request
        threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()
        return srv

    def offline(srv):
        srv.shutdown()
        srv.server_close()
        for sock in list(conns):  # kept-alive connections too: the store is gone for every client
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    server = online()
    while os.getppid() == parent:
        if changed.wait(1.0):
            changed.clear()
            if wanted["online"] and server is None:
                server = online()
            elif not wanted["online"] and server is not None:
                offline(server)
                server = None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve"]:
        _serve(int(argv[1]), int(argv[argv.index("--parent") + 1]), "--requests" in argv)
        return 0
    try:  # the jars, and Spark's settings for AWS's S3 in $AWS_REGION (Delta's jars and these)
        print(json.dumps({"jars": ensure_jars(),
                          "spark_conf": s3a_conf(region=os.environ.get("AWS_REGION") or REGION)}, indent=1))
    except StoreError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER
    return 0


if __name__ == "__main__":
    sys.exit(main())
