"""``userwise backfill --from D1 --to D2``: the daily chain over a range, its tables in one go.

For the UTC days [D1, D2] (both inclusive) it writes what the daily DAG's
``requests -> history -> window`` would, day by day, but in a fixed number of
Spark jobs (cost grows with the data, not with the days):

1. requests, events and quarantine of every day: one job;
2. the history as of the end of D2, derived from the events: one job (each
   day logged in ``history_log``);
3. every day's window [d + 1 - N, d + 1): one plan, one commit
   (:func:`daily.set_samples`, windows may overlap);

then per day, in order, preshard (into S/_staging/...) and publish. The tables
equal the daily jobs run one by one (tested).

A day whose published record exists (``publish.is_published``) is skipped
unless ``--force``; the range rebuilt starts at the first day not published
(every later day is rebuilt too), and its records are removed before any
table is written, so a run killed half-way never leaves a stale record
claiming a day, and rerun with the same arguments it resumes from there.

Every step is idempotent (replaceWhere per date; the history derived from the
events; the windows replaced by set; preshard into a staging folder, publish
by rename and marker last), so rerunning, forced or after a failure, gives the
same tables and shards. ``run_day`` is one day's chain (the daily DAG's order).
"""

from __future__ import annotations

import datetime as dt
import json
import sys
import time

from userwise.pipelines.errors import UserwiseError
from userwise.pipelines.runtime import delta_io, progress
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


def build_days(spark, cfg, *, input_path: str, output: str, first: dt.date, last: dt.date,
               actions_path: str | None = None, window_days: int = 1, log=print) -> dict:
    """The tables of days [first, last] in one go: requests, history, every day's window."""
    from userwise.pipelines.build import build_record, completion, daily
    from userwise.pipelines.build.history import History

    t0 = time.monotonic()
    with completion.job(output, "backfill", input=input_path, from_=first.isoformat(), to=last.isoformat(),
                        window_days=window_days, actions=actions_path):
        ing = daily.ingest_range(spark, cfg, input_path, output, first, last + dt.timedelta(days=1), actions_path)
        _, layout, meta = build_record.load(output)
        with progress.step("history", [delta_io.table_path(output, "history")]):
            hist = History(spark, cfg, layout, output).update_range(first, last, meta.get("retention_days") or 37)
        wins = [("incremental", d + dt.timedelta(days=1 - window_days), d + dt.timedelta(days=1))
                for d in days(first, last)]
        sets = daily.set_samples(spark, cfg, layout, output, wins)
    log(json.dumps({"from": first.isoformat(), "to": last.isoformat(), "status": "tables built",
                    "seconds": round(time.monotonic() - t0, 1), "requests": ing.counts,
                    "history": hist, "samples": sum(s["samples"] for s in sets)}, default=str))
    return {"counts": ing.counts, "history": hist, "sets": sets}


def backfill(spark, cfg, *, date_from, date_to, input_path: str, output: str, actions_path: str | None = None,
             shards: str | None = None, window_days: int = 1, nodes: int = 1, ranks_per_node: int = 1,
             force: bool = False, log=print) -> dict:
    """Run the range; returns {"built": [...], "skipped": [...]} (ISO dates)."""
    from userwise.pipelines import cli

    out = {"built": [], "skipped": []}
    todo = days(date_from, date_to)
    while todo and not force and publish.is_published(output, "incremental", todo[0], shards):
        out["skipped"].append(todo[0].isoformat())
        log(json.dumps({"date": todo[0].isoformat(), "status": "skipped (published)"}))
        todo = todo[1:]
    if not todo:
        return out
    for d in todo:
        publish.unpublish(output, "incremental", d, shards)
    build_days(spark, cfg, input_path=input_path, output=output, first=todo[0], last=todo[-1],
               actions_path=actions_path, window_days=window_days, log=log)
    for d in todo:
        t0 = time.monotonic()
        if shards:
            key = publish.set_key("incremental", date=d)
            staging = publish.staging_root(shards, key)
            rc = cli.main(preshard_argv(output, staging, publish.window_of(d)[1], nodes, ranks_per_node,
                                        window_days))
            if rc:
                raise UserwiseError(f"preshard of {key} into {staging} failed (exit {rc}); fix it and rerun the "
                                    "backfill: it resumes from this day")
        rec = publish.publish(output, kind="incremental", date=d, shards=shards, window_days=window_days)
        log(json.dumps({"date": d.isoformat(), "status": "built", "seconds": round(time.monotonic() - t0, 1),
                        "tables": rec["tables"], "shards": (rec["shards"] or {}).get("root")}))
        out["built"].append(d.isoformat())
    return out


def cli(args) -> int:
    import os

    from userwise.pipelines import config
    from userwise.pipelines.build import validate
    from userwise.pipelines.runtime.spark import get_spark

    if not os.environ.get("PYSPARK_GATEWAY_PORT"):
        # Local run (not under spark-submit): Python workers use this interpreter, which has pyarrow.
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

    days(args.date_from, args.date_to)  # fail on a bad range before starting Spark
    cfg = config.load(args.config)
    validate.front_door(cfg, args.input, args.actions)
    spark = get_spark(args.master, app="userwise-backfill")
    res = backfill(spark, cfg, date_from=args.date_from, date_to=args.date_to, input_path=args.input,
                   output=args.output, actions_path=args.actions, shards=args.shards,
                   window_days=args.window_days, nodes=args.nodes, ranks_per_node=args.ranks_per_node,
                   force=args.force, log=lambda m: progress.say(m, prefix=""))
    print(json.dumps(res))
    return 0
