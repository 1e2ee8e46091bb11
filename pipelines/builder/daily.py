"""The daily jobs, each idempotent (replaceWhere, or the history derived from the events):

- ``requests_day``: one date's requests, events and quarantine;
- ``history_day``: MERGE one date's actions into the history;
- ``window_day``: the incremental samples of the window ending after a date:
  per user the newest L events before the window start, derived from the
  events table, plus the window's own events;
- ``pretrain``: the pretrain samples (one job over all older requests).

Each is a step of :mod:`~userwise.pipelines.builder.steps` for one day or set, the
same functions ``userwise build`` runs over its whole range, so a range run and the
daily jobs give the same tables. The ``*_cli`` functions are the handlers of
``userwise requests|history|window|pretrain``.
"""

from __future__ import annotations

import datetime as dt

from userwise.pipelines import config as C
from userwise.pipelines import console
from userwise.pipelines.builder.history import History
from userwise.pipelines.builder.steps import as_date, ingest_range, log, pretrain_samples, window_samples
from userwise.pipelines.records import build_record, state
from userwise.pipelines.runtime import delta_io, progress


# ---------------------------------------------------------------------------
# The daily API (called by jobs/, the Airflow DAGs and backfill)
# ---------------------------------------------------------------------------
def requests_day(spark, cfg: C.Config, input_path: str, build_dir: str, date, actions_path: str | None = None) -> dict:
    d = as_date(date)
    with state.job(build_dir, "requests", config=cfg.source, input=input_path, date=d.isoformat(), actions=actions_path):
        ing = ingest_range(spark, cfg, input_path, build_dir, d, d + dt.timedelta(days=1), actions_path)
    log(f"requests {d}: {ing.counts}")
    return {"date": d.isoformat(), **ing.counts}


def history_day(spark, cfg: C.Config, build_dir: str, date, retention_days: int | None = None) -> dict:
    d = as_date(date)
    _, layout, meta = build_record.load(build_dir)
    days = retention_days or meta.get("retention_days") or 37
    with state.job(build_dir, "history", config=cfg.source, date=d.isoformat()), \
            progress.step("history", delta_io.commits(delta_io.table_path(build_dir, "history"))):
        out = History(spark, cfg, layout, build_dir).update(d, retention_days=days)
    log(f"history {d}: {out}")
    return {"date": d.isoformat(), **out}


def window_day(spark, cfg: C.Config, build_dir: str, date, window_days: int = 1) -> dict:
    """The window [date+1-N, date+1)."""
    d = as_date(date)
    _, layout, _ = build_record.load(build_dir)
    we = d + dt.timedelta(days=1)
    with state.job(build_dir, "window", config=cfg.source, date=d.isoformat(), window_days=window_days):
        return window_samples(spark, cfg, layout, build_dir, we - dt.timedelta(days=window_days), we)


def pretrain(spark, cfg: C.Config, build_dir: str, as_of, incremental_days: int) -> dict:
    _, layout, _ = build_record.load(build_dir)
    with state.job(build_dir, "pretrain", config=cfg.source, as_of=as_date(as_of).isoformat(), incremental_days=incremental_days):
        return pretrain_samples(spark, cfg, layout, build_dir, as_date(as_of) - dt.timedelta(days=incremental_days))


# ---------------------------------------------------------------------------
# CLI handlers
# ---------------------------------------------------------------------------
def _spark(args):
    from userwise.pipelines.runtime.spark import get_spark

    return get_spark(master=getattr(args, "master", None))


def _print(obj) -> None:
    console.emit(obj)


def requests_cli(args) -> int:
    from userwise.pipelines.builder import validate

    cfg = C.load(args.config)
    validate.front_door(cfg, args.input, args.actions)
    _print(requests_day(_spark(args), cfg, args.input, args.build_dir, args.date, args.actions))
    return 0


def history_cli(args) -> int:
    cfg = C.load(args.config)
    _print(history_day(_spark(args), cfg, args.build_dir, args.date))
    return 0


def window_cli(args) -> int:
    cfg = C.load(args.config)
    _print(window_day(_spark(args), cfg, args.build_dir, args.date, args.window_days))
    return 0


def pretrain_cli(args) -> int:
    cfg = C.load(args.config)
    _print(pretrain(_spark(args), cfg, args.build_dir, as_date(args.as_of), args.incremental_days))
    return 0
