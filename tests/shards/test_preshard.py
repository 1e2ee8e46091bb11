"""`userwise preshard`: balanced, deterministic, reconciled shard sets with a manifest.

The Spark job runs twice on a tiny skewed samples table (``shardgen.build_samples``:
heavy users and a bot with many chunks): once in full, once through the CLI for one window
with other shuffle settings. Its files must equal, byte for byte, those of the
Spark-free twin ``preshard_arrow`` (same assignment rules, same writer).
"""

import collections
import datetime as dt
import json
import os

import duckdb
import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.support.common import LEAN_CFG
from userwise import schemas
from userwise.pipelines import cli, config
from userwise.pipelines.errors import ShardError, UserwiseError
from userwise.pipelines.records import build_record, state
from userwise.pipelines.shards import balance, preshard
from userwise.pipelines.shards import manifest as mf
from userwise.pipelines.tools.shardgen import BOT, BUILD_START, build_samples, layout, write_shard_set

pytestmark = pytest.mark.spark
NODES, RANKS, SEED = 2, 2, 7
KW = dict(nodes=NODES, ranks_per_node=RANKS, seed=SEED, row_group_rows=8)  # one shard per rank: few tasks


def write_build(spark, build_dir: str, **kw) -> pa.Table:
    """``build_samples(**kw)`` as a build folder: D/samples (Delta) and D/_userwise/build.json."""
    table = build_samples(**kw)
    cfg = config.parse(LEAN_CFG)
    lay = cfg.layout(schemas.SYNTH_IMPRESSIONS.to_arrow())
    sch = schemas.samples_schema(lay)
    df = spark.createDataFrame(table.to_pandas(), schema=sch.to_spark())
    (df.repartition(3).write.format("delta").mode("overwrite").partitionBy(*sch.partition_by)
     .save(os.path.join(build_dir, "samples")))
    build_record.save(build_dir, cfg, lay, as_of=str(BUILD_START + dt.timedelta(days=3)))
    state.finish(build_dir, "build")  # what a finished build leaves last: readers require it
    return table


@pytest.fixture(scope="module")
def built(spark, tmp_path_factory):
    d = str(tmp_path_factory.mktemp("build"))
    table = write_build(spark, d, seed=3)
    out = str(tmp_path_factory.mktemp("shards") / "S")
    m = preshard.preshard(spark, build_dir=d, shards=out, **KW)
    return d, table, out, m


def read_all(root, m):
    return {s["path"]: pq.read_table(os.path.join(root, s["path"])) for s in m["shards"]}


def test_manifest_contract(built, spark):
    d, table, out, m = built
    assert mf.load(out) == {k: v for k, v in m.items() if k != "_report"}
    # the documented keys (schemas.MANIFEST_KEYS / MANIFEST_SET_KEYS) are exactly the written ones
    assert set(mf.load(out)) == set(schemas.MANIFEST_KEYS)
    assert all(set(s) == set(schemas.MANIFEST_SET_KEYS) for s in m["sets"])
    assert m["format_version"] == schemas.FORMAT_VERSION
    assert m["schema_fingerprint"] == schemas.shard_schema(layout()).fingerprint()
    assert m["roles"] == layout().roles()
    from delta.tables import DeltaTable
    v = DeltaTable.forPath(spark, os.path.join(d, "samples")).history(1).first()["version"]
    assert m["source"] == {"table": os.path.join(d, "samples"), "version": v}
    ids = [s["id"] for s in m["sets"]]
    assert ids == ["pretrain/2026-01-01", "incremental/2026-01-02", "incremental/2026-01-03",
                   "incremental/2026-01-04"]
    for s in m["shards"]:
        assert set(schemas.MANIFEST_SHARD.names) | {"set"} == set(s)
        assert s["path"] == f"node={s['node']}/shard-{int(s['path'][-13:-8]):05d}.parquet"
        assert s["cost"] == s["events"] + s["impressions"]
        assert len(s["sha256"]) == 64 and s["gds_path"] is None
    nums = sorted(int(s["path"][-13:-8]) for s in m["shards"])
    assert nums == list(range(len(nums)))
    assert all(s["shards_per_rank"] == 1 for s in m["sets"])
    assert mf.verify(out)["files"] == len(m["shards"])


