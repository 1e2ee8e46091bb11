"""userwise_pretrain: the M-day pretrain samples, pre-sharded and published.

    settings -> wait_for_daily -> pretrain -> preshard -> publish

Runs monthly (the interval [1st of month, 1st of next month) is processed with
as-of = the interval's end) or on demand: trigger with conf
``{"date": "YYYY-MM-DD"}`` (the last day to include; as-of is the day after)
and optionally ``{"incremental_days": M}``. ``wait_for_daily`` waits until the
daily DAG has published that last day, so pretrain never reads a half-built
requests table. Pretrain takes requests before as-of minus M days.
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
    dag_id="userwise_pretrain",
    schedule=CronDataIntervalTimetable("0 0 1 * *", timezone="UTC"),
    start_date=common.start_date(CFG),
    catchup=False,
    max_active_runs=1,
    default_args=common.default_args(CFG),
    params={"date": None, "incremental_days": int(CFG["incremental_days"])},
    tags=["userwise"],
    doc_md=__doc__,
)
def userwise_pretrain():
    @task
    def settings() -> dict:
        return common.run_settings(get_current_context(), CFG)

    @task.sensor(poke_interval=float(CFG["sensor_poke_seconds"]),
                 timeout=float(CFG["sensor_timeout_hours"]) * 3600, mode="reschedule", retries=0)
    def wait_for_daily(st: dict) -> bool:
        return common.day_published(st)  # the day's record in the build folder, on its store

    pretrain = common.spark_task("pretrain", "pretrain", [
        "--config", s("config"), "--build-dir", s("build_dir"), "--as-of", s("as_of"),
        "--incremental-days", s("incremental_days")], CFG)
    preshard = common.spark_task("preshard", "preshard", [
        "--build-dir", s("build_dir"), "--shards", s("pretrain_staging"), "--nodes", s("nodes"),
        "--ranks-per-node", s("ranks_per_node"), "--kind", "pretrain"], CFG)
    publish = common.spark_task("publish", "publish", [
        "--build-dir", s("build_dir"), "--shards", s("shards"), "--kind", "pretrain", "--as-of", s("as_of")], CFG)

    st = settings()
    wait_for_daily(st) >> pretrain >> preshard >> publish


userwise_pretrain()
