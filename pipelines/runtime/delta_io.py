"""All Delta I/O in one place: read (at a version), replaceWhere, MERGE, delete, RESTORE, VACUUM.

Nothing else in the project touches ``DeltaTable``. Every write is one Delta
commit, so a failed job leaves the previous version visible and a retry
simply overwrites the same partition.
"""

from __future__ import annotations

import os

from userwise.pipelines.runtime import storage
from userwise.pipelines.runtime.spark import session_conf

# The Parquet codec of every table written here. Spark's default is snappy; the stored product
# (the samples) is read far more often than it is written, over networks and from NVMe.
# zstd makes them about a third smaller than snappy and the build no slower (README, "Tables
# and schemas"). Shards have their own codec (preshard --compression, zstd by default).
CODEC = "zstd"


def table_path(build_dir: str, name: str) -> str:
    return storage.join(storage.absolute(build_dir), name)


def exists(spark, path: str) -> bool:
    from delta.tables import DeltaTable

    return has_log(path) and DeltaTable.isDeltaTable(spark, path)


def has_log(path: str) -> bool:
    """Whether ``path`` (a local path or a URL) holds a Delta log."""
    return storage.is_dir(storage.join(path, "_delta_log"))


def read(spark, path: str, version: int | None = None):
    r = spark.read.format("delta")
    if version is not None:
        r = r.option("versionAsOf", int(version))
    return r.load(path)


def version(spark, path: str) -> int:
    """The table's current Delta version (read from its log by delta-rs: no Spark job)."""
    from deltalake import DeltaTable as RsTable

    return int(RsTable(path).version())


def read_small(path: str, columns: list[str] | None = None):
    """A small table (a log, a manifest) as Arrow, through delta-rs: no Spark job."""
    return dataset(path).to_table(columns=columns)


def write_small(path: str, table, predicate: str | None = None) -> None:
    """Replace rows matching ``predicate`` (or create the table) with a small Arrow table,
    through delta-rs: one commit, no Spark job. For bookkeeping tables only."""
    from deltalake import write_deltalake

    write_deltalake(path, table, mode="overwrite",
                    predicate=predicate if has_log(path) else None)


def least(path: str, col: str = "date"):
    """The least value of ``col`` in a table's rows, from its log (delta-rs, no Spark job): the
    files' partition values where the table is partitioned by ``col``, else their min
    statistics; None when no file holds rows. Files without row counts count as holding rows."""
    import pyarrow as pa
    import pyarrow.compute as pc
    from deltalake import DeltaTable as RsTable

    acts = pa.table(RsTable(path).get_add_actions(flatten=True))
    if "num_records" in acts.column_names:
        acts = acts.filter(pc.fill_null(pc.greater(acts.column("num_records"), 0), True))
    name = next((n for n in (f"partition.{col}", f"min.{col}") if n in acts.column_names), None)
    return pc.min(acts.column(name)).as_py() if name and acts.num_rows else None


class commits:
    """Counts the rows the Delta commits added to ``paths`` after it was made: a step's counter
    for :func:`userwise.pipelines.runtime.progress.step` (the output rows in each new commit's
    metrics, read from the tables' logs by delta-rs: no Spark job).

    Example::

        with progress.step("requests", delta_io.commits(table_path(out, "requests"))):
            replace(df, table_path(out, "requests"), where)
    """

    def __init__(self, *paths: str):
        self.since = {p: _version_or_none(p) for p in paths}

    def rows(self) -> int:
        return sum(_rows_since(p, v) for p, v in self.since.items())


def _version_or_none(path: str) -> int:
    try:
        return version(None, path) if has_log(path) else -1
    except Exception:  # noqa: BLE001 - a log delta-rs cannot read: the count is unknown, not an error
        return -1


def _rows_since(path: str, since: int) -> int:
    from deltalake import DeltaTable as RsTable

    try:
        t = RsTable(path)
        new = int(t.version()) - since
        hist = t.history(new) if new > 0 else []
    except Exception:  # noqa: BLE001 - as above
        return 0
    def added(metrics: dict) -> int:  # Spark's writers name it numOutputRows, delta-rs num_added_rows
        return int(metrics.get("numOutputRows") or metrics.get("num_added_rows") or 0)

    return sum(added(c.get("operationMetrics") or {}) for c in hist if int(c.get("version", -1)) > since)


