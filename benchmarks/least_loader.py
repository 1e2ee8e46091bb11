"""How close to the pyarrow ceiling any loader can come here (not part of the tests).

    python benchmarks/least_loader.py [--shards DIR] [--profiles short long] [--workers 1 2] [--samples N]
                                      [--repeats 12] [--token-budget 32768] [--json out.json] [--plot out.png]
    python benchmarks/least_loader.py --merge run1.json run2.json --json mean.json [--plot out.png]

``loader_bench.py`` measures the loader against pyarrow reading the same files and nothing
else (target: 0.8 of it). This script asks what the least a loader must do costs on the same
machine, so that a shortfall can be told apart from a limit. Side by side, each epoch right
next to one ceiling pass (``loader_bench.ceiling``: the same function), with the same worker
processes, read-ahead lanes, row-group shuffle, 2-row-group buffers and token-budget cut as
the loader:

- ``read``: worker processes that only read their buffers with pyarrow and wrap the Arrow
  buffers as numpy arrays (no copy), sending one message per buffer. What the processes,
  threads and hand-offs cost with no batch made at all.
- ``take`` and ``compiled``: ``read`` plus the one thing every shuffling loader must do:
  each batch's samples (drawn per buffer by a seeded permutation, cut by the token budget,
  sorted by row as the loader's default ``batch_order="stored"``) gathered into one
  shared-memory slot per batch: every value of every column moved once, with its offsets.
  ``take`` does it with numpy (element indexes, then ``np.take`` per column; strings as
  lengths plus byte runs), ``compiled`` with numba loops, one call per group and dtype; both
  write the same bytes. No checks, no request or impression indexes, no meta, no batch
  object: the trainer gets a slot number, wraps it as a tensor and hands it back.
- ``loader``: ``UserwiseLoader`` itself, as ``loader_bench.py`` runs it.

Reported per profile and worker count: the median epoch and the median per-pair share of the
ceiling of each. ``read`` is the floor of the processes and pyarrow; what ``take`` and
``compiled`` add is what moving the values costs here. Where both stay below 0.8, a loader
that reads through pyarrow and shuffles samples needs a cheaper way to move them than either.
Their element gathers suit short lists (the ``short`` profile); for long lists the loader's
run copies beat them, so there they are not a bound.
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import shared_memory

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
from loader_bench import PROFILES, ceiling, shard_set  # noqa: E402

MODES = ("read", "take", "compiled", "loader")
SLOTS = 4  # batches a worker holds ready (the loader's worker_queue)
LANES, AHEAD = 2, 3  # read-ahead threads and reads in flight per worker (the loader's READ_LANES, READ_AHEAD)


def wrap(table: pa.Table) -> dict:
    """name -> (list offsets or None, string offsets or None, values): views of Arrow's buffers."""
    cols = {}
    for name, col in zip(table.column_names, table.columns):
        a = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
        off = None
        if pa.types.is_list(a.type):
            off = np.frombuffer(a.buffers()[1], np.int32)[a.offset: a.offset + len(a) + 1]
            a = a.values
        b = a.buffers()
        if pa.types.is_string(a.type):
            cols[name] = (off, np.frombuffer(b[1], np.int32)[a.offset: a.offset + len(a) + 1], np.frombuffer(b[2], np.uint8))
        else:
            dt = np.int32 if a.type == pa.date32() else a.type.to_pandas_dtype()
            cols[name] = (off, None, np.frombuffer(b[1], dt)[a.offset: a.offset + len(a)])
    return cols


def _group(name: str, off) -> str:
    """Which parallel lists a column belongs to (sample: one value per sample)."""
    return "sample" if off is None else name.split("_")[0]


