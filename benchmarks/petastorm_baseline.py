"""petastorm reading one node's staged shards: the loader benchmark's third baseline.

Runs with the petastorm environment's Python (``.venv-petastorm/bin/python``: petastorm
needs pyarrow 14 and numpy 1.26); ``loader_bench.py`` starts it next to each loader run.

    .venv-petastorm/bin/python benchmarks/petastorm_baseline.py NODE_DIR [--workers 1] [--cap-s 5]

petastorm's ``make_batch_reader`` collates each list column of a batch into a 2-D array,
so variable-length lists must be padded: as in ``tests/support/petastorm_read.py`` (the tests'
second reader of our shards), every list column is padded to its longest list in the set
and gets ``<col>__len``, here with vectorised numpy per column and batch (the tests' recipe
pads row by row). That is what a petastorm user does with jagged samples, and the cost
the padding brings is part of the baseline. Row groups are shuffled
(``shuffle_row_groups``) and the reader loops over the files until ``--cap-s`` seconds have
passed from its first batch (start-up is reported apart, as for the point-wise baseline).
Prints one JSON object: samples/s, events/s (the stored sequences' ``num_events``), start-up,
the padded widths.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "support"))

import numpy as np  # noqa: E402
from petastorm import make_batch_reader  # noqa: E402
from petastorm.transform import TransformSpec  # noqa: E402
from petastorm_read import EPOCH, edit_fields, list_plan  # noqa: E402


def padding_spec(plan):
    """Pad each list column of a batch to its set-wide width in one numpy pass (a mask over
    a (rows, width) array filled from the concatenated values), plus ``<col>__len``."""
    def func(df):
        for c, (dtype, width, pad) in plan.items():
            vals = df[c].values
            lens = np.fromiter(map(len, vals), np.int32, len(vals))
            flat = np.concatenate(list(vals)) if len(vals) else np.zeros(0)
            out_dt = np.dtype("U64") if dtype == object else dtype
            if dtype == np.int32 and flat.dtype == object:  # dates: days since 1970-01-01
                flat = np.array([(x - EPOCH).days for x in flat], np.int32)
            out = np.full((len(vals), width), pad, dtype=out_dt)
            out[np.arange(width)[None, :] < lens[:, None]] = flat
            df[c] = list(out)
            df[c + "__len"] = lens
        return df

    return TransformSpec(func, edit_fields=edit_fields(plan))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="petastorm make_batch_reader over one node's shards (samples/s)")
    p.add_argument("node_dir", help="a node's folder of shard-*.parquet files")
    p.add_argument("--workers", type=int, default=1, help="petastorm's workers_count (thread pool)")
    p.add_argument("--cap-s", type=float, default=5.0, help="seconds to read from the first batch on")
    a = p.parse_args(argv)
    files = sorted(glob.glob(os.path.join(a.node_dir, "shard-*.parquet")))
    if not files:
        raise SystemExit(f"{a.node_dir}: no shard-*.parquet files")
    plan = list_plan(files)
    t0 = time.perf_counter()
    samples = events = 0
    t = startup = None
    with make_batch_reader([f"file://{os.path.abspath(f)}" for f in files], num_epochs=None,
                           workers_count=max(1, a.workers), shuffle_row_groups=True,
                           transform_spec=padding_spec(plan)) as reader:
        for batch in reader:
            if t is None:  # the first batch: start-up ends here, as for the point-wise baseline
                t = time.perf_counter()
                startup = t - t0
                continue
            samples += len(batch.sample_id)
            events += int(batch.num_events.sum())
            if time.perf_counter() - t > a.cap_s:
                break
    el = time.perf_counter() - t
    print(json.dumps({"samples_per_s": samples / el, "events_per_s": events / el, "samples": samples,
                      "seconds": el, "startup_s": startup, "workers": max(1, a.workers),
                      "padded_to": {c: w for c, (_, w, _) in plan.items()}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
