"""``userwise backfill --from D1 --to D2``: the daily chain, day by day, in order.

For each UTC day d in [D1, D2] (both inclusive), the same steps as the daily
DAG, in one Spark session::

    requests(d) -> history(d) -> window(d) -> preshard (into S/_staging/...) -> publish(d)

A day whose published record exists (``publish.is_published``) is skipped
unless ``--force``; since a day is published only after its last step, a
backfill that failed on day d resumes from d when run again with the same
arguments. Once one day is (re)built, every later day of the range is rebuilt
too: day d+1's history starts from day d's. With ``--force`` a day's record
is removed before it is rebuilt, so a run killed half-way never leaves a
stale record claiming the day.

Every step is idempotent (replaceWhere per date; the history MERGEs the next
date and derives itself from the events table when a date is rerun; a window's
stream is derived from the events, never from an old history version; preshard
into a staging folder, publish by rename and marker last), so rerunning a day,
forced or after a failure, gives the same tables and shards.
"""

from __future__ import annotations

import datetime as dt
import json
import sys
import time

from userwise.pipelines.errors import UserwiseError
from userwise.pipelines.shards import publish


def days(date_from, date_to) -> list[dt.date]:
    a, b = dt.date.fromisoformat(str(date_from)), dt.date.fromisoformat(str(date_to))
    if b < a:
        raise UserwiseError(f"--to {b} is before --from {a}; both dates are inclusive, --to must be >= --from")
    return [a + dt.timedelta(days=i) for i in range((b - a).days + 1)]


def preshard_argv(output: str, staging: str, window_end: dt.date, nodes: int, ranks: int,
                  window_days: int = 1) -> list[str]:
    return ["preshard", "--samples", output, "--output", staging, "--nodes", str(nodes),
            "--ranks-per-node", str(ranks), "--kind", "incremental", "--window", window_end.isoformat(),
            "--window-days", str(window_days)]


def run_day(spark, cfg, *, input_path: str, output: str, date: dt.date, actions_path: str | None = None,
            shards: str | None = None, window_days: int = 1, nodes: int = 1, ranks_per_node: int = 1,
            log=print) -> dict:
    """One day's chain; returns the published record."""
    from userwise.pipelines import cli
    from userwise.pipelines.build import daily

    t0 = time.monotonic()
    steps = {}
    steps["requests"] = daily.requests_day(spark, cfg, input_path, output, date, actions_path=actions_path)
    steps["history"] = daily.history_day(spark, cfg, output, date)
    steps["window"] = daily.window_day(spark, cfg, output, date, window_days)
    built = steps["window"] is not None
    if shards and built:
        key = publish.set_key("incremental", date=date)
        staging = publish.staging_root(shards, key)
        rc = cli.main(preshard_argv(output, staging, publish.window_of(date)[1], nodes, ranks_per_node,
                                       window_days))
        if rc:
            raise UserwiseError(f"preshard of {key} into {staging} failed (exit {rc}); fix it and rerun the "
                                "backfill: it resumes from this day")
    rec = publish.publish(output, kind="incremental", date=date, shards=shards if built else None,
                          window_days=window_days)
    log(json.dumps({"date": date.isoformat(), "status": "built", "seconds": round(time.monotonic() - t0, 1),
                    "tables": rec["tables"], "shards": (rec["shards"] or {}).get("root")}))
    return rec


def backfill(spark, cfg, *, date_from, date_to, input_path: str, output: str, actions_path: str | None = None,
             shards: str | None = None, window_days: int = 1, nodes: int = 1, ranks_per_node: int = 1,
             force: bool = False, log=print) -> dict:
    """Run the range; returns {"built": [...], "skipped": [...]} (ISO dates)."""
    out = {"built": [], "skipped": []}
    rebuilding = False
    for d in days(date_from, date_to):
        if not force and not rebuilding and publish.is_published(output, "incremental", d, shards):
            out["skipped"].append(d.isoformat())
            log(json.dumps({"date": d.isoformat(), "status": "skipped (published)"}))
            continue
        rebuilding = True
        publish.unpublish(output, "incremental", d, shards)
        run_day(spark, cfg, input_path=input_path, output=output, date=d, actions_path=actions_path,
                shards=shards, window_days=window_days, nodes=nodes, ranks_per_node=ranks_per_node, log=log)
        out["built"].append(d.isoformat())
    return out


def cli(args) -> int:
    import os

    from userwise.pipelines import config
    from userwise.pipelines.runtime.spark import get_spark

    if not os.environ.get("PYSPARK_GATEWAY_PORT"):
        # Local run (not under spark-submit): Python workers use this interpreter, which has pyarrow.
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

    days(args.date_from, args.date_to)  # fail on a bad range before starting Spark
    cfg = config.load(args.config)
    spark = get_spark(args.master, app="userwise-backfill")
    res = backfill(spark, cfg, date_from=args.date_from, date_to=args.date_to, input_path=args.input,
                   output=args.output, actions_path=args.actions, shards=args.shards,
                   window_days=args.window_days, nodes=args.nodes, ranks_per_node=args.ranks_per_node,
                   force=args.force, log=lambda m: print(m, file=sys.stderr))
    print(json.dumps(res))
    return 0
