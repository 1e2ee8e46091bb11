"""A throw-away Spark standalone cluster on loopback: one master, N workers.

Each daemon is its own JVM, started with pyspark's ``bin/spark-class`` (the
pyspark wheel ships no ``sbin/start-master.sh``). Used by the tests to prove
that ``spark-submit`` works beyond local mode: code ships to executors,
executors import it, and only shipped files are visible to them.

Example::

    from tests.support.standalone import Cluster
    with Cluster(workers=2, root="/tmp/uw-cluster") as c:
        subprocess.run([spark_submit(), "--master", c.master_url, "job.py"])
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from userwise.pipelines.errors import UserwiseError


class ClusterError(UserwiseError):
    """The standalone cluster did not come up (the message names the daemon log)."""


def spark_home() -> Path:
    import pyspark

    return Path(pyspark.__file__).parent


def spark_submit() -> str:
    """The spark-submit script of the installed pyspark."""
    return str(spark_home() / "bin" / "spark-submit")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """A standalone master and ``workers`` workers bound to 127.0.0.1.

    Keyword arguments:
        workers (int, 2): number of worker JVMs.
        cores (int, 1): cores each worker offers.
        memory (str, "1g"): memory each worker offers to executors.
        root (str | Path): folder for daemon logs and worker work dirs.
        start_timeout (float, 120): seconds to wait for every worker to register.
    """

    def __init__(self, *, root, workers: int = 2, cores: int = 1, memory: str = "1g",
                 start_timeout: float = 120.0):
        self.root = Path(root)
        self.workers = workers
        self.cores = cores
        self.memory = memory
        self.start_timeout = start_timeout
        self.port = _free_port()
        self.ui_port = _free_port()
        self.procs: list[subprocess.Popen] = []
        self.logs: list[Path] = []

    @property
    def master_url(self) -> str:
        return f"spark://127.0.0.1:{self.port}"

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update({
            "SPARK_HOME": str(spark_home()),
            "SPARK_LOCAL_IP": "127.0.0.1",
            "SPARK_LOCAL_HOSTNAME": "localhost",
            "SPARK_NO_DAEMONIZE": "1",
            "SPARK_DAEMON_MEMORY": "256m",
        })
        return env

    def _spawn(self, name: str, args: list[str]) -> None:
        log = self.root / f"{name}.log"
        self.logs.append(log)
        fh = open(log, "wb")
        cmd = [str(spark_home() / "bin" / "spark-class"), *args]
        # Own process group: stop() ends the JVM and nothing else.
        p = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=self._env(),
                             start_new_session=True)
        fh.close()
        self.procs.append(p)

    def state(self) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.ui_port}/json/", timeout=5) as r:
            return json.load(r)

    def alive_workers(self) -> int:
        try:
            return sum(1 for w in self.state().get("workers", []) if w.get("state") == "ALIVE")
        except OSError:
            return 0

    def start(self) -> "Cluster":
        self.root.mkdir(parents=True, exist_ok=True)
        self._spawn("master", ["org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                               "--port", str(self.port), "--webui-port", str(self.ui_port)])
        for i in range(self.workers):
            work = self.root / f"worker-{i}"
            work.mkdir(exist_ok=True)
            self._spawn(f"worker-{i}", [
                "org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1",
                "--cores", str(self.cores), "--memory", self.memory,
                "--webui-port", str(_free_port()), "--work-dir", str(work), self.master_url])
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            dead = [(p, log) for p, log in zip(self.procs, self.logs) if p.poll() is not None]
            if dead:
                self.stop()
                raise ClusterError(f"a Spark daemon exited at start; see {dead[0][1]}")
            if self.alive_workers() == self.workers:
                return self
            time.sleep(1.0)
        self.stop()
        raise ClusterError(f"{self.workers} workers did not register within {self.start_timeout:.0f}s; "
                           f"see the logs in {self.root}")

    def stop(self, timeout: float = 30.0) -> None:
        """End the daemons (workers first), waiting for each; kill what does not stop."""
        for p in reversed(self.procs):
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for p in reversed(self.procs):
            try:
                p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(timeout=timeout)
        self.procs = []

    def running(self) -> bool:
        return any(p.poll() is None for p in self.procs)

    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def isolated_python(dest: Path) -> str:
    """A Python for executors that has the third-party packages but not ``userwise``.

    A venv without pip whose only link to the project's environment is a
    ``.pth`` line naming its site-packages: packages there (pyarrow, pyspark,
    yaml) import, while the editable ``userwise`` mapping (itself a ``.pth``
    hook, which Python runs only for site dirs) does not. So ``userwise``
    imports on such an executor only from what spark-submit shipped, as on a
    real cluster node.
    """
    import sysconfig
    import venv

    dest = Path(dest)
    py = dest / "bin" / "python"
    if not py.exists():
        venv.EnvBuilder(with_pip=False, symlinks=True).create(dest)
        site = sysconfig.get_paths()["purelib"]
        ver = f"python{sys.version_info.major}.{sys.version_info.minor}"
        (dest / "lib" / ver / "site-packages" / "_userwise_deps.pth").write_text(site + "\n")
    return str(py)


def bare_python(dest: Path, packages: tuple[str, ...] = ("pyarrow", "numpy")) -> str:
    """A Python for executors with ``packages`` alone (at this environment's versions): no
    ``userwise``, no yaml, no pandas, no pyspark beyond what Spark itself puts on a Python
    worker's path. A venv made by uv (the project's own installer), the wheels from its cache."""
    from importlib import metadata

    dest = Path(dest)
    py = dest / "bin" / "python"
    if not py.exists():
        uv = Path(sys.executable).parent / "uv"
        subprocess.run([str(uv), "venv", "-q", "--python", sys.executable, str(dest)], check=True)
        subprocess.run([str(uv), "pip", "install", "-q", "--python", str(py),
                        *(f"{p}=={metadata.version(p)}" for p in packages)], check=True)
    return str(py)
