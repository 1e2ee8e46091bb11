"""Scoring one request from the K/V cache against a full recompute (issue #48; not part of the tests).

    python benchmarks/serve_bench.py [--quick] [--history 1000 4096] [--candidates 1 64 256] [--new 128]
                                     [--repeats 9] [--device cpu|cuda] [--threads 1] [--dim 64] [--layers 2]
                                     [--heads 4] [--dtype float32|float16|bfloat16] [--json out.json]
                                     [--plot out.png|none]
    python benchmarks/serve_bench.py --replot benchmarks/results/serve_bench.json   # the png from the JSON
    python benchmarks/serve_bench.py --history 16384 --candidates 256 --dtype bfloat16 \
        --json benchmarks/results/serve_bench_16k.json --plot none                   # long L
    python benchmarks/serve_bench.py --sizing [--layers 8 --dim 512 --dtype bfloat16]  # users per tier

The model: a ``ReferenceRanker`` of realistic size for a CPU (dim 64, 2 encoder layers,
4 heads, ``encoder="sample"``, float32 unless ``--dtype`` says float16 or bfloat16: the model
and its K/V pages in that dtype, the training attention ``"blocks"``), random weights; a
user's history of ``n`` events (random ids), the request sees all of them (``max_seq_len =
n``) and ``c`` candidates. Per (n, c), one request scored by:

- **full recompute** (the baseline): ``full_scores``, the training forward over the
  ``n`` events (every event encoded, then the candidates' target attention);
- **cached**: a state prefilled with the ``n - new`` oldest events (not timed), then
  ``extend`` by the ``new`` (128) newest events and ``score``: the store's lookup is
  excluded (the state is in hand);
- **cached + store**: the same through a ``KVStore`` holding the ``n - new`` events'
  state (put back before each repeat, not timed): the chain of the ``n`` current events,
  ``acquire``, ``extend`` by what the lease lacks, ``put``, ``score``. The lookup verifies
  the held state at its own length (the chain of the request's events knows the hash
  after any number of them), so the whole held state is reused, its unfinished last page
  included (n = 1000: 872 reused, 128 encoded);
- **score only**: ``score`` of a state that already holds all ``n`` events (nothing new);
- **least plan**: the target attention alone, ``c`` queries over ``n`` cached keys and
  values (``attend``, the same block attention): the floor no cache can go below.

Each variant runs ``--repeats`` times, alternating, after one warm-up; the median is
reported. Ratios: full / cached and full / cached + store (target: at least 3x at
n = 4,096 with 3,968 cached and 256 candidates), and their inverses ``cached_over_full``
and ``cached_store_over_full`` (the time a cached request takes, as a fraction of the full
recompute's). Before timing, each cached path's logits are checked against the full
recompute's: within 1e-4 in float32, within ``2 * eps * max|logits|`` in float16 and
bfloat16 (the tolerance tests/serve/test_half_precision.py states); ``max_err_units`` is
the largest difference found, in units of ``eps * max|logits|``.

Memory, from the store's own page arithmetic (``KVStore.user_bytes``): ``kv_bytes_per_user``
(the n events' pages in a memory tier, ``page_bytes`` x pages; equal to the store's
``resident_bytes / users`` after the request, checked), ``kv_file_bytes_per_user`` (its
disk file, header included) and ``users_per_gib`` (users of n events in one GiB of a memory
tier). ``--sizing`` prints users per tier (device 80 GiB, host 512 GiB, disk 4 TiB) at
L = 1K, 4K and 16K for the ``--layers``, ``--dim``, ``--dtype`` and ``--page-size`` given,
computed the same way (docs/serving.md's table).

``--quick``: tiny sizes in seconds (the test in tests/benchmarks/test_serve_bench.py).
Defaults write ``benchmarks/results/serve_bench.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import torch  # noqa: E402

from benchmarks.train_bench import finish  # noqa: E402
from userwise.pipelines.serve import (  # noqa: E402
    Candidates,
    Events,
    KVState,
    KVStore,
    chain_of,
    empty_state,
    extend,
    full_scores,
    prefill,
    score,
)
from userwise.pipelines.train import Intervals, ReferenceRanker, attend  # noqa: E402

RESULTS = os.path.join(REPO, "benchmarks", "results")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
GIB = 1 << 30
TIER_BUDGETS = {"device": 80 * GIB, "host": 512 * GIB, "disk": 4 << 40}  # --sizing: one node's tiers
SIZING_LENGTHS = (1024, 4096, 16384)
VARIANTS = ("full", "cached", "cached_store", "score_only", "least_plan")
TARGET = {"history": 4096, "candidates": 256, "speedup": 3.0}


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _events(g: torch.Generator, n: int, device) -> Events:
    return Events(item=torch.randint(0, 1 << 20, (n,), generator=g), side=torch.randint(0, 1 << 20, (n, 2), generator=g),
                  action=torch.randint(1, 8, (n,), generator=g)).to(device)


def tolerance(dtype: torch.dtype, ref: torch.Tensor) -> tuple[float, float]:
    """(the largest difference allowed between a cached path's logits and the full recompute's,
    the unit the error is reported in): 1e-4 absolute in float32 and float64; ``2 * eps *
    max|logits|`` in float16 and bfloat16 (unit ``eps * max|logits|``)."""
    if dtype in (torch.float32, torch.float64):
        return 1e-4, 1e-4
    unit = torch.finfo(dtype).eps * float(ref.float().abs().max())
    return 2 * unit, unit


def user_sizes(store: KVStore, n: int) -> dict:
    """What a user of ``n`` events takes, from the store's page arithmetic (a state stored)."""
    mem = store.user_bytes(n, "device")
    return {"page_bytes": store.page_bytes, "kv_bytes_per_user": mem,
            "kv_file_bytes_per_user": store.user_bytes(n, "disk"), "users_per_gib": GIB // mem}


def sizing(*, layers: int, dim: int, dtype: str, page_size: int, lengths=SIZING_LENGTHS,
           budgets=TIER_BUDGETS) -> list[dict]:
    """Users per tier for a model of ``layers`` encoder layers of width ``dim`` in ``dtype``:
    a store in pages of ``page_size`` holds one page of that shape (``[2 * layers + 2, P,
    dim]``), and its ``user_bytes`` gives each tier's bytes per user of L events; a tier of B
    bytes holds ``B // user_bytes`` (the disk's lock file, under 100 bytes, set aside)."""
    store = KVStore(page_size=page_size, device_bytes=2 * page_size * (2 * layers + 2) * dim * 8, device="cpu")
    page = torch.zeros(2 * layers + 2, page_size, dim, dtype=DTYPES[dtype])
    ev = Events(item=torch.zeros(page_size, dtype=torch.long), side=torch.zeros(page_size, 2, dtype=torch.long),
                action=torch.zeros(page_size, dtype=torch.long))
    store.put("probe", chain_of(ev, block=page_size, version="sizing"), KVState((page,), page_size, page_size, 1))
    rows = []
    for L in lengths:
        per = {t: store.user_bytes(L, t) for t in budgets}
        rows.append({"L": L, "page_bytes": store.page_bytes, "bytes_per_user": per,
                     "users": {t: budgets[t] // per[t] for t in budgets}, "users_per_gib": GIB // per["device"]})
    return rows


def sizing_table(rows: list[dict], *, layers: int, dim: int, dtype: str, page_size: int,
                 budgets=TIER_BUDGETS) -> str:
    """The markdown table of :func:`sizing`'s rows."""
    def size(b):
        return f"{b / (1 << 40):g} TiB" if b >= 1 << 40 else f"{b / GIB:g} GiB"
    head = (f"{layers} layers, dim {dim}, {dtype}, pages of {page_size} events of "
            f"{rows[0]['page_bytes'] // page_size:,} bytes ({rows[0]['page_bytes']:,} bytes a page)")
    out = [head, "", "| L | K/V per user | users per GiB | device " + size(budgets["device"]) + " | host "
           + size(budgets["host"]) + " | disk " + size(budgets["disk"]) + " |", "|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        mib = r["bytes_per_user"]["device"] / (1 << 20)
        out.append(f"| {r['L']:,} | {mib:,.1f} MiB | {r['users_per_gib']:,} | {r['users']['device']:,} | "
                   f"{r['users']['host']:,} | {r['users']['disk']:,} |")
    return "\n".join(out)


def measure(model, n: int, c: int, *, new: int, repeats: int, page_size: int, device, seed: int = 0) -> dict:
    """The median seconds of each variant for one request of ``c`` candidates over ``n`` events."""
    g = torch.Generator().manual_seed(seed * 100_003 + n * 7 + c)
    ev = _events(g, n, device)
    cands = Candidates(torch.randint(0, 1 << 20, (c,), generator=g), torch.randint(0, 1 << 20, (c, 2), generator=g))
    cands = Candidates(cands.item.to(device), cands.side.to(device))
    held = n - new
    st0 = prefill(model, ev[:held], max_seq_len=n, page_size=page_size)
    st_all = extend(model, st0, ev[held:])
    store = KVStore(page_size=page_size, device_bytes=4 * (st_all.nbytes + (1 << 20)), device=device)
    held_chain = chain_of(ev[:held], block=page_size, version="bench")
    H, d = model.heads, model.dim
    q = torch.randn(c, H, d // H, generator=g).to(device=device, dtype=st0.pages[0].dtype)
    k, v = (torch.randn(n, H, d // H, generator=g).to(device=device, dtype=q.dtype) for _ in range(2))
    iv = Intervals(torch.zeros(c, dtype=torch.long, device=device), torch.full((c,), n, dtype=torch.long,
                                                                                device=device), n)
    reused = []

    def full():
        return full_scores(model, ev, cands, n)

    def cached():
        return score(model, extend(model, st0, ev[held:]), cands)

    def cached_store():
        cur = chain_of(ev, block=page_size, version="bench")
        with store.acquire("u", cur) as lease:
            reused.append(lease.length)
            st = lease.state if lease.state is not None else empty_state(model, max_seq_len=n, page_size=page_size)
            st = extend(model, st, ev[lease.length:])
            store.put("u", cur, st)
            return score(model, st, cands)

    def score_only():
        return score(model, st_all, cands)

    def least_plan():
        return attend(q, k, v, iv, model.attention, block=model.block)

    fns = {"full": full, "cached": cached, "cached_store": cached_store, "score_only": score_only,
           "least_plan": least_plan}
    times = {name: [] for name in fns}
    dtype = st0.pages[0].dtype
    worst = 0.0
    with torch.no_grad():
        ref = full()
        tol, unit = tolerance(dtype, ref)
        for name, fn in fns.items():  # warm-up, and the cached paths equal the full recompute
            store.put("u", held_chain, st0)
            out = fn()
            if name in ("cached", "cached_store", "score_only"):
                err = float((out.float() - ref.float()).abs().max())
                worst = max(worst, err / unit)
                if not err <= tol:
                    raise AssertionError(f"{name} differs from the full recompute by {err} > {tol:.3g} (n={n}, c={c}, "
                                         f"{dtype})")
        store.put("u", chain_of(ev, block=page_size, version="bench"), st_all)  # the user after the request
        sizes = user_sizes(store, n)
        s = store.stats()
        if s["resident_bytes"]["device"] != sizes["kv_bytes_per_user"] * s["users"]["device"]:
            raise AssertionError(f"the store holds {s['resident_bytes']['device']} bytes for {s['users']['device']} "
                                 f"user(s), user_bytes says {sizes['kv_bytes_per_user']} each")
        for _ in range(repeats):
            for name, fn in fns.items():
                if name == "cached_store":
                    store.put("u", held_chain, st0)  # the user's state before the request (not timed)
                _sync(device)
                t0 = time.perf_counter()
                fn()
                _sync(device)
                times[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    return {
        "history": n, "candidates": c, "cached_events": held, "new_events": new, "store_reused_events": reused[-1],
        **{f"{name}_ms": round(1e3 * med[name], 3) for name in fns},
        "speedup": round(med["full"] / med["cached"], 2),
        "speedup_with_store": round(med["full"] / med["cached_store"], 2),
        "cached_over_full": round(med["cached"] / med["full"], 4),
        "cached_store_over_full": round(med["cached_store"] / med["full"], 4),
        "max_err_units": round(worst, 3), **sizes,
        "cached_over_least_plan": round(med["cached"] / med["least_plan"], 2),
        "score_only_over_least_plan": round(med["score_only"] / med["least_plan"], 2),
        "spread_ms": {name: [round(1e3 * min(ts), 3), round(1e3 * max(ts), 3)] for name, ts in times.items()},
    }


def verdicts(result: dict) -> list[str]:
    out = []
    for r in result["runs"]:
        if r["history"] == TARGET["history"] and r["candidates"] == TARGET["candidates"]:
            ok = r["speedup"] >= TARGET["speedup"]
            out.append(f"n={r['history']}, {r['cached_events']} cached, c={r['candidates']}: cached {r['speedup']}x "
                       f"the full recompute ({r['speedup_with_store']}x through the store): target "
                       f"{TARGET['speedup']:g}x {'met' if ok else 'NOT met'}")
    return out


# -- plot -------------------------------------------------------------------------------
def plot(result: dict, path: str) -> None:
    try:
        import matplotlib
    except ImportError:  # a GPU image without it: the JSON is the result
        print(f"serve_bench: no matplotlib here; {path} not drawn")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    hist = sorted({r["history"] for r in runs})
    fig, axes = plt.subplots(1, len(hist) + 1, figsize=(5 * (len(hist) + 1), 4.4))
    styles = {"full": ("tab:gray", "o-", "full recompute"), "cached": ("tab:blue", "o-", "cached (extend + score)"),
              "cached_store": ("tab:cyan", "s--", "cached + store lookup"),
              "score_only": ("tab:green", "^:", "score only (nothing new)"),
              "least_plan": ("tab:purple", "v-", "least plan (target attention)")}
    for ax, n in zip(axes, hist):
        rs = sorted((r for r in runs if r["history"] == n), key=lambda r: r["candidates"])
        cs = [r["candidates"] for r in rs]
        for key, (color, fmt, label) in styles.items():
            ax.plot(cs, [r[f"{key}_ms"] for r in rs], fmt, color=color, label=label)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks(cs, [str(x) for x in cs])
        ax.minorticks_off()
        ax.set_xlabel("candidates per request")
        ax.set_ylabel("ms per request (median)")
        ax.set_title(f"{n:,} history events, {rs[0]['cached_events']:,} cached")
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    ax = axes[-1]
    for n, color in zip(hist, ["tab:blue", "tab:orange", "tab:green"]):
        rs = sorted((r for r in runs if r["history"] == n), key=lambda r: r["candidates"])
        cs = [r["candidates"] for r in rs]
        ax.plot(cs, [r["speedup"] for r in rs], "o-", color=color, label=f"n={n:,}: cached")
        ax.plot(cs, [r["speedup_with_store"] for r in rs], "s--", color=color, alpha=0.6, label=f"n={n:,}: + store")
    ax.axhline(TARGET["speedup"], color="tab:red", lw=1, ls=":", label=f"target {TARGET['speedup']:g}x "
               f"(n={TARGET['history']:,}, c={TARGET['candidates']})")
    ax.set_xscale("log")
    ax.set_xticks(sorted({r["candidates"] for r in runs}), [str(x) for x in sorted({r["candidates"] for r in runs})])
    ax.minorticks_off()
    ax.set_xlabel("candidates per request")
    ax.set_ylabel("full recompute / cached (time)")
    h, cfg = result["host"], result["config"]
    threads = f", {h['threads']} thread{'s' if h['threads'] != 1 else ''}" if h["device"] == "cpu" else ""
    ax.set_title(f"{h['device']}{threads}; dim {cfg['dim']}, {cfg['layers']} layers, {cfg['heads']} heads; "
                 f"{result['date']}", fontsize=8)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="cached against full-recompute scoring of one request")
    p.add_argument("--quick", action="store_true", help="tiny sizes, seconds (the test)")
    p.add_argument("--history", type=int, nargs="+", default=None, help="history events n (default 1000 4096)")
    p.add_argument("--candidates", type=int, nargs="+", default=None, help="candidates c (default 1 64 256)")
    p.add_argument("--new", type=int, default=None, help="new events per request, extended (default 128)")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats per variant (default 9; quick 2)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (default 1; 0: torch's default; see benchmarks/README.md)")
    p.add_argument("--dim", type=int, default=None, help="model width (default 64; quick 16)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                   help="the model's and its K/V pages' dtype (default float32)")
    p.add_argument("--sizing", action="store_true", help="only print users per tier at L = 1K, 4K, 16K for "
                   "--layers, --dim, --dtype, --page-size (device 80 GiB, host 512 GiB, disk 4 TiB)")
    p.add_argument("--replot", default=None, metavar="JSON", help="only draw --plot (default: the results' png) "
                   "from an earlier run's JSON")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None, help="the png (default the results'; none: no plot)")
    a = p.parse_args(argv)
    if a.replot:
        with open(a.replot) as f:
            plot(json.load(f), a.plot or os.path.join(RESULTS, "serve_bench.png"))
        return 0
    if a.sizing:
        shape = {"layers": a.layers, "dim": a.dim or 64, "dtype": a.dtype, "page_size": a.page_size}
        print(sizing_table(sizing(**shape), **shape))
        return 0
    q = a.quick
    history = a.history or ([96, 160] if q else [1000, 4096])
    cands = a.candidates or ([1, 8] if q else [1, 64, 256])
    new = a.new if a.new is not None else (32 if q else 128)
    repeats = a.repeats or (2 if q else 9)
    dim = a.dim or (16 if q else 64)
    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("serve_bench: no CUDA device; nothing measured")
        return 0
    if min(history) <= new:
        p.error(f"--new {new} must be below every --history")
    torch.manual_seed(0)
    model = ReferenceRanker(dim=dim, heads=a.heads, layers=a.layers, encoder="sample")
    model = model.to(device=device, dtype=DTYPES[a.dtype]).eval()
    result = {"date": dt.date.today().isoformat(), "quick": q,
              "host": {"cpus": os.cpu_count(), "threads": torch.get_num_threads(), "torch": torch.__version__,
                       "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
                       "loadavg_start": [round(x, 2) for x in os.getloadavg()]},
              "config": {"dim": dim, "heads": a.heads, "layers": a.layers, "encoder": "sample", "dtype": a.dtype,
                         "attention": model.attention, "page_size": a.page_size, "new_events": new,
                         "repeats": repeats, "history": history, "candidates": cands, "max_seq_len": "n"},
              "runs": []}
    for n in history:
        for c in cands:
            r = measure(model, n, c, new=new, repeats=repeats, page_size=a.page_size, device=device)
            result["runs"].append(r)
            print(f"n={n:<5} c={c:<4} full {r['full_ms']:>9.2f} ms  cached {r['cached_ms']:>8.2f} ms "
                  f"({r['speedup']:>6.2f}x)  + store {r['cached_store_ms']:>8.2f} ms ({r['speedup_with_store']:>6.2f}x)"
                  f"  score only {r['score_only_ms']:>7.2f} ms  least plan {r['least_plan_ms']:>7.2f} ms", flush=True)
            print(f"        cached / full {r['cached_over_full']:.4f} (+ store {r['cached_store_over_full']:.4f});"
                  f"  K/V {r['kv_bytes_per_user']:,} bytes per user ({r['users_per_gib']:,} users per GiB; disk file "
                  f"{r['kv_file_bytes_per_user']:,} bytes); error {r['max_err_units']} units", flush=True)
    draw = (lambda result, path: None) if a.plot == "none" else plot
    finish(result, verdicts, draw, name="serve_bench", json_path=a.json, png_path=a.plot, quick=q)
    return 0


if __name__ == "__main__":
    sys.exit(main())
