"""Do processes that read a Delta table through delta-rs exit cleanly? Side by side, under load.

    .venv/bin/python benchmarks/delta_exit_check.py                  # 120 processes per way
    .venv/bin/python benchmarks/delta_exit_check.py --runs 40 --load 0

A small Delta table partitioned like the samples table (kind, window_end) is
written once with delta-rs. Then ``--runs`` fresh Python processes per way,
the ways alternating, each read the filtered table once and exit:

- ``delta-rs fs``: ``DeltaTable.to_pyarrow_dataset()`` with its default
  filesystem (delta-rs' ``DeltaStorageHandler`` behind ``pyarrow.fs.PyFileSystem``);
- ``pyarrow fs``: ``userwise.pipelines.runtime.delta_io.dataset`` (the same files,
  read through pyarrow's own filesystem: what the jobs use);
- ``write``: ``delta_io.write_small`` then ``delta_io.read_small`` (the
  bookkeeping tables' path).

``--load`` busy processes (default: one per core) keep the machine loaded,
as a CI run does. A process that ends by a signal or prints "terminate
called" counts as an abort. On a 2-core machine the first way aborted 4 of
120 times ("terminate called without an active exception", SIGABRT, as the
window job's driver did twice in one CI run); the second, 0 of 120.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

CHILD = {
    "delta-rs fs": (
        "from deltalake import DeltaTable\n"
        "import pyarrow.dataset as pds\n"
        "t = DeltaTable(P).to_pyarrow_dataset().to_table(filter=pds.field('kind') == 'b')\n"
    ),
    "pyarrow fs": (
        "from userwise.pipelines import delta_io\n"
        "import pyarrow.dataset as pds\n"
        "t = delta_io.dataset(P).to_table(filter=pds.field('kind') == 'b')\n"
    ),
    "write": (
        "import os, pyarrow as pa\n"
        "from userwise.pipelines import delta_io\n"
        "q = os.path.join(os.path.dirname(P), 'log_' + str(os.getpid()))\n"
        "delta_io.write_small(q, pa.table({'date': ['2026-01-01'], 'version': [1]}))\n"
        "t = delta_io.read_small(q)\n"
    ),
}


def _table(root: str) -> str:
    import pyarrow as pa
    from deltalake import write_deltalake

    path = os.path.join(root, "samples")
    n = 20_000
    t = pa.table({"user": pa.array(range(n), pa.int64()), "cost": pa.array([i % 97 for i in range(n)], pa.int64()),
                  "kind": pa.array(["a", "b"] * (n // 2)), "window_end": pa.array(["2026-01-02"] * n)})
    write_deltalake(path, t, partition_by=["kind", "window_end"])
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=120, help="processes per way")
    ap.add_argument("--load", type=int, default=os.cpu_count() or 2, help="busy processes alongside")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as root:
        path = _table(root)
        busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
        aborts = {w: 0 for w in CHILD}
        seen = {w: "" for w in CHILD}
        t0 = time.time()
        try:
            for i in range(args.runs):
                for way, code in CHILD.items():
                    r = subprocess.run([sys.executable, "-c", f"P = {path!r}\n" + code + "print(t.num_rows)\n"],
                                       capture_output=True, text=True)
                    if r.returncode != 0 or "terminate called" in r.stderr:
                        aborts[way] += 1
                        seen[way] = f"exit {r.returncode}: {r.stderr.strip().splitlines()[-1:] or ''}"
                if (i + 1) % 20 == 0:
                    print(f"{i + 1}/{args.runs} rounds, {time.time() - t0:.0f} s: "
                          + ", ".join(f"{w} {a}" for w, a in aborts.items()), file=sys.stderr)
        finally:
            for b in busy:
                b.kill()
    print(f"{'way':<12} {'aborts':>7} {'runs':>5}  last failure")
    for way, a in aborts.items():
        print(f"{way:<12} {a:>7} {args.runs:>5}  {seen[way]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
