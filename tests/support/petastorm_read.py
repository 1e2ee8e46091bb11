"""Read one node's shards with petastorm's make_batch_reader (run by .venv-petastorm's python).

petastorm collates every list column of a batch into a 2-D numpy array, so
variable-length lists fail ("Length of all values in column ... are expected
to be the same length"). The recipe: a TransformSpec that pads each list
column to a fixed length (the longest list in the set, found from the
Parquet files) and adds ``<col>__len`` with the true lengths; trimming row i
to ``__len[i]`` gives the list back exactly. Dates become int32 days.

Usage: python petastorm_read.py <node dir> <out.json>
Prints nothing; writes {sample_id: {col: [len, first values...]}}.
"""

import datetime as dt
import glob
import json
import sys

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from petastorm import make_batch_reader
from petastorm.transform import TransformSpec

EPOCH = dt.date(1970, 1, 1)


def list_plan(files):
    """{list column: (numpy dtype, max length, pad)} over the files (a footer + one column pass)."""
    schema = pq.read_schema(files[0])
    plan = {}
    for f in schema:
        if not pa.types.is_list(f.type):
            continue
        vt = f.type.value_type
        longest = 0
        for path in files:
            col = pq.read_table(path, columns=[f.name]).column(0)
            if len(col):
                longest = max(longest, pc.max(pc.list_value_length(col)).as_py() or 0)
        if pa.types.is_string(vt):
            dtype, pad = np.dtype(object), ""
        elif pa.types.is_date32(vt):
            dtype, pad = np.dtype(np.int32), 0
        else:
            dtype, pad = np.dtype(vt.to_pandas_dtype()), 0
        plan[f.name] = (dtype, max(longest, 1), pad)
    return plan


def padding_spec(plan):
    def func(df):
        for c, (dtype, width, pad) in plan.items():
            vals = df[c].values
            lens = np.fromiter((len(v) for v in vals), np.int32, len(vals))
            rows = []
            for v in vals:
                if dtype == np.int32 and len(v) and isinstance(v[0], dt.date):
                    v = [(x - EPOCH).days for x in v]
                out = np.full(width, pad, dtype=dtype if dtype != object else np.dtype("U64"))
                out[: len(v)] = v
                rows.append(out)
            df[c] = rows
            df[c + "__len"] = lens
        return df

    return TransformSpec(func, edit_fields=edit_fields(plan))


def edit_fields(plan):
    """The TransformSpec fields of the padded columns: each list column at its width, plus
    ``<col>__len``."""
    edit = []
    for c, (dtype, width, _) in plan.items():
        edit.append((c, np.str_ if dtype == object else dtype.type, (width,), False))
        edit.append((c + "__len", np.int32, (), False))
    return edit


def main(node_dir, out_path):
    files = sorted(glob.glob(f"{node_dir}/shard-*.parquet"))
    plan = list_plan(files)
    got = {}
    with make_batch_reader([f"file://{p}" for p in files], num_epochs=1, workers_count=1,
                           shuffle_row_groups=False, transform_spec=padding_spec(plan)) as reader:
        for batch in reader:
            b = batch._asdict()
            for i, sid in enumerate(b["sample_id"]):
                rec = {}
                for c in plan:
                    n = int(b[c + "__len"][i])
                    vals = b[c][i][:n].tolist()
                    rec[c] = [n] + [str(x) if isinstance(x, str) else x for x in vals[:3]]
                rec["_count"] = got.get(int(sid), {}).get("_count", 0) + 1
                got[int(sid)] = rec
    with open(out_path, "w") as f:
        json.dump({str(k): v for k, v in got.items()}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