def _kernels():
    """The gathers, compiled (numba, as the loader's kernels): one call per (group, dtype) of a
    batch moves every value of those columns, so the batch costs a few calls, not a few per column."""
    import numba

    @numba.njit(nogil=True)
    def rows(idx, srcs, outs):  # sample columns: one value per sample
        for c in range(len(srcs)):
            s, d = srcs[c], outs[c]
            for i in range(idx.shape[0]):
                d[i] = s[idx[i]]

    @numba.njit(nogil=True)
    def lists(idx, off, srcs, outs):  # the parallel lists of one group: each sample's run, element by element
        for c in range(len(srcs)):
            s, d = srcs[c], outs[c]
            p = 0
            for i in range(idx.shape[0]):
                for k in range(off[idx[i]], off[idx[i] + 1]):
                    d[p] = s[k]
                    p += 1

    @numba.njit(nogil=True)
    def offsets(idx, off, out):  # the batch's offsets of a group; returns its element count
        out[0] = 0
        for i in range(idx.shape[0]):
            out[i + 1] = out[i] + off[idx[i] + 1] - off[idx[i]]
        return out[idx.shape[0]]

    @numba.njit(nogil=True)
    def strings(idx, off, soff, data, out_soff, out):  # a list-of-strings column: bytes and offsets
        p = 0
        j = 0
        out_soff[0] = 0
        for i in range(idx.shape[0]):
            for e in range(off[idx[i]], off[idx[i] + 1]):
                for k in range(soff[e], soff[e + 1]):
                    out[p] = data[k]
                    p += 1
                j += 1
                out_soff[j] = p

    @numba.njit(nogil=True)
    def string_bytes(idx, off, soff):  # bytes the column's strings take in the batch
        n = 0
        for i in range(idx.shape[0]):
            n += soff[off[idx[i] + 1]] - soff[off[idx[i]]]
        return n

    return rows, lists, offsets, strings, string_bytes


def prepare(cols: dict) -> list:
    """A buffer's columns by group (in column order) and dtype: [(group offsets or None,
    [value arrays of one dtype, ...], [(string offsets, bytes), ...]), ...]. Both gathers write
    a batch in this order: per group its offsets, its numeric columns, then its strings."""
    groups: dict = {}
    for name, (off, soff, v) in cols.items():
        g = groups.setdefault(_group(name, off), {"off": off, "num": {}, "str": []})
        if soff is None:
            g["num"].setdefault(v.dtype.str, []).append(v)
        else:
            g["str"].append((soff, v))
    return [(g["off"], [tuple(vs) for vs in g["num"].values()], g["str"]) for g in groups.values()]


class _Slot:
    """Arrays laid one after another (64-byte aligned) into a batch's slot."""

    def __init__(self, slot: np.ndarray):
        self.slot, self.pos = slot, 0

    def put(self, n: int, dt) -> np.ndarray:
        self.pos = (self.pos + 63) // 64 * 64
        v = self.slot[self.pos: self.pos + n * np.dtype(dt).itemsize].view(dt)
        self.pos += v.nbytes
        return v


class TakeGather:
    """One batch gathered into a slot with numpy: per group, the element indexes of the batch's
    samples (one compiled pass), then one ``np.take`` per column; strings as lengths plus byte
    runs. A few numpy calls per column and batch."""

    def __init__(self):
        from userwise.pipelines.loader import _segcopy_numba as nb
        from userwise.pipelines.loader import segcopy

        segcopy.seg_copy(np.zeros(4, np.uint8), np.zeros(1, np.int64), np.ones(1, np.int64), np.zeros(4, np.uint8))
        self.ranges, self.copy = nb.ranges, segcopy.seg_copy
        self.e = np.empty(1 << 16, np.int64)

    prepare = staticmethod(prepare)

    def __call__(self, prepared: list, idx: np.ndarray, slot: np.ndarray) -> int:
        out = _Slot(slot)
        for off, blocks, strs in prepared:
            if off is None:
                e = idx
            else:
                st = off[idx].astype(np.int64)
                ln = off[idx + 1] - st
                new = out.put(len(idx) + 1, np.int64)
                new[0] = 0
                np.cumsum(ln, out=new[1:])
                if len(self.e) < new[-1]:
                    self.e = np.empty(2 * int(new[-1]), np.int64)
                e = self.e[: self.ranges(st, ln, self.e)]
            for vs in blocks:
                for v in vs:
                    np.take(v, e, out=out.put(len(e), v.dtype))
            for soff, data in strs:
                s0 = soff[e].astype(np.int64)
                sl = soff[e + 1] - s0
                so = out.put(len(e) + 1, np.int64)
                so[0] = 0
                np.cumsum(sl, out=so[1:])
                self.copy(data, s0, sl, out.put(int(so[-1]), np.uint8))
        return out.pos


