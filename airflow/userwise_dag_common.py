"""Shared by the userwise DAG files: the config file, run settings, the processed day.

Pure Python, importable without Airflow (the tests import it directly).
No transform logic: the DAGs only submit ``jobs/*.py``.

The processed day. Airflow 3's default timetable for a cron schedule
(``CronTriggerTimetable``) gives a run at 2026-01-02T00:00 a zero-length
data interval and logical date 2026-01-02, the run time, not the day that
just ended; ``CronDataIntervalTimetable`` (which our DAGs use) gives it the
interval [2026-01-01, 2026-01-02). Either way the day to process is the last
UTC day that has fully ended by the interval's end: ``processed_day``.
"""

from __future__ import annotations

import datetime as dt
import json
import os
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PROJECT_ROOT = HERE.parent
CONFIG_ENV = "USERWISE_AIRFLOW_CONFIG"
VARIABLE = "userwise"

# Built-in defaults; the YAML file overrides them (keys documented there).
DEFAULTS: dict[str, Any] = {
    "start_date": "2026-01-01",
    "config": "{project_root}/demo/synth/config.yaml",
    "input": "{project_root}/demo/synth/lean",
    "input_partition": "{input}/date={date}",
    "actions": None,
    "output": "{project_root}/demo/build",
    "shards": "{project_root}/demo/shards",
    "pretrain_days": 30,
    "window_days": 1,
    "nodes": 1,
    "ranks_per_node": 1,
    "py_files": "{project_root}/dist/userwise-0.1.0-pyfiles.zip",
    "jars": "auto",
    "packages": None,
    "spark_conn_id": "spark_default",
    "spark_conf": {},
    "sensor_poke_seconds": 300,
    "sensor_timeout_hours": 12,
    "retries": 2,
    "retry_delay_minutes": 2,
}
# Keys a run may override (DAG params / the Variable); the rest are fixed at parse time.
RUN_KEYS = ("config", "input", "input_partition", "actions", "output", "shards", "pretrain_days",
            "window_days", "nodes", "ranks_per_node", "py_files", "jars", "packages", "spark_conf")


def load_file(path: str | os.PathLike | None = None) -> dict[str, Any]:
    """DEFAULTS overridden by the YAML file (``USERWISE_AIRFLOW_CONFIG`` or airflow/userwise.yaml)."""
    import yaml

    path = Path(path or os.environ.get(CONFIG_ENV) or HERE / "userwise.yaml")
    out = dict(DEFAULTS)
    if path.exists():
        with open(path) as fh:
            got = yaml.safe_load(fh) or {}
        unknown = sorted(set(got) - set(DEFAULTS))
        if unknown:
            raise ValueError(f"{path}: unknown keys {unknown}; known: {sorted(DEFAULTS)}")
        out.update(got)
    return out


def default_args(cfg: dict) -> dict[str, Any]:
    """Retries with exponential backoff, shared by every DAG."""
    return {
        "retries": int(cfg["retries"]),
        "retry_delay": dt.timedelta(minutes=float(cfg["retry_delay_minutes"])),
        "retry_exponential_backoff": 2.0,
        "max_retry_delay": dt.timedelta(hours=1),
    }


def start_date(cfg: dict) -> dt.datetime:
    return dt.datetime.fromisoformat(cfg["start_date"]).replace(tzinfo=dt.timezone.utc)


def processed_day(data_interval_end: dt.datetime, override: str | None = None) -> dt.date:
    """The UTC day a run processes: the last day fully ended at ``data_interval_end``.

    ``override`` (an ISO date from the trigger's conf) wins when given.
    """
    if override:
        return dt.date.fromisoformat(str(override))
    end = data_interval_end
    if end.tzinfo is None:
        raise ValueError(f"data_interval_end {end!r} has no time zone; Airflow passes aware datetimes")
    return end.astimezone(dt.timezone.utc).date() - dt.timedelta(days=1)


def _fmt(v, ctx: dict) -> Any:
    return v.format(**ctx) if isinstance(v, str) else v


