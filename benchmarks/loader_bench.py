"""Loader speed against two baselines run side by side (not part of the tests).

    python benchmarks/loader_bench.py [--samples 40000] [--batch-size 128 | --token-budget 32768] [--workers 0 1 2]
                                      [--repeats 7] [--device cpu|cuda] [--zero-copy on|off] [--json out.json] [--plot out.png]
                                      [--before earlier.json] [--shards DIR] [--buffer-row-groups auto|N]
                                      [--batch-order stored|shuffled]
    python benchmarks/loader_bench.py --lengths 1000 4000 16000 [--length-batch-samples 32] [--length-events 8000000]
                                      [--workers 2] [--no-petastorm] [--no-torch-loader] [--json out.json]
    python benchmarks/loader_bench.py --merge run1.json run2.json [--json mean.json --plot mean.png] [--before ...]

1. Ceiling: pyarrow reading the same shard files into memory and nothing
   else (``pq.ParquetFile.read_row_group`` over every row group, every column
   the loader reads). The loader's samples/s and events/s are reported as a
   share of it (target >= 0.8).
2. Point-wise baseline: the same data expanded to fat point-wise rows (every
   impression carries its visible history) in Parquet, read by a plain
   ``torch.utils.data.Dataset`` + ``DataLoader`` (per-row ``__getitem__``,
   default-style collate) with the same number of workers. Reported:
   impressions delivered per second, each with its history, loader /
   point-wise (target >= 20x).
3. petastorm (``benchmarks/petastorm_baseline.py``, run with the petastorm
   environment's Python, ``.venv-petastorm``): ``make_batch_reader`` over the
   same shard files, the same number of workers (at least 1), list columns
   padded to their longest list as petastorm requires. Reported: the loader's
   samples/s over petastorm's (``--no-petastorm`` skips it).
4. torch's own loader (``--no-torch-loader`` skips it): the same ``UserwiseDataset``
   (same arguments) under ``torch.utils.data.DataLoader`` with ``batch_size=None`` (the
   dataset yields batches), ``pin_memory=True`` (in effect only where CUDA is),
   ``persistent_workers`` with workers, the same number of workers, and a
   ``worker_init_fn`` that gives each worker what the loader's own workers get (Arrow's
   decode threads only when there are fewer workers than cores, ``keep_heap``), so the
   row measures the transport (worker pool, rings, pinned copies), not a setting. An
   IterableDataset under DataLoader splits itself: worker w of k takes buffers
   ``i % k == w`` (``get_worker_info``), and the DataLoader takes their batches in turn.
   With ``--device cuda`` each batch is then copied with ``.to(device, non_blocking=True)``
   in the loop, as a user would. torchdata's ``StatefulDataLoader`` gets the same row
   when it is importable. Reported: its share of the ceiling and its samples/s over the
   loader's, both medians of per-repeat pairs (the ceiling, the loader and it are timed
   one after another in each repeat, the loader and it in alternating order): the run's
   ``torch_dataloader`` and ``torch_vs_loader`` (``stateful_dataloader``,
   ``stateful_vs_loader``). Each of its epochs begins with ``set_epoch`` as a user's loop
   does. Why the loader keeps its own workers: docs/loader-design.md.

Steady state: one loader per worker count is built and run for one warm-up
epoch (worker start-up, first decode; reported separately as ``startup_s``),
then ``--repeats`` epochs are timed, each right next to one ceiling pass (so
both see the same machine load); the reported share is the median of the
per-pair ratios. The point-wise DataLoader is timed from its first batch
(start-up excluded, ``persistent_workers`` with workers) for ``--pointwise-cap-s``
seconds per repeat. ``cpu_efficiency`` (ceiling CPU seconds / loader CPU
seconds, workers included) is a load-independent companion figure. Keep sizes moderate on a shared machine (the defaults are
about 63 and 12 MB of shards); the ratios are what matters. ``--merge`` runs
nothing: it averages earlier runs' JSON (each run's medians, per profile and
worker count; the pairs of all runs are kept) into one, for ``--json``/``--plot``;
with neither, into the published result, ``benchmarks/results/loader_bench.json`` and
``.png``. A single run prints its JSON unless ``--json`` is given.

Long samples (``--lengths``, issue #56): one profile ``L<n>`` per length, whose every
sample holds about ``n`` events (a user with ``n`` events and a history limit of ``n``:
the stored range ends at the last request, 0.75n-n events) and 1-20 impressions. The
token budget scales with the length (``--length-batch-samples`` x n: about that many
samples a batch); each profile holds about ``--length-events`` events in all (8M by
default: 8000, 2000 and 500 samples at 1K, 4K and 16K) in row groups of about as many
events as the long profile's (``409600 // n`` rows, so a moderate set has some twenty;
preshard's 128 MB cut makes larger ones at full size). Each length profile also gets
the one-thread phase breakdown of :mod:`loader_phases` (``phases``: ms of CPU per epoch,
``limiting_phase``: the largest) and a ``verdict``: whether the loader reaches 0.8 of the
ceiling with 2 workers (the largest worker count run, without 2), or where it stops.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
import warnings

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import torch  # noqa: E402

from userwise.pipelines.loader.planning.plan import BATCH_ORDERS  # noqa: E402
from userwise.pipelines.shards import manifest as mf  # noqa: E402
from userwise.pipelines.tools.shardgen import write_shard_set  # noqa: E402


def ceiling(root: str, columns=None) -> dict:
    """pyarrow reading every row group of the node's shards into memory (nothing else)."""
    man = mf.load(root)
    c0 = cpu_now()
    t = time.perf_counter()
    rows = events = 0
    for s in man["shards"]:
        pf = pq.ParquetFile(os.path.join(root, s["path"]))
        for i in range(pf.num_row_groups):
            rg = pf.read_row_group(i, columns=columns)
            rows += rg.num_rows
        events += s["events"]
    el = time.perf_counter() - t
    return {"samples": rows, "events": events, "s": el, "cpu_s": cpu_now() - c0}