class CompiledGather:
    """One batch gathered into a slot by compiled loops: per (group, dtype) one call moves every
    value of those columns (no per-column Python); the same bytes as :class:`TakeGather`."""

    def __init__(self):
        self.rows, self.lists, self.offsets, self.strings, self.string_bytes = _kernels()

    prepare = staticmethod(prepare)

    def __call__(self, prepared: list, idx: np.ndarray, slot: np.ndarray) -> int:
        out = _Slot(slot)
        for off, blocks, strs in prepared:
            if off is None:
                for vs in blocks:
                    self.rows(idx, vs, tuple(out.put(len(idx), vs[0].dtype) for _ in vs))
                one = np.arange(len(strs[0][0]), dtype=np.int32) if strs else None
                for soff, data in strs:  # a string per sample: the lists' path with lists of one
                    self.strings(idx, one, soff, data, out.put(len(idx) + 1, np.int64),
                                 out.put(int(self.string_bytes(idx, one, soff)), np.uint8))
                continue
            n = int(self.offsets(idx, off, out.put(len(idx) + 1, np.int64)))
            for vs in blocks:
                self.lists(idx, off, vs, tuple(out.put(n, vs[0].dtype) for _ in vs))
            for soff, data in strs:
                self.strings(idx, off, soff, data, out.put(n + 1, np.int64),
                             out.put(int(self.string_bytes(idx, off, soff)), np.uint8))
        return out.pos


GATHERS = {"take": TakeGather, "compiled": CompiledGather}
_RGS: dict = {}


def plan(files: list, epoch: int):
    """Buffers of 2 row groups in a seeded row-group order (one file's consecutive picks)."""
    key = tuple(files)
    if key not in _RGS:  # footers read once per process
        _RGS[key] = [(f, i) for f in files for i in range(pq.ParquetFile(f).num_row_groups)]
    rgs = _RGS[key]
    order = np.random.default_rng(epoch).permutation(len(rgs))
    return [[rgs[j] for j in order[k: k + 2]] for k in range(0, len(order), 2)]


def worker(w: int, workers: int, mode: str, files, budget, cmd, out, free, shm_name, slot_bytes):
    from userwise.pipelines.loader.loader import keep_heap

    keep_heap()  # as the loader's workers
    shm = shared_memory.SharedMemory(shm_name)
    mem = np.ndarray((SLOTS, slot_bytes), np.uint8, buffer=shm.buf)
    gather = GATHERS[mode]() if mode in GATHERS else None
    handles: dict = {}

    def read(buf):
        key = (threading.get_ident(), buf[0][0])
        pf = handles.get(key)
        if pf is None:
            pf = handles[key] = pq.ParquetFile(buf[0][0], memory_map=True)
        return wrap(pf.read_row_groups([i for _, i in buf], use_threads=False))

    pool = ThreadPoolExecutor(LANES)
    slots = collections.deque(range(SLOTS))
    while True:
        epoch = cmd.recv()
        if epoch is None:
            break
        rng = np.random.default_rng((epoch, w))
        mine = [b for i, b in enumerate(plan(files, epoch)) if i % workers == w]
        ahead: collections.deque = collections.deque()
        for n in range(len(mine)):
            while len(ahead) < AHEAD and n + len(ahead) < len(mine):
                ahead.append(pool.submit(read, mine[n + len(ahead)]))
            cols = ahead.popleft().result()
            if gather is not None:
                prepared = gather.prepare(cols)
                cost = cols["cost"][2]
                perm = rng.permutation(len(cost))
                cum = np.cumsum(cost[perm])
                bounds = np.concatenate([[0], np.searchsorted(cum, np.arange(budget, cum[-1], budget)), [len(cost)]])
                for a, b in zip(bounds[:-1], bounds[1:]):
                    if b > a:
                        while not slots:
                            slots.append(free.recv())
                        s = slots.popleft()
                        out.send((s, gather(prepared, np.sort(perm[a:b]), mem[s]), int(b - a)))
            out.send(("buffer", len(cols["cost"][2])))
        out.send(None)
    shm.close()


