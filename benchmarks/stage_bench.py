"""``userwise stage`` against the store's own client, side by side, on one HDFS.

Starts a MiniDFSCluster (pipelines/tools/hdfs_store.py: Hadoop's own name node and data
node in a JVM), writes a synthetic shard set to it (preshard's Arrow writer, no Spark),
then copies node 0's files to local disk alternately with

- ``hdfs dfs -get`` (Hadoop's FsShell from the same jars: the store's own client, one
  JVM, files one after another, no checksum against the manifest), and
- ``userwise stage`` (WebHDFS, ``--workers`` streams, ranges of ``--range-mb``, every
  file's sha256 checked against the manifest),

``--repeats`` times each, and prints the MB/s of both (and a JSON line). Every copy goes
to a fresh folder; both clients read the same bytes from the same data node.

    .venv/bin/python benchmarks/stage_bench.py [--users 20000] [--ranks 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from userwise import schemas
from userwise.pipelines.runtime import storage
from userwise.pipelines.shards import manifest as mf
from userwise.pipelines.shards import preshard, stage
from userwise.pipelines.tools.hdfs_store import HdfsStore
from userwise.pipelines.tools.shardgen import build_samples, layout


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--users", type=int, default=20000, help="light users per set of the synthetic samples")
    ap.add_argument("--ranks", type=int, default=4, help="ranks of node 0: one shard file each (at least)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--range-mb", type=float, default=16.0)
    ap.add_argument("--dir", help="scratch folder (default: a temporary one, removed)")
    a = ap.parse_args(argv)
    scratch = Path(a.dir or tempfile.mkdtemp(prefix="stage-bench-"))
    store = HdfsStore(scratch / "hdfs").start()
    os.environ.update(store.env())
    try:
        root = f"{store.url}/bench/S"
        t0 = time.time()
        table = build_samples(seed=1, users=a.users)
        preshard.preshard_arrow(table, root, schema=schemas.shard_schema(layout()).to_arrow(), nodes=1,
                                ranks_per_node=a.ranks, seed=4, compression="none", target_shard_mb=1e6)
        m = mf.load(root)
        files = [f for s in mf.node_shards(m, 0) for f in mf.shard_files(s)]
        total = sum(s for _, s, _ in files)
        print(f"shard set: {len(files)} files, {total / 1e6:.1f} MB on {store.url} "
              f"(written in {time.time() - t0:.1f} s)", file=sys.stderr)
        runs = {"hdfs dfs -get": [], "userwise stage": []}
        for i in range(a.repeats):
            dest = scratch / f"get-{i}"
            dest.mkdir()
            t = time.perf_counter()
            r = store.shell("-get", "/bench/S/node=0", str(dest))
            runs["hdfs dfs -get"].append(time.perf_counter() - t)
            if r.returncode != 0:
                raise SystemExit(f"hdfs dfs -get failed: {r.stderr[-1000:]}")
            got = sum(p.stat().st_size for p in dest.rglob("*.parquet"))
            assert got == total, (got, total)
            shutil.rmtree(dest)

            dest = scratch / f"stage-{i}"
            t = time.perf_counter()
            rep = stage.stage(root, 0, str(dest), workers=a.workers, range_mb=a.range_mb,
                              out=open(os.devnull, "w"))
            runs["userwise stage"].append(time.perf_counter() - t)
            assert rep["bytes"] == total and rep["copied"] == len(files)
            shutil.rmtree(dest)
        out = {"files": len(files), "mb": round(total / 1e6, 1), "workers": a.workers, "range_mb": a.range_mb}
        for k, secs in runs.items():
            med = statistics.median(secs)
            out[k] = {"seconds": [round(s, 2) for s in secs], "median_mb_per_s": round(total / 1e6 / med, 1)}
            print(f"{k:16s} {', '.join(f'{s:.2f}' for s in secs)} s; median {total / 1e6 / med:.1f} MB/s",
                  file=sys.stderr)
        print(json.dumps(out))
    finally:
        store.stop()
        if not a.dir:
            shutil.rmtree(scratch, ignore_errors=True)
        os.environ.pop(storage.WEBHDFS_ENV, None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
