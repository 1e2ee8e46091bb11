"""A real HDFS for the tests: Hadoop's MiniDFSCluster in its own JVM.

The jars are ``org.apache.hadoop:hadoop-client-minicluster`` (the version of the
Hadoop client pyspark ships, so Spark reads and writes ``hdfs://`` with its own
client), fetched once into ``<jar cache>/hadoop-minicluster-<version>/`` the way
Delta's jars are (``pipelines/runtime/jars.py``): Spark's resolver (Ivy), else
Maven with the pinned pom ``hdfs-jars.xml`` next to this file. ``make setup``
runs :func:`ensure_jars`; the fixture does too on a machine where it did not.

:class:`HdfsStore` starts ``org.apache.hadoop.test.MiniDFSClusterManager`` (one
name node, one data node, a folder of its own), waits for its ports, and stops
it; :meth:`HdfsStore.stop` / :meth:`HdfsStore.start` on the same ports and
folder model a store that goes away and comes back. The Python side reaches it
through WebHDFS (``USERWISE_WEBHDFS``, see ``pipelines/runtime/storage.py``).

``python -m tests.support.remote_store`` fetches the jars and prints their folder.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from userwise.pipelines.runtime import jars

HADOOP_VERSION = "3.5.0"
PACKAGE = f"org.apache.hadoop:hadoop-client-minicluster:{HADOOP_VERSION}"
# What the minicluster needs on its class path (the shaded client and its few unshaded deps).
NEEDED = (f"hadoop-client-minicluster-{HADOOP_VERSION}.jar", f"hadoop-client-api-{HADOOP_VERSION}.jar",
          f"hadoop-client-runtime-{HADOOP_VERSION}.jar")
MAIN = "org.apache.hadoop.test.MiniDFSClusterManager"
SHELL = "org.apache.hadoop.fs.FsShell"


class StoreError(RuntimeError):
    pass


def jar_dir() -> Path:
    from userwise.pipelines.runtime import jars

    return jars.cache_dir() / f"hadoop-minicluster-{HADOOP_VERSION}"


def cached_jars() -> list[str] | None:
    d = jar_dir()
    if all((d / n).is_file() and (d / n).stat().st_size > 0 for n in NEEDED):
        return sorted(str(p) for p in d.glob("*.jar"))
    return None


def _via_ivy(dest: Path, log) -> bool:
    import pyspark

    submit = Path(pyspark.__file__).parent / "bin" / "spark-submit"
    ivy = Path(tempfile.mkdtemp(prefix="userwise-ivy-"))
    noop = ivy / "noop.py"
    noop.write_text("pass\n")
    cmd = [str(submit), "--conf", f"spark.jars.ivy={ivy}", "--packages", PACKAGE, str(noop)]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        log(f"spark package resolution failed: {e}")
        return False
    found = glob.glob(str(ivy / "jars" / "*.jar"))
    names = {Path(p).name.split("_", 1)[-1]: p for p in found}  # ivy names them group_artifact-version.jar
    if r.returncode != 0 or not all(n in names for n in NEEDED):
        log("spark package resolution could not fetch the minicluster; falling back to Maven")
        return False
    for n, p in names.items():
        shutil.copy(p, dest / n)
    return True


def _via_maven(dest: Path, log) -> bool:
    return jars.maven_copy(Path(__file__).with_name("hdfs-jars.xml"), dest, log)


def ensure_jars(verbose: bool = True) -> list[str]:
    got = cached_jars()
    if got:
        return got
    log = (lambda m: print(f"[hdfs-jars] {m}", file=sys.stderr)) if verbose else (lambda m: None)
    dest = jar_dir()
    dest.mkdir(parents=True, exist_ok=True)
    log(f"fetching {PACKAGE} into {dest}")
    if _via_maven(dest, log) or _via_ivy(dest, log):
        got = cached_jars()
        if got:
            return got
    raise StoreError(f"could not fetch {PACKAGE}; put {', '.join(NEEDED)} into {dest}")


def class_path() -> str:
    return ":".join(ensure_jars())


def _die_with_parent() -> None:
    """In the child before exec: the kernel kills it when the process that started it dies
    (a killed test run leaves no cluster behind)."""
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
        cmd = ["java", "-Xmx768m", "-XX:+UseSerialGC", "-cp", class_path(), MAIN,
               "-nnport", str(self.nn_port), "-httpport", str(self.http_port), "-datanodes", "1",
               "-writeDetails", str(details),
               "-D", f"hdfs.minidfs.basedir={self.base / 'dfs'}", "-D", "dfs.replication=1",
               "-D", "dfs.permissions.enabled=false", "-D", "dfs.namenode.safemode.extension=0"]
        if not self._formatted:
            cmd.append("-format")
        log = open(self.base / "store.log", "ab")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=self.base,
                                     preexec_fn=_die_with_parent)
        log.close()
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
        return {"USERWISE_WEBHDFS": self.webhdfs}

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
        return subprocess.run(["java", "-Xmx512m", "-cp", f"{conf}:{class_path()}", SHELL, *args],
                              capture_output=True, text=True, timeout=timeout)


def details(store: HdfsStore) -> dict:
    return {"url": store.url, "webhdfs": store.webhdfs, "base": str(store.base)}


if __name__ == "__main__":
    print(json.dumps({"jars": ensure_jars()}, indent=1))
