"""spark-submit beyond local mode: a loopback standalone cluster (master + 2 worker JVMs).

Driver and executors use a Python that has the third-party packages but not
``userwise`` (``standalone.isolated_python``): the project imports only from
the zip shipped with ``--py-files``. The cluster is stopped afterwards.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from userwise.pipelines import jars, ship
from userwise.pipelines.standalone import Cluster, isolated_python, spark_submit

from .uwchain import DAYS, ROOT, shard_digest, synth, table_digest

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
    env.update(PYSPARK_PYTHON=py, PYSPARK_DRIVER_PYTHON=py)
    cmd = [spark_submit(), "--master", cluster.master_url, "--py-files", shipped["zip"],
           "--jars", ",".join(jars.ensure()), "--conf", "spark.executor.memory=768m",
           "--conf", "spark.driver.memory=1g", "--conf", f"spark.pyspark.python={py}",
           "--conf", "spark.sql.shuffle.partitions=4", str(ROOT / "jobs" / f"{job}.py"), *args]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tmp)
    assert r.returncode == 0, f"{job}: {r.stderr[-4000:]}"
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


def test_daily_chain_through_spark_submit_on_the_cluster(cluster, shipped, tmp_path):
    data = synth(tmp_path / "synth", days=1)
    out, shards = tmp_path / "build", tmp_path / "shards"
    day = ["--config", str(data / "config.yaml"), "--output", str(out), "--date", DAYS[0]]
    submit(cluster, shipped, "requests", *day, "--input", str(data / "lean"), tmp=tmp_path)
    submit(cluster, shipped, "history", *day, tmp=tmp_path)
    submit(cluster, shipped, "window", *day, "--window-days", "1", tmp=tmp_path)
    staging = shards / "_staging" / "incremental" / "2026-01-02"
    submit(cluster, shipped, "preshard", "--samples", str(out), "--output", str(staging), "--nodes", "2",
           "--ranks-per-node", "1", "--kind", "incremental", "--window", "2026-01-02", tmp=tmp_path)
    submit(cluster, shipped, "publish", "--output", str(out), "--shards", str(shards), "--date", DAYS[0],
           tmp=tmp_path)
    rec = json.loads((out / "_userwise" / "published" / "incremental" / f"{DAYS[0]}.json").read_text())
    assert rec["shards"]["root"] == str(shards / "incremental" / "2026-01-02")
    assert {"requests", "history", "samples"} <= set(rec["tables"])
    assert not staging.exists()
    # same result as local mode in-process (the backfill path)
    local = subprocess.run([str(Path(os.sys.executable)), "-m", "userwise.pipelines.cli", "backfill", "--from",
                            DAYS[0], "--to", DAYS[0], "--config", str(data / "config.yaml"), "--input",
                            str(data / "lean"), "--output", str(tmp_path / "local"), "--shards",
                            str(tmp_path / "local_s"), "--nodes", "2"], capture_output=True, text=True)
    assert local.returncode == 0, local.stderr[-3000:]
    assert table_digest(out) == table_digest(tmp_path / "local")
    assert shard_digest(shards) == shard_digest(tmp_path / "local_s")
