"""The shard files' writer: what runs on Spark's executors (preshard's ``mapInArrow``),
and in ``forget`` and the synthetic shard sets.

Kept apart from :mod:`~userwise.pipelines.shards.preshard` (the driver's plan) so that an
executor imports only this and what it needs: pyarrow, numpy, the storage layer and the
shard format (no yaml, no Delta, no config). An executor's Python needs pyarrow and numpy
(and fsspec where it writes to HDFS through WebHDFS); ``userwise`` itself comes with the
job (``--py-files``, ``userwise ship``).
"""

from __future__ import annotations

import os
import tempfile
import uuid

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from userwise.pipelines.errors import UserwiseError
from userwise.pipelines.runtime import storage
from userwise.pipelines.shards import manifest as mf
from userwise.schemas import MANIFEST_SHARD

# What a shard writer returns: the shard's number and its manifest entry (schemas.MANIFEST_SHARD)
STATS = pa.schema([("shard", pa.int64()), *[(f.name, f.type) for f in MANIFEST_SHARD.to_arrow()]])
# helper columns that travel with the rows to the writer and are dropped there
AUX = ("_shard", "_node", "_rank", "_order", "_est")


# --------------------------------------------------------------------------
# options
# --------------------------------------------------------------------------
# The shard files' Parquet settings besides codec and dictionary (pipelines/tools/shardgen.py writes the
# benchmarks' and tests' shards with the same ones). Every page carries a CRC32 of its bytes, which
# the loader checks on each read: a flipped bit is an error even without the manifest's sha256.
PARQUET_OPTIONS = {"write_statistics": True, "version": "2.6", "data_page_version": "1.0", "write_page_checksum": True}
DICTIONARY = ("all", "scalars")


def parse_dictionary(spec: str, schema: pa.Schema):
    """``--dictionary``: ``all`` (default) dictionary-encodes every column, ``scalars`` leaves
    the list columns plain. pyarrow's ``use_dictionary`` for it: True, or the scalar columns.

    With zstd, dictionary-encoded lists are about as small and decode with much less CPU,
    because zstd then inflates small indices instead of 8-byte values (figures in
    docs/shards.md, "Parquet"). A column whose dictionary outgrows Parquet's page limit falls
    back to plain pages by itself."""
    if spec == "all":
        return True
    if spec == "scalars":
        return [f.name for f in schema if not (pa.types.is_list(f.type) or pa.types.is_large_list(f.type))]
    raise UserwiseError(f"--dictionary {spec}: use one of {list(DICTIONARY)}")


def parse_compression(spec: str | dict, schema: pa.Schema) -> dict:
    """``zstd`` | ``none`` | ``snappy`` for all columns, or ``default=zstd,seq_ts=none,...``.

    Returns the codec per Parquet leaf column (``seq_ts.list.element`` for lists)."""
    names = schema.names
    if isinstance(spec, dict):
        items = dict(spec)
    else:
        items = {}
        for part in str(spec).split(","):
            part = part.strip()
            if not part:
                continue
            k, _, v = part.rpartition("=")
            items[k or "default"] = v
    ok = {"zstd", "none", "uncompressed", "snappy", "gzip", "lz4", "brotli"}
    out = {}
    for k, v in items.items():
        v = v.lower()
        if v not in ok:
            raise UserwiseError(f"--compression {k}={v}: unknown codec; use one of {sorted(ok)}")
        if k != "default" and k not in names:
            raise UserwiseError(f"--compression names column {k!r}, which the shards do not have")
        out[k] = "none" if v == "uncompressed" else v
    default = out.pop("default", "zstd")
    leaf = {f.name: f.name + ".list.element" if pa.types.is_list(f.type) else f.name for f in schema}
    return {leaf[n]: out.get(n, default) for n in names}


