"""Reading a user's input log (Parquet folder or Delta table), without and with Spark."""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.dataset as ds

from userwise.pipelines.errors import InputError


def is_delta(path: str) -> bool:
    return os.path.isdir(os.path.join(path, "_delta_log"))


def _check(path: str) -> None:
    if "://" not in path and not os.path.exists(path):
        raise InputError(f"input {path!r} does not exist")


def arrow_dataset(path: str) -> ds.Dataset:
    """The input as an Arrow dataset (Delta through delta-rs; Parquet with hive partitions)."""
    _check(path)
    if is_delta(path):
        from userwise.pipelines.runtime.delta_io import dataset

        return dataset(path)
    try:
        return ds.dataset(path, format="parquet", partitioning="hive")
    except (pa.ArrowInvalid, OSError) as e:
        raise InputError(f"input {path!r} is neither a Delta table nor Parquet: {e}") from None


def input_schema(path: str) -> pa.Schema:
    sch = arrow_dataset(path).schema
    # hive partition columns come back as dictionaries or int32: Spark reads `date` as a date.
    fields = []
    for f in sch:
        t = f.type
        if pa.types.is_dictionary(t):
            t = t.value_type
        if f.name == "date" and not pa.types.is_date(t):
            t = pa.date32()
        fields.append(pa.field(f.name, t, f.nullable))
    return pa.schema(fields)


def read_spark(spark, path: str, with_row_ids: bool = True):
    """The input as a Spark DataFrame, with its file path and row index when known."""
    from pyspark.sql import functions as F

    _check(path)
    if is_delta(path):
        df = spark.read.format("delta").load(path)
    else:
        df = spark.read.option("basePath", path).parquet(path)
    if with_row_ids:
        df = df.select("*", F.col("_metadata.file_path").alias("_file"),
                       F.col("_metadata.row_index").alias("_row"))
    return df
