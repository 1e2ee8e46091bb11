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


def _last_json(text: str) -> dict:
    lines = text.splitlines()
    start = max(i for i, line in enumerate(lines) if line == "{")
    return json.loads("\n".join(lines[start:]))


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


def test_daily_chain_through_spark_submit_on_the_cluster(cluster, shipped, spark, tmp_path):
    """requests -> history -> window of one day through the cluster; the tables equal local mode's.

    (preshard and publish through spark-submit run in the DAG test; here the point is the Delta
    jobs on executors that import only the shipped zip.)
    """
    from userwise.pipelines import config
    from userwise.pipelines.build import daily

    data = synth(tmp_path / "synth", days=1)
    out = tmp_path / "build"
    day = ["--config", str(data / "config.yaml"), "--output", str(out), "--date", DAYS[0]]
    before = len(cluster.state().get("completedapps", []))
    submit(cluster, shipped, "requests", *day, "--input", str(data / "lean"), tmp=tmp_path)
    submit(cluster, shipped, "history", *day, tmp=tmp_path)
    r = submit(cluster, shipped, "window", *day, "--window-days", "1", tmp=tmp_path)
    got = _last_json(r.stdout)  # the job's report (stdout also holds Spark's log4j start-up lines)
    assert got["window_end"] == "2026-01-02" and got["samples"] > 0 and got["impressions"] > 0
    assert len(cluster.state().get("completedapps", [])) == before + 3  # all three ran on the cluster
    # same tables as local mode, in-process (the shared session, the daily API)
    local = str(tmp_path / "local")
    cfg = config.load(str(data / "config.yaml"))
    restore = fast_session_conf(spark)
    try:
        daily.requests_day(spark, cfg, str(data / "lean"), local, DAYS[0])
        daily.history_day(spark, cfg, local, DAYS[0])
        daily.window_day(spark, cfg, local, DAYS[0], 1)
    finally:
        restore()
    tables = table_digest(out)
    assert set(tables) == set(TABLES)
    assert tables == table_digest(local)
