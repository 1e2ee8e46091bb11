"""Bit flips in a shard are errors even with ``verify="size"``: preshard writes a CRC32 in
every Parquet page header and the loader checks it on every read.

The tests find the pages of a shard by walking its column chunks (the page headers are
Thrift compact structs), flip one bit, and read the shards as a trainer would.
"""

from __future__ import annotations

import os
import random
import re

import pyarrow.parquet as pq
import pytest

from tests.support.parquet_thrift import i32_fields
from userwise import schemas
from userwise.pipelines import cli
from userwise.pipelines.errors import ShardError, UserwiseError
from userwise.pipelines.loader import UserwiseDataset, UserwiseLoader
from userwise.pipelines.shards import preshard
from userwise.pipelines.tools.shardgen import build_samples, layout, write_shard_set

# -- page headers ------------------------------------------------------------------------------


def pages(path):
    """Every page of a Parquet file: (column, row group, type, header start, payload start,
    payload end, has a CRC). Type 0 is a data page, 2 a dictionary page."""
    data = open(path, "rb").read()
    md = pq.ParquetFile(path).metadata
    out = []
    for g in range(md.num_row_groups):
        for c in range(md.num_columns):
            cc = md.row_group(g).column(c)
            i = cc.dictionary_page_offset if cc.has_dictionary_page else cc.data_page_offset
            end = i + cc.total_compressed_size
            while i < end:
                f, j = i32_fields(data, i)
                out.append((cc.path_in_schema, g, f[1], i, j, j + f[3], 4 in f))  # 1 type, 3 size, 4 crc
                i = j + f[3]
    return out


def footer(path):
    """(start, end) of the file's Thrift footer (the FileMetaData)."""
    size = os.path.getsize(path)
    return size - 8 - pq.ParquetFile(path).metadata.serialized_size, size - 8


# -- shards -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """A shard set written by preshard's own writer (no Spark): one node, one rank."""
    root = str(tmp_path_factory.mktemp("crc") / "S")
    preshard.preshard_arrow(build_samples(seed=4, users=24, bot_chunks=4, windows=2), root,
                            schema=schemas.shard_schema(layout()).to_arrow(), nodes=1, ranks_per_node=1, seed=1,
                            row_group_rows=16)
    ds = UserwiseDataset(root, verify="size", batch_size=8, seed=1, device="cpu")
    big = max(range(len(ds.epochs.settings.shards.shards)), key=lambda s: ds.epochs.settings.shards.shards[s]["bytes"])
    return root, ds.epochs.settings.shards.path(big), batches(root)


def batches(root, workers=0):
    ds = UserwiseDataset(root, verify="size", batch_size=8, seed=1, device="cpu", buffer_row_groups=2)
    ld = UserwiseLoader(ds, num_workers=workers, timeout=60)
    try:
        return [bytes(b.buffer.numpy()) for b in ld]
    finally:
        ld.close()


class Flipped:
    """One bit of a file flipped for the time of a ``with`` block."""

    def __init__(self, path, pos, bit=0):
        self.path, self.pos, self.bit = path, pos, bit

    def __enter__(self):
        self.orig = open(self.path, "rb").read()
        b = bytearray(self.orig)
        b[self.pos] ^= 1 << self.bit
        with open(self.path, "wb") as f:
            f.write(b)
        return self

    def __exit__(self, *exc):
        with open(self.path, "wb") as f:
            f.write(self.orig)


def test_every_page_carries_a_crc(shards, tmp_path):
    """preshard's shards and the synthetic shard sets (tests, benchmarks) alike."""
    _, path, _ = shards
    ps = pages(path)
    assert {p[2] for p in ps} == {0, 2} and all(p[6] for p in ps)
    m = write_shard_set(str(tmp_path / "G"), nodes=1, ranks_per_node=1)
    gen = pages(str(tmp_path / "G" / m["shards"][0]["path"]))
    assert gen and all(p[6] for p in gen)


