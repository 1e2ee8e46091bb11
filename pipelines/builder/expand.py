"""`userwise expand`: user-wise samples back to point-wise rows (the round trip).

Every impression of every sample becomes one row with exactly the input's
columns (names, order, types: timestamp units and zones, unsigned integers and
nanoseconds included) plus the history it sees:
- lean: ``seq_ts``, ``seq_item``, ``seq_<feature>`` per item feature (``seq__<feature>``
  for a feature named like one of ours: ``len``, ``ts``, ``action``...), ``seq_action``,
  and ``seq_arrival`` with an arrival column (each impression's history is then the events
  that arrived before its request, in arrival order: the same pointers);
- fat: the configured snapshot columns, reproduced as given (null stays
  null, empty stays empty, overrides come back whole).

The output is a folder of zstd Parquet files ``part-NNNNN.parquet`` and nothing
else, which polars (``pl.read_parquet("x/*.parquet")``), pyarrow
(``pq.read_table("x")``) and duckdb (``SELECT * FROM 'x/*.parquet'``) read as
they are. Spark writes the rows (timestamps as UTC microseconds) into a scratch
folder inside the output; each of its files is then rewritten with pyarrow, cast
to the input's own types recorded in the build record, one batch at a time.
"""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from userwise import schemas as S
from userwise.pipelines.errors import UserwiseError
from userwise.pipelines.records import state
from userwise.pipelines.runtime import delta_io, storage
from userwise.pipelines.runtime.spark import session_conf
from userwise.schemas import IMP, OVR, REQ, SEQ
from userwise.schemas.layout import input_name


def expand_frame(cfg, layout: S.Layout, samples: DataFrame, max_seq_len: int | None = None) -> DataFrame:
    L = cfg.max_seq_len
    Lp = max_seq_len or L
    if Lp > L:
        raise UserwiseError(f"--max-seq-len {Lp} is larger than the build's max_seq_len {L}: "
                            "the samples only hold the last L events per request")
    imp_cols = [f.name for f in layout.impression_columns]
    req_cols = [f.name for f in layout.stored_request_columns]
    # Per impression: the index of its request.
    imp_req = F.flatten(F.transform(F.sequence(F.lit(0), F.size("req_num_imps") - 1),
                                    lambda r: F.array_repeat(r, F.col("req_num_imps")[r])))
    s = samples.where(F.col("num_impressions") > 0).select("*", imp_req.alias("_imp_req"))
    z = F.arrays_zip(F.col("_imp_req").alias("_r"), *[F.col(IMP + c).alias(f"i{k}") for k, c in enumerate(imp_cols)])
    x = s.select("*", F.explode(z).alias("_z"))
    r = F.col("_z._r")
    begin = F.col("req_seq_begin")[r]
    end = F.col("req_seq_end")[r]
    begin = F.greatest(begin, end - F.lit(Lp))
    n = end - begin
    cols = {}
    cols[layout.user.name] = F.col("user")
    for c in req_cols:
        cols[c] = F.col(REQ + c)[r]
    for c, canon in layout.derived_request_columns.items():  # stored once, as req_id / req_time
        cols[c] = F.col(canon)[r]
    for k, c in enumerate(imp_cols):
        cols[c] = F.col(f"_z.i{k}")
    if not layout.fat:
        seq = {}
        for sf in layout.seq_fields:
            seq[SEQ + sf.name] = F.slice(F.col(SEQ + sf.name), begin + 1, n)
        out_cols = [cols[c].alias(c) for c in layout.input_schema.names] + [v.alias(k) for k, v in seq.items()]
        return x.select(*out_cols)
    kind = F.col("req_snapshot")[r]
    # override o of request r: position of r in ovr_req
    o = F.array_position(F.col(OVR + "req"), r) - 1
    ob = F.col(OVR + "offsets")[o]
    oe = F.col(OVR + "offsets")[o + 1]
    for sf in layout.snapshot:
        sl = F.slice(F.col(SEQ + sf.name), begin + 1, n)
        full = F.slice(F.col(OVR + sf.name), ob + 1, oe - ob)
        ov = F.slice(full, F.greatest(F.size(full) - F.lit(Lp), F.lit(0)) + 1, F.lit(Lp))
        cols[sf.source] = (F.when(kind == 2, F.lit(None))
                           .when(kind == 1, ov)
                           .otherwise(sl))
    return x.select(*[cols[c].alias(c) for c in layout.input_schema.names])


