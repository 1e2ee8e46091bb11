"""GDS side files: format, host reads, the loader's fallback and side-file path."""

from __future__ import annotations

import json
import logging
import os
import struct

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from userwise.pipelines.errors import ShardError
from userwise.pipelines.loader import UserwiseDataset, UserwiseLoader, logs
from userwise.pipelines.shards import gds
from userwise.pipelines.shards import manifest as mf
from userwise.pipelines.tools.shardgen import write_shard_set


@pytest.fixture(scope="module")
def gdsset(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("gds"))
    write_shard_set(root, nodes=1, ranks_per_node=2, row_group_rows=8, gds=True,
                    sets=(("incremental", "2026-01-04", "2026-01-05", 60),))
    return root


def test_side_file_layout_and_round_trip(gdsset):
    man = mf.load(gdsset)
    s = man["shards"][0]
    path = os.path.join(gdsset, s["gds_path"])
    raw = open(path, "rb").read()
    assert raw[-8:] == gds.MAGIC and len(raw) == s["gds_bytes"]
    n = struct.unpack("<Q", raw[-16:-8])[0]
    idx = json.loads(raw[-16 - n:-16])
    assert idx == gds.read_index(path) and idx["format_version"] == 1
    pf = pq.ParquetFile(os.path.join(gdsset, s["path"]))
    assert len(idx["row_groups"]) == pf.num_row_groups
    for i, rg in enumerate(idx["row_groups"]):
        t = pf.read_row_group(i)
        assert rg["rows"] == t.num_rows
        for e in rg["columns"].values():
            for k in ("values", "offsets", "str_offsets", "validity"):
                if e.get(k):
                    assert e[k][0] % 4096 == 0
        got = gds.read_host(path, i, index=idx)
        for name in ("seq_item", "req_seq_end", "imp__click", "user", "imp__score"):
            v, o = got[name]
            col = t.column(name).combine_chunks()
            if o is None:
                assert v.tolist() == col.to_pylist()
            else:
                assert o[0] == 0 and len(o) == t.num_rows + 1
                flat = pa.compute.list_flatten(col)
                want = flat.fill_null(0).to_pylist()
                assert np.allclose(v, want)
        v, o, so = got["req_id"]
        strings = [bytes(v[so[j]:so[j + 1]]).decode() for j in range(len(so) - 1)]
        assert strings == pa.compute.list_flatten(t.column("req_id")).to_pylist()
        assert e["dtype"] in ("<i8", "<i4", "|i1", "<f4", "|u1")


def test_write_from_table_and_bad_files(tmp_path):
    t = pa.table({"a": pa.array([[1, 2], [], [3]], pa.list_(pa.int64())), "d": pa.array([1, 2, 3], pa.date32()),
                  "s": pa.array(["x", None, "zz"])})
    p = str(tmp_path / "t.gds")
    info = gds.write_side_file(t, p)
    assert info["bytes"] == os.path.getsize(p) and len(info["sha256"]) == 64
    got = gds.read_host(p, 0)
    assert got["a"][0].tolist() == [1, 2, 3] and got["a"][1].tolist() == [0, 2, 2, 3]
    assert got["d"][0].dtype == np.dtype("<i4") and got["d"][0].tolist() == [1, 2, 3]
    assert "validity" in gds.read_index(p)["row_groups"][0]["columns"]["s"]
    open(tmp_path / "bad.gds", "wb").write(b"x" * 40)
    with pytest.raises(ShardError, match="bad.gds: not a GDS side file"):
        gds.read_index(str(tmp_path / "bad.gds"))
    with pytest.raises(ShardError, match="missing"):
        gds.read_index(str(tmp_path / "none.gds"))


def test_loader_falls_back_on_cpu_and_says_so_once(gdsset, caplog):
    logs._SAID.clear()
    with caplog.at_level(logging.INFO, logger="userwise.loader"):
        ds = UserwiseDataset(gdsset, world_size=1, rank=0, device="cpu")
        UserwiseDataset(gdsset, world_size=1, rank=0, device="cpu")
    assert ds.data_path == "parquet"
    msgs = [r.getMessage() for r in caplog.records if "data path" in r.getMessage()]
    assert len(msgs) == 1 and "no GPU" in msgs[0]


