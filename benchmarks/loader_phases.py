"""Where the loader's CPU goes, on one thread, next to its ceiling (not part of the tests).

    python benchmarks/loader_phases.py SHARDS [SHARDS ...] [--epochs 8] [--token-budget 32768 | --batch-size 128]
                                       [--batch-order stored|shuffled] [--buffer-row-groups auto|N]

SHARDS: a node's staged shard set (for instance ``loader_bench.py --shards S`` leaves
``S/long`` and ``S/short``). Per epoch, alternating with one ceiling pass (pyarrow's
``read_row_group`` of every row group on one thread, nothing else), the loader's host
path runs buffer by buffer with nothing overlapped (no read-ahead, Arrow's threads
off; glibc's heap kept as in the loader's workers) and each phase is timed with
``time.process_time``: the read (Arrow), Arrow to
numpy (``decode.from_arrow``), the parallel-lists check, the per-buffer set-up
(``Prepared``), the shuffle (``permuted``) and cutting the batches
(``assemble_range``); and, for scale, one bare element gather of every value in the
epoch's order (``gather_cpu``). Prints the median of each, in ms of CPU per epoch, and the
loader's total as a multiple of the ceiling (0.8 of the ceiling needs at most 1.25x
with both sides bound by the same cores).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import pyarrow.parquet as pq  # noqa: E402
import torch  # noqa: E402

from userwise.pipelines.loader.planning.plan import BATCH_ORDERS  # noqa: E402
from userwise.pipelines.shards import manifest as mf  # noqa: E402

PHASES = ("read", "from_arrow", "check", "prepared", "shuffle", "cut")


def ceiling_cpu(root: str) -> float:
    man = mf.load(root)
    t = time.process_time()
    for s in man["shards"]:
        pf = pq.ParquetFile(os.path.join(root, s["path"]))
        for i in range(pf.num_row_groups):
            pf.read_row_group(i, use_threads=False)
    return time.process_time() - t


def loader_epoch_cpu(ds, epoch: int) -> dict:
    from userwise.pipelines.loader.assembly.assemble import Prepared
    from userwise.pipelines.loader.io import decode

    alloc = lambda n: torch.empty(n, dtype=torch.uint8)  # noqa: E731
    acc = dict.fromkeys(PHASES, 0.0)
    acc["samples"] = 0
    pt = time.process_time
    for buf in ds.epochs.plan(epoch).buffers:
        if not len(buf.rgs):
            continue
        t0 = pt()
        table = ds._read_table(buf.rgs)  # the loader's own read (read_threads is off: one thread)
        t1 = pt()
        cols = decode.from_arrow(table, "bench")
        t2 = pt()
        decode.check_groups(cols, "bench")
        t3 = pt()
        prep = Prepared(cols)
        t4 = pt()
        src = prep.permuted(buf.perm)
        t5 = pt()
        for k in range(buf.num_batches):
            acc["samples"] += src.assemble_range(int(buf.bounds[k]), int(buf.bounds[k + 1]), alloc, {}).num_samples
        t6 = pt()
        for name, a, b in zip(PHASES, (t0, t1, t2, t3, t4, t5), (t1, t2, t3, t4, t5, t6)):
            acc[name] += b - a
    return acc


def gather_cpu(ds, epoch: int) -> float:
    """What moving every value once in the epoch's sample order costs by element gathers alone,
    with nothing else timed. Per buffer (read, decoded and indexed untimed): one ``np.take`` of
    every fixed-width value array by its element indexes into a buffer allocated beforehand,
    and for strings one take of their lengths plus one contiguous copy of their bytes. No
    Arrow-to-numpy, checks, index building or batches. Next to the phases it says how much of
    the shuffle is the gathers themselves; for long lists the loader's run copies beat it."""
    import numpy as np

    from userwise.pipelines.jagged import np_ranges
    from userwise.pipelines.loader.io import decode

    total = 0.0
    for buf in ds.epochs.plan(epoch).buffers:
        if not len(buf.rgs):
            continue
        cols = decode.from_arrow(ds._read_table(buf.rgs), "bench")
        perm = np.asarray(buf.perm, np.int64)
        work = []
        for c in cols.values():
            e = perm
            if c.offsets is not None:
                off = np.asarray(c.offsets, np.int64)
                e = np_ranges(off[perm], off[perm + 1] - off[perm])
            if c.str_offsets is not None:
                ln = np.diff(np.asarray(c.str_offsets, np.int64))
                v = np.asarray(c.values)
                work += [(ln, e, np.ones(len(e), ln.dtype)), (v, None, np.ones_like(v))]
            else:
                v = np.asarray(c.values)
                work.append((v, e, np.ones(len(e), v.dtype)))
        t = time.process_time()
        for v, e, out in work:  # into buffers allocated (and touched) before the clock starts
            if e is None:
                np.copyto(out, v)
            else:
                np.take(v, e, out=out, mode="clip")
        total += time.process_time() - t
    return total


