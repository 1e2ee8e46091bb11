"""petastorm's make_batch_reader reads our shards in its own environment (pyarrow 14).

Runs tests/petastorm_read.py with .venv-petastorm's python (made by `make setup`):
every sample id comes back exactly once with its list lengths and values right.
"""

import json
import os
import subprocess

import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from userwise import schemas
from userwise.pipelines.shards import preshard
from userwise.pipelines.tools.shardgen import build_samples, layout

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PETA_PY = os.path.join(ROOT, ".venv-petastorm", "bin", "python")


def staged_node(tmp_path, *, seed, users, bot_chunks, nodes):
    """Generated samples preshard into ``nodes`` nodes: (the samples, node 0's folder)."""
    if not os.path.exists(PETA_PY):
        pytest.fail(f"{PETA_PY} missing: run `make setup` (it builds the petastorm environment)")
    table = build_samples(seed=seed, users=users, bot_chunks=bot_chunks, windows=1)
    root = str(tmp_path / "S")
    preshard.preshard_arrow(table, root, schema=schemas.shard_schema(layout()).to_arrow(), nodes=nodes,
                            ranks_per_node=1, seed=1, row_group_rows=8)
    return table, os.path.join(root, "node=0")


def test_petastorm_reads_every_sample_once(tmp_path):
    table, node_dir = staged_node(tmp_path, seed=2, users=20, bot_chunks=6, nodes=2)
    out = str(tmp_path / "got.json")
    r = subprocess.run([PETA_PY, os.path.join(ROOT, "tests", "support", "petastorm_read.py"), node_dir, out],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.load(open(out))
    want = pq.read_table(node_dir)
    ids = [str(x) for x in want.column("sample_id").to_pylist()]
    assert sorted(got) == sorted(ids)
    assert all(v["_count"] == 1 for v in got.values())
    lists = [f.name for f in want.schema if f.type.num_fields == 1 and str(f.type).startswith("list")]
    assert "seq_item" in lists and "imp__date" in lists and "req_id" in lists
    for c in lists:
        lens = pc.list_value_length(want.column(c)).to_pylist()
        firsts = want.column(c).to_pylist()
        for sid, n, vals in zip(ids, lens, firsts):
            assert got[sid][c][0] == n, (c, sid)
            head = vals[:3]
            if c == "imp__date":
                head = [(d - __import__("datetime").date(1970, 1, 1)).days for d in head]
            elif c == "imp__score":
                head = [pytest.approx(x, rel=1e-6) for x in head]
            assert got[sid][c][1:] == head, (c, sid)


def test_the_petastorm_baseline_pads_like_the_tests_reader_and_reports_a_rate(tmp_path):
    """benchmarks/petastorm_baseline.py (the loader benchmark's petastorm baseline) pads every
    list column in one numpy pass per batch: the same arrays as the row-by-row recipe of
    petastorm_read.py (which the test above proves exact), strings, dates, NaNs and empty
    lists included; and a short run reports samples and events per second."""
    table, node_dir = staged_node(tmp_path, seed=3, users=30, bot_chunks=4, nodes=1)
    check = f"""
import glob, sys
sys.path[:0] = [{os.path.join(ROOT, "tests", "support")!r}, {os.path.join(ROOT, "benchmarks")!r}]
import numpy as np, pyarrow.parquet as pq
import petastorm_read as R, petastorm_baseline as B
files = sorted(glob.glob({node_dir!r} + "/shard-*.parquet"))
plan = R.list_plan(files)
df = pq.read_table(files[0]).to_pandas()
a, b = R.padding_spec(plan).func(df.copy()), B.padding_spec(plan).func(df.copy())
for c in plan:
    x, y = np.stack(a[c].values), np.stack(b[c].values)
    assert x.dtype == y.dtype and x.shape == y.shape, c
    assert np.array_equal(x, y, equal_nan=x.dtype.kind == "f"), c
    assert (a[c + "__len"].values == b[c + "__len"].values).all(), c
print(len(plan), len(df))
"""
    r = subprocess.run([PETA_PY, "-c", check], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    n_lists, n_rows = map(int, r.stdout.split())
    assert n_lists >= 10 and n_rows > 0
    r = subprocess.run([PETA_PY, os.path.join(ROOT, "benchmarks", "petastorm_baseline.py"), node_dir,
                        "--cap-s", "0.5"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["samples"] > 0 and got["samples_per_s"] > 0 and got["events_per_s"] > 0
    assert got["padded_to"]["seq_item"] == max(pc.list_value_length(table.column("seq_item")).to_pylist())