def test_side_file_path_gives_the_same_batches_as_parquet(gdsset):
    kw = dict(world_size=2, rank=1, batch_size=8, seed=2, verify="none")
    a = [b for b in UserwiseLoader(UserwiseDataset(gdsset, gds=False, **kw))]
    g = UserwiseDataset(gdsset, gds="host", **kw)
    assert g.data_path == "gds-host"
    b = [x for x in UserwiseLoader(g)]
    assert len(a) == len(b)
    for x, y in zip(a, b):  # host batches, or device batches where a GPU is present
        assert x.spec == y.spec
        assert bytes(x.buffer.cpu().numpy()) == bytes(y.buffer.cpu().numpy())


@pytest.mark.parametrize("n", [1, 7, 8, 9, 100])
def test_validity_reads_the_bitmap_of_sliced_arrays(n):
    from userwise.pipelines.shards.gds import validity

    vals = [None if i % 3 == 0 else float(i) for i in range(n)]
    a = pa.array(vals, pa.float32())
    for off in range(min(n, 10)):
        assert validity(a.slice(off)).tolist() == [int(v is not None) for v in vals[off:]], off
    assert validity(pa.array([1.0] * n)).tolist() == [1] * n


def test_device_assembler_gives_the_same_bytes_as_the_host_assembler(gdsset):
    """The GDS path assembles batches with torch ops where the columns live (the device).
    Run that assembler on CPU tensors read from the side files and compare every batch
    with the host assembler's bytes (the GPU run of the same code: tests/loader/test_gpu.py)."""
    import torch

    from userwise.pipelines.loader.assembly import assemble_torch
    from userwise.pipelines.loader.assembly.assemble import Prepared
    from userwise.pipelines.loader.io import decode

    ds = UserwiseDataset(gdsset, gds="host", world_size=1, rank=0, batch_size=8, seed=3, verify="none")
    alloc = lambda n: torch.empty(n, dtype=torch.uint8)  # noqa: E731
    plan, n = ds.epochs.plan(0), 0
    for buf in plan.buffers:
        cols = ds._read_buffer(buf.rgs)
        host = Prepared(cols).permuted(buf.perm)
        for k in range(buf.num_batches):
            a, b = int(buf.bounds[k]), int(buf.bounds[k + 1])
            idx = np.asarray(buf.perm[a:b], np.int64)
            want = host.assemble_range(a, b, alloc, {"index": n})
            got = assemble_torch.assemble(decode.torch_cols(cols), torch.from_numpy(idx), alloc, {"index": n})
            assert want.spec == got.spec and want.meta["columns"] == got.meta["columns"]
            assert bytes(want.buffer.numpy()) == bytes(got.buffer.numpy())
            n += 1
    assert n == plan.num_batches and n > 3


@pytest.mark.parametrize("compat,mode,want", [(True, "auto", "parquet"), (False, "auto", "gds"), (True, "device", "gds"),
                                              (False, True, "gds")])
def test_auto_takes_kvikio_only_with_a_gds_driver(gdsset, monkeypatch, compat, mode, want):
    """Without a GDS driver kvikio reads through POSIX (measured 7x slower than Parquet +
    pinned memory on an H200 host): "auto" then keeps Parquet; "device" forces kvikio."""
    import sys
    import types

    fake = types.ModuleType("kvikio")
    fake.defaults = types.SimpleNamespace(is_compat_mode_preferred=lambda: compat)
    monkeypatch.setitem(sys.modules, "kvikio", fake)
    monkeypatch.setitem(sys.modules, "kvikio.defaults", fake.defaults)
    monkeypatch.setattr(logs, "_SAID", set())
    ds = UserwiseDataset(gdsset, world_size=1, rank=0, device="cuda", gds=mode, verify="none")
    assert ds.data_path == want


def test_gds_device_mode_refuses_what_it_cannot_do(gdsset, tmp_path):
    with pytest.raises(ShardError, match="gds='device' needs GDS side files .* and a CUDA device"):
        UserwiseDataset(gdsset, world_size=1, rank=0, device="cpu", gds="device", verify="none")
    with pytest.raises(ValueError, match="gds must be"):
        UserwiseDataset(gdsset, world_size=1, rank=0, device="cpu", gds="yes", verify="none")


def test_gds_without_kvikio_falls_back_or_refuses(gdsset, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "kvikio", None)  # import kvikio -> ImportError
    monkeypatch.setattr(logs, "_SAID", set())
    ds = UserwiseDataset(gdsset, world_size=1, rank=0, device="cuda", gds="auto", verify="none")
    assert ds.data_path == "parquet"
    with pytest.raises(ShardError, match="gds='device' needs kvikio"):
        UserwiseDataset(gdsset, world_size=1, rank=0, device="cuda", gds="device", verify="none")