def cpu_now() -> float:
    """CPU seconds used so far by this process and its children (live workers and reaped ones)."""
    t = os.times()
    cpu = time.process_time() + t.children_user + t.children_system  # this process: finer than os.times' ticks
    try:
        import psutil

        for c in psutil.Process().children(recursive=True):
            try:
                ct = c.cpu_times()
                cpu += ct.user + ct.system
            except psutil.Error:
                pass
    except ImportError:  # pragma: no cover
        pass
    return cpu


def loader_epoch(ld) -> dict:
    c0 = cpu_now()
    t = time.perf_counter()
    samples = events = imps = 0
    for b in ld:
        samples += b.num_samples
        events += int(b.meta.get("events", 0))
        imps += int(b.meta.get("impressions", 0))
    if ld.device.type == "cuda":  # the last copies landed
        torch.cuda.synchronize(ld.device)
    return {"samples": samples, "events": events, "impressions": imps, "s": time.perf_counter() - t,
            "cpu_s": cpu_now() - c0}


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


def pointwise_loader(path: str, batch_size: int, workers: int):
    return torch.utils.data.DataLoader(PointwiseDataset(path), batch_size=batch_size, num_workers=workers,
                                       collate_fn=_collate, shuffle=True, persistent_workers=workers > 0)


def pointwise_rate(dl, cap_s: float) -> dict:
    """Impressions/s from the first batch on (start-up excluded), for about cap_s seconds."""
    t0 = time.perf_counter()
    it = iter(dl)
    n = 0
    t = None
    while True:
        try:
            b = next(it)
        except StopIteration:
            it = iter(dl)
            continue
        if t is None:
            t, startup = time.perf_counter(), time.perf_counter() - t0
            continue
        n += len(b["item_id"])
        if time.perf_counter() - t > cap_s:
            break
    del it
    return {"impressions_per_s": n / (time.perf_counter() - t), "startup_s": startup}


def torch_loaders(root: str, size: dict, workers: int, device: str, buffer_row_groups, batch_order: str) -> dict:
    """torch's own loaders over the same dataset (a fresh ``UserwiseDataset``, the loader's
    arguments): ``DataLoader``, and torchdata's ``StatefulDataLoader`` when it is importable."""
    from userwise.pipelines.loader import UserwiseDataset

    kinds = {"torch_dataloader": torch.utils.data.DataLoader}
    with contextlib.suppress(ImportError):
        from torchdata.stateful_dataloader import StatefulDataLoader

        kinds["stateful_dataloader"] = StatefulDataLoader
    out = {}
    for name, cls in kinds.items():
        ds = UserwiseDataset(root, world_size=1, rank=0, verify="none", device=device, gds=False,
                             buffer_row_groups=buffer_row_groups, batch_order=batch_order, **size)
        out[name] = cls(ds, batch_size=None, num_workers=workers, pin_memory=True, persistent_workers=workers > 0,
                        worker_init_fn=_torch_worker_init if workers else None)
    return out


