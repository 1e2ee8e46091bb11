"""A real HDFS on one machine: Hadoop's MiniDFSCluster in its own JVM (the tests' store
and the demo's remote mode, ``make demo-remote``).

The jars are ``org.apache.hadoop:hadoop-client-minicluster`` (the version of the Hadoop
client pyspark ships, so Spark reads and writes ``hdfs://`` with its own client), fetched
once into ``<jar cache>/hadoop-minicluster-<version>/`` as Delta's are
(:mod:`userwise.pipelines.runtime.jars`, :data:`HADOOP`: Maven with the pinned pom
``pipelines/runtime/hadoop-jars.xml``, else Spark's resolver). ``make setup`` fetches them;
:meth:`HdfsStore.start` does too on a machine where it did not.

:class:`HdfsStore` starts ``org.apache.hadoop.test.MiniDFSClusterManager`` (one name node,
one data node, a folder of its own), waits for its ports, and stops it; :meth:`HdfsStore.stop`
/ :meth:`HdfsStore.start` on the same ports and folder model a store that goes away and comes
back. The Python side reaches it through WebHDFS (``USERWISE_WEBHDFS``, see
``pipelines/runtime/storage.py``; :meth:`HdfsStore.env`).

Example::

    store = HdfsStore("/tmp/dfs").start()
    os.environ.update(store.env())
    ...  # userwise build --build-dir f"{store.url}/D" ...
    store.stop()

``python -m userwise.pipelines.tools.hdfs_store`` fetches the jars and prints them.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path

from userwise.pipelines.errors import EXIT_USER, StoreError
from userwise.pipelines.runtime import jars

HADOOP_VERSION = "3.5.0"
PACKAGE = f"org.apache.hadoop:hadoop-client-minicluster:{HADOOP_VERSION}"
HADOOP = jars.JarSet(
    name=f"the HDFS minicluster {HADOOP_VERSION}",
    packages=(PACKAGE,),
    pom="hadoop-jars.xml",
    folder=f"hadoop-minicluster-{HADOOP_VERSION}",
    # what the minicluster needs on its class path: the shaded client and its few unshaded deps
    needed=(f"hadoop-client-minicluster-{HADOOP_VERSION}.jar", f"hadoop-client-api-{HADOOP_VERSION}.jar",
            f"hadoop-client-runtime-{HADOOP_VERSION}.jar"),
    whole_folder=True,
    maven_first=True,
)
MAIN = "org.apache.hadoop.test.MiniDFSClusterManager"
SHELL = "org.apache.hadoop.fs.FsShell"


def ensure_jars(verbose: bool = True) -> list[str]:
    """The minicluster's jars, fetched into the cache if needed."""
    try:
        return jars.fetch(HADOOP, verbose=verbose)
    except jars.JarsError as e:
        raise StoreError(str(e)) from None


def class_path() -> str:
    return ":".join(ensure_jars())


def _java() -> str:
    home = os.environ.get("JAVA_HOME")
    if home and (Path(home) / "bin" / "java").is_file():
        return str(Path(home) / "bin" / "java")
    return "java"


def _die_with_parent() -> None:
    """In the child before exec: the kernel kills it when the process that started it dies
    (a killed run leaves no cluster behind)."""
    import ctypes
    import signal

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


class HdfsStore:
    """A MiniDFSCluster in its own JVM, on fixed ports so that a restart comes back at the same URL."""

    def __init__(self, base: str | Path):
        self.base = Path(base)
        self.base.mkdir(parents=True, exist_ok=True)
        self.nn_port = _free_port()
        self.http_port = _free_port()
        self.url = f"hdfs://localhost:{self.nn_port}"
        self.webhdfs = f"localhost:{self.http_port}"
        self.proc: subprocess.Popen | None = None
        self._formatted = False

    def start(self, timeout: float = 180.0) -> "HdfsStore":
        details = self.base / "details.json"
        details.unlink(missing_ok=True)
        cmd = [_java(), "-Xmx768m", "-XX:+UseSerialGC", "-cp", class_path(), MAIN,
               "-nnport", str(self.nn_port), "-httpport", str(self.http_port), "-datanodes", "1",
               "-writeDetails", str(details),
               "-D", f"hdfs.minidfs.basedir={self.base / 'dfs'}", "-D", "dfs.replication=1",
               "-D", "dfs.permissions.enabled=false", "-D", "dfs.namenode.safemode.extension=0"]
        if not self._formatted:
            cmd.append("-format")
        with open(self.base / "store.log", "ab") as log:
            try:
                self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=self.base,
                                             preexec_fn=_die_with_parent)
            except FileNotFoundError:
                raise StoreError("java is not on PATH (nor in JAVA_HOME): install Java 17 to start the "
                                 "MiniDFSCluster") from None
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise StoreError(f"the MiniDFSCluster exited ({self.proc.returncode}); see {self.base / 'store.log'}")
            if details.exists() and details.stat().st_size and _listening(self.http_port) and self._ready():
                self._formatted = True
                return self
            time.sleep(0.5)
        self.stop()
        raise StoreError(f"the MiniDFSCluster did not come up in {timeout:.0f} s; see {self.base / 'store.log'}")

    def _ready(self) -> bool:
        """The name node answers WebHDFS and is out of safe mode (a write succeeds)."""
        try:
            fs = self.fsspec()
            fs.mkdir("/.ready")
            return True
        except Exception:  # noqa: BLE001 - not up yet
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self.proc = None

    def env(self) -> dict[str, str]:
        """What a process needs to reach the store from Python (Spark needs nothing)."""
        from userwise.pipelines.runtime import storage

        return {storage.WEBHDFS_ENV: self.webhdfs}

    def fsspec(self):
        import fsspec

        return fsspec.filesystem("webhdfs", host="localhost", port=self.http_port, user=os.environ.get("USER", "root"),
                                 skip_instance_cache=True)

    def arrow(self):
        import pyarrow.fs as pafs

        return pafs.PyFileSystem(pafs.FSSpecHandler(self.fsspec()))

    def shell(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        """Hadoop's own client (``hdfs dfs``): FsShell from the minicluster's jars."""
        conf = self.base / "conf"
        conf.mkdir(exist_ok=True)
        (conf / "core-site.xml").write_text(  # FsShell loads its configuration from the class path
            '<?xml version="1.0"?>\n<configuration><property><name>fs.defaultFS</name>'
            f"<value>{self.url}</value></property></configuration>\n")
        return subprocess.run([_java(), "-Xmx512m", "-cp", f"{conf}:{class_path()}", SHELL, *args],
                              capture_output=True, text=True, timeout=timeout)


if __name__ == "__main__":
    import sys

    try:
        print(json.dumps({"jars": ensure_jars()}, indent=1))
    except StoreError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(EXIT_USER)
