"""The five Spark-side commands as keyword-only Python functions (:mod:`userwise.pipelines.api`).

Each takes the command's flags under their own names (``--build-dir`` is ``build_dir``) and
returns the report the command prints with ``--json``. The modules that do the work are
imported when a function runs, so importing this one starts nothing; ``publish`` and
``stage`` never import pyspark.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import sys
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from userwise.pipelines.config import Config


def _spark(spark: SparkSession | None, master: str | None, app: str) -> SparkSession:
    if spark is not None:
        return spark
    from userwise.pipelines.runtime.spark import get_spark

    return get_spark(master=master, app=app)


def build(*, config: str | Config, input: str, build_dir: str, as_of: str | dt.date, incremental_days: int,
          window_days: int = 1, actions: str | None = None, input_version: int | None = None,
          master: str | None = None, spark: SparkSession | None = None, lock: bool = True) -> dict:
    """Build requests, history, samples and quarantine for every day before ``as_of``
    (``userwise build``); returns the build's report (rows read, quarantined, samples, ...,
    ``reconciled``).

    ``config``: the YAML config's path (or a parsed :class:`~userwise.pipelines.config.Config`);
    ``input``: the impression log (every form ``--input`` takes), read at Delta version
    ``input_version`` when given; ``build_dir``: the build folder; ``as_of``: the exclusive
    cut-off date; ``incremental_days``: M, the last days cut into incremental windows of
    ``window_days`` (N) days each; ``actions``: an optional separate action log; ``master``:
    the Spark master of a new session, or ``spark``: a session to use; ``lock``: hold the build
    folder's writer lock while building (the command holds it already and passes False).

    Example::

        from userwise.pipelines import api

        rep = api.build(config="conf.yaml", input="s3a://logs/imp", build_dir="s3a://b/D",
                        as_of="2026-02-01", incremental_days=7, window_days=1)
        assert rep["reconciled"]
    """
    from userwise.pipelines import config as C
    from userwise.pipelines.builder import build as job
    from userwise.pipelines.builder import validate
    from userwise.pipelines.builder.inputs import with_version
    from userwise.pipelines.records.writer_lock import WriterLock

    cfg = C.load(config) if isinstance(config, str) else config
    if input_version is not None:
        input = with_version(input, input_version)
    validate.front_door(cfg, input, actions)  # the same refusals as `userwise validate`, before Spark
    job.windows(job.as_date(as_of), incremental_days, window_days)  # a bad M or N, before Spark
    with WriterLock(build_dir, "build") if lock else contextlib.nullcontext():
        return job.build(_spark(spark, master, "userwise-build"), cfg, input, build_dir, as_of, incremental_days,
                         window_days, actions)


def expand(*, build_dir: str, expanded: str, max_seq_len: int | None = None, kind: str | None = None,
           master: str | None = None, spark: SparkSession | None = None) -> dict:
    """Expand a build's user-wise samples back to point-wise rows (``userwise expand``);
    returns ``{"impressions": rows written, "expanded": expanded}``.

    ``build_dir``: the build folder (or its ``samples`` table); ``expanded``: the Parquet
    folder written; ``max_seq_len``: L' <= the build's L (default: the build's L); ``kind``:
    ``"incremental"`` or ``"pretrain"`` only (default: both); ``master``/``spark``: as in
    :func:`build`.

    Example::

        from userwise.pipelines import api

        api.expand(build_dir="/data/D", expanded="/data/pointwise", kind="pretrain")
    """
    from userwise.pipelines.builder import expand as job
    from userwise.pipelines.errors import UserwiseError
    from userwise.pipelines.records import build_record
    from userwise.pipelines.runtime import storage

    folder = build_dir
    if folder.rstrip("/").rsplit("/", 1)[-1] == "samples" and not storage.exists(build_record.path(folder)):
        folder = folder.rstrip("/").rsplit("/", 1)[0]
    cfg, layout, _ = build_record.load(folder)
    if max_seq_len and max_seq_len > cfg.max_seq_len:
        raise UserwiseError(f"--max-seq-len {max_seq_len} is larger than the build's max_seq_len "
                            f"{cfg.max_seq_len}: the samples only hold the last L events per request")
    session = _spark(spark, master, "userwise-expand")
    df = job.expand_frame(cfg, layout, job.read_samples(session, folder, kind), max_seq_len)
    return {"impressions": job.write(session, df, layout, expanded), "expanded": expanded}


def preshard(*, build_dir: str, shards: str, nodes: int, ranks_per_node: int, kind: str | None = None,
             window: str | None = None, window_days: int | None = None, target_shard_mb: float = 256.0,
             row_group_rows: int = 2048, row_group_mb: float = 128.0, compression: str = "zstd",
             dictionary: str = "all", layout: str = "parquet", seed: int = 0, master: str | None = None,
             spark: SparkSession | None = None) -> dict:
    """Pre-shard a build's samples into balanced per-node shard sets with a manifest
    (``userwise preshard``); returns the job's report (shards, rows, bytes, per set the ranks'
    cost balance).

    ``build_dir``: the build folder; ``shards``: the shard set's root (written); ``nodes`` and
    ``ranks_per_node``: the training job's shape; ``kind``: one kind only; ``window``: one
    incremental window by its end date, whose start is ``window_days`` before (default: the
    build's N); ``target_shard_mb``: shard size to aim at; ``row_group_rows`` and
    ``row_group_mb``: where a row group is cut; ``compression``: ``zstd``, ``none``, ``snappy``
    or ``col=codec,...``; ``dictionary``: ``all`` or ``scalars``; ``layout``: ``parquet`` or
    ``gds`` (raw side files too); ``seed``: the assignment's seed; ``master``/``spark``: as in
    :func:`build`.

    Example::

        from userwise.pipelines import api

        rep = api.preshard(build_dir="/data/D", shards="/data/S", nodes=2, ranks_per_node=8)
        print(rep["shards"], "shards")
    """
    from userwise.pipelines.shards import preshard as job

    m = job.preshard(_spark(spark, master, "userwise-preshard"), build_dir=build_dir, shards=shards, nodes=nodes,
                     ranks_per_node=ranks_per_node, kind=kind, window=window, target_shard_mb=target_shard_mb,
                     row_group_rows=row_group_rows, row_group_mb=row_group_mb, compression=compression,
                     layout=layout, seed=seed, window_days=window_days, dictionary=dictionary)
    return m["_report"]


def publish(*, build_dir: str, shards: str | None = None, kind: str = "incremental", date: str | dt.date | None = None,
            as_of: str | dt.date | None = None, window_days: int = 1) -> dict:
    """Put a pre-sharded set in place and mark the day (or the pretrain set) published, the
    build folder's record last (``userwise publish``); returns the published record. No Spark.

    ``build_dir``: the build folder; ``shards``: the shard sets' root, the set pre-sharded
    under ``shards/_staging/<kind>/<date>`` (None: publish the tables' versions only);
    ``kind``: ``"incremental"`` (needs ``date``, the processed UTC day, and ``window_days``)
    or ``"pretrain"`` (needs ``as_of``).

    Example::

        from userwise.pipelines import api

        rec = api.publish(build_dir="/data/D", shards="/data/S", date="2026-02-01")
        print(rec["shards"]["root"])
    """
    from userwise.pipelines.shards import publish as job

    return job.publish(build_dir, kind=kind, date=date, as_of=as_of, shards=shards, window_days=window_days)


def stage(*, shards: str, node: int, staged: str, workers: int = 8, limit_mbps: float | None = None,
          range_mb: float = 64.0, retries: int = 4, progress: TextIO | None = sys.stderr) -> dict:
    """Copy one node's shards to local disk, verified and resumable (``userwise stage``);
    returns the report (files, copied, skipped, bytes, seconds). Never imports pyspark.

    ``shards``: the shard set's root (a local path or a store's URL); ``node``: the node to
    stage (0-based); ``staged``: the local folder written; ``workers``: parallel copy streams;
    ``limit_mbps``: a cap on the copy rate over all workers (None: no cap); ``range_mb``:
    files larger than this are copied as parallel ranges of this size; ``retries``: retries
    of a failed read before the node fails; ``progress``: where progress lines go (None: nowhere).

    Example::

        from userwise.pipelines import api

        rep = api.stage(shards="s3a://bucket/S", node=0, staged="/nvme/S", workers=16)
        print(rep["copied"], "files copied")
    """
    import os

    from userwise.pipelines.shards import stage as job

    if progress is None:
        with open(os.devnull, "w") as sink:
            return job.stage(shards, node, staged, workers=workers, limit_mbps=limit_mbps, range_mb=range_mb,
                             retries=retries, out=sink)
    return job.stage(shards, node, staged, workers=workers, limit_mbps=limit_mbps, range_mb=range_mb,
                     retries=retries, out=progress)