def arrow_filesystem(path: str):
    """pyarrow's filesystem rooted at the table ``path``: the local one for a path or a
    ``file://`` URI, pyarrow's S3 for ``s3://`` / ``s3a://`` (:func:`storage.filesystem`: the
    same ``AWS_*`` settings delta-rs reads); None for other schemes (delta-rs' own filesystem).

    delta-rs reads its Arrow datasets through a Python filesystem of its own by default
    (``DeltaStorageHandler``: Arrow's I/O threads call back into Python and a Rust runtime).
    A process that read through it sometimes aborts as it exits ("terminate called without an
    active exception", SIGABRT; delta-rs#2184): 4 of 120 such processes on a loaded 2-core
    machine, and the window job's driver twice in one CI run (spark-submit exit 134). Read
    through pyarrow's filesystem, the same 120 exited cleanly. delta-rs still reads the log
    and lists the files; only the Parquet bytes come through pyarrow.
    """
    import pyarrow.fs as pafs

    if "://" not in path:
        root = os.path.abspath(path)
    elif path.startswith("file://"):
        _, root = pafs.FileSystem.from_uri(path)
    elif storage.is_s3(path):
        try:
            fs, root = storage.filesystem(path)
        except storage.StorageError:  # pyarrow cannot reach the bucket: delta-rs' own filesystem
            return None
        return pafs.SubTreeFileSystem(root, fs)
    else:
        return None
    return pafs.SubTreeFileSystem(root, pafs.LocalFileSystem())


def table_bytes(path: str, version: int | None = None) -> int:
    """Bytes of the data files of a table's version (default: the current one), from its log.

    Files of earlier versions, which reruns leave on disk until VACUUM, do not count; a
    table that does not exist has 0 bytes. Works for any URL delta-rs reads.
    """
    import pyarrow as pa
    from deltalake import DeltaTable as RsTable
    from deltalake.exceptions import TableNotFoundError

    try:
        t = RsTable(path, version=version)
    except TableNotFoundError:
        return 0
    return int(sum(pa.table(t.get_add_actions(flatten=True)).column("size_bytes").to_pylist()))


def dataset(path: str):
    """A Delta table's current version as a pyarrow dataset (delta-rs lists the files, pyarrow
    reads them: no Spark job; see :func:`arrow_filesystem`)."""
    from deltalake import DeltaTable as RsTable

    return RsTable(path).to_pyarrow_dataset(filesystem=arrow_filesystem(path))


def replace(df, path: str, where: str | None, partition_by: tuple[str, ...] = (), schema=None,
            properties: dict[str, str] | None = None) -> None:
    """Atomically replace the rows matching ``where`` (or the whole table) with ``df``.

    The DataFrame is cast to ``schema`` (a TableSchema) first: the schema
    contract of every table we write. Its columns carry their descriptions (the
    ``comment`` of each field, which replaceWhere and MERGE keep), and the table
    gets the schema's properties (``schema.properties``, then ``properties``).

    The files' layout is the schema's too: its ``partition_by``, and its ``order_by``
    (rows range-partitioned and sorted by it, so each file holds a contiguous run and
    min/max statistics skip files; the number of files follows the data). A table that
    exists keeps its own partitioning. ``partition_by`` is for writes without a schema.
    """
    spark = df.sparkSession
    order_by: tuple[str, ...] = ()
    if schema is not None:
        from pyspark.sql import functions as F

        partition_by, order_by = schema.partition_by, schema.order_by
        st = schema.to_spark()
        df = df.select([F.col(f.name).cast(f.dataType).alias(f.name, metadata=f.metadata) for f in st.fields])
        properties = {**schema.properties, **(properties or {})}
    if order_by:
        # by range, not by value: AQE merges small ranges, so a day is never a file of its own
        df = df.repartitionByRange(*order_by).sortWithinPartitions(*order_by)
    w = df.write.format("delta").mode("overwrite").option("compression", CODEC)
    if partition_by:
        w = w.partitionBy(*partition_by)
    if exists(spark, path):
        if where:
            w = w.option("replaceWhere", where)
        else:
            w = w.option("overwriteSchema", "false")
    w.save(path)
    if schema is not None:
        describe(spark, path, schema)
    if properties:
        set_properties(spark, path, properties)


def _sql_string(v: str) -> str:
    return "'" + str(v).replace("\\", "\\\\").replace("'", "\\'") + "'"


def set_properties(spark, path: str, props: dict[str, str]) -> None:
    """Set the table properties ``props`` that differ from the table's (one commit; none
    when all are already set)."""
    from deltalake import DeltaTable as RsTable

    have = RsTable(path).metadata().configuration
    todo = {k: str(v) for k, v in props.items() if have.get(k) != str(v)}
    if todo:
        sets = ", ".join(f"{_sql_string(k)} = {_sql_string(v)}" for k, v in todo.items())
        spark.sql(f"ALTER TABLE delta.`{path}` SET TBLPROPERTIES ({sets})")


