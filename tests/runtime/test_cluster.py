"""spark-submit beyond local mode: a loopback standalone cluster (master + 2 worker JVMs).

The executors' Python has pyarrow and numpy alone (``standalone.bare_python``): the project
imports there only from the zip shipped with ``--py-files``, or from the one a command ships
itself (``userwise preshard --master spark://...``, whose writer runs on the executors). The
submitted driver uses a Python that has the third-party packages but not ``userwise``
(``standalone.isolated_python``). The cluster is stopped afterwards.
"""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from tests.support.standalone import Cluster, bare_python, isolated_python, spark_submit
from tests.support.uwchain import DAYS, ROOT, TABLES, fast_session_conf, submit_conf_args, synth, table_digest
from userwise.pipelines.runtime import jars, ship

pytestmark = [pytest.mark.spark, pytest.mark.slow]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("cluster")
    c = Cluster(root=root, workers=2, cores=1, memory="1g")
    c.start()
    yield c
    c.stop()
    assert not c.running()


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    d = tmp_path_factory.mktemp("ship")
    return {"zip": str(ship.build(d / "dist")), "python": isolated_python(d / "iso"),
            "executor_python": bare_python(d / "bare")}


def submit(cluster, shipped, job, *args, tmp):
    py = shipped["python"]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SPARK_HOME")}
    # PYTHONFAULTHANDLER: a Python process killed by a signal prints every thread's stack first.
    # (spark-submit exit 134, SIGABRT, seen here and in the DAG test: delta-rs' filesystem
    # aborting the driver at exit; see delta_io.arrow_filesystem.)
    env.update(PYSPARK_PYTHON=py, PYSPARK_DRIVER_PYTHON=py, PYTHONFAULTHANDLER="1")
    cmd = [spark_submit(), "--master", cluster.master_url, "--py-files", shipped["zip"],
           "--jars", ",".join(jars.ensure()), "--conf", "spark.executor.memory=768m",
           "--conf", "spark.driver.memory=1g", "--conf", f"spark.pyspark.python={shipped['executor_python']}",
           "--conf", f"spark.pyspark.driver.python={py}",
           *submit_conf_args(), str(ROOT / "jobs" / f"{job}.py"), *args]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tmp)
    if r.returncode != 0:  # keep everything for the post-mortem, show its ends
        log = tmp / f"{job}.stderr.log"
        log.write_text(r.stderr)
        (tmp / f"{job}.stdout.log").write_text(r.stdout)
        crash = sorted(str(f) for f in tmp.rglob("*") if f.name.startswith(("hs_err", "core")))
        # the Python driver's stdout and stderr reach spark-submit's stdout (Spark's PythonRunner
        # merges them): a Python fatal error or a C++ "terminate called" shows there, not in stderr
        pytest.fail(f"{job}: spark-submit exited {r.returncode}; full output in {log} and .stdout.log; "
                    f"crash files {crash}\n--- stdout (the Python driver), end:\n{r.stdout[-3000:]}\n"
                    f"--- stderr (the JVM):\n{r.stderr[:1500]}\n[...]\n{r.stderr[-4000:]}")
    return r


def test_cluster_runs_two_workers_and_executors_import_the_shipped_zip(cluster, shipped, tmp_path):
    assert cluster.alive_workers() == 2
    out = tmp_path / "probe.json"
    submit(cluster, shipped, "probe", str(out), tmp=tmp_path)
    got = json.loads(out.read_text())
    assert got["master"] == cluster.master_url
    assert got["executors"] and all(e["file"].startswith("./userwise-0.1.0-pyfiles.zip/")
                                    for e in got["executors"])
    apps = cluster.state().get("completedapps", [])
    assert any(a["name"] == "userwise-probe" for a in apps)


@pytest.fixture(scope="module")
def builds(cluster, shipped, spark, tmp_path_factory):
    """One range build (a pretrain set and a one-day window) through the cluster, and the same
    build in local mode, in-process on the shared session: (cluster's folder, its report,
    whether it ran on the cluster, the local folder)."""
    from tests.builder.test_roundtrip import run_cli

    tmp = tmp_path_factory.mktemp("builds")
    data = synth(tmp / "synth", days=2)
    args = ["--config", str(data / "config.yaml"), "--input", str(data / "lean"), "--as-of", DAYS[2],
            "--incremental-days", "1", "--window-days", "1"]
    out = tmp / "build"
    before = len(cluster.state().get("completedapps", []))
    submit(cluster, shipped, "build", *args, "--build-dir", str(out), "--report", str(tmp / "r.json"), tmp=tmp)
    on_cluster = len(cluster.state().get("completedapps", [])) == before + 1
    local = tmp / "local"
    restore = fast_session_conf(spark)
    try:
        rc, err = run_cli(["build", *args, "--build-dir", str(local)])
    finally:
        restore()
    assert rc == 0, err
    return out, json.loads((tmp / "r.json").read_text()), on_cluster, local


def test_a_build_through_spark_submit_on_the_cluster_equals_local_mode(builds):
    """The cluster's tables equal local mode's. The point is the Delta jobs on executors that
    import only the shipped zip (the daily jobs through spark-submit run in the DAG test)."""
    out, got, on_cluster, local = builds
    assert got["reconciled"] and got["samples"] > 0 and got["impressions_in_samples"] > 0
    assert on_cluster
    tables = table_digest(out)
    assert set(tables) == set(TABLES)
    assert tables == table_digest(local)


def test_preshard_given_the_cluster_s_master_ships_itself_to_executors_without_userwise(
        cluster, shipped, spark, builds, tmp_path):
    """``userwise preshard --master spark://...`` from the project's environment: its writer runs
    in the executors' bare Python (pyarrow and numpy alone), importing userwise from the zip
    the command shipped itself (``ship.installed_zip``). The set equals a local preshard's, byte
    for byte (the manifest's checksums)."""
    import sys

    from tests.builder.test_roundtrip import run_cli
    from userwise.pipelines.shards import manifest as mf

    build = builds[3]
    restore = fast_session_conf(spark)
    try:
        rc, err = run_cli(["preshard", "--build-dir", str(build), "--shards", str(tmp_path / "local"),
                           "--nodes", "2", "--ranks-per-node", "1"])
        assert rc == 0, err
    finally:
        restore()
    before = len(cluster.state().get("completedapps", []))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SPARK_HOME", "PYSPARK_PYTHON")}
    r = subprocess.run([sys.executable, "-m", "userwise.pipelines.cli", "preshard", "--build-dir", str(build),
                        "--shards", str(tmp_path / "remote"), "--nodes", "2", "--ranks-per-node", "1",
                        "--master", cluster.master_url, "--conf", f"spark.pyspark.python={shipped['executor_python']}",
                        "--conf", "spark.executor.memory=768m", *submit_conf_args()],
                       env=env, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-4000:]
    end = time.monotonic() + 60  # the master counts an application completed once its driver is gone
    while len(cluster.state().get("completedapps", [])) == before and time.monotonic() < end:
        time.sleep(0.5)
    assert len(cluster.state().get("completedapps", [])) == before + 1  # it ran on the cluster
    local, remote = mf.load(str(tmp_path / "local")), mf.load(str(tmp_path / "remote"))
    assert remote["shards"] and [(s["path"], s["sha256"]) for s in remote["shards"]] == \
        [(s["path"], s["sha256"]) for s in local["shards"]]
