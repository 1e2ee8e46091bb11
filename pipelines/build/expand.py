"""`userwise expand`: user-wise samples back to point-wise rows (the round trip).

Every impression of every sample becomes one row with exactly the input's
columns (names, order, types) plus the history it sees:
- lean: ``seq_item``, ``seq_ts``, ``seq_<feature>``, ``seq_action``;
- fat: the configured snapshot columns, reproduced as given (null stays
  null, empty stays empty, overrides come back whole).
"""

from __future__ import annotations

import os

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from userwise import schemas as S
from userwise.pipelines.build import build_record
from userwise.pipelines.errors import UserwiseError
from userwise.pipelines.runtime import delta_io
from userwise.schemas import IMP, OVR, REQ, SEQ


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
            name = {"ts": "seq_ts", "item": "seq_item", "action": "seq_action"}.get(sf.name, SEQ + sf.name)
            seq[name] = F.slice(F.col(SEQ + sf.name), begin + 1, n)
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


def read_samples(spark, samples: str, kind: str | None = None) -> DataFrame:
    path = samples if os.path.isdir(os.path.join(samples, "_delta_log")) else delta_io.table_path(samples, "samples")
    if not delta_io.exists(spark, path):
        raise UserwiseError(f"no samples table at {path}; pass the folder written by `userwise build`")
    df = delta_io.read(spark, path)
    if kind:
        df = df.where(F.col("kind") == kind)
    return df


def cli(args) -> int:
    from userwise.pipelines.runtime.spark import get_spark

    build_dir = args.samples
    if os.path.basename(os.path.normpath(build_dir)) == "samples" and not os.path.exists(
            build_record.path(build_dir)):
        build_dir = os.path.dirname(os.path.normpath(build_dir))
    cfg, layout, _ = build_record.load(build_dir)
    if args.max_seq_len and args.max_seq_len > cfg.max_seq_len:
        raise UserwiseError(f"--max-seq-len {args.max_seq_len} is larger than the build's max_seq_len "
                            f"{cfg.max_seq_len}: the samples only hold the last L events per request")
    spark = get_spark(master=args.master)
    df = expand_frame(cfg, layout, read_samples(spark, build_dir, args.kind), args.max_seq_len)
    df.write.mode("overwrite").parquet(args.output)
    n = spark.read.parquet(args.output).count()
    print(f"expanded {n} impressions into {args.output}")
    return 0
