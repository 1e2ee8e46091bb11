"""`make demo`: the whole product on the embedded default (local Spark + Delta folders).

synth -> build (lean + action log) -> expand -> build (fat rows) -> preshard ->
stage -> one epoch of the PyTorch loader. Every step goes through the same
`userwise` commands a user runs, so the demo doubles as a smoke test.

`--remote hdfs` (`make demo-remote`) runs the data path from cluster storage: it
starts a MiniDFSCluster (`pipelines/tools/hdfs_store.py`, its folder under the
output), puts the synthetic logs on it, and every build input and output (Delta
tables, `build.json`, locks, reports), the expanded rows and the shard set live on
`hdfs://`; `stage` then pulls node 0 onto the local "NVMe" folder and the loader
reads that copy. `--remote hdfs://host:port/base` uses a running HDFS instead (a
base folder that does not exist yet); its Python side is WebHDFS at
`USERWISE_WEBHDFS` (`host:port` of the name node's HTTP server; default: the name
node's host, port 9870) unless libhdfs is installed (docs/storage.md).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import sys
import time
from urllib.parse import urlsplit

from userwise.pipelines import cli
from userwise.pipelines.errors import UserwiseError


class _StepFailed(Exception):
    def __init__(self, rc: int):
        self.rc = rc


def step(title: str, argv: list[str]) -> None:
    print(f"\n=== {title}\n$ userwise {' '.join(argv)}", flush=True)
    t = time.time()
    rc = cli.main(argv)
    if rc:
        raise _StepFailed(rc)  # the command printed its own `error:` line
    print(f"--- {title}: {time.time() - t:.1f}s", flush=True)


def _remote_base(remote: str) -> str:
    """The base URL of ``--remote hdfs://host:port/base``, checked: the store answers and
    the base folder does not exist yet (the demo writes all its outputs under it)."""
    from userwise.pipelines.runtime import storage

    u = urlsplit(remote)
    if u.scheme != "hdfs" or not u.hostname or u.path.strip("/") == "":
        raise UserwiseError(f"--remote {remote}: use hdfs (start a MiniDFSCluster here) or "
                            "hdfs://namenode:port/base (a running HDFS; the demo writes under base)")
    base = remote.rstrip("/")
    try:
        taken = storage.exists(base)
    except Exception as e:  # noqa: BLE001 - whatever the client raises, the store did not answer
        addr = os.environ.get(storage.WEBHDFS_ENV) or f"{u.hostname}:9870"
        raise UserwiseError(
            f"--remote {base}: no answer from the store's WebHDFS at {addr} ({type(e).__name__}); check the URL, "
            f"and set {storage.WEBHDFS_ENV} to the name node's HTTP address (host:port) where it is not "
            f"{u.hostname}:9870") from None
    if taken:
        raise UserwiseError(f"--remote {base}: it exists; give a base folder that does not exist yet "
                            "(the demo writes every output under it)")
    return base


def _put(local: str, url: str) -> None:
    """Copy a local folder's files to a store's folder (the logs a cluster would already hold)."""
    from userwise.pipelines.runtime import storage

    for d, _, files in storage.walk(local):
        rel = os.path.relpath(d, local)
        for f in files:
            storage.copy_file(os.path.join(d, f), storage.join(url, *([] if rel == "." else rel.split(os.sep)), f))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", default="demo", help="local folder: the logs, the staged copy (and the local outputs)")
    p.add_argument("--users", type=int, default=60)
    p.add_argument("--days", type=int, default=4)
    p.add_argument("--max-seq-len", type=int, default=50)
    p.add_argument("--remote", metavar="hdfs|URL",
                   help="outputs on HDFS: 'hdfs' starts a MiniDFSCluster under --output; "
                        "hdfs://namenode:port/base uses a running one")
    p.add_argument("--skip-fat", action="store_true", help="leave out the fat-row log and its build (step 4)")
    p.add_argument("--conf", type=cli._conf, action="append", default=[], metavar="KEY=VALUE",
                   help="a Spark or Hadoop setting for every Spark step (repeatable)")
    a = p.parse_args(argv)
    from userwise.pipelines.runtime import storage

    store, webhdfs = None, os.environ.get(storage.WEBHDFS_ENV)
    try:
        base = _remote_base(a.remote) if a.remote not in (None, "hdfs") else None
        out = os.path.abspath(a.output)
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(out)
        conf = dict(a.conf)
        if a.remote == "hdfs":
            from userwise.pipelines.tools.hdfs_store import HdfsStore

            print("\n=== 0. start a MiniDFSCluster (name node + data node in one JVM)", flush=True)
            store = HdfsStore(os.path.join(out, "hdfs")).start()
            os.environ.update(store.env())  # the Python side: WebHDFS
            conf.setdefault("spark.hadoop.dfs.replication", "1")  # one data node
            base = f"{store.url}/demo"
            print(f"{store.url} (WebHDFS at {store.webhdfs}; its files under {store.base})", flush=True)
        return _run(a, out, base, conf)
    except _StepFailed as e:
        return e.rc
    except UserwiseError as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    finally:
        if store is not None:
            store.stop()
            os.environ.pop(storage.WEBHDFS_ENV, None)
            if webhdfs is not None:
                os.environ[storage.WEBHDFS_ENV] = webhdfs


def _run(a, out: str, base: str | None, conf: dict[str, str]) -> int:
    from userwise.pipelines.runtime import storage

    start = dt.date(2026, 1, 1)
    as_of = (start + dt.timedelta(days=a.days)).isoformat()
    syn = os.path.join(out, "synth")
    kinds = "lean,actions" if a.skip_fat else "lean,fat,actions"
    step("1. synthetic logs (lean, action log)" if a.skip_fat else "1. synthetic logs (lean, fat rows, action log)",
         ["synth", "--output", syn, "--days", str(a.days), "--users", str(a.users), "--kinds", kinds,
          "--max-seq-len", str(a.max_seq_len), "--start", start.isoformat(), "--bad-rows", "0.002"])
    where = base or out  # every output of the Spark steps
    logs = syn
    if base:
        logs = storage.join(base, "synth")
        print(f"\n=== 1b. put the logs on the store: {logs}", flush=True)
        t = time.time()
        _put(syn, logs)
        print(f"--- 1b: {time.time() - t:.1f}s", flush=True)
    spark_args = [x for k, v in conf.items() for x in ("--conf", f"{k}={v}")]
    from userwise.pipelines.runtime.spark import get_spark

    get_spark(conf=conf)  # one local session for every step
    lean = storage.join(where, "build")
    step("2. build user-wise samples from the lean log + action log",
         ["build", "--config", storage.join(logs, "config.yaml"), "--input", storage.join(logs, "lean"),
          "--actions", storage.join(logs, "actions"), "--build-dir", lean, "--as-of", as_of,
          "--incremental-days", "2", "--window-days", "1", "--report", storage.join(where, "report_lean.json"),
          *spark_args])
    step("3. expand back to point-wise rows (the lossless round trip)",
         ["expand", "--build-dir", lean, "--expanded", storage.join(where, "expanded"), *spark_args])
    if not a.skip_fat:
        step("4. build from the legacy fat-row log (stitched snapshots)",
             ["build", "--config", storage.join(logs, "config_fat.yaml"), "--input", storage.join(logs, "fat"),
              "--build-dir", storage.join(where, "build_fat"), "--as-of", as_of, "--incremental-days", "2",
              "--window-days", "1", "--report", storage.join(where, "report_fat.json"), *spark_args])
    shards = storage.join(where, "shards")
    step("5. pre-shard per node, balanced per rank",
         ["preshard", "--build-dir", lean, "--shards", shards, "--nodes", "2", "--ranks-per-node", "2", *spark_args])
    nvme = os.path.join(out, "nvme", "node0")
    step("6. stage node 0's shards onto 'local NVMe'" + (" from the store" if base else ""),
         ["stage", "--shards", shards, "--node", "0", "--staged", nvme, "--workers", "2"])
    print("\n=== 7. one epoch of the PyTorch loader on node 0, rank 0 of 2", flush=True)
    from userwise.pipelines.loader import UserwiseDataset, UserwiseLoader

    ds = UserwiseDataset(nvme, batch_size=32, seed=0, rank=0, world_size=2)
    loader = UserwiseLoader(ds, num_workers=0)
    n = sum(1 for _ in loader)
    print(f"{n} batches; {json.dumps(loader.stats.summary(), default=str)}")
    if not a.skip_fat:
        rep = json.loads(storage.read_bytes(storage.join(where, "report_fat.json")))
        print(f"\nfat-row log bytes / user-wise samples bytes: {rep['storage_ratio']}")
    if base:
        print(f"tables, reports, expanded rows and shards under {base}; the staged copy under {nvme}")
    print(f"demo outputs under {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
