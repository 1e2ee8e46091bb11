"""The handlers of ``userwise build|expand|preshard|publish|stage``: each hands the parsed
flags to its :mod:`~userwise.pipelines.api.commands` function under the same names and prints
the report (``console.emit``); nothing else."""

from __future__ import annotations

import json

from userwise.pipelines import console
from userwise.pipelines.api import commands
from userwise.pipelines.errors import UserwiseError


def build(args) -> int:
    from userwise.pipelines.builder.build import report_text
    from userwise.pipelines.runtime import storage

    # the command holds the build folder's lock already (cli.main), and has applied --input-version
    rep = commands.build(config=args.config, input=args.input, build_dir=args.build_dir, as_of=args.as_of,
                         incremental_days=args.incremental_days, window_days=args.window_days,
                         actions=args.actions, master=args.master, lock=False)
    console.emit(rep, report_text)
    if args.report:  # a local path or a store's URL
        storage.write_bytes(args.report, json.dumps(rep, indent=1, sort_keys=True, default=str).encode())
    if not rep["reconciled"]:
        raise UserwiseError("counts do not reconcile: rows read != in samples + quarantined + after as-of "
                            f"({json.dumps({k: rep[k] for k in ('rows_read', 'impressions_in_samples', 'after_as_of')})})")
    return 0


def expand(args) -> int:
    rep = commands.expand(build_dir=args.build_dir, expanded=args.expanded, max_seq_len=args.max_seq_len,
                          kind=args.kind, master=args.master)
    console.emit(rep, f"expanded {rep['impressions']} impressions into {rep['expanded']}")
    return 0


def preshard(args) -> int:
    from userwise.pipelines.shards.preshard import format_report

    rep = commands.preshard(build_dir=args.build_dir, shards=args.shards, nodes=args.nodes,
                            ranks_per_node=args.ranks_per_node, kind=args.kind, window=args.window,
                            window_days=args.window_days, target_shard_mb=args.target_shard_mb,
                            row_group_rows=args.row_group_rows, row_group_mb=args.row_group_mb,
                            compression=args.compression, dictionary=args.dictionary, layout=args.layout,
                            seed=args.seed, master=args.master)
    console.emit(rep, format_report)
    return 0


def publish(args) -> int:
    """``jobs/publish.py`` under spark-submit and the daily DAG run it too."""
    rec = commands.publish(build_dir=args.build_dir, shards=args.shards, kind=args.kind, date=args.date,
                           as_of=args.as_of, window_days=args.window_days)
    what = f"{rec['kind']} {rec.get('date') or rec.get('as_of')}"
    console.emit(rec, f"published {what}" + (f": {rec['shards']['rows']} samples at {rec['shards']['root']}"
                                              if rec["shards"] else " (tables only, no shards)"))
    return 0


def stage(args) -> int:
    from userwise.pipelines.shards.stage import report_text

    rep = commands.stage(shards=args.shards, node=args.node, staged=args.staged, workers=args.workers,
                         limit_mbps=args.limit_mbps, range_mb=args.range_mb, retries=args.retries)
    console.emit(rep, report_text)
    return 0
