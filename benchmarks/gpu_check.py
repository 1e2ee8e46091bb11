"""GPU check (under 5 minutes on one GPU): pinned vs pageable H2D, prefetch overlap, the GDS path.

    python benchmarks/gpu_check.py [--mb 256] [--samples 4000] [--cap-s 60] [--out DIR]

Without a CUDA device it prints a message and exits 0. Every stage has a
time cap; results print as lines and (with --out) a JSON file.
1. H2D bandwidth of one contiguous buffer: pageable vs pinned (GB/s).
2. Prefetch overlap: a fixed GPU compute per batch, alone and fed by the
   loader at prefetch 1 vs 4 (batches/s, wait share, overlap), on a synthetic
   shard set of long sequences.
3. GDS: the same shard set with side files; the data path taken (gds when
   kvikio + cuFile work, else the fallback), its rate, and byte-equality of
   its first batches with the Parquet path.
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


def h2d(torch, mb: int, reps: int = 20) -> dict:
    n = mb << 20
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    out = {}
    for name, pin in (("pageable", False), ("pinned", True)):
        src = torch.empty(n, dtype=torch.uint8, pin_memory=pin)
        src.fill_(1)
        dev.copy_(src, non_blocking=pin)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(reps):
            dev.copy_(src, non_blocking=pin)
        torch.cuda.synchronize()
        out[f"{name}_GBps"] = reps * n / (time.perf_counter() - t) / 1e9
    out["pinned_over_pageable"] = out["pinned_GBps"] / out["pageable_GBps"]
    return out


def overlap(torch, root: str, batch_size: int, workers: int, cap_s: float = 60) -> dict:
    """Fixed GPU compute per batch (4 fp32 2048^3 products): alone, and fed by the loader at
    prefetch 1 and 4. Each loader runs one untimed warm-up epoch (worker start, first
    decode), then whole epochs until cap_s/3 have passed. ``overlap`` = the fed rate over the
    slower of compute alone and loader alone (1.0: the copies and decode hide completely)."""
    from userwise.pipelines.loader import UserwiseDataset, UserwiseLoader

    a = torch.randn(2048, 2048, device="cuda")

    def compute(a):
        for _ in range(4):
            a = (a @ a).clamp_(-1, 1)
        return a

    for _ in range(5):
        a = compute(a)
    torch.cuda.synchronize()
    t, n = time.perf_counter(), 200
    for _ in range(n):
        a = compute(a)
    torch.cuda.synchronize()
    out = {"compute_alone_batches_per_s": n / (time.perf_counter() - t)}

    def timed(ld, work):
        nonlocal a
        for b in ld:  # warm-up epoch
            pass
        ld.stats.reset()
        t, n = time.perf_counter(), 0
        while True:
            for b in ld:
                if work:
                    a = compute(a)
                b["seq_item"].sum()
                n += 1
            if time.perf_counter() - t > cap_s / 3:
                break
        torch.cuda.synchronize()
        s = ld.stats.summary()
        return {"batches_per_s": n / (time.perf_counter() - t), "wait_share": s["wait_share"],
                "bytes_per_s": s["bytes_per_s"], "samples_per_s": s["samples_per_s"]}

    for pf in (1, 4):
        ds = UserwiseDataset(root, batch_size=batch_size, world_size=1, rank=0, verify="none", gds=False)
        ld = UserwiseLoader(ds, num_workers=workers, device="cuda", prefetch=pf)
        if pf == 1:
            out["loader_alone"] = timed(ld, False)
        r = out[f"prefetch{pf}"] = timed(ld, True)
        r["overlap"] = r["batches_per_s"] / min(out["compute_alone_batches_per_s"], out["loader_alone"]["batches_per_s"])
        ld.close()
    return out


def gds_path(torch, root: str, batch_size: int, cap_s: float = 60) -> dict:
    from userwise.pipelines.loader import UserwiseDataset, UserwiseLoader
    from userwise.pipelines.loader.io.gpudirect import kvikio_compat

    auto = UserwiseDataset(root, batch_size=batch_size, world_size=1, rank=0, verify="none", gds="auto", device="cuda")
    ds = UserwiseDataset(root, batch_size=batch_size, world_size=1, rank=0, verify="none", gds="device", device="cuda")
    ref = UserwiseDataset(root, batch_size=batch_size, world_size=1, rank=0, verify="none", gds=False, device="cuda")
    t = time.perf_counter()
    ld = UserwiseLoader(ds, device="cuda")
    first, n = [], 0
    for b in ld:
        if len(first) < 3:
            first.append(b)
        n += b.num_samples
        if time.perf_counter() - t > cap_s:
            break
    torch.cuda.synchronize()
    rate = n / (time.perf_counter() - t)
    same = all(bytes(x.buffer.cpu().numpy()) == bytes(y.buffer.cpu().numpy())
               for x, y in zip(first, UserwiseLoader(ref, device="cuda")))
    return {"data_path": ds.data_path, "auto_data_path": auto.data_path, "samples_per_s": rate,
            "kvikio_compat_mode": kvikio_compat(), "first_batches_equal_parquet": same}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=256)
    p.add_argument("--samples", type=int, default=4000)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--cap-s", type=float, default=60, help="time cap of each timed stage (seconds)")
    p.add_argument("--out")
    a = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device on this machine; nothing to measure (run it on a GPU machine)")
        return 0
    from userwise.pipelines.errors import ShardError
    from userwise.pipelines.tools.shardgen import write_shard_set

    res = {"device": torch.cuda.get_device_name(0)}
    t0 = time.perf_counter()
    res["h2d"] = h2d(torch, a.mb)
    print("h2d:", json.dumps(res["h2d"]), flush=True)
    with tempfile.TemporaryDirectory() as root:
        n = a.samples
        # long sequences (~200 events per sample), as benchmarks/loader_bench.py's "long" profile
        write_shard_set(root, nodes=1, ranks_per_node=1, row_group_rows=512, gds=True,
                        sets=(("incremental", "2026-01-04", "2026-01-05", n),),
                        max_seq_len=512, max_events=2000, event_scale=150.0)
        res["overlap"] = overlap(torch, root, a.batch_size, a.workers, a.cap_s)
        print("overlap:", json.dumps(res["overlap"]), flush=True)
        try:
            res["gds"] = gds_path(torch, root, a.batch_size, a.cap_s)
        except (ImportError, ShardError) as e:  # no kvikio here: the loader falls back (tested)
            res["gds"] = {"data_path": "unavailable", "why": str(e)}
        print("gds:", json.dumps(res["gds"]), flush=True)
    res["total_s"] = time.perf_counter() - t0
    print(f"gpu_check: done in {res['total_s']:.0f}s")
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "gpu_check.json"), "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
