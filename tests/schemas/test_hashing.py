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


# ids as strings, features of every type a log may hold, nulls; P = 3 events a block
CHAIN_TYPES = "item string, cat int, author bigint, price double, cost decimal(10,2), ok boolean, day date, action bigint"
CHAIN_SPARK = ("item array<string>, cat array<int>, author array<bigint>, price array<double>, "
               "cost array<decimal(10,2)>, ok array<boolean>, day array<date>, action array<bigint>")


def _events(n: int, seed: int) -> list[tuple]:
    import decimal
    import random

    rng = random.Random(seed)
    out = []
    for k in range(n):
        out.append((rng.choice(["i-1", "i-2", "ü ñ", "", None, f"x{k}"]), rng.choice([3, -1, None, 2**31 - 1]),
                    rng.choice([7, -(2**63), 2**63 - 1, None]),
                    rng.choice([1.9, -1.9, 0.0, float("nan"), float("inf"), 1e30, None]),
                    rng.choice([decimal.Decimal("12.75"), decimal.Decimal("-0.50"), None]),
                    rng.choice([True, False, None]), rng.choice([dt.date(2026, 3, 1), dt.date(1969, 12, 31), None]),
                    rng.choice([1, 2, 3])))
    return out


@pytest.mark.spark
def test_the_chain_column_is_sequence_chain(spark):
    """Spark's chain of a row's lists (chain_column: transform + aggregate, no UDF) equals the
    Python chain of the same values, for string items, every scalar type and nulls, at every
    length around the block size."""
    import numpy as np
    import pyarrow as pa
    from pyspark.sql import functions as F

    from userwise.schemas.hashing import CHAIN_SEED, chain_column, chain_value, sequence_chain

    P = 3
    seqs = [_events(n, seed) for seed, n in enumerate([0, 1, 2, 3, 4, 6, 7, 20])]
    rows = [tuple(list(col) for col in zip(*s)) if s else tuple([] for _ in range(8)) for s in seqs]
    df = spark.createDataFrame(rows, CHAIN_SPARK)
    types = [pa.string(), pa.int32(), pa.int64(), pa.float64(), pa.decimal128(10, 2), pa.bool_(), pa.date32(),
             pa.int64()]
    chain = chain_column([(F.col(f.name), t) for f, t in zip(df.schema.fields, types)], P)
    got = [(r["c"]["checkpoints"], r["c"]["end"]) for r in df.select(chain.alias("c")).collect()]
    for s, (cps, end) in zip(seqs, got):
        cols = [np.array(list(c), dtype=object) for c in zip(*s)] if s else [np.array([], dtype=np.int64)]
        want_cps, want_end = sequence_chain(cols, P)
        assert (cps, end) == (want_cps.tolist(), want_end), len(s)
        assert len(cps) == len(s) // P and (end == CHAIN_SEED) == (not s)
    # the scalar reading of a value: as the model reads it, nulls skipped
    assert chain_value(1.9) == (1, "long") and chain_value(-1.9) == (-1, "long")
    assert chain_value(float("nan"))[0] is None and chain_value(1e30)[0] is None
    assert chain_value(dt.date(1970, 1, 2)) == (1, "long") and chain_value("a") == ("a", "string")


def test_synthetic_samples_carry_the_chain_of_their_events():
    from userwise.schemas.hashing import sequence_chain

    t = shardgen.make_samples(30, kind="incremental", window_start="2026-01-03", window_end="2026-01-04", seed=2,
                              max_seq_len=200, max_events=300, event_scale=60.0)
    cols = ["seq_item", "seq_category", "seq_author", "seq_action", "chain_block", "chain_checkpoints", "chain_end"]
    rows = t.select(cols).to_pylist()
    assert any(len(r["chain_checkpoints"]) > 1 for r in rows) and any(not r["chain_checkpoints"] for r in rows)
    for r in rows:
        cps, end = sequence_chain([r[c] for c in cols[:4]], r["chain_block"])
        assert (r["chain_checkpoints"], r["chain_end"]) == (cps.tolist(), end)