def width(t: pa.DataType) -> int:
    try:
        return max(1, t.bit_width // 8)
    except ValueError:
        return 8


def shard_name(shard: int, node: int) -> str:
    return f"node={node}/shard-{shard:05d}.parquet"


# --------------------------------------------------------------------------
# the executor side: one function writes every shard of a partition
# --------------------------------------------------------------------------
class ShardWriter:
    def __init__(self, cfg: dict, shard: int, node: int, rank: int):
        self.cfg, self.shard, self.node, self.rank = cfg, shard, node, rank
        self.rel = shard_name(shard, node)
        storage.apply(cfg.get("storage"))  # the driver's store settings reach the executors
        fs, base = mf.resolve(cfg["shards"])
        self.fs, self.final = fs, mf.join(base, self.rel)
        self.local = isinstance(fs, pafs.LocalFileSystem)
        tag = uuid.uuid4().hex[:12]
        if self.local:
            d = os.path.dirname(self.final)
            os.makedirs(d, exist_ok=True)
            self.tmpdir = None
            self.tmp = os.path.join(d, f".shard-{shard:05d}.parquet.tmp-{tag}")
        else:
            self.tmpdir = tempfile.mkdtemp(prefix="userwise-shard-")
            self.tmp = os.path.join(self.tmpdir, f"shard-{shard:05d}.parquet")
        schema: pa.Schema = cfg["schema"]
        self.writer = pq.ParquetWriter(
            self.tmp, schema, compression=cfg["compression"],
            use_dictionary=parse_dictionary(cfg["dictionary"], schema), **PARQUET_OPTIONS,
        )
        self.buf: list[pa.Table] = []
        self.buf_rows = self.buf_est = 0
        self.rows = self.events = self.imps = self.cost = self.row_groups = 0

    def add(self, t: pa.Table, est: np.ndarray) -> None:
        # Cut row groups at row_group_rows rows or row_group_bytes of estimated
        # uncompressed data: a function of the rows only, not of Spark's batches.
        start, n = 0, t.num_rows
        while start < n:
            room = min(self.cfg["row_group_rows"] - self.buf_rows, n - start)
            cum = np.cumsum(est[start:start + room])
            fit = int(np.searchsorted(cum, self.cfg["row_group_bytes"] - self.buf_est, side="right"))
            if fit == 0 and self.buf_rows == 0:
                fit = 1  # one oversized sample makes a row group of its own
            take = min(room, fit)
            if take:
                self.buf.append(t.slice(start, take))
                self.buf_rows += take
                self.buf_est += int(cum[take - 1])
                start += take
            if self.buf_rows >= self.cfg["row_group_rows"] or take < room:
                self._flush()

    def add_row_group(self, t: pa.Table) -> None:
        """Write ``t`` as one row group of its own (``forget`` keeps a shard's row groups)."""
        self._flush()
        self.buf, self.buf_rows = [t], t.num_rows
        self._flush()

    def _flush(self) -> None:
        if not self.buf_rows:
            return
        t = pa.concat_tables(self.buf).combine_chunks()
        self.writer.write_table(t, row_group_size=t.num_rows)
        self.row_groups += 1
        self.rows += t.num_rows
        imps = pc.sum(t.column("num_impressions")).as_py() or 0
        cost = pc.sum(t.column("cost")).as_py() or 0
        self.imps += imps
        self.cost += cost
        self.events += cost - imps
        self.buf, self.buf_rows, self.buf_est = [], 0, 0

    def close(self) -> dict:
        self._flush()
        self.writer.close()
        out = {"shard": self.shard, "path": self.rel, "node": self.node, "rank": self.rank,
               "rows": self.rows, "events": self.events, "impressions": self.imps, "cost": self.cost,
               "bytes": os.path.getsize(self.tmp), "row_groups": self.row_groups,
               "sha256": mf.file_sha256(self.tmp), "gds_path": None, "gds_bytes": None, "gds_sha256": None}
        files = [(self.tmp, self.final)]
        if self.cfg["layout"] == "gds":
            from userwise.pipelines.shards.gds import write_side_file

            gtmp = self.tmp[: -len(".parquet")] + ".gds" if self.tmp.endswith(".parquet") else self.tmp + ".gds"
            info = write_side_file(self.tmp, gtmp)
            grel = self.rel[: -len(".parquet")] + ".gds"
            out.update(gds_path=grel, gds_bytes=int(info["bytes"]), gds_sha256=info["sha256"])
            files.append((gtmp, self.final[: -len(".parquet")] + ".gds"))
        for src, dst in files:
            if self.local:
                os.replace(src, dst)
            else:
                self.fs.create_dir(os.path.dirname(dst), recursive=True)
                with open(src, "rb") as f, self.fs.open_output_stream(dst) as o:
                    while b := f.read(mf.CHUNK):
                        o.write(b)
                os.remove(src)
        if self.tmpdir:
            os.rmdir(self.tmpdir)
        return out


def rewriter(root: str, manifest: dict, schema: pa.Schema, path: str, node: int, rank: int) -> ShardWriter:
    """A writer that replaces the shard ``path`` (``node=<k>/shard-<NNNNN>.parquet``) of the set at
    ``root`` with the set's own settings (codec, dictionary, layout from its manifest); write its
    row groups with ``add_row_group``, then ``close()`` returns its manifest entry's stats."""
    name = os.path.basename(path)
    if not (name.startswith("shard-") and name.endswith(".parquet") and name[6:-8].isdigit()
            and path == shard_name(int(name[6:-8]), node)):
        raise UserwiseError(f"{mf.join(root, path)}: not a shard name preshard writes "
                            "(node=<k>/shard-<NNNNN>.parquet); rerun `userwise preshard`")
    codec = manifest.get("compression", "zstd")  # the manifest names leaf columns (seq_ts.list.element)
    if isinstance(codec, dict):
        codec = {k.removesuffix(".list.element"): v for k, v in codec.items()}
    cfg = writer_cfg(root, schema, compression=codec, layout=manifest["layout"],
                      row_group_rows=manifest.get("row_group_rows", 2048), row_group_mb=128.0,
                      dictionary=manifest.get("dictionary", "all"))
    return ShardWriter(cfg, int(name[6:-8]), node, rank)


def write_partition(batches, cfg: dict):
    """mapInArrow body: rows sorted by (_shard, _order, sample_id) in, one stats row per shard out."""
    schema: pa.Schema = cfg["schema"]
    w: ShardWriter | None = None
    for b in batches:
        if b.num_rows == 0:
            continue
        t = pa.Table.from_batches([b])
        shard = t.column("_shard").to_numpy()
        cuts = np.flatnonzero(np.diff(shard)) + 1
        for lo, hi in zip(np.r_[0, cuts], np.r_[cuts, len(shard)]):
            part = t.slice(lo, hi - lo)
            sid = int(shard[lo])
            if w is None or w.shard != sid:
                if w is not None:
                    yield pa.RecordBatch.from_pylist([w.close()], schema=STATS)
                w = ShardWriter(cfg, sid, int(part.column("_node")[0].as_py()), int(part.column("_rank")[0].as_py()))
            est = part.column("_est").to_numpy().astype(np.int64)
            w.add(_conform(part, schema), est)
    if w is not None:
        yield pa.RecordBatch.from_pylist([w.close()], schema=STATS)


def _conform(t: pa.Table, schema: pa.Schema) -> pa.Table:
    cols = []
    for f in schema:
        c = t.column(f.name)
        if c.type != f.type:
            c = c.cast(f.type)
        cols.append(c)
    return pa.Table.from_arrays(cols, schema=schema)


def write_empty(cfg: dict, shard: int, node: int, rank: int) -> dict:
    """A shard with no rows (a rank with no sample in a set smaller than the slots)."""
    w = ShardWriter(cfg, shard, node, rank)
    return w.close()


def writer_cfg(shards, schema, *, compression, layout, row_group_rows, row_group_mb, dictionary="all") -> dict:
    parse_dictionary(dictionary, schema)  # a bad value fails here, before any Spark work
    if layout not in ("parquet", "gds"):
        raise UserwiseError(f"--layout {layout}: use parquet or gds")
    if layout == "gds":
        try:
            from userwise.pipelines.shards.gds import write_side_file  # noqa: F401
        except ImportError as e:
            raise UserwiseError(f"--layout gds needs userwise.pipelines.shards.gds.write_side_file ({e}); "
                                "use --layout parquet") from None
    # field docs are not part of the contract (the fingerprint ignores them): keep files lean
    schema = pa.schema([f.remove_metadata() for f in schema], metadata=schema.metadata)
    return {"shards": shards, "schema": schema, "compression": parse_compression(compression, schema),
            "dictionary": dictionary, "layout": layout, "row_group_rows": int(row_group_rows),
            "row_group_bytes": int(row_group_mb * (1 << 20)), "storage": storage.settings()}
