"""delta_io's JVM-free reads: delta-rs lists a table's files, pyarrow's own filesystem reads them.

(Read through delta-rs' default Python filesystem, a process sometimes aborted as it exited:
see ``delta_io.arrow_filesystem`` and docs/tables.md.)
"""

from __future__ import annotations

import datetime as dt
import os

import pyarrow as pa
import pyarrow.dataset as pds
import pyarrow.fs as pafs
import pytest

from userwise.pipelines.builder import inputs
from userwise.pipelines.runtime import delta_io, storage


@pytest.fixture()
def table(tmp_path):
    from deltalake import write_deltalake

    rows = pa.table({"user": pa.array([3, 1, 2, 5, 4], pa.int64()),
                     "cost": pa.array([30, 10, 20, 50, 40], pa.int64()),
                     "kind": ["pretrain", "incremental", "incremental", "pretrain", "incremental"],
                     "window_end": pa.array([dt.date(2026, 1, 2)] * 4 + [dt.date(2026, 1, 3)])})
    path = tmp_path / "a dir" / "samples"  # a space: the root is a path, not a URI
    write_deltalake(str(path), rows, partition_by=["kind", "window_end"])
    # a second commit that removes a file: only the current version's files are read
    write_deltalake(str(path), rows.filter(pa.compute.equal(rows["kind"], "incremental")),
                    mode="overwrite", predicate="kind = 'incremental'")
    return path, rows


def _sorted(t: pa.Table, cols) -> list[dict]:
    return sorted(t.select(cols).to_pylist(), key=lambda r: r["user"])


def test_dataset_reads_through_pyarrows_filesystem_not_a_python_one(table):
    path, rows = table
    ds = delta_io.dataset(str(path))
    assert isinstance(ds.filesystem, pafs.SubTreeFileSystem)
    assert not isinstance(ds.filesystem, pafs.PyFileSystem)
    assert isinstance(ds.filesystem.base_fs, pafs.LocalFileSystem)
    cols = ["user", "cost", "kind", "window_end"]
    assert _sorted(ds.to_table(columns=cols), cols) == _sorted(rows, cols)


def test_dataset_prunes_by_partition_and_reads_the_current_version_only(table):
    path, rows = table
    ds = delta_io.dataset(str(path))
    t = ds.to_table(columns=["user", "cost"], filter=(pds.field("kind") == "incremental")
                    & (pds.field("window_end") == dt.date(2026, 1, 2)))
    assert _sorted(t, ["user", "cost"]) == [{"user": 1, "cost": 10}, {"user": 2, "cost": 20}]
    assert delta_io.version(None, str(path)) == 1


def test_read_small_and_write_small_round_trip(tmp_path):
    p = str(tmp_path / "log")
    delta_io.write_small(p, pa.table({"date": [dt.date(2026, 1, 1)], "version": pa.array([4], pa.int64())}))
    delta_io.write_small(p, pa.table({"date": [dt.date(2026, 1, 2)], "version": pa.array([5], pa.int64())}),
                         "date = '2026-01-02'")
    t = delta_io.read_small(p, ["version", "date"])
    assert t.column_names == ["version", "date"]
    assert sorted(t.to_pylist(), key=lambda r: r["version"]) == [
        {"version": 4, "date": dt.date(2026, 1, 1)}, {"version": 5, "date": dt.date(2026, 1, 2)}]


def test_delta_input_is_read_through_the_same_path(table):
    path, rows = table
    ds = inputs.arrow_dataset(str(path))
    assert isinstance(ds.filesystem, pafs.SubTreeFileSystem)
    assert ds.count_rows() == rows.num_rows  # the overwrite rewrote the same rows