def _spread(ps, n, seed):
    """``n`` pages of both kinds, across columns and row groups."""
    rnd = random.Random(seed)
    data = [p for p in ps if p[2] == 0 and p[5] > p[4]]
    dicts = [p for p in ps if p[2] == 2 and p[5] > p[4]]
    return rnd.sample(data, n - n // 3) + rnd.sample(dicts, n // 3)


def test_a_flipped_bit_in_a_page_is_an_error_with_verify_size(shards):
    """Eight single-bit flips inside data and dictionary pages, read with ``verify="size"``
    (which does not hash the files): each read fails naming the file, none gives batches."""
    root, path, ref = shards
    rnd = random.Random(7)
    for col, g, kind, _, a, z, _ in _spread(pages(path), 8, seed=3):
        with Flipped(path, rnd.randrange(a, z), rnd.randrange(8)), pytest.raises(ShardError) as e:
            batches(root)
        assert path in str(e.value) and "re-stage" in str(e.value), (col, g, kind)
    assert batches(root) == ref  # every file restored


def test_a_corrupt_page_read_by_a_worker_fails_the_trainer(shards):
    root, path, _ = shards
    _, _, _, _, a, z, _ = next(p for p in reversed(pages(path)) if p[2] == 0 and p[5] - p[4] > 8)
    with Flipped(path, (a + z) // 2, 5), pytest.raises(UserwiseError, match=f"ShardError: {path}"):
        batches(root, workers=2)


def test_flips_in_headers_and_the_footer_never_change_batches(shards):
    """A page header or the footer is outside the pages' CRCs: a flip there either fails
    the read with a ShardError naming the file or leaves the data as it was (a statistic,
    say), never other batches and never another exception."""
    root, path, ref = shards
    rnd = random.Random(11)
    ps = pages(path)
    positions = [rnd.randrange(p[3], p[4]) for p in rnd.sample(ps, 12)]
    f0, f1 = footer(path)
    positions += [rnd.randrange(f0, f1) for _ in range(12)]
    outcome = {"error": 0, "same": 0}
    for pos in positions:
        with Flipped(path, pos, rnd.randrange(8)):
            try:
                got = batches(root)
            except ShardError as e:
                assert path in str(e), e
                outcome["error"] += 1
            else:
                assert got == ref, f"a flip at byte {pos} changed the batches"
                outcome["same"] += 1
    assert outcome["error"] > 0


@pytest.mark.parametrize("where", ["page", "header", "footer"])
def test_the_cli_says_one_line(shards, capsys, where):
    """`userwise diagnose` (it reads with verify="size") on a flipped shard: one line
    ``error:`` naming the file, exit code 2."""
    root, path, _ = shards
    ps = [p for p in pages(path) if p[2] == 0 and p[5] - p[4] > 8]
    pos = {"page": (ps[0][4] + ps[0][5]) // 2,
           "header": ps[0][3] + 3,  # the page's uncompressed size (after the type field)
           "footer": footer(path)[0]}[where]  # the FileMetaData's first field header
    with Flipped(path, pos, 6):
        rc = cli.main(["diagnose", "--staged", root, "--device", "cpu", "--batch-size", "8", "--batches", "400"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: ") and path in err[0], (rc, err)


def test_a_flip_in_a_column_read_for_planning_is_an_error(shards):
    """``cost`` (token budgets) and ``user`` (held-out users) are read for the plan, apart
    from the batches' columns: a flip in one of their pages fails the plan, even when the
    batches do not carry that column."""
    root, path, _ = shards
    rnd = random.Random(5)
    for name, kw in (("cost", dict(token_budget=400)), ("user", dict(split="train", eval_user_share=0.3))):
        ps = [p for p in pages(path) if p[0] == name and p[2] == 0 and p[5] > p[4]]
        _, _, _, _, a, z, _ = rnd.choice(ps)
        with Flipped(path, rnd.randrange(a, z), rnd.randrange(8)), pytest.raises(ShardError, match=re.escape(path)):
            ds = UserwiseDataset(root, verify="size", seed=1, device="cpu", columns=["sample_id"], **kw)
            list(UserwiseLoader(ds))
