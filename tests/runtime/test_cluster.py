"""spark-submit beyond local mode: a loopback standalone cluster (master + 2 worker JVMs).

Driver and executors use a Python that has the third-party packages but not
``userwise`` (``standalone.isolated_python``): the project imports only from
the zip shipped with ``--py-files``. The cluster is stopped afterwards.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.support.standalone import Cluster, isolated_python, spark_submit
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
    return {"zip": str(ship.build(d / "dist")), "python": isolated_python(d / "iso")}


def submit(cluster, shipped, job, *args, tmp):
    py = shipped["python"]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SPARK_HOME")}
    # PYTHONFAULTHANDLER: a Python process killed by a signal prints every thread's stack first.
    # (spark-submit exit 134, SIGABRT, seen here and in the DAG test: delta-rs' filesystem
    # aborting the driver at exit; see delta_io.arrow_filesystem.)
    env.update(PYSPARK_PYTHON=py, PYSPARK_DRIVER_PYTHON=py, PYTHONFAULTHANDLER="1")
    cmd = [spark_submit(), "--master", cluster.master_url, "--py-files", shipped["zip"],
           "--jars", ",".join(jars.ensure()), "--conf", "spark.executor.memory=768m",
           "--conf", "spark.driver.memory=1g", "--conf", f"spark.pyspark.python={py}",
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


def test_a_build_through_spark_submit_on_the_cluster_equals_local_mode(cluster, shipped, spark, tmp_path):
    """One range build (a pretrain set and a one-day window) through the cluster; its tables
    equal the same build's in local mode. The point is the Delta jobs on executors that
    import only the shipped zip (the daily jobs through spark-submit run in the DAG test).
    """
    from tests.builder.test_roundtrip import run_cli

    data = synth(tmp_path / "synth", days=2)
    args = ["--config", str(data / "config.yaml"), "--input", str(data / "lean"), "--as-of", DAYS[2],
            "--pretrain-days", "1", "--window-days", "1"]
    out = tmp_path / "build"
    before = len(cluster.state().get("completedapps", []))
    submit(cluster, shipped, "build", *args, "--output", str(out), "--report", str(tmp_path / "r.json"),
           tmp=tmp_path)
    got = json.loads((tmp_path / "r.json").read_text())
    assert got["reconciled"] and got["samples"] > 0 and got["impressions_in_samples"] > 0
    assert len(cluster.state().get("completedapps", [])) == before + 1  # it ran on the cluster
    # the same build in local mode, in-process on the shared session
    local = tmp_path / "local"
    restore = fast_session_conf(spark)
    try:
        rc, err = run_cli(["build", *args, "--output", str(local)])
    finally:
        restore()
    assert rc == 0, err
    tables = table_digest(out)
    assert set(tables) == set(TABLES)
    assert tables == table_digest(local)