class Least:
    """``workers`` processes of ``mode`` ("read", "take" or "compiled"); ``epoch(e)`` returns samples seen."""

    def __init__(self, mode: str, files: list, budget: int, workers: int, slot_bytes: int):
        ctx = mp.get_context("fork")
        self.files, self.workers, self.mode = files, workers, mode
        self.pipes, self.procs = [], []
        for w in range(workers):
            sub = shared_memory.SharedMemory(create=True, size=SLOTS * slot_bytes)
            c1, c2 = ctx.Pipe()
            o1, o2 = ctx.Pipe()
            f1, f2 = ctx.Pipe()
            p = ctx.Process(target=worker, args=(w, workers, mode, files, budget, c2, o2, f2, sub.name, slot_bytes), daemon=True)
            p.start()
            self.pipes.append((c1, o1, f1, sub, np.ndarray((SLOTS, slot_bytes), np.uint8, buffer=sub.buf)))
            self.procs.append(p)

    def epoch(self, e: int) -> int:
        import torch

        nbuf = len(plan(self.files, e))
        for c, *_ in self.pipes:
            c.send(e)
        samples = 0
        for i in range(nbuf):  # buffers in epoch order, from the worker that made each
            _, o, f, _, mem = self.pipes[i % self.workers]
            while True:
                r = o.recv()
                if r[0] == "buffer":
                    if self.mode == "read":
                        samples += r[1]
                    break
                s, used, k = r
                batch = torch.from_numpy(mem[s, :used])  # what a trainer would get: a view of the slot
                samples += k
                del batch
                f.send(s)
        for _, o, *_ in self.pipes:
            assert o.recv() is None
        return samples

    def close(self):
        for c, *_ in self.pipes:
            c.send(None)
        for p in self.procs:
            p.join(10)
        subs = [sub for *_, sub, _ in self.pipes]
        self.pipes.clear()  # the slot views go first, then their segments
        for sub in subs:
            sub.close()
            sub.unlink()


def bench(root: str, workers: int, repeats: int, budget: int) -> dict:
    from userwise.pipelines.loader import UserwiseDataset, UserwiseLoader

    man = json.load(open(os.path.join(root, "manifest.json")))
    files = [os.path.join(root, s["path"]) for s in man["shards"]]
    slot_bytes = 4 * sum(os.path.getsize(f) for f in files) // max(1, len(plan(files, 0))) + (16 << 20)
    ds = UserwiseDataset(root, token_budget=budget, world_size=1, rank=0, verify="none", seed=1, device="cpu")
    ld = UserwiseLoader(ds, num_workers=workers, device="cpu")
    runners = {m: Least(m, files, budget, workers, slot_bytes) for m in MODES[:-1]}

    def loader_epoch(_e):
        return sum(b.num_samples for b in ld)

    run = {**{m: r.epoch for m, r in runners.items()}, "loader": loader_epoch}
    total = sum(s["rows"] for s in man["shards"])
    for name, f in run.items():  # warm: workers started, kernels loaded, page cache
        got = f(0)
        if got != total:
            raise SystemExit(f"{name}: {got} samples in an epoch, the shards have {total}")
    epoch = {k: [] for k in run}
    share = {k: [] for k in run}
    for r in range(1, repeats + 1):
        for name, f in run.items():
            c = ceiling(root)["s"]
            t = time.perf_counter()
            f(r)
            el = time.perf_counter() - t
            epoch[name].append(el)
            share[name].append(c / el)
    for m in runners.values():
        m.close()
    del ld
    return {"workers": workers, "samples": total,
            **{f"{k}_epoch_ms": statistics.median(v) * 1e3 for k, v in epoch.items()},
            **{f"{k}_share": statistics.median(v) for k, v in share.items()},
            "pairs": share}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="the least loader's share of the pyarrow ceiling, next to the loader's")
    p.add_argument("--shards", default=None, help="shard sets under DIR/<profile> (made as loader_bench.py makes them)")
    p.add_argument("--profiles", nargs="+", default=["short"], choices=sorted(PROFILES))
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeats", type=int, default=12)
    p.add_argument("--token-budget", type=int, default=32768)
    p.add_argument("--samples", type=int, default=None,
                   help="samples of a shard set made here (default: loader_bench.py's, 40000 short and 32000 long)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--plot", help="write a bar chart (PNG) of the shares here")
    p.add_argument("--merge", nargs="+", metavar="JSON",
                   help="run nothing: average these runs' medians into --json / --plot")
    a = p.parse_args(argv)
    if a.merge:
        return write(merge([json.load(open(f)) for f in a.merge]), a)
    import tempfile

    out = {"cpus": len(os.sched_getaffinity(0)), "token_budget": a.token_budget, "profiles": {}}
    with tempfile.TemporaryDirectory(prefix="least-loader-") as tmp:
        for prof in a.profiles:
            root = os.path.join(a.shards or tmp, prof)
            shard_set(prof, root, a.samples)
            out["profiles"][prof] = []
            for w in a.workers:
                r = bench(root, w, a.repeats, a.token_budget)
                out["profiles"][prof].append(r)
                print(f"{prof}, {w} worker(s), {r['samples']} samples, median of {a.repeats} paired epochs: "
                      + "; ".join(f"{k} {r[f'{k}_epoch_ms']:.1f} ms = {r[f'{k}_share']:.2f} of the ceiling"
                                  for k in MODES), flush=True)
    return write(out, a)


