"""`userwise`: one console script, one subcommand per job.

Each subcommand's handler lives in its own module and is imported only when that
subcommand runs, so ``userwise --help`` and the loader's commands start without Spark.

One name per concept across commands; each shared flag is defined once below, with one
help text and one placeholder:

| concept | flag |
|---|---|
| the build folder (Delta tables + ``_userwise/``) | ``--build-dir D`` |
| a shard set's root | ``--shards S`` |
| one node's staged copy on local disk | ``--staged DIR`` |
| the exclusive cut-off date | ``--as-of T`` |
| the processed UTC day of a daily job | ``--date YYYY-MM-DD`` |
| M, the last days cut into incremental windows | ``--incremental-days M`` |
| N, days per incremental window | ``--window-days N`` |

The library's Python functions (:mod:`userwise.pipelines.api`) take the same names as
keyword arguments (``build_dir``, ``shards``, ``staged``, ``as_of``, ``incremental_days``, ...).

Every command takes ``--json`` (its report as one JSON object on stdout; default: text) and
``--quiet`` (no progress on stderr). Errors a user can fix print one line (``error: ...``) and
exit 2; a failed Spark job exits 3 (only commands that run Spark); an internal error 1
(:mod:`userwise.pipelines.console`). Each command's ``--help`` ends with the codes it can give.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import sys
import traceback

from userwise.pipelines import console
from userwise.pipelines.errors import (
    DATE_RANGE,
    EXIT_CODES,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_SPARK,
    EXIT_USER,
    MAX_DAYS,
    MAX_MB,
    one_line,
)


def _date(s: str) -> str:
    import datetime as dt

    try:
        d = dt.date.fromisoformat(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a date YYYY-MM-DD") from None
    lo, hi = DATE_RANGE
    if not lo <= d.isoformat() <= hi:
        raise argparse.ArgumentTypeError(f"{s} is outside the dates a command takes: give a date from {lo} to {hi}")
    return s


# -- the flags' types: each bound is defined once (here, or in pipelines/errors.py where the library
# checks the same value) and every flag of a kind uses the same type
INT64_MAX = (1 << 63) - 1


def _int_in(minimum: int, maximum: int = INT64_MAX):
    """An argparse type: an integer in [minimum, maximum], else one line that says what to give."""
    def parse(s: str) -> int:
        digits = s.strip().lstrip("+-")
        if digits.isdigit() and len(digits) > 30:  # int() refuses 4,300+ digits with a confusing message
            raise argparse.ArgumentTypeError(f"{s[:20]}... ({len(digits)} digits) is too large: give at most "
                                             f"{maximum:,}")
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{s!r} is not an integer") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"{v} must be at least {minimum}")
        if v > maximum:
            raise argparse.ArgumentTypeError(f"{v:,} is too large: give at most {maximum:,}")
        return v
    parse.__name__ = "integer"
    return parse


def _num(x: float) -> str:
    return f"{x:,.0f}" if float(x).is_integer() else f"{x:g}"


def _float_in(minimum: float, maximum: float, *, above: bool = False, unit: str = ""):
    """An argparse type: a finite number in [minimum, maximum] (``above``: > minimum), else one line."""
    def parse(s: str) -> float:
        try:
            v = float(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{s!r} is not a number") from None
        where = f"{'above' if above else 'at least'} {_num(minimum)} and at most {_num(maximum)}{unit}"
        if not math.isfinite(v) or v < minimum or (above and v == minimum) or v > maximum:
            raise argparse.ArgumentTypeError(f"{s} is out of range: give a number {where}")
        return v
    parse.__name__ = "number"
    return parse


_pos_int = _int_in(1)
_nonneg_int = _int_in(0)
_days = _int_in(1, MAX_DAYS)  # a positive day count (N): a date plus or minus it stays a date
_days0 = _int_in(0, MAX_DAYS)  # a day count that may be 0 (M)
_mb = _float_in(0.0, MAX_MB, above=True, unit=" MiB")  # a size in MiB above 0
_mb0 = _float_in(0.0, MAX_MB, unit=" MiB")  # a size in MiB that may be 0 (a tier that is off)
MAX_NODES = 10_000  # training or serving nodes
MAX_RANKS_PER_NODE = 1_024
MAX_SAMPLE_ROWS = 10_000_000  # what `validate` reads into memory at most
MAX_ROW_GROUP_ROWS = 1 << 24
MAX_COPY_STREAMS = 256  # stage's threads
MAX_RETRIES = 100


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
    p.add_argument("--input-version", type=_nonneg_int, metavar="VERSION",
                   help="read the Delta input(s) as of this table version (time travel; same as <table>@v<N>)")
    if actions:
        p.add_argument("--actions", metavar="A", help="an optional separate action log (same forms as --input), "
                                                      "mapped by columns.actions")


def _build_dir(p):
    p.add_argument("--build-dir", dest="build_dir", required=True, metavar="D", help=BUILD_DIR_HELP)


SHARDS_HELP = "a shard set's root (node=K/ folders and manifest.json): a local path or a store's URL"


def _shards(p, required=True, note="", append=False):
    if append:
        p.add_argument("--shards", action="append", metavar="S", help=SHARDS_HELP + note)
    else:
        p.add_argument("--shards", dest="shards", required=required, metavar="S", help=SHARDS_HELP + note)


def _staged(p):
    p.add_argument("--staged", dest="staged", required=True, metavar="DIR",
          help="one node's staged copy on local disk (what `userwise stage` writes)")


def _incremental_days(p, required=True, default=None):
    p.add_argument("--incremental-days", dest="incremental_days", type=_days0, required=required, default=default,
          metavar="M", help="M: the last M days before as-of are cut into incremental windows; "
                            "older requests are the pretrain samples")


def _window_days(p, default=None, note=""):
    p.add_argument("--window-days", type=_days, default=default, metavar="N",
                   help="N: days per incremental window (N divides M; 1: daily); a job given --date takes the "
                        "window of the N days ending with that date" + note)


def _date_flag(p, required=True, note=""):
    p.add_argument("--date", required=required, type=_date, metavar="YYYY-MM-DD", help="the UTC day to process" + note)


def _as_of(p, required=True):
    p.add_argument("--as-of", dest="as_of", required=required, type=_date, metavar="T",
          help="T, the exclusive UTC cut-off date: requests before T are built, later ones wait for a later "
               "build; pretrain samples hold the requests before T minus M days")


def _seed(p, what: str):
    p.add_argument("--seed", type=_nonneg_int, default=0, metavar="SEED", help=f"the seed of {what}")


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
    p.add_argument("--days", type=_days, default=3, metavar="DAYS", help="days of log")
    p.add_argument("--users", type=_pos_int, default=200, metavar="COUNT", help="users (a bot user among them)")
    p.add_argument("--items", type=_pos_int, default=5000, metavar="COUNT", help="distinct items")
    p.add_argument("--impressions", type=_pos_int, default=None, metavar="COUNT",
                   help="target impressions in total (overrides --users)")
    p.add_argument("--max-seq-len", type=_pos_int, default=50, metavar="L",
                   help="L for the fat rows' snapshots and the config")
    p.add_argument("--format", choices=["parquet", "delta"], default="parquet", help="how the logs are written")
    p.add_argument("--kinds", default="lean,fat,actions", metavar="KINDS", help="comma list of lean, fat, actions")
    p.add_argument("--bad-rows", type=float, default=0.0, metavar="SHARE",
                   help="share of malformed rows to inject (for tests)")
    p.add_argument("--shape", choices=["default", "production"], default="default",
                   help="the distributions: production = long histories (weeks of action log before the "
                        "impressions, a median over 3K events at request time); see docs/synth.md")
    p.add_argument("--history-days", type=_nonneg_int, default=None, metavar="DAYS",
                   help="days of action log alone before --start (default: the shape's, 0 or 53)")
    p.add_argument("--arrivals", action="store_true",
                   help="an arrival time per event (arrival_ts in lean/ and actions/: most within seconds of the "
                        "action, a tail of hours, a few of days), mapped in config.yaml; the fat snapshots hold "
                        "what arrived before each request")
    _seed(p, "the synthetic log")


def _validate_args(p):
    _config(p)
    _input(p)
    p.add_argument("--sample-rows", type=_int_in(1, MAX_SAMPLE_ROWS), default=10000, metavar="ROWS", help="rows read for the warnings")


def _build_args(p):
    _config(p)
    _input(p)
    _build_dir(p)
    _as_of(p)
    _incremental_days(p)
    _window_days(p, default=1)
    p.add_argument("--report", metavar="R.json", help="also write the report as JSON to this file (or URL)")
    _spark(p)


def _day_args(p, needs_input=True):
    _config(p)
    if needs_input:
        _input(p)
    _build_dir(p)
    _date_flag(p)
    _spark(p)


def _window_args(p):
    _day_args(p, needs_input=False)
    _window_days(p, default=1)


def _pretrain_args(p):
    _config(p)
    _build_dir(p)
    _as_of(p)
    _incremental_days(p)
    _spark(p)


def _expand_args(p):
    _build_dir(p)
    p.add_argument("--expanded", dest="expanded", required=True, metavar="P",
          help="the Parquet folder for the point-wise rows")
    p.add_argument("--max-seq-len", type=_pos_int, metavar="L'", help="L' <= the build's L (default: the build's L)")
    p.add_argument("--kind", choices=["incremental", "pretrain"], help="only this kind (default: both)")
    _spark(p)


def _preshard_args(p):
    _build_dir(p)
    _shards(p, note=" (written)")
    _nodes(p, required=True, default=None)
    p.add_argument("--kind", choices=["incremental", "pretrain"], help="only this kind (default: every kind)")
    p.add_argument("--window", type=_date, metavar="YYYY-MM-DD",
                   help="one incremental window, by its end date (exclusive) (default: every window)")
    _window_days(p, default=None, note=" (here: for a --window that holds no samples, an empty set is published; "
                                       "default: the build's N, else 1)")
    p.add_argument("--target-shard-mb", type=_mb, default=256.0, metavar="MB", help="shard size to aim at")
    p.add_argument("--row-group-rows", type=_int_in(1, MAX_ROW_GROUP_ROWS), default=2048, metavar="ROWS", help="samples per row group, at most")
    p.add_argument("--row-group-mb", type=_mb, default=128.0, metavar="MB",
                   help="also cut a row group at this much (estimated uncompressed) data")
    p.add_argument("--compression", default="zstd", metavar="CODECS",
                   help="zstd | none | snappy (all columns), or col=codec,...")
    p.add_argument("--dictionary", choices=["all", "scalars"], default="all",
                   help="dictionary-encode every column, or only the scalar ones (lists plain)")
    p.add_argument("--layout", choices=["parquet", "gds"], default="parquet",
                   help="gds: also a raw side file per shard for GPUDirect Storage reads")
    _seed(p, "the balanced assignment and the in-shard order")
    _spark(p)


def _publish_args(p):
    _build_dir(p)
    _shards(p, required=False, note="; the set was pre-sharded under S/_staging/<kind>/<date> "
                                    "(default: publish the tables' versions without shards)")
    p.add_argument("--kind", choices=["incremental", "pretrain"], default="incremental", help="which set")
    _date_flag(p, required=False, note=" (here: of an incremental set)")
    _as_of(p, required=False)
    _window_days(p, default=1)
    p.add_argument("--master", help=argparse.SUPPRESS)  # spark-submit passes it; publish needs no Spark


def _stage_args(p):
    _shards(p)
    p.add_argument("--node", required=True, type=_int_in(0, MAX_NODES - 1), metavar="K", help="the node to stage (0-based)")
    _staged(p)
    p.add_argument("--workers", type=_int_in(1, MAX_COPY_STREAMS), default=8, metavar="COUNT",
                   help="parallel copy streams")
    p.add_argument("--limit-mbps", type=float, default=None, metavar="MB/S",
                   help="cap the copy rate over all workers, e.g. to spare a shared network (default: no cap)")
    p.add_argument("--range-mb", type=float, default=64.0, metavar="MB",
                   help="copy files larger than this as parallel ranges of this size (several streams per file)")
    p.add_argument("--retries", type=_int_in(0, MAX_RETRIES), default=4, metavar="COUNT",
                   help="retries of a failed read, with exponential backoff, before the node fails")


def _diagnose_args(p):
    _staged(p)
    p.add_argument("--device", choices=["cuda", "cpu"], default=None,
                   help="where the batches go (default: cuda if available, else cpu)")
    p.add_argument("--batch-size", type=_pos_int, default=64, metavar="SAMPLES", help="samples per batch")
    p.add_argument("--batches", type=_pos_int, default=50, metavar="COUNT", help="batches per step of the test")


def _replay_args(p):
    _shards(p, note=" (here: read: every training node's shards, or one node's staged copy)")
    p.add_argument("--serving-nodes", type=_pos_int, default=1, metavar="K",
                   help="serving nodes (users routed by a jump consistent hash of their id), a cache each")
    p.add_argument("--checkpoint", metavar="F.pt", help="the model: a torch file {'config': ReferenceRanker's keyword "
                   "arguments, 'state_dict': its weights} (default: random weights from --seed)")
    p.add_argument("--encoder", choices=["sample", "window", "none"], default="sample", help="the random model's encoder")
    p.add_argument("--window", type=_pos_int, metavar="EVENTS", help="the window of --encoder window (default: L)")
    for flag, default, what in (("--dim", 32, "width"), ("--heads", 2, "attention heads"), ("--layers", 2, "blocks")):
        p.add_argument(flag, type=_pos_int, default=default, metavar="COUNT", help=f"the random model's {what}")
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32",
                   help="the model's dtype; logits must agree to 1e-5 (float32) or 1e-9 (float64)")
    _seed(p, "the random model's weights")
    p.add_argument("--max-seq-len", type=_pos_int, metavar="L", help="L, the newest events a request sees "
                   "(default: the longest span of the pointers)")
    p.add_argument("--page-size", type=_pos_int, default=64, metavar="P", help="events per cache page")
    for tier, default in (("device", 256.0), ("host", 1024.0), ("disk", 0.0)):
        p.add_argument(f"--{tier}-mb", type=float, default=default, metavar="MB", help=f"each node's {tier} tier")
    p.add_argument("--cache-dir", metavar="DIR", help="the disk tier's files (default: a temporary folder)")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None,
                   help="where the model and the device tier run (default: cuda if available, else cpu)")
    p.add_argument("--max-requests", type=_pos_int, metavar="COUNT", help="each node's first requests only")
    p.add_argument("--verify", choices=["checksum", "size", "none"], default="checksum",
                   help="how the shards are checked against the manifest before they are read, as the loader does "
                        "(every footer and page is checked in each mode)")
    p.add_argument("--order", choices=["arrival", "action_time", "both"], default="arrival",
                   help="how each user's events are held: arrival (as stored: late events append), action_time "
                        "(re-sorted by action time: a late event lands mid-stream and costs a re-encode), or both "
                        "side by side (hit rate, invalidations, tokens encoded again for each)")


def _backfill_args(p):
    p.add_argument("--from", dest="date_from", required=True, type=_date, metavar="YYYY-MM-DD",
                   help="the first UTC day to process")
    p.add_argument("--to", dest="date_to", required=True, type=_date, metavar="YYYY-MM-DD",
                   help="the last UTC day to process (inclusive)")
    _config(p)
    _input(p)
    _build_dir(p)
    _shards(p, required=False, note=" to pre-shard and publish each day into (default: none)")
    _incremental_days(p, required=False, default=30)
    _window_days(p, default=1)
    _nodes(p, required=False, default=1)
    p.add_argument("--force", action="store_true", help="rebuild days already published")
    _spark(p)


def _forget_args(p):
    _build_dir(p)
    p.add_argument("--users", required=True, metavar="FILE",
                   help="text file: one user id per line (as the build's user column holds it; "
                        "blank lines and lines starting with # are skipped)")
    _shards(p, append=True, note="; here also a folder of shard sets (published, staged): every set below it "
                                 "that holds the users is rewritten without them; repeatable (default: none)")
    p.add_argument("--vacuum", action="store_true",
                   help="also delete the tables' older files from disk (Delta VACUUM, retention 0): "
                        "time travel to earlier versions ends")
    _spark(p)


def _nodes(p, *, required: bool, default):
    p.add_argument("--nodes", required=required, default=default, type=_int_in(1, MAX_NODES), metavar="NODES",
                   help="training nodes: a node=K/ folder each")
    p.add_argument("--ranks-per-node", required=required, default=default, type=_int_in(1, MAX_RANKS_PER_NODE), metavar="RANKS",
                   help="ranks (GPUs) per node, balanced by cost")


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
              _build_args, "userwise.pipelines.api.handlers:build"),
    "expand": ("expand user-wise samples back to point-wise rows (the lossless round trip)",
               _expand_args, "userwise.pipelines.api.handlers:expand"),
    "requests": ("daily job: build the requests (and quarantine) of one date",
                 _day_args, "userwise.pipelines.builder.daily:requests_cli"),
    "history": ("daily job: MERGE one date's actions into the user history",
                lambda p: _day_args(p, needs_input=False), "userwise.pipelines.builder.daily:history_cli"),
    "window": ("daily job: build the incremental samples of the window ending with one date",
               _window_args, "userwise.pipelines.builder.daily:window_cli"),
    "pretrain": ("job: build the pretrain samples (requests before as-of minus M days)",
                 _pretrain_args, "userwise.pipelines.builder.daily:pretrain_cli"),
    "preshard": ("pre-shard samples into balanced per-node Parquet shard sets with a manifest",
                 _preshard_args, "userwise.pipelines.api.handlers:preshard"),
    "publish": ("put a pre-sharded set in place and mark the day (or pretrain set) published, record last",
                _publish_args, "userwise.pipelines.api.handlers:publish"),
    "stage": ("copy one node's shards to local disk, verified and resumable",
              _stage_args, "userwise.pipelines.api.handlers:stage"),
    "diagnose": ("three-step bottleneck test of the loader on one node's staged shards",
                 _diagnose_args, "userwise.pipelines.loader.diagnose:cli"),
    "replay": ("serve a shard set's requests through the K/V cache and a full recompute: equal logits, hit rates, "
               "tokens recomputed, resident bytes, requests per second", _replay_args,
               "userwise.pipelines.serve.build_replay:cli"),
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
        if not any(action.default is x for x in (None, False, argparse.SUPPRESS)) and action.default != [] \
                and "(default" not in h:
            return f"{h} (default: %(default)s)"
        return h


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one ``error:`` line (exit 2) like every other failure."""

    def __init__(self, *a, **kw):
        kw.setdefault("formatter_class", _Formatter)
        super().__init__(*a, **kw)

    def error(self, message: str):
        self.exit(EXIT_USER, f"error: {message} (see `{self.prog} --help`)\n")


def version() -> str:
    from userwise.pipelines.runtime.ship import version

    return version()


EPILOG = "exit codes: " + "; ".join(f"{k} {v}" for k, v in EXIT_CODES.items())


def epilog(spark: bool) -> str:
    """The exit codes a command can give: 3 only where it runs Spark."""
    return "exit codes: " + "; ".join(f"{k} {v}" for k, v in EXIT_CODES.items() if spark or k != EXIT_SPARK)


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
        sp = sub.add_parser(name, help=help_, description=help_)
        build(sp)
        sp.epilog = epilog(any(a.dest == "conf" for a in sp._actions))
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

    quiet_before, progress.QUIET = progress.QUIET, args.quiet
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
        return EXIT_INTERRUPTED
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
        progress.QUIET = quiet_before  # a command's --quiet ends with it (main runs in-process in tests)
    return int(rc or EXIT_OK)


if __name__ == "__main__":
    sys.exit(main())