def test_every_sample_in_exactly_one_shard(built):
    d, table, out, m = built
    files = read_all(out, m)
    seen = collections.Counter()
    for s in m["shards"]:
        t = files[s["path"]]
        kinds = set(zip(t.column("kind").to_pylist(), map(str, t.column("window_end").to_pylist())))
        assert kinds <= {tuple(s["set"].split("/"))}             # one set per shard
        assert t.num_rows == s["rows"]
        assert (pa.compute.sum(t.column("num_impressions")).as_py() or 0) == s["impressions"]
        assert (pa.compute.sum(t.column("cost")).as_py() or 0) == s["cost"]
        assert pq.ParquetFile(os.path.join(out, s["path"])).metadata.num_row_groups == s["row_groups"]
        assert os.path.getsize(os.path.join(out, s["path"])) == s["bytes"]
        seen.update(t.column("sample_id").to_pylist())
    assert sorted(seen) == sorted(table.column("sample_id").to_pylist())
    assert set(seen.values()) == {1}
    for st in m["sets"]:
        k, w = st["id"].split("/")
        n = sum(1 for a, b in zip(table.column("kind").to_pylist(), table.column("window_end").to_pylist())
                if a == k and str(b) == w)
        assert st["rows"] == n
    # the rows are the samples, unchanged
    got = pa.concat_tables(files.values()).sort_by("sample_id")
    want = table.sort_by("sample_id")
    for c in want.column_names:
        assert got.column(c).to_pylist() == want.column(c).to_pylist(), c


def test_balance_per_set(built):
    d, table, out, m = built
    costs = table.column("cost").to_numpy()
    for st in m["sets"]:
        b = st["balance"]
        rc, rr = np.array(b["rank_cost"]), np.array(b["rank_rows"])
        assert rc.shape == rr.shape == (NODES, RANKS)
        assert rr.max() - rr.min() <= 1
        assert b["within_bound"] and balance.within_bound(rc, b["max_sample_cost"])
        assert b["max_sample_cost"] <= costs.max()
        mine = [s for s in m["shards"] if s["set"] == st["id"]]
        per = collections.Counter()
        for s in mine:
            per[(s["node"], s["rank"])] += s["cost"]
        assert [[per[(n, r)] for r in range(RANKS)] for n in range(NODES)] == b["rank_cost"]
    rep = m["_report"]["sets"]
    assert [r["max_dev"] for r in rep] == [s["balance"]["max_dev"] for s in m["sets"]]
    # the bot's chunks are spread over every rank of a set
    files = read_all(out, m)
    for st in m["sets"]:
        ranks = {(s["node"], s["rank"]) for s in m["shards"] if s["set"] == st["id"]
                 and BOT in files[s["path"]].column("user").to_pylist()}
        assert len(ranks) == NODES * RANKS


def test_users_shuffled(built):
    d, table, out, m = built
    files = read_all(out, m)
    for st in m["sets"]:
        users = [u for s in m["shards"] if s["set"] == st["id"] for u in files[s["path"]].column("user").to_pylist()]
        asc = np.mean(np.diff(users) > 0)
        assert 0.2 < asc < 0.8                          # neither sorted nor reverse-sorted by user
        bot_pos = [i for i, u in enumerate(users) if u == BOT]
        assert max(np.diff(bot_pos)) > 1                 # the bot's chunks are not one run


def test_spark_matches_pure_twin_byte_for_byte(built, tmp_path):
    d, table, out, m = built
    m2 = preshard.preshard_arrow(table, str(tmp_path / "S2"), schema=schemas.shard_schema(layout()).to_arrow(),
                                 **KW)
    assert [(s["path"], s["sha256"]) for s in m["shards"]] == [(s["path"], s["sha256"]) for s in m2["shards"]]
    assert m2["sets"] == m["sets"]
    m3 = preshard.preshard_arrow(table, str(tmp_path / "S3"), schema=schemas.shard_schema(layout()).to_arrow(),
                                 **{**KW, "seed": SEED + 1})
    assert {s["sha256"] for s in m3["shards"]}.isdisjoint({s["sha256"] for s in m["shards"]})


def test_assign_spark_agrees_with_balance(spark):
    rng = np.random.default_rng(0)
    costs = np.r_[rng.integers(1, 50, 80), np.full(20, 200)]
    ids = rng.integers(-(1 << 60), 1 << 60, 100)
    sets = np.r_[np.zeros(60, int), np.ones(40, int)]
    df = spark.createDataFrame(pa.table({"_set": pa.array(sets, pa.int32()), "sample_id": ids, "cost": costs})
                               .to_pandas()).repartition(3)
    got = {r["sample_id"]: r for r in preshard.assign_spark(df, slots=6, ranks_per_node=3, seed=9).collect()}
    for s in (0, 1):
        sel = sets == s
        p = balance.plan(costs[sel], ids[sel], nodes=2, ranks_per_node=3, seed=9)
        for i, sid in enumerate(ids[sel]):
            g = got[int(sid)]
            assert (g["_index"], g["_slot"], g["_node"], g["_rank"], g["_order"]) == \
                (p["index"][i], p["slot"][i], p["node"][i], p["rank"][i], p["order"][i])


