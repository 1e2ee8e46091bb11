"""One hash for the ids the build makes: ``schemas.hashing`` equals Spark's ``xxhash64``, and
the synthetic samples carry the ``sample_id`` a build would give them."""

from __future__ import annotations

import datetime as dt

import pyarrow.compute as pc
import pytest

from userwise.pipelines.tools import shardgen
from userwise.schemas.hashing import sample_id, sample_id_column, xxhash64

ROWS = [("pretrain", dt.date(2026, 1, 3), 42, 0), ("incremental", dt.date(2026, 1, 4), -7, 3),
        ("incremental", dt.date(1999, 12, 31), "u-42", 1), ("pretrain", dt.date(2026, 2, 1), "ü ñ", 12)]


@pytest.mark.spark
@pytest.mark.parametrize("user_type", ["bigint", "string"])
def test_sample_id_is_the_builds(spark, user_type):
    rows = [r for r in ROWS if isinstance(r[2], int) == (user_type == "bigint")]
    df = spark.createDataFrame([(k, w, u, c) for k, w, u, c in rows],
                               f"kind string, window_end date, user {user_type}, chunk int")
    got = [r["id"] for r in df.select(sample_id_column().alias("id")).collect()]
    assert got == [sample_id(*r) for r in rows]


@pytest.mark.spark
def test_xxhash64_folds_as_spark_does(spark):
    row = spark.sql("SELECT xxhash64('a', 7, CAST(7 AS BIGINT), CAST(NULL AS STRING), 'ß') AS h").first()
    assert row["h"] == xxhash64([("a", "string"), (7, "int"), (7, "long"), (None, "string"), ("ß", "string")])


def test_synthetic_samples_carry_the_builds_sample_id():
    t = shardgen.build_samples(seed=3)
    for r in t.select(["sample_id", "kind", "window_end", "user", "chunk"]).to_pylist()[:50]:
        assert r["sample_id"] == sample_id(r["kind"], r["window_end"], r["user"], r["chunk"])
    assert pc.count_distinct(t["sample_id"]).as_py() == t.num_rows