def describe(spark, path: str, schema) -> None:
    """Give the table's columns the descriptions of ``schema`` (a TableSchema) where they
    differ: a table created by a write already has them; one created without them (or with
    other texts) gets them in one ALTER TABLE commit."""
    from deltalake import DeltaTable as RsTable

    from userwise.schemas.core import COMMENT

    have = {f.name: (f.metadata or {}).get(COMMENT) for f in RsTable(path).schema().fields}
    todo = [f for f in schema.fields if f.doc and f.name in have and have[f.name] != f.doc]
    if todo:
        cols = ", ".join(f"`{f.name}` {COMMENT.upper()} {_sql_string(f.doc)}" for f in todo)
        spark.sql(f"ALTER TABLE delta.`{path}` ALTER COLUMN {cols}")


CODEC_CONF = {"spark.sql.parquet.compression.codec": CODEC}  # what a MERGE writes with (it takes no options)


def merge_by_key(spark, path: str, updates, key: str) -> None:
    """Upsert ``updates`` into the table on ``key`` (one MERGE commit), its files in
    :data:`CODEC` (a MERGE takes no writer options: the session's codec, set for the call)."""
    from delta.tables import DeltaTable

    t = DeltaTable.forPath(spark, path)
    with session_conf(spark, CODEC_CONF):
        (
            t.alias("t")
            .merge(updates.alias("s"), f"t.`{key}` = s.`{key}`")
            .whenMatchedUpdateAll()
            .whenNotMatchedInsertAll()
            .execute()
        )


def retention_properties(days: int) -> dict[str, str]:
    """Log and file retention so time travel reaches back ``days`` days."""
    return {
        "delta.logRetentionDuration": f"interval {int(days)} days",
        "delta.deletedFileRetentionDuration": f"interval {int(days)} days",
    }


def delete_matching(spark, path: str, keys, condition) -> int:
    """Delete the rows of the table that match a row of ``keys`` (one MERGE ... WHEN MATCHED
    DELETE commit); returns the number of rows deleted.

    ``keys`` is a DataFrame (broadcast: a list of ids, however long, is a join, never a giant
    ``IN`` string); ``condition`` is the match (SQL text or a Column), the table aliased ``t``
    and ``keys`` aliased ``k``, e.g. ``"t.user = k.user"``. Files that hold no match are not
    rewritten.

    Example::

        delete_matching(spark, table_path(out, "samples"), users, "t.user = k.user")
    """
    from delta.tables import DeltaTable
    from pyspark.sql import functions as F

    t = DeltaTable.forPath(spark, path)
    v0 = t.history(1).select("version").first()["version"]
    with session_conf(spark, CODEC_CONF):  # the rewritten files keep the table's codec
        t.alias("t").merge(F.broadcast(keys).alias("k"), condition).whenMatchedDelete().execute()
    last = t.history(1).select("version", "operationMetrics").first()
    if last["version"] == v0:  # nothing matched and nothing was committed
        return 0
    return int((last["operationMetrics"] or {}).get("numTargetRowsDeleted", 0))


def purge_deleted(spark, path: str) -> None:
    """Rewrite the files whose rows a deletion vector hides, so that the current version's files
    hold no deleted row (REORG ... APPLY (PURGE)); a no-op on tables without deletion vectors."""
    from delta.tables import DeltaTable

    props = DeltaTable.forPath(spark, path).detail().select("properties").first()["properties"] or {}
    if str(props.get("delta.enableDeletionVectors", "false")).lower() == "true":
        spark.sql(f"REORG TABLE delta.`{path}` APPLY (PURGE)")


def vacuum(spark, path: str, hours: float = 0.0) -> None:
    """Physically remove the files no version younger than ``hours`` needs (VACUUM). With 0,
    every file the current version does not read is removed: time travel to any older version
    of the table ends here. (The session disables Delta's retention check: runtime/spark.py.)

    VACUUM lists the table's folders in Spark jobs of
    ``spark.sql.sources.parallelPartitionDiscovery.parallelism`` tasks (10,000 by default):
    on a small table, about 170,000 empty tasks and 26 s locally against 2.5 s with the
    listing capped at a few tasks per core, which this call does (a session set lower keeps
    its value)."""
    from delta.tables import DeltaTable

    key = "spark.sql.sources.parallelPartitionDiscovery.parallelism"
    cap = 4 * max(1, spark.sparkContext.defaultParallelism)
    have = spark.conf.get(key, None)
    with session_conf(spark, {} if have is not None and int(have) <= cap else {key: str(cap)}):
        DeltaTable.forPath(spark, path).vacuum(float(hours))