def _torch_worker_init(_worker: int) -> None:
    """What the loader's own workers do first (``workers.pool.worker_main``): Arrow's decode
    threads only where cores are left over, glibc keeps freed buffers (``keep_heap``).
    torch's worker loop already sets one intra-op thread."""
    from userwise.pipelines.loader.workers.pool import cores, keep_heap

    info = torch.utils.data.get_worker_info()
    keep_heap()
    info.dataset.set_read_threads(info.num_workers < cores())


def torch_epoch(dl, device: str, epoch: int) -> dict:
    """Epoch ``epoch`` of torch's loader, begun with ``set_epoch`` as a user's loop does (with
    persistent workers it reaches only the trainer's copy of the dataset: the workers' copies
    plan epoch 0 again, which spares them the planning the loader does); on CUDA each batch
    goes to the device as a user would copy it."""
    dev = torch.device(device)
    dl.dataset.set_epoch(epoch)
    c0 = cpu_now()
    t = time.perf_counter()
    samples = events = imps = 0
    with warnings.catch_warnings():  # pin_memory=True without an accelerator: torch warns and does not pin
        warnings.filterwarnings("ignore", message=".*pin_memory.*")
        for b in dl:
            samples += b.num_samples
            events += int(b.meta.get("events", 0))
            imps += int(b.meta.get("impressions", 0))
            if dev.type == "cuda":
                b = b.to(dev, non_blocking=True)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return {"samples": samples, "events": events, "impressions": imps, "s": time.perf_counter() - t,
            "cpu_s": cpu_now() - c0}


PETASTORM_PY = os.path.join(REPO, ".venv-petastorm", "bin", "python")


