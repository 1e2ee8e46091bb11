"""Shared by the userwise DAG files: the config file, run settings, the processed day.

Importable without Airflow (the tests import it directly); the product's own modules are
imported inside the functions that run in tasks, never when the scheduler parses a DAG
file. No transform logic: the DAGs only submit ``jobs/*.py``.

Paths may be local or any store's URL (``hdfs://``, ``s3a://``, ``gs://``): every path is
joined and tested through the product's storage layer (``userwise.pipelines.runtime.storage``,
the same code the jobs use), never ``os.path``, and the sensors poke the store itself. A
process that reaches HDFS through WebHDFS needs ``USERWISE_WEBHDFS`` (docs/storage.md); S3
the ``AWS_*`` variables.

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
    "build_dir": "{project_root}/demo/build",
    "shards": "{project_root}/demo/shards",
    "incremental_days": 30,
    "window_days": 1,
    "nodes": 1,
    "ranks_per_node": 1,
    "py_files": "{project_root}/dist/userwise-0.1.0-pyfiles.zip",
    "jobs": "{project_root}/jobs",
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
RUN_KEYS = ("config", "input", "input_partition", "actions", "build_dir", "shards", "incremental_days",
            "window_days", "nodes", "ranks_per_node", "py_files", "jobs", "jars", "packages", "spark_conf")
# Run conf keys that are not settings: the processed day a manual run asks for.
RUN_ONLY = ("date",)


class SettingsError(ValueError):
    """A Variable or run conf key the DAGs do not know or cannot change at run time."""


def _check_keys(layer: dict, where: str, allowed: tuple[str, ...] = ()) -> dict:
    """The layer's run settings; a key that is not a run setting is refused by name."""
    out = {}
    for k, v in layer.items():
        if k in RUN_KEYS or k in allowed:
            out[k] = v
        elif k in DEFAULTS:
            raise SettingsError(f"{where}: {k!r} is fixed when the scheduler parses the DAG files; set it in "
                                f"the settings file ({CONFIG_ENV} or airflow/userwise.yaml), not per run")
        else:
            raise SettingsError(f"{where}: unknown key {k!r}; the keys a run may set are "
                                f"{sorted(RUN_KEYS + allowed)}")
    return out


def load_file(path: str | os.PathLike | None = None) -> dict[str, Any]:
    """DEFAULTS overridden by the YAML file (``USERWISE_AIRFLOW_CONFIG`` or airflow/userwise.yaml)."""
    from userwise.pipelines.config import safe_yaml

    path = Path(path or os.environ.get(CONFIG_ENV) or HERE / "userwise.yaml")
    out = dict(DEFAULTS)
    if path.exists():
        got = safe_yaml(path.read_text(), str(path)) or {}
        unknown = sorted(set(got) - set(DEFAULTS))
        if unknown:
            raise SettingsError(f"{path}: unknown keys {unknown}; known: {sorted(DEFAULTS)}")
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
    """The settings of one run: run conf > Variable > file, paths formatted, jars resolved.

    Every key of the Variable and of the run conf is honoured or refused by name
    (:class:`SettingsError`): a key the DAGs do not know, or one fixed at parse time."""
    from userwise.pipelines.runtime import storage
    from userwise.pipelines.shards import publish

    layers = (_check_keys(variable or {}, f"the Airflow Variable {VARIABLE!r}"),
              _check_keys(run_conf or {}, "the run conf", RUN_ONLY))
    out = {k: file_cfg[k] for k in RUN_KEYS}
    for layer in layers:
        for k, v in layer.items():
            if k in RUN_KEYS and v is not None and v != "":
                out[k] = v
    ctx = {"project_root": str(PROJECT_ROOT), "date": day.isoformat()}
    for k in ("config", "input", "actions", "build_dir", "shards", "py_files", "jobs"):
        out[k] = _fmt(out[k], ctx)
    out["input_partition"] = _fmt(out["input_partition"], {**ctx, "input": out["input"]})
    for k in ("incremental_days", "window_days", "nodes", "ranks_per_node"):
        out[k] = int(out[k])
    if out["jars"] == "auto":
        out["jars"] = _auto_jars(out["input"], out["actions"], out["build_dir"], out["shards"], out["config"])
    for k in ("jars", "py_files", "actions"):
        out[k] = out[k] or ""  # "" renders to no --jars / --py-files flag
    conf = {str(k): str(v) for k, v in (file_cfg.get("spark_conf") or {}).items()}
    conf.update({str(k): str(v) for k, v in (out["spark_conf"] or {}).items()})
    out["spark_conf"] = conf
    out["date"] = day.isoformat()
    out["window_end"] = (day + dt.timedelta(days=1)).isoformat()
    out["as_of"] = (day + dt.timedelta(days=1)).isoformat()
    out["project_root"] = str(PROJECT_ROOT)
    for k in ("config", "input", "input_partition", "actions", "build_dir", "shards", "jobs"):
        if out[k]:
            out[k] = storage.absolute(out[k])  # a local path made absolute; a URL as it is
    out["incremental_staging"] = publish.staging_root(out["shards"], publish.set_key("incremental", date=day))
    out["pretrain_staging"] = publish.staging_root(out["shards"], publish.set_key("pretrain", as_of=out["as_of"]))
    return out


def input_ready(st: dict) -> bool:
    """The daily sensor's poke: the day's input partition exists on its store."""
    from userwise.pipelines.runtime import storage

    return storage.exists(st["input_partition"])


def day_published(st: dict) -> bool:
    """The pretrain sensor's poke: the daily DAG has published the last day to include."""
    from userwise.pipelines.records import published

    return published.read(st["build_dir"], "incremental", st["date"]) is not None


def _auto_jars(*paths) -> str | None:
    """Delta's jars from the cache, and the S3 connector's when a path is on S3."""
    try:
        from userwise.pipelines.runtime import jars
    except ImportError:
        return None
    got = jars.for_paths(*paths)
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
    """The job file spark-submit runs: ``<jobs>/<name>.py``, from the run's settings (a local
    folder, or a store's URL that a cluster-mode submission reads)."""
    return "{{ ti.xcom_pull(task_ids='settings')['jobs'] }}/" + f"{name}.py"


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
