"""`userwise`: one console script, one subcommand per job.

Each subcommand's handler lives in its own module and is imported only when
that subcommand runs, so ``userwise --help`` and the loader's commands start
without Spark. Errors a user can fix print one line (``error: ...``) and exit 2.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback

from userwise.pipelines.errors import one_line


def _date(s: str) -> str:
    import datetime as dt

    try:
        dt.date.fromisoformat(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a date YYYY-MM-DD") from None
    return s


def _int_at_least(minimum: int):
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{s!r} is not an integer") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"{v} must be at least {minimum}")
        return v
    return parse


_pos_int = _int_at_least(1)
_nonneg_int = _int_at_least(0)


INPUT_HELP = ("the impression log: a Delta table, a Parquet file, a folder of Parquet files (hive partitions "
              "or not), a glob, or a comma-separated list of these; local or any URL Spark reads")


def _input_args(p: argparse.ArgumentParser, actions: bool = True) -> None:
    p.add_argument("--input", required=True, help=INPUT_HELP)
    p.add_argument("--input-version", type=_nonneg_int,
                   help="read the Delta input(s) as of this table version (time travel; same as <table>@v<N>)")
    if actions:
        p.add_argument("--actions", help="optional separate action log (same forms as --input); "
                                         "mapped by columns.actions")


def _conf(s: str) -> tuple[str, str]:
    k, sep, v = s.partition("=")
    if not sep or not k.strip():
        raise argparse.ArgumentTypeError(f"{s!r} is not key=value")
    return k.strip(), v


def _common_spark(p: argparse.ArgumentParser) -> None:
    p.add_argument("--master", help="Spark master URL (default: local[2], or what spark-submit set)")
    p.add_argument("--conf", type=_conf, action="append", default=[], metavar="KEY=VALUE",
                   help="a Spark or Hadoop setting (repeatable), e.g. spark.hadoop.fs.s3a.endpoint=http://...; "
                        "see the README's \"Cluster storage\"")


def _quiet(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quiet", action="store_true",
                   help="no progress lines on stderr (the report on stdout and errors stay)")


def _build_args(p):
    p.add_argument("--config", required=True, help="YAML config mapping columns onto roles")
    _input_args(p, actions=False)
    p.add_argument("--output", required=True, help="folder for the Delta tables (requests, history, samples, ...)")
    p.add_argument("--as-of", required=True, type=_date, help="exclusive UTC date T: requests before T are built")
    p.add_argument("--pretrain-days", required=True, type=int, help="M: the last M days are incremental windows")
    p.add_argument("--window-days", required=True, type=_pos_int, help="N: incremental window length (divides M)")
    p.add_argument("--actions", help="optional separate action log (same forms as --input); "
                                     "mapped by columns.actions")
    p.add_argument("--report", help="also write the report as JSON to this file")
    _quiet(p)
    _common_spark(p)


def _day_args(p, needs_input=True):
    p.add_argument("--config", required=True)
    if needs_input:
        _input_args(p)
    p.add_argument("--output", required=True, help="the build folder (as for `userwise build`)")
    p.add_argument("--date", required=True, type=_date, help="the UTC day to process")
    _quiet(p)
    _common_spark(p)


def _synth_args(p):
    p.add_argument("--output", required=True, help="output folder: lean/, fat/, actions/ and config*.yaml")
    p.add_argument("--start", type=_date, default="2026-01-01", help="first UTC day")
    p.add_argument("--days", type=_pos_int, default=3)
    p.add_argument("--users", type=_pos_int, default=200)
    p.add_argument("--items", type=_pos_int, default=5000)
    p.add_argument("--impressions", type=int, default=None, help="target impressions in total (overrides --users)")
    p.add_argument("--max-seq-len", type=_pos_int, default=50, help="L for the fat rows' snapshots and the config")
    p.add_argument("--format", choices=["parquet", "delta"], default="parquet")
    p.add_argument("--kinds", default="lean,fat,actions", help="comma list of lean, fat, actions")
    p.add_argument("--bad-rows", type=float, default=0.0, help="share of malformed rows to inject (for tests)")
    p.add_argument("--seed", type=int, default=0)


def _expand_args(p):
    p.add_argument("--samples", required=True, help="the build folder (or its samples table)")
    p.add_argument("--output", required=True, help="Parquet folder for the point-wise rows")
    p.add_argument("--max-seq-len", type=_pos_int, help="L' <= the build's L (default: the build's L)")
    p.add_argument("--kind", choices=["incremental", "pretrain"], help="only this kind")
    _common_spark(p)


def _preshard_args(p):
    p.add_argument("--samples", required=True, help="the build folder (output of `userwise build`)")
    p.add_argument("--output", required=True, help="shard set root")
    p.add_argument("--nodes", required=True, type=_pos_int)
    p.add_argument("--ranks-per-node", required=True, type=_pos_int)
    p.add_argument("--kind", choices=["incremental", "pretrain"], help="default: every kind")
    p.add_argument("--window", help="incremental window end date (YYYY-MM-DD); default: every window")
    p.add_argument("--window-days", type=_pos_int, default=None,
                   help="N, for a --window that holds no samples (an empty set is published); "
                        "default: the build's, else 1")
    p.add_argument("--target-shard-mb", type=float, default=256.0)
    p.add_argument("--row-group-rows", type=_pos_int, default=2048)
    p.add_argument("--row-group-mb", type=float, default=128.0,
                   help="also cut a row group at this much (estimated uncompressed) data")
    p.add_argument("--compression", default="zstd", help="zstd | none | snappy (all columns)")
    p.add_argument("--dictionary", choices=["all", "scalars"], default="all",
                   help="dictionary-encode every column (default) or only the scalar ones (lists plain)")
    p.add_argument("--layout", choices=["parquet", "gds"], default="parquet")
    p.add_argument("--seed", type=int, default=0)
    _common_spark(p)


def _stage_args(p):
    p.add_argument("--shards", required=True, help="shard set root: a path or any fsspec/pyarrow URL")
    p.add_argument("--node", required=True, type=int)
    p.add_argument("--dest", required=True, help="local NVMe folder")
    p.add_argument("--workers", type=_pos_int, default=8)
    p.add_argument("--limit-mbps", type=float, default=None,
                   help="cap the copy rate (MB/s over all workers), e.g. to spare a shared network")
    p.add_argument("--range-mb", type=float, default=64.0,
                   help="copy files larger than this as parallel ranges of this size (several streams per file)")


def _diagnose_args(p):
    p.add_argument("--shards", required=True, help="one node's staged shards")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda if available")
    p.add_argument("--batch-size", type=_pos_int, default=64)
    p.add_argument("--batches", type=_pos_int, default=50)


def _backfill_args(p):
    p.add_argument("--from", dest="date_from", required=True, type=_date)
    p.add_argument("--to", dest="date_to", required=True, type=_date, help="inclusive")
    p.add_argument("--config", required=True)
    _input_args(p)
    p.add_argument("--output", required=True, help="the build folder")
    p.add_argument("--shards", help="shard set root to pre-shard each day into (optional)")
    p.add_argument("--pretrain-days", type=int, default=30)
    p.add_argument("--window-days", type=_pos_int, default=1)
    p.add_argument("--nodes", type=_pos_int, default=1)
    p.add_argument("--ranks-per-node", type=_pos_int, default=1)
    p.add_argument("--force", action="store_true", help="rebuild days already published")
    _quiet(p)
    _common_spark(p)


def _validate_args(p):
    p.add_argument("--config", required=True)
    _input_args(p)
    p.add_argument("--sample-rows", type=_pos_int, default=10000, help="rows read for the warnings")


def _forget_args(p):
    p.add_argument("--output", required=True, help="the build folder")
    p.add_argument("--users", required=True,
                   help="text file: one user id per line (as the build's user column holds it; "
                        "blank lines and lines starting with # are skipped)")
    p.add_argument("--shards", action="append",
                   help="a shard set root, or a folder of shard sets (published, staged): every set below it "
                        "that holds the users is rewritten without them; repeatable")
    p.add_argument("--vacuum", action="store_true",
                   help="also delete the tables' older files from disk (Delta VACUUM, retention 0): "
                        "time travel to earlier versions ends")
    _common_spark(p)


# name -> (one-line help, argument builder, "module:function")
COMMANDS = {
    "synth": ("generate a synthetic impression log (lean, fat rows, action log) and its config",
              _synth_args, "userwise.pipelines.tools.synth:cli"),
    "validate": ("check a config against an input as the build would (same errors, no JVM) and warn about "
                 "what a sample of rows would quarantine; writes nothing",
                 _validate_args, "userwise.pipelines.builder.validate:cli"),
    "build": ("build requests, history, samples and quarantine for a date range (Spark + Delta)",
              _build_args, "userwise.pipelines.builder.build:cli"),
    "expand": ("expand user-wise samples back to point-wise rows (the lossless round trip)",
               _expand_args, "userwise.pipelines.builder.expand:cli"),
    "requests": ("daily job: build the requests (and quarantine) of one date",
                 _day_args, "userwise.pipelines.builder.daily:requests_cli"),
    "history": ("daily job: MERGE one date's actions into the user history",
                lambda p: _day_args(p, needs_input=False), "userwise.pipelines.builder.daily:history_cli"),
    "window": ("daily job: build the incremental samples of the window ending after one date",
               lambda p: (_day_args(p, needs_input=False),
                          p.add_argument("--window-days", type=_pos_int, default=1)),
               "userwise.pipelines.builder.daily:window_cli"),
    "pretrain": ("job: build the pretrain samples (requests before as-of minus M days)",
                 lambda p: (_day_args(p, needs_input=False),
                            p.add_argument("--pretrain-days", type=int, required=True)),
                 "userwise.pipelines.builder.daily:pretrain_cli"),
    "preshard": ("pre-shard samples into balanced per-node Parquet shard sets with a manifest",
                 _preshard_args, "userwise.pipelines.shards.preshard:cli"),
    "stage": ("copy one node's shards to local disk, verified and resumable",
              _stage_args, "userwise.pipelines.shards.stage:cli"),
    "diagnose": ("three-step bottleneck test of the loader on one node's shards",
                 _diagnose_args, "userwise.pipelines.loader.diagnose:cli"),
    "backfill": ("run the daily chain day by day over a date range, skipping published days",
                 _backfill_args, "userwise.pipelines.manage.backfill:cli"),
    "forget": ("remove users from every table of a build folder and from its shard sets (privacy)",
               _forget_args, "userwise.pipelines.manage.forget:cli"),
    "jars": ("fetch Delta's jars into the local cache (Spark's resolver, else Maven)",
             lambda p: None, "userwise.pipelines.runtime.jars:cli"),
}


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one ``error:`` line (exit 2) like every other failure."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (see `{self.prog} --help`)\n")


def parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="userwise",
        description="User-wise recommender samples: build with Spark/Delta, pre-shard, load into PyTorch.",
    )
    p.add_argument("--debug", action="store_true", help="show the traceback of an internal error")
    p.add_argument("--verbose", action="store_true", help="Spark's and Java's log on the console (default: a file)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    sub.required = True
    for name, (help_, build, _) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_, description=help_)
        build(sp)
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.verbose:
        os.environ["USERWISE_VERBOSE"] = "1"
    if hasattr(args, "quiet"):  # a build command: its progress lines on stderr, unless --quiet
        from userwise.pipelines.runtime import progress

        progress.QUIET = args.quiet
    target = COMMANDS[args.command][2]
    mod, fn = target.split(":")
    lock = None
    try:
        if getattr(args, "input_version", None) is not None:
            from userwise.pipelines.builder.inputs import with_version

            args.input = with_version(args.input, args.input_version)
        if hasattr(args, "conf"):  # a Spark command: its --conf settings, and only these
            from userwise.pipelines.runtime import spark as spark_runtime

            spark_runtime.CLI_CONF.clear()
            spark_runtime.CLI_CONF.update(dict(args.conf))
        from userwise.pipelines.records import writer_lock

        lock = writer_lock.for_command(args.command, args)
        if lock is not None:
            lock.acquire()  # before anything is read or written: a refused job changes nothing
        handler = getattr(importlib.import_module(mod), fn)
        rc = handler(args)
    except KeyboardInterrupt:
        print("error: interrupted; run the same command again: finished work is kept", file=sys.stderr)
        return 130
    except Exception as e:
        if args.debug:
            traceback.print_exc()
        log_path = sys.modules["userwise.pipelines.runtime.spark"].LOG_PATH \
            if "userwise.pipelines.runtime.spark" in sys.modules else None
        code, line = one_line(e, log_path)
        print(f"error: {line}", file=sys.stderr)
        return code
    finally:
        if lock is not None:
            lock.release()
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
