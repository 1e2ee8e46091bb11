"""Skewed synthetic user-wise samples (the `userwise build` output shape), for
preshard/stage tests and anyone else who needs a samples table quickly.

``make_samples()`` is pure pyarrow: rows of ``schemas.samples_schema(layout)``
with consistent list lengths (seq_* = seq_len, req_* = num_requests,
imp__* = num_impressions, cost = seq_len + num_impressions). Skew: many light
users, a few heavy ones, and one bot-like user with many chunks near the cost
cap. Sets: pretrain + ``windows`` daily incremental windows.

``write_build(spark, D)`` writes it as the Delta table ``D/samples``
partitioned by (kind, window_end), plus ``D/_userwise/build.json``.
"""

from __future__ import annotations

import datetime as dt
import json
import os

import numpy as np
import pyarrow as pa
import xxhash

from tests.support.common import LEAN_CFG
from userwise import schemas
from userwise.pipelines import config

BOT = 999_999
START = dt.date(2026, 1, 2)


def layout():
    return config.parse(LEAN_CFG).layout(schemas.SYNTH_IMPRESSIONS.to_arrow())


def _vals(t: pa.DataType, n: int, rng) -> list:
    if pa.types.is_string(t):
        return [f"s{int(x)}" for x in rng.integers(0, 50, n)]
    if pa.types.is_date32(t):
        return [START + dt.timedelta(days=int(x)) for x in rng.integers(0, 3, n)]
    if pa.types.is_floating(t):
        return [float(x) for x in rng.random(n)]
    hi = 100 if t.bit_width <= 8 else 10_000
    return [int(x) for x in rng.integers(0, hi, n)]


def make_samples(*, seed: int = 0, users: int = 40, heavy: int = 3, bot_chunks: int = 16, windows: int = 3,
                 cap: int = 200) -> pa.Table:
    lay = layout()
    schema = schemas.samples_schema(lay).to_arrow()
    rng = np.random.default_rng(seed)
    sets = [("pretrain", dt.date(2025, 12, 1), START - dt.timedelta(days=1))]
    sets += [("incremental", START + dt.timedelta(days=i - 1), START + dt.timedelta(days=i)) for i in range(windows)]
    rows = {f.name: [] for f in schema}
    for kind, ws, we in sets:
        plan = [(u, 0, int(rng.integers(3, 40))) for u in range(users) if rng.random() < 0.8]
        plan += [(10_000 + u, c, int(rng.integers(cap // 2, cap))) for u in range(heavy) for c in range(3)]
        plan += [(BOT, c, cap - int(rng.integers(0, 4))) for c in range(bot_chunks)]
        for user, chunk, cost in plan:
            nreq = max(1, int(rng.integers(1, 6)))
            per = rng.multinomial(max(nreq, cost // 3) - nreq, [1 / nreq] * nreq) + 1
            nimp = int(per.sum())
            seq_len = max(0, cost - nimp)
            r = rows
            r["format_version"].append(schemas.FORMAT_VERSION)
            r["sample_id"].append(xxhash.xxh64_intdigest(f"{kind}|{we}|{user}|{chunk}".encode()) - (1 << 63))
            r["kind"].append(kind)
            r["window_start"].append(ws)
            r["window_end"].append(we)
            r["user"].append(user)
            r["chunk"].append(chunk)
            r["num_requests"].append(nreq)
            r["num_impressions"].append(nimp)
            r["seq_len"].append(seq_len)
            r["cost"].append(seq_len + nimp)
            for f in schema:
                if not pa.types.is_list(f.type):
                    continue
                n = seq_len if f.name.startswith("seq_") else nimp if f.name.startswith("imp__") else nreq
                if f.name == "req_num_imps":
                    r[f.name].append([int(x) for x in per])
                elif f.name == "req_seq_end":
                    r[f.name].append([int(x) for x in np.sort(rng.integers(0, seq_len + 1, nreq))])
                elif f.name == "req_seq_begin":
                    r[f.name].append([0] * nreq)
                else:
                    r[f.name].append(_vals(f.type.value_type, n, rng))
    return pa.Table.from_pydict(rows, schema=schema)


def write_build(spark, build_dir: str, table: pa.Table | None = None, **kw) -> pa.Table:
    """Write ``table`` (default ``make_samples(**kw)``) as D/samples (Delta) and D/_userwise/build.json."""
    table = make_samples(**kw) if table is None else table
    lay = layout()
    sch = schemas.samples_schema(lay)
    df = spark.createDataFrame(table.to_pandas(), schema=sch.to_spark())
    (df.repartition(3).write.format("delta").mode("overwrite").partitionBy(*sch.partition_by)
     .save(os.path.join(build_dir, "samples")))
    os.makedirs(os.path.join(build_dir, "_userwise"), exist_ok=True)
    with open(os.path.join(build_dir, "_userwise", "build.json"), "w") as f:
        json.dump({"config": LEAN_CFG, "roles": lay.roles(),
                   "input_schema": [[x.name, str(x.type), x.nullable] for x in lay.input_schema],
                   "as_of": str(START + dt.timedelta(days=3))}, f)
    return table