def output_schema(layout: S.Layout) -> tuple[list[str], pa.Schema]:
    """The columns of :func:`expand_frame` (storage names) and the output's Arrow schema:
    the input's own names and types, then (lean) the history lists."""
    src = layout.source_schema
    names = list(layout.input_schema.names)
    fields = list(src)
    if not layout.fat:
        taken = set(src.names)
        for sf in layout.seq_fields:
            name = SEQ + input_name(sf.name)
            if name in taken:  # only a contrived mix of names: keep the stored name
                name = SEQ + sf.name
            taken.add(name)
            t = layout.source_type(sf.source) if sf.source is not None else (
                layout.source_type(layout.item.name) if sf.name == "item" else sf.type)
            names.append(SEQ + sf.name)
            fields.append(pa.field(name, pa.list_(pa.field("element", t, True)), True))
    return names, pa.schema(fields)


def _cast(col: pa.ChunkedArray, t: pa.DataType) -> pa.ChunkedArray:
    if col.type == t:
        return col
    if pa.types.is_timestamp(col.type) and pa.types.is_timestamp(t) and col.type.tz is None and t.tz:
        col = col.cast(pa.timestamp(col.type.unit, tz="UTC"))  # Spark's timestamps are UTC instants
    return col.cast(t)


def rewrite(spark_dir: str, expanded: str, names: list[str], schema: pa.Schema, fs) -> int:
    """Spark's Parquet files under ``spark_dir`` -> ``expanded``/part-NNNNN.parquet, columns
    renamed and cast to ``schema``, zstd; the number of rows."""
    import pyarrow.fs as pafs

    infos = fs.get_file_info(pafs.FileSelector(spark_dir, recursive=True))
    files = sorted(i.path for i in infos if i.type == pafs.FileType.File and i.path.endswith(".parquet")
                   and not os.path.basename(i.path).startswith(("_", ".")))
    rows = 0
    for k, f in enumerate(files or [None]):
        with pq.ParquetWriter(f"{expanded}/part-{k:05d}.parquet", schema, compression=delta_io.CODEC,
                              filesystem=fs) as w:
            if f is None:  # nothing to expand: one empty file carries the schema
                w.write_table(schema.empty_table())
                continue
            pf = pq.ParquetFile(fs.open_input_file(f))
            for batch in pf.iter_batches(batch_size=65536, columns=names):
                t = pa.Table.from_batches([batch])
                cols = [_cast(t.column(n), fld.type) for n, fld in zip(names, schema)]
                w.write_table(pa.Table.from_arrays(cols, schema=schema))
                rows += t.num_rows
    return rows


def write(spark, df: DataFrame, layout: S.Layout, expanded: str) -> int:
    """Write :func:`expand_frame`'s rows to the folder ``expanded`` (see the module docstring)."""
    fs, root = storage.filesystem(expanded)
    scratch = f"{root}/_spark"
    fs.create_dir(root, recursive=True)
    fs.delete_dir_contents(root, missing_dir_ok=True)
    names, schema = output_schema(layout)
    # not INT96: the rewrite reads instants, exactly
    with session_conf(spark, {"spark.sql.parquet.outputTimestampType": "TIMESTAMP_MICROS"}):
        target = scratch if "://" not in expanded or expanded.startswith("file:") else expanded.rstrip("/") + "/_spark"
        df.select(*[F.col(n) for n in names]).write.mode("overwrite").parquet(target)
    try:
        return rewrite(scratch, root, names, schema, fs)
    finally:
        fs.delete_dir(scratch)


def read_samples(spark, build_dir: str, kind: str | None = None) -> DataFrame:
    path = build_dir if delta_io.has_log(build_dir) else delta_io.table_path(build_dir, "samples")
    if not delta_io.exists(spark, path):
        state.complete_state(path.rstrip("/").rsplit("/", 1)[0])  # names a build that died first
        raise UserwiseError(f"no samples table at {path}; pass the folder written by `userwise build`")
    # the folder's complete state: a build or daily job still running, or killed, is not read
    build_dir = path.rstrip("/").rsplit("/", 1)[0]
    df = delta_io.read(spark, path, state.version_of(build_dir, "samples"))
    if kind:
        df = df.where(F.col("kind") == kind)
    return df
