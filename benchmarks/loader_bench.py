"""Loader speed against two baselines run side by side (not part of the tests).

    python benchmarks/loader_bench.py [--samples 3000] [--batch-size 128] [--workers 1 2] [--row-group-rows 512]

1. Ceiling: pyarrow reading the same shard files into memory and nothing
   else (``pq.ParquetFile.read_row_group`` over every row group). The loader's
   samples/s and events/s are reported as a share of it (target >= 0.8).
2. Point-wise baseline: the same data expanded to fat point-wise rows (every
   impression carries its visible history) in Parquet, read by a plain
   ``torch.utils.data.Dataset`` + ``DataLoader`` (per-row ``__getitem__``,
   default collate). Reported: impressions delivered per second, each with its
   history, loader / point-wise (target >= 20x).
Runs with the listed worker counts (default 1 and 2). Keep sizes small on a
shared machine; the ratios are what matters.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import torch  # noqa: E402


def ceiling(root: str) -> dict:
    man = json.load(open(os.path.join(root, "manifest.json")))
    t = time.perf_counter()
    rows = events = 0
    for s in man["shards"]:
        pf = pq.ParquetFile(os.path.join(root, s["path"]))
        for i in range(pf.num_row_groups):
            rg = pf.read_row_group(i)
            rows += rg.num_rows
        events += s["events"]
    el = time.perf_counter() - t
    return {"samples_per_s": rows / el, "events_per_s": events / el, "s": el}


def loader_rate(root: str, batch_size: int, workers: int) -> dict:
    from userwise.pipelines.loader import UserwiseDataset, UserwiseLoader

    ds = UserwiseDataset(root, batch_size=batch_size, world_size=1, rank=0, verify="none", device="cpu")
    ld = UserwiseLoader(ds, num_workers=workers, device="cpu")
    t = time.perf_counter()
    for b in ld:
        pass
    el = time.perf_counter() - t
    s = ld.stats.summary()
    return {"samples_per_s": s["samples"] / el, "events_per_s": s["events"] / el,
            "impressions_per_s": s["impressions"] / el, "s": el}


class PointwiseDataset(torch.utils.data.Dataset):
    """The legacy way: one fat row per impression, decoded per row."""

    def __init__(self, path):
        self.t = pq.read_table(path)
        self.cols = {c: self.t.column(c) for c in self.t.column_names}

    def __len__(self):
        return self.t.num_rows

    def __getitem__(self, i):
        out = {}
        for c, col in self.cols.items():
            v = col[i].as_py()
            if isinstance(v, list):
                out[c] = torch.tensor(v if v else [], dtype=torch.float64 if c == "score" else torch.int64)
            elif isinstance(v, (int, float)):
                out[c] = v
            elif v is None:
                out[c] = float("nan")
        return out


def _collate(rows):
    out = {}
    for k in rows[0]:
        v = [r[k] for r in rows]
        out[k] = torch.cat(v) if isinstance(v[0], torch.Tensor) else torch.tensor(v)
        if isinstance(v[0], torch.Tensor):
            out[k + ".lengths"] = torch.tensor([len(x) for x in v])
    return out


def pointwise_rate(path: str, batch_size: int, workers: int, cap_s: float) -> dict:
    dl = torch.utils.data.DataLoader(PointwiseDataset(path), batch_size=batch_size, num_workers=workers,
                                     collate_fn=_collate)
    t = time.perf_counter()
    n = 0
    for b in dl:
        n += len(b["item_id"])
        if time.perf_counter() - t > cap_s:
            break
    return {"impressions_per_s": n / (time.perf_counter() - t)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="loader vs pyarrow ceiling vs point-wise DataLoader")
    p.add_argument("--samples", type=int, default=3000)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--row-group-rows", type=int, default=512)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--pointwise-cap-s", type=float, default=20.0)
    a = p.parse_args(argv)
    from tests.shardgen import write_shard_set
    from userwise.pipelines.loader import UserwiseDataset, UserwiseLoader, expand_batch

    with tempfile.TemporaryDirectory() as root:
        write_shard_set(root, nodes=1, ranks_per_node=1, row_group_rows=a.row_group_rows,
                        sets=(("incremental", "2026-01-04", "2026-01-05", a.samples),))
        ds = UserwiseDataset(root, batch_size=1024, world_size=1, rank=0, verify="none", shuffle=False, device="cpu")
        pw = os.path.join(root, "pointwise.parquet")
        pq.write_table(pa.concat_tables([expand_batch(b) for b in UserwiseLoader(ds)]), pw)
        for _ in range(2):  # warm the page cache for everyone
            ceil = ceiling(root)
        res = {"samples": a.samples, "ceiling": ceil, "runs": {}}
        for w in a.workers:
            lr = loader_rate(root, a.batch_size, w)
            pr = pointwise_rate(pw, a.batch_size, w, a.pointwise_cap_s)
            res["runs"][w] = {
                "loader": lr, "pointwise": pr,
                "share_of_ceiling_samples": lr["samples_per_s"] / ceil["samples_per_s"],
                "share_of_ceiling_events": lr["events_per_s"] / ceil["events_per_s"],
                "impressions_vs_pointwise": lr["impressions_per_s"] / pr["impressions_per_s"],
            }
            r = res["runs"][w]
            print(f"workers={w}: loader {lr['samples_per_s']:.0f} samples/s, {lr['events_per_s']:.0f} events/s "
                  f"= {r['share_of_ceiling_samples']:.2f} of the pyarrow ceiling (target >= 0.8); "
                  f"impressions/s {r['impressions_vs_pointwise']:.1f}x the point-wise DataLoader (target >= 20x)",
                  flush=True)
        print(json.dumps(res, indent=1, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