def phases(root: str, size: dict, epochs: int, batch_order: str = BATCH_ORDERS[0],
           buffer_row_groups="auto") -> tuple[dict, set]:
    """The median ms of CPU per epoch of the ceiling, each phase, their total and the bare
    gather, over ``epochs`` epochs on one thread (after one warm epoch), and the set of
    samples-per-epoch counts seen. ``size``: the dataset's ``batch_size`` or ``token_budget``.
    Call :func:`userwise.pipelines.loader.workers.pool.keep_heap` first, as :func:`main` does."""
    from userwise.pipelines.loader import UserwiseDataset

    ds = UserwiseDataset(root, **size, world_size=1, rank=0, verify="none", seed=1, device="cpu",
                         batch_order=batch_order,
                         buffer_row_groups=buffer_row_groups if buffer_row_groups == "auto" else int(buffer_row_groups))
    ds.set_read_threads(False)
    loader_epoch_cpu(ds, 0)  # warm: kernels compiled or loaded, files opened
    rows: dict = {k: [] for k in ("ceiling",) + PHASES + ("total", "gather")}
    samples = set()
    for ep in range(epochs):
        rows["ceiling"].append(ceiling_cpu(root))
        acc = loader_epoch_cpu(ds, ep)
        samples.add(acc.pop("samples"))
        for k, v in acc.items():
            rows[k].append(v)
        rows["total"].append(sum(acc.values()))
        rows["gather"].append(gather_cpu(ds, ep))
    return {k: statistics.median(v) * 1e3 for k, v in rows.items()}, samples


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="the loader's CPU per phase on one thread, next to the pyarrow ceiling")
    p.add_argument("shards", nargs="+")
    p.add_argument("--epochs", type=int, default=8)
    size = p.add_mutually_exclusive_group()
    size.add_argument("--token-budget", type=int, default=None, help="tokens per batch (the default: 32768)")
    size.add_argument("--batch-size", type=int, default=None,
                      help="samples per batch instead (loader_bench.py's default cut is 128 samples)")
    p.add_argument("--batch-order", choices=BATCH_ORDERS, default=BATCH_ORDERS[0],
                   help="the order of samples inside a batch (the loader's batch_order)")
    p.add_argument("--buffer-row-groups", default="auto", help="row groups per shuffle buffer (default: auto)")
    a = p.parse_args(argv)
    from userwise.pipelines.loader.workers.pool import keep_heap

    keep_heap()  # as in the loader's worker processes, where the benchmark's epochs decode

    size = {"batch_size": a.batch_size} if a.batch_size else {"token_budget": a.token_budget or 32768}
    for root in a.shards:
        med, samples = phases(root, size, a.epochs, a.batch_order, a.buffer_row_groups)
        print(f"{root} ({', '.join(f'{k} {v}' for k, v in size.items())}): {'/'.join(map(str, sorted(samples)))} samples per epoch; ms of CPU per epoch (median of {a.epochs}) "
              + ", ".join(f"{k} {v:.1f}" for k, v in med.items())
              + f"; loader / ceiling {med['total'] / med['ceiling']:.2f}x"
              + f"; (ceiling + gather alone) / ceiling {(med['ceiling'] + med['gather']) / med['ceiling']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
