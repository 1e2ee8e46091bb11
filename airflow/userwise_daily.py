"""userwise_daily: one UTC day of impressions -> published user-wise shards.

    settings -> wait_for_input -> requests -> history -> window -> preshard -> publish

- ``settings`` resolves the run's settings once (run conf > Variable
  ``userwise`` > ``airflow/userwise.yaml``) and the processed day: the last
  UTC day that has ended at the data interval's end (not the logical date).
  Trigger with conf ``{"date": "YYYY-MM-DD"}`` to process a given day.
- ``wait_for_input`` pokes for the day's partition (``input_partition``) in
  reschedule mode (no worker slot held between pokes) and fails after
  ``sensor_timeout_hours``.
- ``requests``, ``history``, ``window``, ``preshard``, ``publish`` each
  spark-submit one file of ``jobs/`` with the project's zip (``--py-files``)
  and Delta's jars. ``history`` has ``depends_on_past``: day d's history
  needs day d-1's, so a failed day blocks the next; ``max_active_runs=1`` and
  catchup run missed days in order.
- ``publish`` moves the staged shard set into place and writes the
  published record (Delta versions, manifest checksum) last.
"""

from __future__ import annotations

import sys
from pathlib import Path

from airflow.sdk import CronDataIntervalTimetable, dag, get_current_context, task

sys.path.insert(0, str(Path(__file__).resolve().parent))
import userwise_dag_common as common  # noqa: E402

CFG = common.load_file()
s = common.s


@dag(
    dag_id="userwise_daily",
    schedule=CronDataIntervalTimetable("0 0 * * *", timezone="UTC"),
    start_date=common.start_date(CFG),
    catchup=True,
    max_active_runs=1,
    default_args=common.default_args(CFG),
    params={"date": None},
    tags=["userwise"],
    doc_md=__doc__,
)
def userwise_daily():
    @task
    def settings() -> dict:
        return common.run_settings(get_current_context(), CFG)

    @task.sensor(poke_interval=float(CFG["sensor_poke_seconds"]),
                 timeout=float(CFG["sensor_timeout_hours"]) * 3600, mode="reschedule", retries=0)
    def wait_for_input(st: dict) -> bool:
        return common.input_ready(st)  # on its store: a local folder, hdfs://, s3a://, ...

    day = ["--config", s("config"), "--build-dir", s("build_dir"), "--date", s("date")]
    actions = ["--actions", s("actions")] if CFG.get("actions") else []
    requests = common.spark_task("requests", "requests", [*day, "--input", s("input"), *actions], CFG)
    history = common.spark_task("history", "history", day, CFG, depends_on_past=True)
    window = common.spark_task("window", "window", [*day, "--window-days", s("window_days")], CFG)
    preshard = common.spark_task("preshard", "preshard", [
        "--build-dir", s("build_dir"), "--shards", s("incremental_staging"), "--nodes", s("nodes"),
        "--ranks-per-node", s("ranks_per_node"), "--kind", "incremental", "--window", s("window_end"),
        "--window-days", s("window_days")], CFG)
    publish = common.spark_task("publish", "publish", [
        "--build-dir", s("build_dir"), "--shards", s("shards"), "--date", s("date"),
        "--window-days", s("window_days")], CFG)

    st = settings()
    wait_for_input(st) >> requests >> history >> window >> preshard >> publish


userwise_daily()
