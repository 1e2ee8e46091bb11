"""Scale check of `userwise synth`: time, peak memory and throughput at a chosen size.

Runs the generator in a child process per case (so peak RSS is that case's
own) and reports rows/s and peak RSS for lean-only (the baseline), lean+fat
(the snapshot's cost as a ratio against the baseline) and, optionally,
actions. Peak RSS should stay flat as --impressions grows: memory is bounded
by the chunk size, not by the data.

    .venv/bin/python benchmarks/synth_scale.py --impressions 1000000 --max-seq-len 20
    .venv/bin/python benchmarks/synth_scale.py --impressions 10000000 --max-seq-len 10   # big machine only
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile

CHILD = r"""
import io, json, resource, sys, time
from userwise.pipelines.tools.synth import synth
a = json.loads(sys.argv[1])
t0 = time.perf_counter()
s = synth(a["out"], days=a["days"], impressions=a["impressions"], max_seq_len=a["L"], kinds=tuple(a["kinds"]),
          fmt=a["fmt"], seed=0, log=sys.stderr if a["verbose"] else io.StringIO())
dt = time.perf_counter() - t0
rows = {k: sum(v.values()) for k, v in s["rows"].items()}
print(json.dumps({"seconds": dt, "rows": rows, "users": s["users"],
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def du_mb(path: str) -> float:
    total = 0
    for root, _, files in os.walk(path):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    return total / 2**20


def run(case: str, kinds: list[str], args, workdir: str) -> dict:
    out = os.path.join(workdir, case)
    payload = json.dumps({"out": out, "days": args.days, "impressions": args.impressions, "L": args.max_seq_len,
                          "kinds": kinds, "fmt": args.format, "verbose": args.verbose})
    proc = subprocess.run([sys.executable, "-c", CHILD, payload], capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr)
        raise SystemExit(f"case {case} failed")
    if args.verbose:
        sys.stderr.write(proc.stderr)
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    r["mb_on_disk"] = du_mb(out)
    shutil.rmtree(out, ignore_errors=True)
    return r


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--impressions", type=int, default=1_000_000)
    p.add_argument("--days", type=int, default=1)
    p.add_argument("--max-seq-len", type=int, default=20)
    p.add_argument("--format", choices=["parquet", "delta"], default="parquet")
    p.add_argument("--no-fat", action="store_true", help="skip the lean+fat case (e.g. at 10M with a large L)")
    p.add_argument("--workdir", default=None)
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args(argv)
    workdir = args.workdir or tempfile.mkdtemp(prefix="synth-bench-")
    cases = [("lean", ["lean"]), ("lean+actions", ["lean", "actions"])]
    if not args.no_fat:
        cases.append(("lean+fat", ["lean", "fat"]))
    print(f"synth scale: target {args.impressions:,} impressions, {args.days} day(s), L={args.max_seq_len}, "
          f"{args.format}")
    warm = argparse.Namespace(**{**vars(args), "impressions": min(args.impressions, 50_000), "verbose": False})
    run("warmup", ["lean"], warm, workdir)  # imports and file cache, not timed
    base = None
    for case, kinds in cases:
        r = run(case, kinds, args, workdir)
        base = base or r["seconds"]
        lean = r["rows"]["lean"]
        print(f"  {case:13s} {lean:>12,} lean rows  {r['seconds']:7.1f} s  {lean / r['seconds']:>11,.0f} rows/s  "
              f"x{r['seconds'] / base:4.2f} vs lean  peak RSS {r['peak_rss_mb']:7.0f} MB  "
              f"disk {r['mb_on_disk']:8.1f} MB  users {r['users']:,}")
    shutil.rmtree(workdir, ignore_errors=True) if args.workdir is None else None
    print(f"  (this process: peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
