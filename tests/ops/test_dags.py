"""The Airflow DAGs: they load, their graph is the README's, the processed day is right.

The end-to-end test runs the daily DAG with ``dag.test()`` (SparkSubmitOperator
tasks against local Spark) twice on one small generated day.
"""

from __future__ import annotations

import datetime as dt
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.uwchain import FAST_CONF, ROOT, SUBMIT_JVM, env_with_spark_bin, synth

DAG_FOLDER = ROOT / "airflow"
UTC = dt.timezone.utc


@pytest.fixture(scope="module", autouse=True)
def airflow_home(tmp_path_factory):
    home = tmp_path_factory.mktemp("airflow_home")
    old = {k: os.environ.get(k) for k in ("AIRFLOW_HOME", "AIRFLOW__CORE__LOAD_EXAMPLES")}
    os.environ["AIRFLOW_HOME"] = str(home)
    os.environ["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"
    yield home
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def common():
    sys.path.insert(0, str(DAG_FOLDER))
    return importlib.import_module("userwise_dag_common")


def dagbag():
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(dag_folder=str(DAG_FOLDER))


def edges(dag) -> set[tuple[str, str]]:
    return {(t.task_id, d) for t in dag.tasks for d in t.downstream_task_ids}


def test_dagbag_loads_every_dag_without_errors():
    bag = dagbag()
    assert bag.import_errors == {}
    assert set(bag.dag_ids) == {"userwise_daily", "userwise_pretrain"}


def test_daily_graph_is_the_documented_chain():
    dag = dagbag().dags["userwise_daily"]
    chain = ["settings", "wait_for_input", "requests", "history", "window", "preshard", "publish"]
    assert edges(dag) == set(zip(chain, chain[1:]))
    by_id = {t.task_id: t for t in dag.tasks}
    assert [t for t, op in by_id.items() if op.depends_on_past] == ["history"]
    assert dag.max_active_runs == 1 and dag.catchup is True
    for tid in ("requests", "history", "window", "preshard", "publish"):
        op = by_id[tid]
        assert type(op).__name__ == "SparkSubmitOperator"
        assert op.application == "{{ ti.xcom_pull(task_ids='settings')['jobs'] }}/" + f"{tid}.py"
        assert op.retries == 2 and op.retry_exponential_backoff
    sensor = by_id["wait_for_input"]
    assert sensor.mode == "reschedule" and sensor.timeout == 12 * 3600
    assert dag.start_date == dt.datetime(2026, 1, 1, tzinfo=UTC)


def test_pretrain_graph():
    dag = dagbag().dags["userwise_pretrain"]
    chain = ["settings", "wait_for_daily", "pretrain", "preshard", "publish"]
    assert edges(dag) == set(zip(chain, chain[1:]))
    assert dag.max_active_runs == 1


def test_documented_graph_matches_the_readme():
    text = (ROOT / "docs" / "operations.md").read_text()
    assert "settings -> wait_for_input -> requests -> history -> window -> preshard -> publish" in text
    assert "settings -> wait_for_daily -> pretrain -> preshard -> publish" in text


@pytest.mark.parametrize("end, override, want", [
    (dt.datetime(2026, 1, 2, tzinfo=UTC), None, dt.date(2026, 1, 1)),
    (dt.datetime(2026, 1, 2, 13, 45, tzinfo=UTC), None, dt.date(2026, 1, 1)),  # manual run mid-day
    (dt.datetime(2026, 1, 2, 1, 0, tzinfo=dt.timezone(dt.timedelta(hours=8))), None, dt.date(2025, 12, 31)),
    (dt.datetime(2026, 1, 2, tzinfo=UTC), "2025-06-30", dt.date(2025, 6, 30)),
])
def test_processed_day(end, override, want):
    assert common().processed_day(end, override) == want


def test_processed_day_rejects_naive_datetimes():
    with pytest.raises(ValueError, match="time zone"):
        common().processed_day(dt.datetime(2026, 1, 2))


def _scheduled_intervals(timetable, start, n):
    from airflow.timetables.base import TimeRestriction

    out, last = [], None
    for _ in range(n):
        info = timetable.next_dagrun_info(last_automated_data_interval=last,
                                          restriction=TimeRestriction(earliest=start, latest=None, catchup=True))
        out.append(info)
        last = info.data_interval
    return out


@pytest.mark.parametrize("kind", ["interval", "trigger"])
def test_catchup_runs_process_consecutive_days_from_start(kind):
    """Airflow 3 semantics: with either cron timetable, catch-up runs process start, start+1, ...

    With CronTriggerTimetable (Airflow 3's default for a cron string) the
    logical date is the run time, one day after the processed day.
    """
    import pendulum
    from airflow.timetables.interval import CronDataIntervalTimetable
    from airflow.timetables.trigger import CronTriggerTimetable

    start = pendulum.datetime(2026, 1, 1, tz="UTC")
    tt = (CronDataIntervalTimetable("0 0 * * *", timezone="UTC") if kind == "interval"
          else CronTriggerTimetable("0 0 * * *", timezone="UTC"))
    infos = _scheduled_intervals(tt, start if kind == "interval" else start.add(days=1), 3)
    days = [common().processed_day(i.data_interval.end) for i in infos]
    assert days == [dt.date(2026, 1, 1), dt.date(2026, 1, 2), dt.date(2026, 1, 3)]
    if kind == "trigger":
        assert [i.logical_date.date() for i in infos] == [dt.date(2026, 1, 2), dt.date(2026, 1, 3),
                                                          dt.date(2026, 1, 4)]


def test_dag_timetable_first_run_processes_start_date():
    from airflow.serialization.encoders import coerce_to_core_timetable
    from airflow.timetables.base import TimeRestriction

    dag = dagbag().dags["userwise_daily"]
    tt = coerce_to_core_timetable(dag.timetable)
    info = tt.next_dagrun_info(last_automated_data_interval=None,
                               restriction=TimeRestriction(earliest=dag.start_date, latest=None, catchup=True))
    assert common().processed_day(info.data_interval.end) == dt.date(2026, 1, 1)


def test_manual_run_processes_the_day_before_its_logical_date():
    """Airflow 3 infers a manual run's interval as the one ending at the logical date.

    So `airflow dags test userwise_daily 2026-01-02` (or dag.test(logical_date=2026-01-02))
    processes 2026-01-01, while the scheduled run for 2026-01-01 has logical date
    2026-01-01 and the interval [01-01, 01-02): both process 2026-01-01.
    """
    import pendulum
    from airflow.timetables.interval import CronDataIntervalTimetable

    tt = CronDataIntervalTimetable("0 0 * * *", timezone="UTC")
    iv = tt.infer_manual_data_interval(run_after=pendulum.datetime(2026, 1, 2, tz="UTC"))
    assert common().processed_day(iv.end) == dt.date(2026, 1, 1)


def test_settings_precedence_run_conf_over_variable_over_file(tmp_path):
    c = common()
    f = c.load_file()
    f = {**f, "build_dir": "/file/out", "nodes": 1, "spark_conf": {"spark.executor.memory": "2g"}}
    got = c.resolve(f, {"build_dir": "/var/out", "nodes": 4, "spark_conf": {"spark.executor.memory": "8g"}},
                    {"nodes": "2", "incremental_days": 7, "date": "2026-01-03"}, dt.date(2026, 1, 3))
    assert got["build_dir"] == "/var/out" and got["nodes"] == 2 and got["incremental_days"] == 7
    assert got["spark_conf"] == {"spark.executor.memory": "8g"}
    assert got["date"] == "2026-01-03" and got["window_end"] == "2026-01-04"
    assert got["incremental_staging"] == os.path.abspath(got["shards"]) + "/_staging/incremental/2026-01-04"
    assert got["input_partition"] == f"{got['input']}/date=2026-01-03"
    assert got["jobs"] == str(ROOT / "jobs")


@pytest.mark.parametrize("layer,key,why", [
    ("variable", "nodez", "unknown key 'nodez'"), ("run_conf", "unknown", "unknown key 'unknown'"),
    ("variable", "retries", "fixed when the scheduler parses"), ("run_conf", "start_date", "fixed when"),
    ("variable", "date", "unknown key 'date'"),  # the processed day is a run's own, not the Variable's
])
def test_every_variable_and_run_conf_key_is_honoured_or_refused_by_name(layer, key, why):
    c = common()
    kw = {"variable": None, "run_conf": None, layer: {key: 1}}
    with pytest.raises(c.SettingsError, match=why):
        c.resolve(c.load_file(), kw["variable"], kw["run_conf"], dt.date(2026, 1, 3))


def test_an_old_key_name_is_an_unknown_key(tmp_path):
    """``output`` and ``pretrain_days`` are no settings: the keys are the command line's words
    (``build_dir``, ``incremental_days``), and a file or a run naming another key is refused."""
    c = common()
    p = tmp_path / "uw.yaml"
    p.write_text("output: /old/D\npretrain_days: 5\n")
    with pytest.raises(c.SettingsError, match=r"unknown keys \['output', 'pretrain_days'\]"):
        c.load_file(p)
    with pytest.raises(c.SettingsError, match="unknown key 'pretrain_days'"):
        c.resolve(c.load_file(), {}, {"pretrain_days": 3}, dt.date(2026, 1, 3))


def test_paths_on_cluster_storage_stay_urls():
    """No os.path on a URL: hdfs:// and s3a:// paths come out as they went in, the staging
    folders joined under them."""
    c = common()
    f = {**c.load_file(), "input": "hdfs://nn:8020/logs/imp", "build_dir": "s3a://uw/D", "shards": "s3a://uw/S/",
         "config": "s3a://uw/conf/c.yaml", "jobs": "hdfs://nn:8020/uw/jobs"}
    got = c.resolve(f, None, None, dt.date(2026, 1, 3))
    assert got["input_partition"] == "hdfs://nn:8020/logs/imp/date=2026-01-03"
    assert got["incremental_staging"] == "s3a://uw/S/_staging/incremental/2026-01-04"
    assert got["pretrain_staging"] == "s3a://uw/S/_staging/pretrain/2026-01-04"
    assert got["build_dir"] == "s3a://uw/D" and got["config"] == "s3a://uw/conf/c.yaml"
    assert got["jobs"] == "hdfs://nn:8020/uw/jobs"


def test_the_sensors_poke_the_store(tmp_path):
    """The sensors' pokes go through the product's storage layer (any store), not Path."""
    c = common()
    st = {"input_partition": str(tmp_path / "in" / "date=2026-01-03"), "build_dir": str(tmp_path / "D"),
          "date": "2026-01-03"}
    assert not c.input_ready(st) and not c.day_published(st)
    (tmp_path / "in" / "date=2026-01-03").mkdir(parents=True)
    from userwise.pipelines.records import published

    published.write(str(tmp_path / "D"), "incremental", "2026-01-03", {"kind": "incremental"})
    assert c.input_ready(st) and c.day_published(st)
    assert c.input_ready({**st, "input_partition": "memory://nothing/here"}) is False


def test_config_file_rejects_unknown_keys(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("nodez: 3\n")
    with pytest.raises(common().SettingsError, match="nodez"):
        common().load_file(p)


def test_spark_submit_command_ships_the_zip_and_jars():
    """What the operator would run, rendered through the hook with the connection from env."""
    from airflow.providers.apache.spark.hooks.spark_submit import SparkSubmitHook

    os.environ["AIRFLOW_CONN_SPARK_DEFAULT"] = '{"conn_type": "spark", "host": "local[2]"}'
    op = {t.task_id: t for t in dagbag().dags["userwise_daily"].tasks}["history"]
    hook = SparkSubmitHook(conn_id=op._conn_id, conf={"spark.executor.memory": "2g"},
                           py_files="dist/userwise-0.1.0-pyfiles.zip", jars="a.jar,b.jar", name="userwise-history",
                           application_args=["--date", "2026-01-01"])
    cmd = hook._build_spark_submit_command(op.application)
    assert cmd[:3] == ["spark-submit", "--master", "local[2]"]
    assert cmd[cmd.index("--py-files") + 1] == "dist/userwise-0.1.0-pyfiles.zip"
    assert cmd[cmd.index("--jars") + 1] == "a.jar,b.jar"
    assert cmd[-3:] == [op.application, "--date", "2026-01-01"] and op.application.endswith("/history.py")
    assert "{{" in op.py_files and "settings" in op.py_files  # resolved per run from the settings task


_FATAL = ("Error code is", "Traceback", "Error:", "Fatal Python error", "terminate called", "panicked",
          "hs_err", "Killed", "Aborted")


def _why(r: subprocess.CompletedProcess, log: Path) -> str:
    """A failed dag.test(): the whole output to ``log``; the lines that say why (a task's
    exception, a job's fatal error: its output is in the task log, amid Airflow's lines), then
    the end."""
    out = r.stdout + r.stderr
    log.write_text(out)
    lines = out.splitlines()
    hits = [i for i, line in enumerate(lines) if any(k in line for k in _FATAL)]
    keep = sorted({j for i in hits[-12:] for j in range(max(0, i - 2), min(len(lines), i + 3))})
    said = "\n".join(lines[j][:600] for j in keep)
    return f"full output in {log}\n--- lines that say why:\n{said}\n--- end:\n{out[-2500:]}"


DAG_RUNS = """
import datetime as dt, sys
from airflow.dag_processing.dagbag import DagBag
bag = DagBag(dag_folder=%(folder)r)
utc = dt.timezone.utc
runs = [("userwise_daily", dt.datetime(2026, 1, 2, tzinfo=utc), None),   # processes 2026-01-01
        ("userwise_daily", dt.datetime(2026, 1, 3, tzinfo=utc), None),   # processes 2026-01-02
        ("userwise_pretrain", dt.datetime(2026, 1, 3, 12, tzinfo=utc), {"date": "2026-01-02", "incremental_days": 1})]
for dag_id, when, conf in runs:
    run = bag.dags[dag_id].test(logical_date=when, run_conf=conf)
    print("STATE", dag_id, when.date(), run.state, flush=True)
    if not str(run.state).endswith("success"):
        sys.exit(1)
"""


@pytest.mark.spark
@pytest.mark.slow
def test_both_dags_on_hdfs_equal_a_local_run(spark, tmp_path, airflow_home):
    """dag.test() of the daily DAG for two days and of the pretrain DAG, with the config, the
    input, the build folder and the shards on a MiniDFSCluster: every task spark-submits its
    job, the sensors poke HDFS. The tables and shard sets on HDFS equal those of the same days
    run locally (backfill, then pretrain, preshard and publish through the CLI)."""
    from tests.support.uwchain import shard_rows, table_rows
    from userwise.pipelines import cli
    from userwise.pipelines.records import published
    from userwise.pipelines.runtime import ship
    from userwise.pipelines.tools.hdfs_store import HdfsStore

    data = synth(tmp_path / "synth", days=2)
    store = HdfsStore(tmp_path / "hdfs").start()
    try:
        fs = store.fsspec()
        fs.put(str(data / "lean"), "/in/lean", recursive=True)
        fs.put(str(data / "config.yaml"), "/conf/config.yaml")
        url = store.url
        zip_path = ship.build(tmp_path / "dist")
        cfg = tmp_path / "userwise.yaml"
        conf = {**FAST_CONF, **SUBMIT_JVM, "spark.hadoop.dfs.replication": "1"}
        cfg.write_text(
            f"config: {url}/conf/config.yaml\ninput: {url}/in/lean\nbuild_dir: {url}/uw/D\nshards: {url}/uw/S\n"
            f"py_files: {zip_path}\nnodes: 2\nsensor_poke_seconds: 1\nsensor_timeout_hours: 0.01\nretries: 0\n"
            "spark_conf: {spark.driver.memory: 1g, spark.ui.enabled: 'false', "
            + ", ".join(f"{k}: '{v}'" for k, v in conf.items()) + "}\n")
        env = env_with_spark_bin()
        env.update(store.env(), USERWISE_AIRFLOW_CONFIG=str(cfg), AIRFLOW_HOME=str(airflow_home),
                   AIRFLOW__CORE__DAGS_FOLDER=str(DAG_FOLDER), AIRFLOW__CORE__LOAD_EXAMPLES="False",
                   AIRFLOW_CONN_SPARK_DEFAULT='{"conn_type": "spark", "host": "local[2]"}')
        subprocess.run([sys.executable, "-m", "airflow", "db", "migrate"], env=env, check=True, capture_output=True)
        r = subprocess.run([sys.executable, "-c", DAG_RUNS % {"folder": str(DAG_FOLDER)}], env=env,
                           capture_output=True, text=True)
        (tmp_path / "dags.out").write_text(r.stdout + r.stderr)
        assert r.returncode == 0, _why(r, tmp_path / "dags.log")
        remote_d, remote_s = f"{url}/uw/D", f"{url}/uw/S"
        os.environ.update(store.env())  # this process reads the store too
        for day in ("2026-01-01", "2026-01-02"):
            assert published.read(remote_d, "incremental", day)["shards"]["root"].startswith(url)
        assert published.read(remote_d, "pretrain", "2026-01-03")["shards"]["rows"] > 0
        assert not fs.exists("/uw/S/_staging/incremental/2026-01-02")  # moved into place

        # the same days locally, through the CLI
        local_d, local_s = str(tmp_path / "local" / "D"), str(tmp_path / "local" / "S")
        common_args = ["--config", str(data / "config.yaml"), "--build-dir", local_d]
        assert cli.main(["backfill", "--from", "2026-01-01", "--to", "2026-01-02", *common_args, "--input",
                         str(data / "lean"), "--shards", local_s, "--nodes", "2"]) == 0
        assert cli.main(["pretrain", *common_args, "--as-of", "2026-01-03", "--incremental-days", "1"]) == 0
        assert cli.main(["preshard", "--build-dir", local_d, "--shards", f"{local_s}/_staging/pretrain/2026-01-03",
                         "--nodes", "2", "--ranks-per-node", "1", "--kind", "pretrain"]) == 0
        assert cli.main(["publish", "--build-dir", local_d, "--shards", local_s, "--kind", "pretrain",
                         "--as-of", "2026-01-03"]) == 0
        for t in ("requests", "events", "history", "samples", "quarantine"):
            a, b = table_rows(spark, local_d, t, [str(data / "lean")]), table_rows(spark, remote_d, t, ["lean"])
            assert a == b and (a[1] or t == "quarantine"), t
        for key in ("incremental/2026-01-02", "incremental/2026-01-03", "pretrain/2026-01-03"):
            assert shard_rows(f"{local_s}/{key}") == shard_rows(f"{remote_s}/{key}") != [], key
    finally:
        os.environ.pop("USERWISE_WEBHDFS", None)
        store.stop()
