"""`userwise`: one console script, one subcommand per job.

Each subcommand's handler lives in its own module and is imported only when that
subcommand runs, so ``userwise --help`` and the loader's commands start without Spark.

One vocabulary across commands (the older names still work as aliases):

| concept | flag | older names |
|---|---|---|
| the build folder (Delta tables + ``_userwise/``) | ``--build-dir D`` | ``--output`` (build, the daily jobs, backfill, forget, publish), ``--samples`` (expand, preshard) |
| a shard set's root | ``--shards S`` | ``--output`` (preshard) |
| one node's staged copy on local disk | ``--staged DIR`` | ``--dest`` (stage), ``--shards`` (diagnose) |
| the exclusive cut-off date | ``--as-of T`` | ``--date`` (pretrain) |
| the processed UTC day of a daily job | ``--date D`` | |
| M, the last days cut into incremental windows | ``--incremental-days M`` | ``--pretrain-days`` |

Every command takes ``--json`` (its report as one JSON object on stdout; default: text) and
``--quiet`` (no progress on stderr). Errors a user can fix print one line (``error: ...``) and
exit 2; a failed Spark job exits 3; an internal error 1 (:mod:`userwise.pipelines.console`).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback

from userwise.pipelines import console
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
    parse.__name__ = "integer"
    return parse


_pos_int = _int_at_least(1)
_nonneg_int = _int_at_least(0)


def _conf(s: str) -> tuple[str, str]:
    k, sep, v = s.partition("=")
    if not sep or not k.strip():
        raise argparse.ArgumentTypeError(f"{s!r} is not key=value")
    return k.strip(), v


# -- the shared flags (one name per concept) -----------------------------------------
INPUT_HELP = ("the impression log: a Delta table, a Parquet file, a folder of Parquet files (hive partitions "
              "or not), a glob, or a comma-separated list of these; local or any URL Spark reads")
BUILD_DIR_HELP = "the build folder: its Delta tables (requests, events, history, samples, quarantine) and _userwise/"


def _config(p, required=True):
    p.add_argument("--config", required=required, metavar="C.yaml",
                   help="the YAML config mapping the log's columns onto roles (docs/config.md)")


def _input(p, required=True, actions=True):
    p.add_argument("--input", required=required, metavar="P", help=INPUT_HELP)
    p.add_argument("--input-version", type=_nonneg_int, metavar="N",
                   help="read the Delta input(s) as of this table version (time travel; same as <table>@v<N>)")
    if actions:
        p.add_argument("--actions", metavar="A", help="an optional separate action log (same forms as --input), "
                                                      "mapped by columns.actions")


def _build_dir(p, *aliases, help=BUILD_DIR_HELP):
    p.add_argument("--build-dir", *aliases, dest="build_dir", required=True, metavar="D", help=help)


def _shards(p, *aliases, required=True, help="the shard set's root: a local path or a store's URL"):
    p.add_argument("--shards", *aliases, dest="shards", required=required, metavar="S", help=help)


def _staged(p, *aliases, help="one node's staged copy on local disk (what `userwise stage` writes)"):
    p.add_argument("--staged", *aliases, dest="staged", required=True, metavar="DIR", help=help)


def _incremental_days(p, required=True, default=None):
    p.add_argument("--incremental-days", "--pretrain-days", dest="incremental_days", type=_nonneg_int,
                   required=required, default=default, metavar="M",
                   help="M: the last M days before as-of are cut into incremental windows; "
                        "older requests are the pretrain samples")


def _window_days(p, default=None, help="N: days per incremental window (N divides M; 1: daily)"):
    p.add_argument("--window-days", type=_pos_int, default=default, metavar="N", help=help)


def _spark(p):
    p.add_argument("--master", metavar="URL",
                   help="Spark master: local[K], spark://host:port or yarn ship the package to the executors "
                        "themselves; k8s:// is refused with the spark-submit command to use "
                        "(default: local[2], or what spark-submit set)")
    p.add_argument("--conf", type=_conf, action="append", default=[], metavar="KEY=VALUE",
                   help="a Spark or Hadoop setting (repeatable), e.g. spark.hadoop.fs.s3a.endpoint=http://...; "
                        "see docs/storage.md")


# -- the commands ----------------------------------------------------------------------
def _synth_args(p):
    p.add_argument("--output", required=True, metavar="DIR",
                   help="where the logs go: lean/, fat/, actions/ and config*.yaml")
    p.add_argument("--start", type=_date, default="2026-01-01", metavar="YYYY-MM-DD", help="first UTC day")
    p.add_argument("--days", type=_pos_int, default=3, help="days of log")
    p.add_argument("--users", type=_pos_int, default=200, help="users (a bot user among them)")
    p.add_argument("--items", type=_pos_int, default=5000, help="distinct items")
    p.add_argument("--impressions", type=_pos_int, default=None,
                   help="target impressions in total (overrides --users)")
    p.add_argument("--max-seq-len", type=_pos_int, default=50, metavar="L",
                   help="L for the fat rows' snapshots and the config")
    p.add_argument("--format", choices=["parquet", "delta"], default="parquet", help="how the logs are written")
    p.add_argument("--kinds", default="lean,fat,actions", help="comma list of lean, fat, actions")
    p.add_argument("--bad-rows", type=float, default=0.0, metavar="SHARE",
                   help="share of malformed rows to inject (for tests)")
    p.add_argument("--seed", type=int, default=0, help="random seed")


def _validate_args(p):
    _config(p)
    _input(p)
    p.add_argument("--sample-rows", type=_pos_int, default=10000, metavar="N", help="rows read for the warnings")


def _build_args(p):
    _config(p)
    _input(p)
    _build_dir(p, "--output")
    p.add_argument("--as-of", required=True, type=_date, metavar="T",
                   help="the exclusive UTC cut-off date: requests before T are built, later ones are left")
    _incremental_days(p)
    _window_days(p, default=1)
    p.add_argument("--report", metavar="R.json", help="also write the report as JSON to this file (or URL)")
    _spark(p)


def _day_args(p, needs_input=True):
    _config(p)
    if needs_input:
        _input(p)
    _build_dir(p, "--output")
    p.add_argument("--date", required=True, type=_date, metavar="YYYY-MM-DD", help="the UTC day to process")
    _spark(p)


def _window_args(p):
    _day_args(p, needs_input=False)
    _window_days(p, default=1, help="N: the window is the N days ending with --date")


def _pretrain_args(p):
    _config(p)
    _build_dir(p, "--output")
    p.add_argument("--as-of", "--date", dest="as_of", required=True, type=_date, metavar="T",
                   help="the exclusive cut-off: pretrain samples hold the requests before T minus M days")
    _incremental_days(p)
    _spark(p)


def _expand_args(p):
    _build_dir(p, "--samples", help=BUILD_DIR_HELP + " (or its samples table)")
    p.add_argument("--expanded", "--output", dest="expanded", required=True, metavar="P",
                   help="the Parquet folder for the point-wise rows")
    p.add_argument("--max-seq-len", type=_pos_int, metavar="L'", help="L' <= the build's L (default: the build's L)")
    p.add_argument("--kind", choices=["incremental", "pretrain"], help="only this kind (default: both)")
    _spark(p)


def _preshard_args(p):
    _build_dir(p, "--samples")
    _shards(p, "--output", help="the shard set's root to write: a local path or a store's URL")
    p.add_argument("--nodes", required=True, type=_pos_int, help="training nodes: a node=<k>/ folder each")
    p.add_argument("--ranks-per-node", required=True, type=_pos_int, help="ranks (GPUs) per node, balanced by cost")
    p.add_argument("--kind", choices=["incremental", "pretrain"], help="only this kind (default: every kind)")
    p.add_argument("--window", type=_date, metavar="YYYY-MM-DD",
                   help="one incremental window, by its end date (exclusive) (default: every window)")
    _window_days(p, default=None, help="N, for a --window that holds no samples (an empty set is published) "
                                       "(default: the build's, else 1)")
    p.add_argument("--target-shard-mb", type=float, default=256.0, metavar="MB", help="shard size to aim at")
    p.add_argument("--row-group-rows", type=_pos_int, default=2048, metavar="N", help="samples per row group, at most")
    p.add_argument("--row-group-mb", type=float, default=128.0, metavar="MB",
                   help="also cut a row group at this much (estimated uncompressed) data")
    p.add_argument("--compression", default="zstd", help="zstd | none | snappy (all columns), or col=codec,...")
    p.add_argument("--dictionary", choices=["all", "scalars"], default="all",
                   help="dictionary-encode every column, or only the scalar ones (lists plain)")
    p.add_argument("--layout", choices=["parquet", "gds"], default="parquet",
                   help="gds: also a raw side file per shard for GPUDirect Storage reads")
    p.add_argument("--seed", type=int, default=0, help="seed of the balanced assignment and the in-shard order")
    _spark(p)


def _publish_args(p):
    _build_dir(p, "--output")
    _shards(p, required=False, help="the shard root S; the set is staged under S/_staging/<kind>/<date> "
                                    "(default: publish the tables' versions without shards)")
    p.add_argument("--kind", choices=["incremental", "pretrain"], default="incremental", help="which set")
    p.add_argument("--date", type=_date, metavar="YYYY-MM-DD", help="the processed UTC day (incremental)")
    p.add_argument("--as-of", type=_date, metavar="T", help="the pretrain set's as-of date (pretrain)")
    _window_days(p, default=1, help="N: the window is the N days ending with --date")
    p.add_argument("--master", help=argparse.SUPPRESS)  # spark-submit passes it; publish needs no Spark


def _stage_args(p):
    _shards(p, help="the shard set's root: a local path or any store URL (hdfs://, s3://, gs://, ...)")
    p.add_argument("--node", required=True, type=_nonneg_int, metavar="K", help="the node to stage")
    _staged(p, "--dest", help="the local folder (NVMe) for node K's copy")
    p.add_argument("--workers", type=_pos_int, default=8, help="parallel copy streams")
    p.add_argument("--limit-mbps", type=float, default=None, metavar="MB/S",
                   help="cap the copy rate over all workers, e.g. to spare a shared network (default: no cap)")
    p.add_argument("--range-mb", type=float, default=64.0, metavar="MB",
                   help="copy files larger than this as parallel ranges of this size (several streams per file)")
    p.add_argument("--retries", type=_nonneg_int, default=4, metavar="N",
                   help="retries of a failed read, with exponential backoff, before the node fails")


def _diagnose_args(p):
    _staged(p, "--shards")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None, help="(default: cuda if available)")
    p.add_argument("--batch-size", type=_pos_int, default=64, help="samples per batch")
    p.add_argument("--batches", type=_pos_int, default=50, help="batches per step of the test")


def _backfill_args(p):
    p.add_argument("--from", dest="date_from", required=True, type=_date, metavar="D1",
                   help="the first UTC day to process")
    p.add_argument("--to", dest="date_to", required=True, type=_date, metavar="D2",
                   help="the last UTC day to process (inclusive)")
    _config(p)
    _input(p)
    _build_dir(p, "--output")
    _shards(p, required=False, help="the shard root to pre-shard and publish each day into (default: none)")
    _incremental_days(p, required=False, default=30)
    _window_days(p, default=1, help="N: each day's window is the N days ending with it")
    p.add_argument("--nodes", type=_pos_int, default=1, help="training nodes of each day's shard set")
    p.add_argument("--ranks-per-node", type=_pos_int, default=1, help="ranks per node of each day's shard set")
    p.add_argument("--force", action="store_true", help="rebuild days already published")
    _spark(p)


def _forget_args(p):
    _build_dir(p, "--output")
    p.add_argument("--users", required=True, metavar="FILE",
                   help="text file: one user id per line (as the build's user column holds it; "
                        "blank lines and lines starting with # are skipped)")
    p.add_argument("--shards", action="append", metavar="S",
                   help="a shard set root, or a folder of shard sets (published, staged): every set below it "
                        "that holds the users is rewritten without them; repeatable (default: none)")
    p.add_argument("--vacuum", action="store_true",
                   help="also delete the tables' older files from disk (Delta VACUUM, retention 0): "
                        "time travel to earlier versions ends")
    _spark(p)


def _ship_args(p):
    p.add_argument("--dist", default="dist", metavar="DIR",
                   help="where the wheel and the --py-files zip go")


def _no_args(p):
    return None


# name -> (one-line help, argument builder, "module:function")
COMMANDS = {
    "synth": ("generate a synthetic impression log (lean, fat rows, action log) and its config",
              _synth_args, "userwise.pipelines.tools.synth:cli"),
    "validate": ("check a config against an input as the build would (same errors, no JVM) and warn about "
                 "what a sample of rows would quarantine; writes nothing",
                 _validate_args, "userwise.pipelines.builder.validate:cli"),
    "build": ("build requests, history, samples and quarantine for every day before as-of (Spark + Delta)",
              _build_args, "userwise.pipelines.builder.build:cli"),
    "expand": ("expand user-wise samples back to point-wise rows (the lossless round trip)",
               _expand_args, "userwise.pipelines.builder.expand:cli"),
    "requests": ("daily job: build the requests (and quarantine) of one date",
                 _day_args, "userwise.pipelines.builder.daily:requests_cli"),
    "history": ("daily job: MERGE one date's actions into the user history",
                lambda p: _day_args(p, needs_input=False), "userwise.pipelines.builder.daily:history_cli"),
    "window": ("daily job: build the incremental samples of the window ending with one date",
               _window_args, "userwise.pipelines.builder.daily:window_cli"),
    "pretrain": ("job: build the pretrain samples (requests before as-of minus M days)",
                 _pretrain_args, "userwise.pipelines.builder.daily:pretrain_cli"),
    "preshard": ("pre-shard samples into balanced per-node Parquet shard sets with a manifest",
                 _preshard_args, "userwise.pipelines.shards.preshard:cli"),
    "publish": ("put a pre-sharded set in place and mark the day (or pretrain set) published, record last",
                _publish_args, "userwise.pipelines.shards.publish:cli"),
    "stage": ("copy one node's shards to local disk, verified and resumable",
              _stage_args, "userwise.pipelines.shards.stage:cli"),
    "diagnose": ("three-step bottleneck test of the loader on one node's staged shards",
                 _diagnose_args, "userwise.pipelines.loader.diagnose:cli"),
    "backfill": ("run the daily chain over a date range, skipping published days",
                 _backfill_args, "userwise.pipelines.manage.backfill:cli"),
    "forget": ("remove users from every table of a build folder and from its shard sets (privacy)",
               _forget_args, "userwise.pipelines.manage.forget:cli"),
    "jars": ("fetch Delta's jars into the local cache (Maven, else Spark's resolver)",
             _no_args, "userwise.pipelines.runtime.jars:cli"),
    "ship": ("build the wheel and the --py-files zip that spark-submit ships to executors",
             _ship_args, "userwise.pipelines.runtime.ship:cli"),
}


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Help with every flag's default (where it has one) and ``(required)`` on required flags."""

    def _get_help_string(self, action):
        h = action.help or ""
        if action.help is argparse.SUPPRESS or not action.option_strings:
            return h
        if action.required:
            return f"{h} (required)"
        if action.default not in (None, False, [], argparse.SUPPRESS) and "(default" not in h:
            return f"{h} (default: %(default)s)"
        return h


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one ``error:`` line (exit 2) like every other failure."""

    def __init__(self, *a, **kw):
        kw.setdefault("formatter_class", _Formatter)
        super().__init__(*a, **kw)

    def error(self, message: str):
        self.exit(console.EXIT_USER, f"error: {message} (see `{self.prog} --help`)\n")


def version() -> str:
    from userwise.pipelines.runtime.ship import version

    return version()


EPILOG = "exit codes: " + "; ".join(f"{k} {v}" for k, v in console.EXIT_CODES.items())


def parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="userwise",
        description="User-wise recommender samples: build with Spark/Delta, pre-shard, load into PyTorch.",
        epilog=EPILOG,
    )
    p.add_argument("--version", action="version", version=f"userwise {version()}",
                   help="print the version and exit")
    p.add_argument("--debug", action="store_true", help="show the traceback of an internal error")
    p.add_argument("--verbose", action="store_true", help="Spark's and Java's log on the console (default: a file)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", title="commands", parser_class=_Parser)
    sub.required = True
    for name, (help_, build, _) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_, description=help_, epilog=EPILOG)
        build(sp)
        sp.add_argument("--json", action="store_true", help="the report as one JSON object on stdout (default: text)")
        sp.add_argument("--quiet", action="store_true",
                        help="no progress on stderr (the report on stdout and errors stay)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.verbose:
        os.environ["USERWISE_VERBOSE"] = "1"
    from userwise.pipelines.runtime import progress

    progress.QUIET = args.quiet
    console.JSON = args.json
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
        console.JSON = False
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
