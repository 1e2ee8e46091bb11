"""``userwise backfill --from D1 --to D2``: the daily chain over a range, its tables in one go.

For the UTC days [D1, D2] (both inclusive) it writes what the daily DAG's
``requests -> history -> window`` would, day by day, but in a fixed number of
Spark jobs (cost grows with the data, not with the days):

1. requests, events and quarantine of every day: one job;
2. the history as of the end of D2, derived from the events: one job (each
   day logged in ``history_log``);
3. every day's window [d + 1 - N, d + 1): one plan, one commit
   (:func:`steps.set_samples`, windows may overlap);

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

from userwise.pipelines import console
from userwise.pipelines.builder import daily, steps
from userwise.pipelines.builder.history import History
from userwise.pipelines.errors import UserwiseError
from userwise.pipelines.records import build_record, state
from userwise.pipelines.runtime import delta_io, progress
from userwise.pipelines.shards import preshard, publish


def days(date_from, date_to) -> list[dt.date]:
    a, b = dt.date.fromisoformat(str(date_from)), dt.date.fromisoformat(str(date_to))
    if b < a:
        raise UserwiseError(f"--to {b} is before --from {a}; both dates are inclusive, --to must be >= --from")
    return [a + dt.timedelta(days=i) for i in range((b - a).days + 1)]


def publish_day(spark, *, build_dir: str, date: dt.date, shards: str | None, window_days: int = 1, nodes: int = 1,
                ranks_per_node: int = 1, built: bool = True) -> dict:
    """Pre-shard the day's window into ``S/_staging/...`` (when ``shards`` is given and the day
    was built), then publish it: the set moved into place, the day's record written last."""
    if shards and built:
        key = publish.set_key("incremental", date=date)
        preshard.preshard(spark, build_dir=build_dir, shards=publish.staging_root(shards, key), nodes=nodes,
                          ranks_per_node=ranks_per_node, kind="incremental",
                          window=publish.window_of(date)[1].isoformat(), window_days=window_days)
    return publish.publish(build_dir, kind="incremental", date=date, shards=shards if built else None,
                           window_days=window_days)


def _log_published(log, date: dt.date, rec: dict, t0: float) -> None:
    log(json.dumps({"date": date.isoformat(), "status": "built", "seconds": round(time.monotonic() - t0, 1),
                    "tables": rec["tables"], "shards": (rec["shards"] or {}).get("root")}))


def run_day(spark, cfg, *, input_path: str, build_dir: str, date: dt.date, actions_path: str | None = None,
            shards: str | None = None, window_days: int = 1, nodes: int = 1, ranks_per_node: int = 1,
            log=print) -> dict:
    """One day's chain (the daily DAG's order); returns the published record."""
    t0 = time.monotonic()
    daily.requests_day(spark, cfg, input_path, build_dir, date, actions_path=actions_path)
    daily.history_day(spark, cfg, build_dir, date)
    built = daily.window_day(spark, cfg, build_dir, date, window_days) is not None
    rec = publish_day(spark, build_dir=build_dir, date=date, shards=shards, window_days=window_days, nodes=nodes,
                      ranks_per_node=ranks_per_node, built=built)
    _log_published(log, date, rec, t0)
    return rec


def build_days(spark, cfg, *, input_path: str, build_dir: str, first: dt.date, last: dt.date,
               actions_path: str | None = None, window_days: int = 1, shards: str | None = None, nodes: int = 1,
               ranks_per_node: int = 1, log=print) -> dict:
    """The tables of days [first, last] in one go: requests, history, every day's window
    (``shards``, ``nodes`` and ``ranks_per_node`` only go into the rerun hint: the backfill
    that publishes these days)."""
    t0 = time.monotonic()
    with state.job(build_dir, "backfill", config=cfg.source, input=input_path, from_=first.isoformat(),
                   to=last.isoformat(), window_days=window_days, actions=actions_path, shards=shards,
                   nodes=nodes if shards else None, ranks_per_node=ranks_per_node if shards else None):
        ing = steps.ingest_range(spark, cfg, input_path, build_dir, first, last + dt.timedelta(days=1), actions_path)
        _, layout, meta = build_record.load(build_dir)
        with progress.step("history", delta_io.commits(delta_io.table_path(build_dir, "history"))):
            hist = History(spark, cfg, layout, build_dir).update_range(first, last, meta.get("retention_days") or 37)
        wins = [("incremental", d + dt.timedelta(days=1 - window_days), d + dt.timedelta(days=1))
                for d in days(first, last)]
        sets = steps.set_samples(spark, cfg, layout, build_dir, wins)
    log(json.dumps({"from": first.isoformat(), "to": last.isoformat(), "status": "tables built",
                    "seconds": round(time.monotonic() - t0, 1), "requests": ing.counts,
                    "history": hist, "samples": sum(s["samples"] for s in sets)}, default=str))
    return {"counts": ing.counts, "history": hist, "sets": sets}


def backfill(spark, cfg, *, date_from, date_to, input_path: str, build_dir: str, actions_path: str | None = None,
             shards: str | None = None, window_days: int = 1, nodes: int = 1, ranks_per_node: int = 1,
             force: bool = False, log=print) -> dict:
    """Run the range; returns {"built": [...], "skipped": [...]} (ISO dates)."""
    out = {"built": [], "skipped": []}
    todo = days(date_from, date_to)
    while todo and not force and publish.is_published(build_dir, "incremental", todo[0], shards):
        out["skipped"].append(todo[0].isoformat())
        log(json.dumps({"date": todo[0].isoformat(), "status": "skipped (published)"}))
        todo = todo[1:]
    if not todo:
        return out
    for d in todo:
        publish.unpublish(build_dir, "incremental", d, shards)
    build_days(spark, cfg, input_path=input_path, build_dir=build_dir, first=todo[0], last=todo[-1],
               actions_path=actions_path, window_days=window_days, shards=shards, nodes=nodes,
               ranks_per_node=ranks_per_node, log=log)
    for d in todo:
        t0 = time.monotonic()
        rec = publish_day(spark, build_dir=build_dir, date=d, shards=shards, window_days=window_days, nodes=nodes,
                          ranks_per_node=ranks_per_node)
        _log_published(log, d, rec, t0)
        out["built"].append(d.isoformat())
    return out


def cli(args) -> int:
    import os

    from userwise.pipelines import config
    from userwise.pipelines.builder import validate
    from userwise.pipelines.runtime.spark import get_spark

    if not os.environ.get("PYSPARK_GATEWAY_PORT"):
        # Local run (not under spark-submit): Python workers use this interpreter, which has pyarrow.
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

    days(args.date_from, args.date_to)  # fail on a bad range before starting Spark
    cfg = config.load(args.config)
    validate.front_door(cfg, args.input, args.actions)
    spark = get_spark(args.master, app="userwise-backfill")
    res = backfill(spark, cfg, date_from=args.date_from, date_to=args.date_to, input_path=args.input,
                   build_dir=args.build_dir, actions_path=args.actions, shards=args.shards,
                   window_days=args.window_days, nodes=args.nodes, ranks_per_node=args.ranks_per_node,
                   force=args.force, log=lambda m: progress.say(m, prefix=""))
    console.emit(res, lambda r: f"backfill {args.date_from}..{args.date_to}: built {len(r['built'])} days "
                                f"{r['built']}, skipped {len(r['skipped'])} published {r['skipped']}")
    return 0
