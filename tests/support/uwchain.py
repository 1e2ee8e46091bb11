"""Shared helpers for the Airflow / backfill / cluster tests: a tiny generated log, table snapshots."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from userwise.pipelines.shards import manifest as mf

ROOT = Path(__file__).resolve().parents[2]
DAYS = ("2026-01-01", "2026-01-02", "2026-01-03")
TABLES = ("requests", "events", "history", "samples", "quarantine")
# Spark settings for tiny tables: few shuffle partitions, and Delta's snapshot state in one partition
# (Delta's default is 50 tasks per snapshot, which dominates a day of a few hundred rows).
FAST_CONF = {"spark.sql.shuffle.partitions": "2", "spark.databricks.delta.snapshotPartitions": "1"}
# For the DAG test's short-lived spark-submit JVMs (one small job each): the client compiler only
# and the serial collector. A one-day job on the tiny log took 16-17 s instead of 20-21 s, the DAG
# test 191 s instead of 212 s. Longer-lived JVMs keep the defaults: the suite's in-process session
# was slower with C1 alone (238 vs 178 s on three build tests), a backfill and the cluster's jobs
# were no faster.
SUBMIT_JVM = {"spark.driver.extraJavaOptions": "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"}


def synth(dest: Path, days: int = 3) -> Path:
    """A tiny lean log (hive-partitioned by date) and its config under dest."""
    if not (dest / "config.yaml").exists():
        subprocess.run([sys.executable, "-m", "userwise.pipelines.cli", "synth", "--output", str(dest),
                        "--days", str(days), "--users", "8", "--items", "100", "--impressions", "600",
                        "--kinds", "lean", "--start", DAYS[0]], check=True, capture_output=True)
    return dest


def table_digest(output: str | Path, tables=TABLES) -> dict[str, str]:
    """Order-free content digest of each Delta table's current version (delta-rs, no JVM)."""
    from userwise.pipelines.runtime import delta_io

    out = {}
    for t in tables:
        p = Path(output) / t
        if not (p / "_delta_log").is_dir():
            continue
        tbl = delta_io.read_small(str(p))
        rows = sorted(json.dumps(r, sort_keys=True, default=str) for r in tbl.to_pylist())
        out[t] = hashlib.sha256("\n".join(rows).encode()).hexdigest()
    return out


def shard_digest(shards: str | Path) -> dict[str, str]:
    """sha256 of every published shard file (manifest excluded: it names the source version)."""
    out = {}
    for p in sorted(Path(shards).rglob("*.parquet")):
        if "_staging" not in p.parts:
            out[str(p.relative_to(shards))] = mf.file_sha256(str(p))
    return out


def table_rows(spark, out, name, inputs, where=None) -> tuple[list[str], list[str]]:
    """(columns, every row as text, sorted): a table's content (the rows matching the SQL ``where``),
    whatever its file order or store, with the input files' locations (quarantined rows name their
    file) cut to the input's own folder (``inputs``: the input paths, or their base names)."""
    import re

    from userwise.pipelines.runtime import delta_io

    cut = re.compile(r"[^\s'\"]*/(" + "|".join(re.escape(os.path.basename(str(p))) for p in inputs) + r")/")
    df = delta_io.read(spark, delta_io.table_path(str(out), name))
    if where is not None:
        df = df.where(where)
    pdf = df.select([f.name for f in df.schema if not f.dataType.typeName().startswith("timestamp")]  # when it ran
                    if name == "history_log" else df.columns).toPandas()
    return list(pdf.columns), sorted(cut.sub(r"<in>/\1/", str(tuple(str(v) for v in r)))
                                     for r in pdf.itertuples(index=False))


def shard_rows(root, drop=()) -> list[str]:
    """Every row of a shard set's files (local or on a store; without the users ``drop``), as
    text, sorted."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from userwise.pipelines.runtime import storage

    fs, base = storage.filesystem(str(root))
    out = []
    for s in mf.load(str(root))["shards"]:
        t = pq.read_table(f"{base}/{s['path']}", filesystem=fs)
        if drop:
            t = t.filter(pc.invert(pc.is_in(t["user"], value_set=pa.array(drop, t["user"].type))))
        out += [str(r) for r in t.to_pylist()]
    return sorted(out)


def fast_session_conf(spark):
    """Set FAST_CONF on a live session; returns a function that restores the old values."""
    from userwise.pipelines.runtime.spark import session_conf

    block = session_conf(spark, FAST_CONF)
    block.__enter__()
    return lambda: block.__exit__(None, None, None)


def submit_conf_args() -> list[str]:
    """FAST_CONF (and no UI) as spark-submit ``--conf`` arguments."""
    out = []
    for k, v in {**FAST_CONF, "spark.ui.enabled": "false"}.items():
        out += ["--conf", f"{k}={v}"]
    return out


def env_with_spark_bin() -> dict[str, str]:
    from tests.support.standalone import spark_home

    env = dict(os.environ)
    env["PATH"] = f"{spark_home() / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("PYSPARK_PYTHON", sys.executable)
    return env
