"""Determinism: the same input gives the same tables and the same shard bytes.

One edge log (tests/support/edgegen.py: ties in time, late actions, an action log, a heavy
user split into chunks, every kind of bad row) is built four times through the CLI on the
shared session: with ``spark.sql.shuffle.partitions`` 2, 7 and 23 (adaptive coalescing
off, so each count really cuts the data that many ways) and once more with 2 into a fresh
folder. Every table has the same rows, and every list inside a row holds the same values
in the same order. The two builds with 2 partitions are then sharded, each into its own
root: the shard files are byte-identical and the manifests equal.
"""

from __future__ import annotations

import json
import os

import polars as pl
import pytest

from tests.builder.test_roundtrip import build_argv, run_cli
from tests.support import edgegen as E
from userwise.pipelines.runtime import delta_io
from userwise.pipelines.shards import manifest as mf
from userwise.pipelines.shards import preshard

pytestmark = [pytest.mark.spark, pytest.mark.slow]

TABLES = ("requests", "events", "history", "samples", "quarantine")
M, N = 3, 1  # pretrain before 03-03, then three one-day windows
RUNS = [("p2", 2), ("p7", 7), ("p23", 23), ("p2-rerun", 2)]
CONF = {"spark.sql.adaptive.coalescePartitions.enabled": "false"}


def _set_conf(spark, conf: dict) -> dict:
    """Set each key; return what it was (None: unset)."""
    before = {k: spark.conf.get(k, None) for k in conf}
    for k, v in conf.items():
        if v is None:
            spark.conf.unset(k)
        else:
            spark.conf.set(k, v)
    return before


@pytest.fixture(scope="module")
def builds(spark, tmp_path_factory):
    log = E.make_lean(tmp_path_factory.mktemp("det-log"), actions=True)
    out = {}
    for name, parts in RUNS:
        dest = tmp_path_factory.mktemp(f"det-{name}") / "out"
        before = _set_conf(spark, {**CONF, "spark.sql.shuffle.partitions": str(parts)})
        try:
            rc, err = run_cli(build_argv(log, dest, M, N))
        finally:
            _set_conf(spark, before)
        assert rc == 0, f"build with {parts} shuffle partitions failed: {err}"
        out[name] = dest
    return log, out


def read_table(path) -> pl.DataFrame:
    """A table's current rows, sorted by every scalar column (the key and more); lists untouched."""
    df = pl.from_arrow(delta_io.dataset(str(path)).to_table())
    scalars = [c for c, t in df.schema.items() if not isinstance(t, (pl.List, pl.Array, pl.Struct))]
    return df.select(sorted(df.columns)).sort(scalars, nulls_last=False, maintain_order=True)


def _first_difference(a: pl.DataFrame, b: pl.DataFrame) -> str:
    if a.columns != b.columns or a.schema != b.schema:
        return f"schemas differ: {a.schema} != {b.schema}"
    if a.height != b.height:
        return f"{a.height} rows != {b.height} rows"
    for c in a.columns:
        for i in range(a.height):
            if not a[c][i:i + 1].equals(b[c][i:i + 1]):
                return f"column {c}, row {i} (sorted): {a[c][i]!r} != {b[c][i]!r}"
    return "frames differ"


def test_tables_identical_across_reruns_and_shuffle_partitions(builds):
    log, out = builds
    ref = out["p2"]
    for t in TABLES:
        want = read_table(ref / t)
        assert want.height > 0, t
        lists = [c for c, dt_ in want.schema.items() if isinstance(dt_, pl.List)]
        if t in ("requests", "history", "samples"):
            assert lists, f"{t}: the comparison must cover the order inside list columns"
        for name, _ in RUNS[1:]:
            got = read_table(out[name] / t)
            assert got.equals(want), f"{t}: build {name} differs from p2: {_first_difference(got, want)}"


def test_lists_compared_in_their_stored_order(builds):
    """The comparison above does not sort inside lists: a list reversed in one row is a difference."""
    _, out = builds
    want = read_table(out["p2"] / "samples")
    i = next(i for i, s in enumerate(want["seq_item"].to_list()) if len(s) > 1 and s != s[::-1])
    flipped = want.with_columns(pl.Series("seq_item", [s[::-1] if j == i else s
                                                       for j, s in enumerate(want["seq_item"].to_list())],
                                          dtype=want.schema["seq_item"]))
    assert not flipped.equals(want)


def _shard_files(root) -> dict[str, str]:
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            if f == mf.MANIFEST:
                continue
            p = os.path.join(d, f)
            out[os.path.relpath(p, root)] = mf.file_sha256(p)
    return out


def test_shards_byte_identical_across_reruns(builds, spark, tmp_path):
    _, out = builds
    roots, manifests = [], []
    for name in ("p2", "p2-rerun"):
        root = tmp_path / f"shards-{name}"
        m = preshard.preshard(spark, build_dir=str(out[name]), shards=str(root), nodes=1, ranks_per_node=2,
                              row_group_rows=4)
        roots.append(root)
        manifests.append(json.loads((root / mf.MANIFEST).read_text()))
        assert m["shards"] and sum(s["rows"] for s in m["shards"]) > 0
    a, b = (_shard_files(r) for r in roots)
    assert sorted(a) == sorted(b), "the two shard sets hold different files"
    assert any(p.endswith(".parquet") for p in a)
    diff = [p for p in a if a[p] != b[p]]
    assert diff == [], f"files differ between reruns: {diff}"
    # the manifests differ only where they name their source table's folder
    for m, name in zip(manifests, ("p2", "p2-rerun")):
        assert m["source"]["table"] == delta_io.table_path(str(out[name]), "samples")
        m["source"]["table"] = "<samples>"
    assert manifests[0] == manifests[1]
    # the checksums in each manifest are the files' own (the one checksum helper)
    for root, m in zip(roots, manifests):
        for s in m["shards"]:
            assert s["sha256"] == mf.file_sha256(str(root / s["path"])), s["path"]