def test_arrow_filesystem_roots(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rel = delta_io.arrow_filesystem("t")
    assert rel.base_path.rstrip("/") == str(tmp_path / "t")
    uri = delta_io.arrow_filesystem(f"file://{tmp_path}/t")
    assert isinstance(uri, pafs.SubTreeFileSystem) and uri.base_path.rstrip("/") == str(tmp_path / "t")
    # S3 goes through pyarrow's S3 (an endpoint given: made without a request; reads in
    # tests/remote/test_s3_store.py); one pyarrow cannot open, and other object stores, keep
    # delta-rs' own filesystem (None)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    s3 = delta_io.arrow_filesystem("s3a://bucket/t")
    assert isinstance(s3, pafs.SubTreeFileSystem) and isinstance(s3.base_fs, pafs.S3FileSystem)
    assert s3.base_path.rstrip("/") == "bucket/t"

    def unreachable(url):
        raise storage.StorageError(f"{url}: cannot open this location")

    monkeypatch.setattr(storage, "filesystem", unreachable)
    assert delta_io.arrow_filesystem("s3://bucket/t") is None
    assert delta_io.arrow_filesystem("nosuchscheme://bucket/t") is None


@pytest.mark.spark
def test_a_table_spark_wrote_with_escaped_partition_values_reads_the_same(spark, tmp_path):
    """Spark escapes some characters in partition folder names and the log URL-encodes the
    path again: pyarrow's filesystem must still find every file and the values must come back."""
    path = str(tmp_path / "t")
    vals = ["a b:c", "d%e/f", "é=ü", "plain"]
    spark.createDataFrame([(i, v) for i, v in enumerate(vals)], "x long, p string") \
        .write.format("delta").partitionBy("p").save(path)
    got = delta_io.dataset(path).to_table().to_pylist()
    assert sorted((r["x"], r["p"]) for r in got) == list(enumerate(vals))
    assert isinstance(inputs.arrow_dataset(path).filesystem, pafs.SubTreeFileSystem)


@pytest.mark.spark
def test_spark_writes_and_merges_zstd_files_and_leaves_the_session_codec_alone(spark, tmp_path):
    """Every table the build writes is zstd (delta_io.CODEC), by replaceWhere and by MERGE;
    the MERGE sets the session's codec only for its own call."""
    import glob

    import pyarrow.parquet as pq

    path = str(tmp_path / "t")
    key = "spark.sql.parquet.compression.codec"
    before = spark.conf.get(key, None)
    delta_io.replace(spark.createDataFrame([(1, "a"), (2, "b")], "user long, v string"), path, None)
    first = set(glob.glob(os.path.join(path, "*.parquet")))
    delta_io.merge_by_key(spark, path, spark.createDataFrame([(2, "c"), (3, "d")], "user long, v string"), "user")
    merged = set(glob.glob(os.path.join(path, "*.parquet"))) - first
    assert first and merged  # both writes added files
    for f in first | merged:
        md = pq.ParquetFile(f).metadata
        assert {md.row_group(0).column(j).compression for j in range(md.num_columns)} == {"ZSTD"}, f
    assert spark.conf.get(key, None) == before
    assert sorted(delta_io.read_small(path).to_pylist(), key=lambda r: r["user"]) == [
        {"user": 1, "v": "a"}, {"user": 2, "v": "c"}, {"user": 3, "v": "d"}]


def test_table_bytes_counts_only_the_current_version_s_files(tmp_path):
    """A rerun leaves the replaced files on disk until VACUUM: the report's bytes must not count them."""
    import pyarrow as pa
    from deltalake import write_deltalake

    path = str(tmp_path / "t")
    data = pa.table({"a": list(range(5000))})
    write_deltalake(path, data)
    one = delta_io.table_bytes(path)
    on_disk = lambda: sum(f.stat().st_size for f in (tmp_path / "t").glob("*.parquet"))  # noqa: E731
    assert one == on_disk() > 0
    write_deltalake(path, data, mode="overwrite")
    assert on_disk() == 2 * one and delta_io.table_bytes(path) == one
    assert delta_io.table_bytes(path, version=0) == one
    assert delta_io.table_bytes(str(tmp_path / "missing")) == 0


@pytest.mark.spark
def test_a_write_describes_a_table_that_lacks_descriptions_once(spark, tmp_path):
    """A table written without descriptions or properties (by other code, or an older
    format) gets them from the next ``delta_io.replace`` (one ALTER for the comments, one
    for the properties); a write that finds them in place adds no commit of its own.
    Quotes and backslashes in the texts survive the SQL."""
    from deltalake import DeltaTable

    from userwise import schemas as S
    from userwise.schemas.labels import action_bits_property

    t = S.TableSchema("t", (S.Field("date", pa.date32(), False, "the day"),
                            S.Field("n", pa.int64(), True, "it's n \\ 2")),
                      partition_by=("date",), properties=action_bits_property(["a'b", "c"]))
    p = str(tmp_path / "t")
    df = spark.createDataFrame([(dt.date(2026, 1, 1), 1)], "date date, n long")
    df.write.format("delta").partitionBy("date").save(p)
    assert all(not (f.metadata or {}).get("comment") for f in DeltaTable(p).schema().fields)
    v0 = DeltaTable(p).version()
    delta_io.replace(df, p, "date = '2026-01-01'", schema=t)
    assert {f.name: (f.metadata or {}).get("comment") for f in DeltaTable(p).schema().fields} == \
        {"date": "the day", "n": "it's n \\ 2"}
    assert S.action_bits(p) == ["a'b", "c"]
    assert DeltaTable(p).version() == v0 + 3  # the write, the comments, the properties
    delta_io.replace(df, p, "date = '2026-01-01'", schema=t)
    assert DeltaTable(p).version() == v0 + 4  # the write alone
    assert spark.read.format("delta").load(p).count() == 1