def test_cli_one_window_several_shards_per_rank(built, spark, tmp_path, capsys):
    d, table, out, m = built
    win = table.filter(pa.compute.equal(table.column("window_end"), pa.scalar(
        __import__("datetime").date(2026, 1, 3), pa.date32())))
    old = spark.conf.get("spark.sql.shuffle.partitions")
    spark.conf.set("spark.sql.shuffle.partitions", "3")
    try:
        rc = cli.main(["preshard", "--build-dir", d, "--shards", str(tmp_path / "W"), "--nodes", str(NODES),
                       "--ranks-per-node", str(RANKS), "--window", "2026-01-03", "--seed", str(SEED),
                       "--target-shard-mb", "0.03", "--row-group-rows", "8", "--json"])
    finally:
        spark.conf.set("spark.sql.shuffle.partitions", old)
    assert rc == 0
    cap = capsys.readouterr()
    assert len(cap.out.splitlines()) == 1 and json.loads(cap.out)["sets"][0]["id"] == "incremental/2026-01-03"
    w = mf.load(str(tmp_path / "W"))
    assert [s["id"] for s in w["sets"]] == ["incremental/2026-01-03"]
    assert w["sets"][0]["shards_per_rank"] > 1
    assert sum(s["rows"] for s in w["shards"]) == win.num_rows
    # same bytes as the pure twin, whatever Spark's partitioning; the set's
    # assignment does not depend on the other sets
    twin = preshard.preshard_arrow(win, str(tmp_path / "T"), schema=schemas.shard_schema(layout()).to_arrow(),
                                   **{**KW, "target_shard_mb": 0.03})
    assert [(s["path"], s["sha256"]) for s in w["shards"]] == [(s["path"], s["sha256"]) for s in twin["shards"]]
    assert w["sets"][0]["balance"] == next(s for s in m["sets"] if s["id"] == w["sets"][0]["id"])["balance"]


def test_window_without_samples_gives_an_empty_set_the_loader_reads_as_zero_batches(built, tmp_path, capsys):
    """A day without traffic: the daily chain must publish an empty set, not fail."""
    from userwise.pipelines.loader import UserwiseDataset, UserwiseLoader

    d, *_ = built
    rc = cli.main(["preshard", "--build-dir", d, "--shards", str(tmp_path / "E"), "--nodes", str(NODES),
                   "--ranks-per-node", str(RANKS), "--kind", "incremental", "--window", "2027-02-10",
                   "--window-days", "2", "--dictionary", "scalars"])
    assert rc == 0
    text = capsys.readouterr().out  # the report as text, by default
    assert "incremental/2027-02-10: 0 samples" in text and "max dev" in text
    e = mf.load(str(tmp_path / "E"))
    assert e["dictionary"] == "scalars"  # the flag reaches the writer's settings
    assert [(s["id"], s["window_start"], s["window_end"]) for s in e["sets"]] == [
        ("incremental/2027-02-10", "2027-02-08", "2027-02-10")]
    assert len(e["shards"]) == NODES * RANKS and all(s["rows"] == 0 for s in e["shards"])
    for node in range(NODES):
        for rank in range(RANKS):
            ds = UserwiseDataset(str(tmp_path / "E"), node=node, rank=rank, world_size=RANKS)
            assert list(UserwiseLoader(ds)) == []


def _dictionary_columns(path: str) -> tuple[set, set]:
    """(leaf columns with a dictionary page in every row group, leaf columns without one in any)."""
    md = pq.ParquetFile(path).metadata
    names = [md.schema.column(i).path for i in range(md.num_columns)]
    has = [[md.row_group(g).column(i).has_dictionary_page for g in range(md.num_row_groups)]
           for i in range(md.num_columns)]
    return {n for n, h in zip(names, has) if all(h)}, {n for n, h in zip(names, has) if not any(h)}


def test_parquet_properties(built, tmp_path):
    """Row groups, codec, statistics and the format in the footer; every column
    dictionary-encoded by default (lists too: docs/shards.md, "Parquet"),
    only the scalar ones with --dictionary scalars, which the manifest records."""
    d, table, out, m = built
    s = m["shards"][0]
    md = pq.ParquetFile(os.path.join(out, s["path"])).metadata
    names = [md.schema.column(i).path for i in range(md.num_columns)]
    lists = {n for n in names if n.endswith(".list.element")}
    assert lists and len(lists) < len(names)
    for g in range(md.num_row_groups):
        rg = md.row_group(g)
        assert rg.num_rows <= 8
        for i in range(md.num_columns):
            c = rg.column(i)
            assert c.compression == "ZSTD" and c.is_stats_set
    assert m["dictionary"] == "all" and _dictionary_columns(os.path.join(out, s["path"]))[0] == set(names)
    sch = pq.read_schema(os.path.join(out, s["path"]))
    assert sch.metadata[b"userwise.format_version"] == str(schemas.FORMAT_VERSION).encode() and b"userwise.roles" in sch.metadata

    m2 = preshard.preshard_arrow(table, str(tmp_path / "P"), schema=schemas.shard_schema(layout()).to_arrow(),
                                 **KW, dictionary="scalars")
    assert m2["dictionary"] == "scalars" and mf.load(str(tmp_path / "P"))["dictionary"] == "scalars"
    for sh in m2["shards"]:
        if sh["rows"]:
            dict_cols, plain_cols = _dictionary_columns(os.path.join(tmp_path, "P", sh["path"]))
            assert dict_cols == set(names) - lists and plain_cols == lists, sh["path"]
    # the same rows either way
    a, b = read_all(out, m), read_all(str(tmp_path / "P"), m2)
    assert a.keys() == b.keys() and all(a[k].equals(b[k]) for k in a)
    with pytest.raises(UserwiseError, match="--dictionary"):
        preshard.preshard_arrow(table, str(tmp_path / "Q"), schema=schemas.shard_schema(layout()).to_arrow(),
                                **KW, dictionary="lists")


