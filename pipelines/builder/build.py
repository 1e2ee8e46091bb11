"""`userwise build`: the whole chain over a date range, in a fixed number of Spark jobs.

Cost grows with the data, not with the number of days or windows:
1. requests, events and quarantine for every day before as-of: one job;
2. the pretrain samples and every window's, from one plan, in one commit
   (:func:`steps.set_samples`: a lean window's stream is the newest H events
   before its start plus its own events, derived for all windows at once);
3. the history as of the day before as-of, derived from the events: one job.
No step runs per day or per window. The daily jobs (pipelines.build.daily) use
the same functions, so a range run and the daily jobs give the same tables.
"""

from __future__ import annotations

import datetime as dt

from userwise.pipelines import config as C
from userwise.pipelines.builder import inputs
from userwise.pipelines.builder.history import History
from userwise.pipelines.builder.steps import as_date, ingest_range, log, log_set, set_samples
from userwise.pipelines.errors import UserwiseError
from userwise.pipelines.records import build_record, state
from userwise.pipelines.runtime import delta_io, progress, storage


def input_bytes(spec: str) -> int:
    """Bytes of the input's data: every form ``--input`` takes (:func:`inputs.resolve`: a
    Delta table at its version, a file, a folder, a glob, a list), local or remote; 0 when
    its file system cannot be read here."""
    total = 0
    try:
        for src in inputs.resolve(spec):
            total += delta_io.table_bytes(src.path, src.version) if src.kind == "delta" else storage.du(src.path)
    except (UserwiseError, OSError, ValueError):
        return 0
    return total


def windows(as_of: dt.date, incremental_days: int, window_days: int) -> list[tuple[dt.date, dt.date]]:
    if incremental_days < 0:
        raise UserwiseError(f"--incremental-days must be >= 0, got {incremental_days}")
    if incremental_days % window_days:
        raise UserwiseError(
            f"--window-days {window_days} does not divide --incremental-days {incremental_days}: "
            "the last M days must cut into whole N-day windows")
    start = as_of - dt.timedelta(days=incremental_days)
    return [(start + dt.timedelta(days=k), start + dt.timedelta(days=k + window_days))
            for k in range(0, incremental_days, window_days)]


def build(spark, cfg: C.Config, input_path: str, build_dir: str, as_of, incremental_days: int, window_days: int,
          actions_path: str | None = None) -> dict:
    T = as_date(as_of)
    wins = windows(T, incremental_days, window_days)
    boundary = T - dt.timedelta(days=incremental_days)
    if cfg.fat and actions_path:
        raise UserwiseError("--actions is for lean input; fat rows carry their own sequence")
    build_dir = storage.absolute(build_dir)
    log(f"build: input {input_path} -> {build_dir}, as-of {T}, pretrain before {boundary}, "
        f"{len(wins)} incremental windows of {window_days} day(s)")
    with state.job(build_dir, "build", config=cfg.source, input=input_path, as_of=T.isoformat(), incremental_days=incremental_days,
                        window_days=window_days, actions=actions_path):
        ing = ingest_range(spark, cfg, input_path, build_dir, None, T, actions_path, as_of=T)
        layout = ing.layout
        retention = max(incremental_days, window_days) + 7
        build_record.save(build_dir, cfg, layout, retention_days=retention, as_of=T.isoformat(),
                          incremental_days=incremental_days, window_days=window_days)
        plan = [("pretrain", None, boundary)] + [("incremental", ws, we) for ws, we in wins]
        sets = set_samples(spark, cfg, layout, build_dir, plan)
        for out, (_, ws, _) in zip(sets, plan):
            log_set(out, ws)
        # the history as of the end of the day before as-of (what the daily jobs would have left)
        with progress.step("history", delta_io.commits(delta_io.table_path(build_dir, "history"))):
            History(spark, cfg, layout, build_dir).derive(T - dt.timedelta(days=1), retention,
                                                       since=dt.date(1970, 1, 1))
    with progress.step("report"):
        return report(spark, cfg, layout, input_path, build_dir, ing.counts, sets)


def report(spark, cfg, layout, input_path, build_dir, counts: dict, sets: list[dict]) -> dict:
    samples_path = delta_io.table_path(build_dir, "samples")
    in_samples = sum(s["impressions"] for s in sets)
    rep = {
        **counts,
        "impressions_in_samples": in_samples,
        "requests": sum(s["requests"] for s in sets),
        "samples": sum(s["samples"] for s in sets),
        # samples beyond a user's first in a set: what splitting heavy users by the cost cap added
        "extra_chunks": sum(s["extra_chunks"] for s in sets),
        "sets": sets,
    }
    rep["reconciled"] = (counts["rows_read"] == in_samples + sum(counts["quarantined"].values())
                         + counts["after_as_of"])
    if layout.fat:
        from userwise.pipelines.builder.fat_rows import snapshot_counts

        rep.update(snapshot_counts(spark, build_dir, [(s["kind"], s["window_end"]) for s in sets]))
    rep["bytes_in"] = input_bytes(input_path)
    rep["bytes_out"] = delta_io.table_bytes(samples_path)  # the current version only, not replaced files
    rep["storage_ratio"] = round(rep["bytes_in"] / rep["bytes_out"], 3) if rep["bytes_out"] else None
    return rep


def report_text(rep: dict) -> str:
    q = rep.get("quarantined", {})
    lines = [
        f"rows read           {rep['rows_read']}",
        f"accepted            {rep['accepted']}",
        f"quarantined         {sum(q.values())}  " + ", ".join(f"{k}={v}" for k, v in sorted(q.items())),
        f"at/after as-of      {rep['after_as_of']}",
        f"in samples          {rep['impressions_in_samples']}  (reconciled: {rep['reconciled']})",
        f"requests            {rep['requests']}",
        f"samples             {rep['samples']}  (extra chunks from heavy users: {rep['extra_chunks']})",
    ]
    if "overrides" in rep:
        lines.append(f"snapshots           overrides={rep['overrides']} leaking={rep['leaking_snapshots']} "
                     f"null={rep['null_snapshots']}")
    lines.append(f"bytes in / out      {rep['bytes_in']} / {rep['bytes_out']}  ratio {rep['storage_ratio']}")
    return "\n".join(lines)