def petastorm_rate(root: str, workers: int, cap_s: float, python: str) -> dict:
    """One run of benchmarks/petastorm_baseline.py over the node's shards (its own process)."""
    import subprocess

    r = subprocess.run([python, os.path.join(REPO, "benchmarks", "petastorm_baseline.py"), os.path.join(root, "node=0"),
                        "--workers", str(max(1, workers)), "--cap-s", str(cap_s)],
                       capture_output=True, text=True, timeout=600)
    if r.returncode:
        raise SystemExit(f"petastorm baseline failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def run(root: str, pw: str, batch_size: int, workers: int, repeats: int, cap_s: float, device: str = "cpu",
        zero_copy: bool = True, buffer_row_groups="auto", token_budget: int | None = None,
        petastorm: str | None = None, batch_order: str = "stored", torch_loader: bool = True) -> dict:
    from userwise.pipelines.loader import UserwiseDataset, UserwiseLoader

    size = {"batch_size": batch_size} if token_budget is None else {"token_budget": token_budget}
    ds = UserwiseDataset(root, world_size=1, rank=0, verify="none", device=device, gds=False,
                         buffer_row_groups=buffer_row_groups, batch_order=batch_order, **size)
    ld = UserwiseLoader(ds, num_workers=workers, device=device, zero_copy=zero_copy)
    warm = loader_epoch(ld)  # worker start-up + first decode
    tdl = torch_loaders(root, size, workers, device, buffer_row_groups, batch_order) if torch_loader else {}
    twarm = {k: torch_epoch(dl, device, 0) for k, dl in tdl.items()}
    ceil, lds, pairs = [], [], []
    tds: dict[str, list] = {k: [] for k in tdl}
    for i in range(repeats):
        c = ceiling(root)
        if i % 2:  # torch's loaders first every other repeat: neither side always runs second
            for k, dl in tdl.items():
                tds[k].append(torch_epoch(dl, device, i + 1))
        r = loader_epoch(ld)
        if not i % 2:
            for k, dl in tdl.items():
                tds[k].append(torch_epoch(dl, device, i + 1))
        ceil.append(c)
        lds.append(r)
        pairs.append(c["s"] / r["s"])  # same samples and events: share of the ceiling's rate
    steady = statistics.median(r["s"] for r in lds)
    getattr(ld, "close", lambda: None)()
    torch_rows = {}
    for k, ts in tds.items():
        if ts[0]["samples"] != lds[0]["samples"]:
            raise SystemExit(f"{k} delivered {ts[0]['samples']} samples per epoch, the loader {lds[0]['samples']}")
        t_s = statistics.median(t["s"] for t in ts)
        vs = [r["s"] / t["s"] for r, t in zip(lds, ts)]  # per repeat: its samples/s over the loader's
        torch_rows[k] = {"samples_per_s": ts[0]["samples"] / t_s, "events_per_s": ts[0]["events"] / t_s,
                         "epoch_s": [t["s"] for t in ts], "startup_s": max(0.0, twarm[k]["s"] - t_s),
                         "share_of_ceiling": statistics.median(c["s"] / t["s"] for c, t in zip(ceil, ts)),
                         "share_of_ceiling_pairs": [c["s"] / t["s"] for c, t in zip(ceil, ts)],
                         "cpu_efficiency": _ratio(statistics.median(c["cpu_s"] for c in ceil),
                                                  statistics.median(t["cpu_s"] for t in ts)),
                         "pinned": torch.cuda.is_available(), "persistent_workers": workers > 0}
        torch_rows[k.replace("_dataloader", "_vs_loader")] = statistics.median(vs)
        torch_rows[k.replace("_dataloader", "_vs_loader_pairs")] = vs
    del tdl
    dl = pointwise_loader(pw, batch_size, workers)
    pws = [pointwise_rate(dl, cap_s) for _ in range(max(1, repeats // 2))]
    del dl
    pts = [petastorm_rate(root, workers, cap_s, petastorm) for _ in range(2)] if petastorm else []
    lr = lds[0]
    pw_rate = statistics.median(p["impressions_per_s"] for p in pws)
    ld_imps = statistics.median(r["impressions"] / r["s"] for r in lds)
    ceil_s = statistics.median(c["s"] for c in ceil)
    return {
        "workers": workers, "device": device, "zero_copy": zero_copy, "buffer_row_groups": ds.buffer_row_groups,
        "batch_order": batch_order,
        "batches_per_epoch": len(ld),
        "loader": {"samples_per_s": lr["samples"] / steady, "events_per_s": lr["events"] / steady,
                   "impressions_per_s": ld_imps, "epoch_s": [r["s"] for r in lds],
                   "startup_s": max(0.0, warm["s"] - steady)},
        "ceiling": {"samples_per_s": ceil[0]["samples"] / ceil_s, "events_per_s": ceil[0]["events"] / ceil_s,
                    "pass_s": [c["s"] for c in ceil]},
        "pointwise": {"impressions_per_s": pw_rate, "startup_s": statistics.median(p["startup_s"] for p in pws)},
        "share_of_ceiling": statistics.median(pairs),  # samples/s and events/s alike (same data per pass)
        "share_of_ceiling_pairs": pairs,
        # load-independent view: CPU seconds (all processes) per pass, ceiling / loader
        "cpu_efficiency": _ratio(statistics.median(c["cpu_s"] for c in ceil), statistics.median(r["cpu_s"] for r in lds)),
        "impressions_vs_pointwise": ld_imps / pw_rate,
        **torch_rows,
        **({"petastorm": {"samples_per_s": statistics.median(p["samples_per_s"] for p in pts),
                          "events_per_s": statistics.median(p["events_per_s"] for p in pts),
                          "startup_s": statistics.median(p["startup_s"] for p in pts), "workers": pts[0]["workers"]},
            "samples_vs_petastorm": lr["samples"] / steady / statistics.median(p["samples_per_s"] for p in pts)}
           if pts else {}),
    }


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None  # a run too short for the CPU clocks' resolution


def plot(series: list[tuple[str, dict]], path: str) -> None:
    """Bar chart per worker count: share of the ceiling and x point-wise, one bar per
    series (a sample-size profile, or an earlier run's JSON given with ``--before``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workers = sorted({r["workers"] for _, res in series for r in res["runs"]})
    x = list(range(len(workers)))
    k = len(series)
    wd = 0.8 / k
    colors = ["#4878d0", "#ee854a", "#6acc64", "#bbbbbb"]
    peta = "samples_vs_petastorm" in series[0][1]["runs"][0]  # an earlier run without it draws no bar there
    tdl = "torch_vs_loader" in series[0][1]["runs"][0]
    n = 2 + peta + tdl
    fig, axes = plt.subplots(1, n, figsize=(5 * n, 4))
    specs = [(axes[0], "share_of_ceiling", 0.8, "share of pyarrow ceiling\n(samples/s, events/s)", "{:.2f}"),
             (axes[1], "impressions_vs_pointwise", 20, "impressions/s vs point-wise\nDataset+DataLoader", "{:.0f}x")]
    if peta:  # no target: petastorm is a reference, the targets are the other two
        specs.append((axes[2], "samples_vs_petastorm", None,
                      "samples/s vs petastorm\nmake_batch_reader (padded lists)", "{:.0f}x"))
    if tdl:  # dashed: within 10% of the loader (docs/loader-design.md, Why not torch's DataLoader)
        specs.append((axes[-1], "torch_vs_loader", 0.9, "torch DataLoader (same dataset) samples/s\n"
                      "over the loader's", "{:.2f}"))
    for ax, key, target, title, fmt in specs:
        top = target or 0
        for j, (label, res) in enumerate(series):
            by = {r["workers"]: r.get(key, 0) for r in res["runs"]}
            vals = [by.get(w, 0) for w in workers]
            pos = [i - 0.4 + wd * (j + 0.5) for i in x]
            ax.bar(pos, vals, wd, color=colors[j % len(colors)], label=label)
            for px, v in zip(pos, vals):
                if v:  # 0: a series without this baseline (an earlier run's JSON)
                    ax.text(px, v, fmt.format(v), ha="center", va="bottom", fontsize=7)
            top = max([top] + vals)
        if target is not None:
            ax.axhline(target, ls="--", c="k", lw=1)
        ax.set_ylim(0, 1.45 * top)  # room for the legend above the bars
        ax.set_xticks(x, [str(w) for w in workers])
        ax.set(title=title, xlabel="workers")
        ax.legend(fontsize=7, loc="upper left")
    res = series[0][1]
    how = f"median of {res['repeats']} paired runs"
    if res.get("runs_averaged"):  # several bench runs merged (--merge)
        how = f"mean of {res['runs_averaged']} runs, each the {how}"
    size = f"token budget {res['token_budget']}" if res.get("token_budget") else f"batch {res['batch_size']}"
    fig.suptitle(f"{size}, {how}, {res['cpus']} shared cores (dashed: targets)", fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)


# Sample-size profiles (pipelines/tools/shardgen.make_samples): events per sample follow a Pareto law
# capped at max_events; a request sees at most max_seq_len of them.
PROFILES = {
    # user-wise samples of a long-sequence model (the product's purpose): ~10^2-10^3 events each
    "long": dict(max_seq_len=512, max_events=2000, event_scale=150.0),
    # the unit tests' tiny samples (~9 events each): a stress case for per-buffer overhead
    "short": dict(max_seq_len=20, max_events=120, event_scale=8.0),
}
SAMPLES = {"long": 32000, "short": 40000}  # per profile by default: about 63 and 12 MB of shards
LENGTH_EVENTS = 8_000_000  # events per length profile (--lengths) by default
LENGTH_ROW_GROUP_EVENTS = 409_600  # events per row group of a length profile: the long profile's 2048 x ~200


def length_profile(L: int) -> dict:
    """Samples of about ``L`` events: users of exactly ``L`` events (an event scale far above
    the cap) and a history limit of ``L``, so a request sees every event before it."""
    return dict(max_seq_len=L, max_events=L, event_scale=1e6 * L)


def profile_kw(prof: str) -> dict:
    """The sample generator's settings of a profile: a fixed one, or ``L<n>`` (``--lengths``)."""
    return PROFILES[prof] if prof in PROFILES else length_profile(int(prof[1:]))


def shard_set(prof: str, root: str, n: int | None = None, row_group_rows: int = 2048) -> None:
    """The profile's shard set of ``n`` samples (default :data:`SAMPLES`) under ``root``, made
    unless one is there already (benchmarks reuse it with ``--shards``)."""
    if not os.path.exists(os.path.join(root, mf.MANIFEST)):
        write_shard_set(root, nodes=1, ranks_per_node=1, row_group_rows=row_group_rows,
                        sets=(("incremental", "2026-01-04", "2026-01-05", n or SAMPLES[prof]),), **profile_kw(prof))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="loader vs pyarrow ceiling vs point-wise DataLoader")
    p.add_argument("--samples", type=int, default=None,
                   help="samples per profile (default: 32000 long, 40000 short: about 63 and 12 MB of shards)")
    p.add_argument("--profiles", nargs="+", default=None, choices=sorted(PROFILES),
                   help="sample-size profiles (default: long short, or none with --lengths)")
    p.add_argument("--lengths", type=int, nargs="+", default=[],
                   help="also run a profile of samples of about this many events per length (e.g. 1000 4000 16000), "
                        "token budget scaled (--length-batch-samples x length)")
    p.add_argument("--length-batch-samples", type=int, default=32,
                   help="a length profile's token budget in samples of its length (default 32)")
    p.add_argument("--length-events", type=int, default=LENGTH_EVENTS,
                   help=f"events per length profile (default {LENGTH_EVENTS}; --samples gives a sample count instead)")
    p.add_argument("--phase-epochs", type=int, default=3,
                   help="epochs of the one-thread phase breakdown per length profile (0: skip it)")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--token-budget", type=int,
                   help="cut the loader's batches by this many tokens (events + impressions) instead of --batch-size "
                        "samples (the point-wise loader keeps --batch-size rows)")
    p.add_argument("--row-group-rows", type=int, default=None,
                   help="rows per row group (default: preshard's 2048; a length profile's: 409600 // length)")
    p.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where the loader delivers batches (cuda: pinned pool + side-stream copies; "
                        "the ceiling stays pyarrow into host memory)")
    p.add_argument("--pointwise-samples", type=int, default=None,
                   help="samples expanded for the point-wise file (default: 300 long, 3000 short, "
                        "300000 // length for a length profile)")
    p.add_argument("--pointwise-cap-s", type=float, default=5.0)
    p.add_argument("--shards", help="reuse (or create) the shard sets under this folder (one per profile)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--plot", help="write a bar chart (PNG) here")
    p.add_argument("--before", help="an earlier run's --json, drawn next to this one in the plot")
    p.add_argument("--zero-copy", choices=["on", "off"], default="on",
                   help="off: workers' batches are copied out of their shared-memory ring (the loader before zero_copy)")
    p.add_argument("--buffer-row-groups", default="auto",
                   help="row groups per shuffle buffer (default: the loader's auto choice)")
    p.add_argument("--batch-order", choices=BATCH_ORDERS, default=BATCH_ORDERS[0],
                   help="the order of samples inside a batch (the loader's batch_order; default its own)")
    p.add_argument("--no-petastorm", action="store_true",
                   help="skip the petastorm baseline (it needs .venv-petastorm, made by `make setup`)")
    p.add_argument("--no-torch-loader", action="store_true",
                   help="skip torch's own DataLoader (and StatefulDataLoader) over the same dataset")
    p.add_argument("--merge", nargs="+", metavar="JSON",
                   help="run nothing: average these runs' JSON into --json / --plot (default: benchmarks/results)")
    a = p.parse_args(argv)
    if a.merge:
        out = merge([json.load(open(f)) for f in a.merge])
        if not a.json and not a.plot:  # the published result (benchmarks/README.md)
            a.json, a.plot = (os.path.join(REPO, "benchmarks", "results", f"loader_bench.{x}") for x in ("json", "png"))
        return write(out, a)
    if a.buffer_row_groups != "auto":
        a.buffer_row_groups = int(a.buffer_row_groups)
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but torch sees no CUDA device here")
    if any(L < 1 for L in a.lengths) or a.length_batch_samples < 1 or a.length_events < 1:
        p.error("--lengths, --length-batch-samples and --length-events take positive numbers")
    profiles = (a.profiles or ([] if a.lengths else ["long", "short"])) + [f"L{L}" for L in a.lengths]
    out = {"profiles": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for prof in profiles:
            root = os.path.join(a.shards or tmp, prof)
            L = int(prof[1:]) if prof not in PROFILES else None
            n = a.samples or (SAMPLES[prof] if L is None else max(1, a.length_events // L))
            npw = a.pointwise_samples or (max(8, 300_000 // L) if L else 300 if prof == "long" else 3000)
            res = bench_profile(prof, root, os.path.join(tmp, f"pointwise-{prof}.parquet"), n, npw, a)
            out["profiles"][prof] = res
    out["loadavg_end"] = os.getloadavg()
    return write(out, a)


def write(out: dict, a) -> int:
    if not a.json:
        print(json.dumps(out, indent=1, default=float))
    else:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1, default=float)
    if a.plot:
        series = [(f"{p}: {r['events_per_sample']:.0f} events/sample", r) for p, r in out["profiles"].items()]
        if a.before:
            old = json.load(open(a.before))
            series += [(f"before, {p}", r) for p, r in old.get("profiles", {"": old}).items()]
        plot(series, a.plot)
    return 0


def merge(runs: list[dict]) -> dict:
    """The mean of several bench runs of the same profiles and worker counts: every number
    averaged (a run's medians, rates, CPU ratios); lists (pairs, epoch and pass times)
    concatenated; ``runs_averaged`` says how many. A figure only some runs have (petastorm's,
    from runs without ``--no-petastorm``) is the mean of those that have it."""
    def avg(xs):
        have = [x for x in xs if x is not None]
        if len(have) < len(xs) and have:  # measured in some runs only
            return avg(have)
        x0 = xs[0]
        if isinstance(x0, (bool, int, str)) or x0 is None:  # labels and counts: must agree
            if any(x != x0 for x in xs):
                raise SystemExit(f"--merge: runs differ in {x0!r} vs {[x for x in xs if x != x0][0]!r}")
            return x0
        if isinstance(x0, dict):
            return {k: avg([x.get(k) for x in xs]) for k in x0}
        if isinstance(x0, list):
            return [y for x in xs for y in x]
        return statistics.fmean(xs)

    out = {"profiles": {}}
    for prof in runs[0]["profiles"]:
        rs = [r["profiles"][prof] for r in runs]
        res = {k: v for k, v in rs[0].items() if k not in ("runs", "loadavg_start", "loadavg_end")}
        res["runs"] = [avg([r["runs"][i] for r in rs]) for i in range(len(rs[0]["runs"]))]
        res["runs_averaged"] = len(rs)
        out["profiles"][prof] = res
    return out


def bench_profile(prof: str, root: str, pw: str, n: int, npw: int, a) -> dict:
    from userwise.pipelines.loader import UserwiseDataset, UserwiseLoader, expand_batch

    L = int(prof[1:]) if prof not in PROFILES else None
    token_budget = a.length_batch_samples * L if L else a.token_budget
    shard_set(prof, root, n, a.row_group_rows or (max(8, LENGTH_ROW_GROUP_EVENTS // L) if L else 2048))
    ds = UserwiseDataset(root, batch_size=256, world_size=1, rank=0, verify="none", shuffle=False, device="cpu")
    parts, k = [], 0
    for b in UserwiseLoader(ds):  # the point-wise file: the same data, as many rows as npw samples give
        parts.append(expand_batch(b))
        k += b.num_samples
        if k >= npw:
            break
    pq.write_table(pa.concat_tables(parts), pw)
    man = mf.load(root)
    for _ in range(2):  # warm the page cache for everyone
        ceiling(root)
    samples = sum(s["rows"] for s in man["shards"])
    res = {"profile": prof, "samples": samples, "batch_size": a.batch_size, "token_budget": token_budget,
           "repeats": a.repeats,
           "events_per_sample": sum(s["events"] for s in man["shards"]) / samples,
           "shard_mb": sum(s["bytes"] for s in man["shards"]) / 1e6, "cpus": os.cpu_count(), "device": a.device,
           "row_groups": sum(s["row_groups"] for s in man["shards"]),
           "impressions_per_sample": sum(s["impressions"] for s in man["shards"]) / samples,
           "loadavg_start": os.getloadavg(), "runs": []}
    if L:
        res["length"] = L
    print(f"profile {prof}: {samples} samples, {res['events_per_sample']:.0f} events per sample, "
          f"{res['shard_mb']:.1f} MB of shards in {res['row_groups']} row groups"
          + (f", token budget {token_budget}" if token_budget else ""), flush=True)
    peta = None if a.no_petastorm else PETASTORM_PY
    if peta and not os.path.exists(peta):
        raise SystemExit(f"{peta} missing: run `make setup`, or pass --no-petastorm")
    for w in a.workers:
        r = run(root, pw, a.batch_size, w, a.repeats, a.pointwise_cap_s, a.device, a.zero_copy == "on",
                a.buffer_row_groups, token_budget, peta, a.batch_order, not a.no_torch_loader)
        res["runs"].append(r)
        print(f"  workers={w}: loader {r['loader']['samples_per_s']:.0f} samples/s, "
              f"{r['loader']['events_per_s']:.0f} events/s = {r['share_of_ceiling']:.2f} of the pyarrow ceiling "
              f"(target >= 0.8; pairs {', '.join(f'{x:.2f}' for x in r['share_of_ceiling_pairs'])}); "
              f"impressions/s {r['impressions_vs_pointwise']:.1f}x the point-wise DataLoader (target >= 20x); "
              f"start-up {r['loader']['startup_s']:.2f}s (point-wise {r['pointwise']['startup_s']:.2f}s); "
              f"CPU s ceiling/loader {r['cpu_efficiency'] or float('nan'):.2f}; {r['buffer_row_groups']} row groups per buffer; "
              f"{r['batches_per_epoch']} batches per epoch"
              + (f"; samples/s {r['samples_vs_petastorm']:.1f}x petastorm ({r['petastorm']['samples_per_s']:.0f}/s, "
                 f"{r['petastorm']['workers']} worker(s))" if "samples_vs_petastorm" in r else "")
              + "".join(f"; {k.replace('_', ' ')} {r[k]['samples_per_s']:.0f} samples/s = "
                        f"{r[k]['share_of_ceiling']:.2f} of the ceiling, "
                        f"{r[k.replace('_dataloader', '_vs_loader')]:.2f}x the loader (pairs "
                        f"{', '.join(f'{x:.2f}' for x in r[k.replace('_dataloader', '_vs_loader_pairs')])})"
                        for k in ("torch_dataloader", "stateful_dataloader") if k in r),
              flush=True)
    if L and a.phase_epochs:
        res["phases"] = phase_breakdown(root, {"token_budget": token_budget}, a.phase_epochs, a.batch_order,
                                        a.buffer_row_groups)
        res["limiting_phase"] = max(PHASES, key=res["phases"].get)
    if L:
        res["verdict"] = verdict(res)
        print(f"  {res['verdict']}", flush=True)
    res["loadavg_end"] = os.getloadavg()
    return res


PHASES = ("read", "from_arrow", "check", "prepared", "shuffle", "cut")  # loader_phases.PHASES


def phase_breakdown(root: str, size: dict, epochs: int, batch_order: str, buffer_row_groups) -> dict:
    """benchmarks/loader_phases.py's one-thread breakdown of one node's epoch (ms of CPU per
    epoch, medians), in a process of its own (it sets glibc's heap as the loader's workers do)."""
    import subprocess

    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import loader_phases as lp; "
            "from userwise.pipelines.loader.workers.pool import keep_heap; keep_heap(); "
            "med, _ = lp.phases(sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6]); "
            "print(json.dumps(med))")
    r = subprocess.run([sys.executable, "-c", code, os.path.join(REPO, "benchmarks"), root, json.dumps(size),
                        str(epochs), batch_order, str(buffer_row_groups)], capture_output=True, text=True, timeout=1200)
    if r.returncode:
        raise SystemExit(f"loader_phases failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def verdict(res: dict) -> str:
    """Whether the loader reaches 0.8 of the ceiling with 2 workers (else the most run), or
    where it stops: its share, and the largest phase of the one-thread breakdown."""
    runs = {r["workers"]: r for r in res["runs"]}
    w = 2 if 2 in runs else max(runs)
    share = runs[w]["share_of_ceiling"]
    res["reaches_target"] = share >= 0.8
    res["target_workers"] = w
    head = (f"L={res['length']}: {share:.2f} of the pyarrow ceiling with {w} worker(s) "
            f"({res['events_per_sample']:.0f} events/sample, token budget {res['token_budget']}): ")
    if share >= 0.8:
        return head + "reaches 0.8"
    out = head + "stops below 0.8"
    ph = res.get("phases")
    if ph:
        lim = res["limiting_phase"]
        out += (f"; largest phase on one thread: {lim} ({ph[lim]:.0f} of {ph['total']:.0f} ms CPU per epoch; "
                f"ceiling {ph['ceiling']:.0f} ms; loader / ceiling {ph['total'] / ph['ceiling']:.2f}x)")
    return out


if __name__ == "__main__":
    sys.exit(main())