def write(out: dict, a) -> int:
    """The results to --json and --plot (where given)."""
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    if a.plot:
        plot(out, a.plot)
    return 0


def merge(runs: list) -> dict:
    """The mean of each figure over runs (per profile and worker count); every run's pairs kept."""
    out = {"cpus": runs[0]["cpus"], "token_budget": runs[0]["token_budget"], "runs_averaged": len(runs), "profiles": {}}
    for prof, first in runs[0]["profiles"].items():
        merged = []
        for i, r0 in enumerate(first):
            rs = [r["profiles"][prof][i] for r in runs]
            if any(r["workers"] != r0["workers"] for r in rs):
                raise SystemExit(f"{prof}: the runs measured different worker counts")
            m = {k: statistics.mean(r[k] for r in rs) for k in r0 if k.endswith(("_share", "_epoch_ms"))}
            merged.append({"workers": r0["workers"], "samples": r0["samples"], **m,
                           "pairs": {k: [x for r in rs for x in r["pairs"][k]] for k in r0["pairs"]}})
        out["profiles"][prof] = merged
    return out


def plot(out: dict, path: str) -> None:
    """One panel per profile: per worker count, each mode's median share of the ceiling."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    profs = list(out["profiles"])
    fig, axes = plt.subplots(1, len(profs), figsize=(5.5 * len(profs), 3.6), squeeze=False)
    labels = {"read": "read only", "take": "least: numpy takes", "compiled": "least: compiled", "loader": "UserwiseLoader"}
    for ax, prof in zip(axes[0], profs):
        runs = out["profiles"][prof]
        width = 0.8 / len(MODES)
        for k, m in enumerate(MODES):
            xs = [i + (k - (len(MODES) - 1) / 2) * width for i in range(len(runs))]
            ys = [r[f"{m}_share"] for r in runs]
            bars = ax.bar(xs, ys, width, label=labels[m])
            for b, y in zip(bars, ys):
                ax.text(b.get_x() + b.get_width() / 2, y + 0.01, f"{y:.2f}", ha="center", fontsize=7)
        ax.axhline(0.8, color="k", ls="--", lw=0.8)
        ax.set_xticks(range(len(runs)), [f"{r['workers']} worker{'s' if r['workers'] > 1 else ''}" for r in runs])
        ax.set_ylabel("share of the pyarrow ceiling")
        ax.set_title(f"{prof} samples ({out['cpus']} cores)")
        ax.set_ylim(0, 1.25)
    axes[0][-1].legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