def resolve(file_cfg: dict, variable: dict | None, run_conf: dict | None, day: dt.date) -> dict[str, Any]:
    """The settings of one run: run conf > Variable > file, paths formatted, jars resolved."""
    out = {k: file_cfg[k] for k in RUN_KEYS}
    for layer in (variable or {}, run_conf or {}):
        for k, v in layer.items():
            if k in RUN_KEYS and v is not None and v != "":
                out[k] = v
    ctx = {"project_root": str(PROJECT_ROOT), "date": day.isoformat()}
    for k in ("config", "input", "actions", "output", "shards", "py_files"):
        out[k] = _fmt(out[k], ctx)
    out["input_partition"] = _fmt(out["input_partition"], {**ctx, "input": out["input"]})
    for k in ("pretrain_days", "window_days", "nodes", "ranks_per_node"):
        out[k] = int(out[k])
    if out["jars"] == "auto":
        out["jars"] = _auto_jars()
    for k in ("jars", "py_files", "actions"):
        out[k] = out[k] or ""  # "" renders to no --jars / --py-files flag
    conf = {str(k): str(v) for k, v in (file_cfg.get("spark_conf") or {}).items()}
    conf.update({str(k): str(v) for k, v in (out["spark_conf"] or {}).items()})
    out["spark_conf"] = conf
    out["date"] = day.isoformat()
    out["window_end"] = (day + dt.timedelta(days=1)).isoformat()
    out["as_of"] = (day + dt.timedelta(days=1)).isoformat()
    out["project_root"] = str(PROJECT_ROOT)
    out["incremental_staging"] = os.path.join(os.path.abspath(out["shards"]), "_staging", "incremental",
                                              out["window_end"])
    out["pretrain_staging"] = os.path.join(os.path.abspath(out["shards"]), "_staging", "pretrain", out["as_of"])
    return out


def _auto_jars() -> str | None:
    try:
        from userwise.pipelines.runtime import jars
    except ImportError:
        return None
    got = jars.cached_jars()
    return ",".join(got) if got else None


def run_settings(context: dict, file_cfg: dict) -> dict[str, Any]:
    """Resolve a run's settings inside a task (reads the Variable, the run conf, the interval)."""
    from airflow.sdk import Variable

    conf = dict(getattr(context.get("dag_run"), "conf", None) or {})
    try:
        var = Variable.get(VARIABLE, default=None, deserialize_json=True)
    except Exception:  # noqa: BLE001 - no Variable store reachable: file defaults
        var = None
    if isinstance(var, str):
        var = json.loads(var)
    day = processed_day(context["data_interval_end"], conf.get("date") or None)
    return resolve(file_cfg, var, conf, day)


def job(name: str) -> str:
    return str(PROJECT_ROOT / "jobs" / f"{name}.py")


def s(key: str) -> str:
    """Template pulling one resolved setting from the ``settings`` task's XCom."""
    return "{{ ti.xcom_pull(task_ids='settings')['" + key + "'] }}"


def spark_task(task_id: str, app: str, args: list[str], file_cfg: dict, **kw):
    """A SparkSubmitOperator for ``jobs/<app>.py`` with the run's shipping and resources."""
    from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator

    return SparkSubmitOperator(
        task_id=task_id,
        application=job(app),
        application_args=args,
        conn_id=file_cfg["spark_conn_id"],
        py_files=s("py_files"),
        jars=s("jars") if file_cfg.get("jars") else None,
        packages=file_cfg.get("packages"),
        # Resources and any Spark setting: templated, so a run's conf or the Variable can change them.
        # The keys are the file's spark_conf keys; each value is templated, so a run's conf or the
        # Variable can change resources (memory, cores, partitions) without editing the DAG.
        conf={k: "{{ ti.xcom_pull(task_ids='settings')['spark_conf']['" + k + "'] }}"
              for k in (file_cfg.get("spark_conf") or {})},
        name=f"userwise-{task_id}",
        **kw,
    )