def test_plain_readers(built):
    d, table, out, m = built
    n = len(table)
    assert pl.scan_parquet(os.path.join(out, "node=*", "*.parquet")).select(pl.len()).collect().item() == n
    got = duckdb.sql(f"select count(*), sum(len(seq_item)) from read_parquet('{out}/node=*/*.parquet')").fetchall()[0]
    assert got == (n, sum(pa.compute.list_value_length(table.column("seq_item")).to_pylist()))


def test_incomplete_set_refused(built, tmp_path):
    d, table, out, m = built
    import shutil
    copy = str(tmp_path / "copy")
    shutil.copytree(out, copy)
    os.remove(os.path.join(copy, "manifest.json"))
    with pytest.raises(ShardError, match="no manifest"):
        mf.load(copy)


def test_gds_layout_side_files(tmp_path):
    table = build_samples(seed=5, users=10, bot_chunks=4, windows=1)
    m = preshard.preshard_arrow(table, str(tmp_path / "G"), schema=schemas.shard_schema(layout()).to_arrow(),
                                nodes=1, ranks_per_node=2, seed=0, layout="gds", row_group_rows=4)
    from userwise.pipelines.shards import gds
    assert m["layout"] == "gds" and m["_report"]["gds_bytes"] > 0
    for s in m["shards"]:
        p = os.path.join(tmp_path, "G", s["gds_path"])
        assert os.path.getsize(p) == s["gds_bytes"] and mf.file_sha256(p) == s["gds_sha256"]
        idx = gds.read_index(p)
        assert len(idx["row_groups"]) == s["row_groups"]
        t = pq.read_table(os.path.join(tmp_path, "G", s["path"]))
        vals, offs = gds.read_host(p, 0, ["seq_item"])["seq_item"]
        first = t.slice(0, idx["row_groups"][0]["rows"]).column("seq_item").combine_chunks()
        assert vals.tolist() == first.values.to_pylist()
    assert mf.verify(str(tmp_path / "G"))["files"] == 2 * len(m["shards"])


def test_output_with_foreign_files_refused(tmp_path):
    (tmp_path / "O").mkdir()
    (tmp_path / "O" / "notes.txt").write_text("mine")
    with pytest.raises(UserwiseError, match="not a shard set"):
        preshard.preshard_arrow(build_samples(users=3, bot_chunks=1, windows=1), str(tmp_path / "O"),
                                schema=schemas.shard_schema(layout()).to_arrow(), nodes=1, ranks_per_node=1)


def test_benchmark_shards_are_written_like_preshards(built, tmp_path):
    """The loader benchmark's shards (pipelines/tools/shardgen.py) carry preshard's Parquet settings:
    the same codec, dictionary pages, statistics and format per column, so the benchmark
    measures the decode that preshard's shards cost."""
    d, table, out, m = built

    def settings(path):
        md = pq.ParquetFile(path).metadata
        cols = {}
        for i in range(md.num_columns):
            c = md.row_group(0).column(i)
            cols[md.schema.column(i).path] = (c.compression, c.has_dictionary_page, c.is_stats_set)
        return md.format_version, cols

    ref_version, ref = settings(os.path.join(out, next(s["path"] for s in m["shards"] if s["rows"])))
    for dictionary in ("all", "scalars"):
        root = str(tmp_path / dictionary)
        bm = write_shard_set(root, nodes=1, ranks_per_node=1, dictionary=dictionary)
        version, got = settings(os.path.join(root, bm["shards"][0]["path"]))
        assert version == ref_version
        shared = sorted(set(got) & set(ref))
        assert len(shared) > 10
        want = ref if dictionary == "all" else {  # the lists plain, the rest as preshard writes it
            c: (z, has and not c.endswith(".list.element"), st) for c, (z, has, st) in ref.items()}
        assert {c: got[c] for c in shared} == {c: want[c] for c in shared}, dictionary
