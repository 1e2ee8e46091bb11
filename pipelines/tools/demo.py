"""`make demo`: the whole product on the embedded default (local Spark + Delta folders).

synth -> build (lean + action log) -> expand -> build (fat rows) -> preshard ->
stage -> one epoch of the PyTorch loader. Every step goes through the same
`userwise` commands a user runs, so the demo doubles as a smoke test.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

from userwise.pipelines import cli


def step(title: str, argv: list[str]) -> None:
    print(f"\n=== {title}\n$ userwise {' '.join(argv)}", flush=True)
    t = time.time()
    rc = cli.main(argv)
    if rc:
        sys.exit(rc)
    print(f"--- {title}: {time.time() - t:.1f}s", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--output", default="demo")
    p.add_argument("--users", type=int, default=60)
    p.add_argument("--days", type=int, default=4)
    p.add_argument("--max-seq-len", type=int, default=50)
    a = p.parse_args(argv)
    out = os.path.abspath(a.output)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    import datetime as dt

    start = dt.date(2026, 1, 1)
    as_of = (start + dt.timedelta(days=a.days)).isoformat()
    syn = os.path.join(out, "synth")
    step("1. synthetic logs (lean, fat rows, action log)",
         ["synth", "--output", syn, "--days", str(a.days), "--users", str(a.users),
          "--max-seq-len", str(a.max_seq_len), "--start", start.isoformat(), "--bad-rows", "0.002"])
    from userwise.pipelines.runtime.spark import get_spark

    get_spark()  # one local session for every step
    lean = os.path.join(out, "build")
    step("2. build user-wise samples from the lean log + action log",
         ["build", "--config", os.path.join(syn, "config.yaml"), "--input", os.path.join(syn, "lean"),
          "--actions", os.path.join(syn, "actions"), "--output", lean, "--as-of", as_of,
          "--pretrain-days", "2", "--window-days", "1", "--report", os.path.join(out, "report_lean.json")])
    step("3. expand back to point-wise rows (the lossless round trip)",
         ["expand", "--samples", lean, "--output", os.path.join(out, "expanded")])
    fat = os.path.join(out, "build_fat")
    step("4. build from the legacy fat-row log (stitched snapshots)",
         ["build", "--config", os.path.join(syn, "config_fat.yaml"), "--input", os.path.join(syn, "fat"),
          "--output", fat, "--as-of", as_of, "--pretrain-days", "2", "--window-days", "1",
          "--report", os.path.join(out, "report_fat.json")])
    shards = os.path.join(out, "shards")
    step("5. pre-shard per node, balanced per rank",
         ["preshard", "--samples", lean, "--output", shards, "--nodes", "2", "--ranks-per-node", "2"])
    nvme = os.path.join(out, "nvme", "node0")
    step("6. stage node 0's shards onto 'local NVMe'",
         ["stage", "--shards", shards, "--node", "0", "--dest", nvme, "--workers", "2"])
    print("\n=== 7. one epoch of the PyTorch loader on node 0, rank 0 of 2", flush=True)
    from userwise.pipelines.loader import UserwiseDataset, UserwiseLoader

    ds = UserwiseDataset(nvme, batch_size=32, seed=0, rank=0, world_size=2)
    loader = UserwiseLoader(ds, num_workers=0)
    n = sum(1 for _ in loader)
    print(f"{n} batches; {json.dumps(loader.stats.summary(), default=str)}")
    with open(os.path.join(out, "report_fat.json")) as f:
        rep = json.load(f)
    print(f"\nfat-row log bytes / user-wise samples bytes: {rep['storage_ratio']}")
    print(f"demo outputs under {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
