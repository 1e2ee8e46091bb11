"""User-level training against point-wise training over the same data (issue #39; not part of the tests).

    python benchmarks/train_bench.py [--quick] [--lengths 200 1000] [--profiles demo heavy one_request]
                                     [--seconds 6] [--device cpu|cuda] [--threads 1] [--dim 64] [--layers 1]
                                     [--encoder sample|window|request] [--json out.json] [--plot out.png]
                                     [--max-history-events 33554432] [--max-batches 64]
    python benchmarks/train_bench.py --replot benchmarks/results/train_bench.json   # the png from the JSON

Samples. The shapes come from ``userwise synth`` logs (not timed), cut as the daily
build cuts them (one sample per user and UTC day, the bot user left out: a build
splits it by its cost cap):
- ``demo``: the demo's log (``make demo``: 60 users, 4 days);
- ``heavy``: the same log with every user heavy (``SynthParams(heavy_share=1)``: 10x
  the requests);
- ``one_request``: the demo's requests one per sample (request-level samples: the
  saving is the impressions factor only).
A sample's requests, their impressions and the user's actions of that day (clicks,
likes and action-log events, at their times) are the log's; every user is taken to
have a long history, so a request sees the ``L`` newest events strictly before it
(the pointer rule) and the sample stores ``L`` events plus the day's until its last
request. Ids and labels are random (speed does not depend on them).

Per setting (profile, L), side by side in one process, steps alternating:
- **user-wise**: ``ReferenceRanker`` (``--encoder``, default ``sample``: one encoder pass
  per sample) trained on batches of whole samples (at most ``--budget`` tokens, stored
  events plus impressions, a batch: the loader's ``token_budget``): forward, backward,
  Adam step;
- **point-wise** (the baseline): the same model and the same impressions as the rows
  ``expand_batch`` gives (each row its own copy of its history, encoded for it), in
  micro-batches of ``--rows`` rows per step (``16384 // L``: the same history tokens a
  step);
- **least plan**: the target attention alone (each impression's query over its span's
  keys and values, forward and backward), the part no layout can skip.
Reported: trained impressions per second of each, and per impression the model's FLOPs
(forward x 3 for training; visible attention pairs counted exactly) and the least
plan's (the target attention's FLOPs alone). The ratio user-wise / point-wise is
expected to grow with L and with impressions per sample.

Memory bound. A setting keeps its leading batches while the point-wise rows' histories
(impressions x L events, every row its own copy) stay within ``--max-history-events``
(2^25 by default: 1 GiB of int64 event columns) and at most ``--max-batches`` (64; the
least plan's random keys and values cost ~1 KB a token): the point-wise baseline at
L = 4,000 fits a 24 GiB machine (the heavy log's 151K impressions x 4,000 would be 600M
events). Both sides are measured, and FLOPs counted, over the same kept batches; each run
reports ``impressions_in_setting``, ``impressions_measured`` and ``capped``.

``--quick``: tiny sizes in seconds (the test in tests/train/test_bench.py). Defaults
write ``benchmarks/results/train_bench.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import io
import json
import os
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import numpy as np  # noqa: E402
import pyarrow.compute as pc  # noqa: E402
import pyarrow.dataset as pds  # noqa: E402
import torch  # noqa: E402

from userwise.pipelines.tools import synth  # noqa: E402
from userwise.pipelines.train import Intervals, ReferenceRanker, Spans, UserBatch  # noqa: E402
from userwise.pipelines.train.attention import block_attention  # noqa: E402

RESULTS = os.path.join(REPO, "benchmarks", "results")
MS_DAY = 86_400_000


# -- sample shapes from synthetic logs -------------------------------------------------
def log_shapes(profile: str, *, users: int, days: int, seed: int = 0) -> list[dict]:
    """Per sample (user, UTC day; bot left out): request times, impressions per request, and the
    times of that day's actions."""
    if profile not in ("demo", "heavy"):
        raise ValueError(f"profile {profile!r}: demo or heavy")
    params = synth.SynthParams(heavy_share=1.0) if profile == "heavy" else synth.SynthParams()
    with tempfile.TemporaryDirectory() as out:
        summary = synth.synth(out, days=days, users=users, kinds=("lean", "actions"), seed=seed, params=params,
                              log=io.StringIO())
        lean = pds.dataset(os.path.join(out, "lean"), format="parquet", partitioning="hive").to_table(
            columns=["user_id", "request_id", "request_ts", "action_ts", "click", "like"])
        acts = pds.dataset(os.path.join(out, "actions"), format="parquet", partitioning="hive").to_table()
    bot = summary["bot_user_id"]
    lean = lean.filter(pc.not_equal(lean["user_id"], bot))
    req = lean.group_by(["user_id", "request_id", "request_ts"]).aggregate([("click", "count")])
    acted = lean.filter(pc.or_(pc.greater(lean["click"], 0), pc.greater(lean["like"], 0)))
    ucol = next(c for c in acts.column_names if c in ("user_id", "uid", "user"))
    tcol = next(c for c in acts.column_names if c in ("ts", "action_ts", "time"))
    ev_user = np.concatenate([np.asarray(acted["user_id"]), np.asarray(acts[ucol])])
    ev_ts = np.concatenate([np.asarray(acted["action_ts"]), np.asarray(acts[tcol])]).astype(np.int64)
    r_user, r_ts = np.asarray(req["user_id"]), np.asarray(req["request_ts"]).astype(np.int64)
    r_k = np.asarray(req["click_count"]).astype(np.int64)
    keep = ev_user != bot
    ev_user, ev_ts = ev_user[keep], ev_ts[keep]
    out = []
    r_day, e_day = r_ts // MS_DAY, ev_ts // MS_DAY
    r_key, e_key = r_user.astype(np.int64) * 100_000 + r_day, ev_user.astype(np.int64) * 100_000 + e_day
    order_e = np.lexsort((ev_ts, e_key))
    e_key_s, ev_ts_s = e_key[order_e], ev_ts[order_e]
    for key in np.unique(r_key):
        m = r_key == key
        o = np.argsort(r_ts[m], kind="stable")
        lo, hi = np.searchsorted(e_key_s, key, "left"), np.searchsorted(e_key_s, key, "right")
        out.append({"req_ts": r_ts[m][o], "imps": r_k[m][o], "ev_ts": ev_ts_s[lo:hi]})
    return out


def one_request(shapes: list[dict]) -> list[dict]:
    """The same requests, one per sample (request-level samples)."""
    return [{"req_ts": s["req_ts"][i:i + 1], "imps": s["imps"][i:i + 1], "ev_ts": s["ev_ts"]}
            for s in shapes for i in range(len(s["req_ts"]))]


def to_batches(shapes: list[dict], L: int, budget: int, seed: int) -> list[UserBatch]:
    """User-wise batches of whole samples, at most ``budget`` tokens (stored events + impressions,
    the loader's ``token_budget``) each; a larger sample is a batch of its own."""
    rng = np.random.default_rng(seed)
    batches, cur = [], []

    def flush():
        if not cur:
            return
        so, ro, io_, rb, re, ir = [0], [0], [0], [], [], []
        for s in cur:
            e = np.searchsorted(s["ev_ts"], s["req_ts"], side="left")  # the day's actions strictly before
            end, begin = L + e, e  # L older events first, then the day's
            lo, hi = int(begin.min()), int(end.max())
            so.append(so[-1] + hi - lo)
            rb += (begin - lo).tolist()
            re += (end - lo).tolist()
            n = len(s["req_ts"])
            ir += np.repeat(np.arange(ro[-1], ro[-1] + n), s["imps"]).tolist()
            ro.append(ro[-1] + n)
            io_.append(io_[-1] + int(s["imps"].sum()))
        t = lambda x: torch.tensor(np.asarray(x, dtype=np.int64))  # noqa: E731
        sp = Spans.from_arrays(seq_offsets=t(so), req_offsets=t(ro), req_begin=t(rb), req_end=t(re),
                               imp_offsets=t(io_), imp_req=t(ir))
        T, N = so[-1], io_[-1]
        ids = lambda *shape: torch.from_numpy(rng.integers(0, 1 << 20, shape))  # noqa: E731
        batches.append(UserBatch(ev_item=ids(T), ev_side=ids(T, 2), ev_action=torch.from_numpy(rng.integers(1, 4, T)),
                                 tgt_item=ids(N), tgt_side=ids(N, 2),
                                 labels=torch.from_numpy((rng.random((N, 2)) < 0.1).astype(np.float32)), spans=sp))
        cur.clear()

    n = 0
    for s in shapes:
        e = np.searchsorted(s["ev_ts"], s["req_ts"], side="left")
        k = int(s["imps"].sum()) + L + int(e[-1] - e[0])  # impressions + stored events
        if cur and n + k > budget:
            flush()
            n = 0
        cur.append(s)
        n += k
    flush()
    return batches


def shape_summary(shapes: list[dict]) -> dict:
    k = np.array([int(s["imps"].sum()) for s in shapes])
    r = np.array([len(s["req_ts"]) for s in shapes])
    e = np.array([len(s["ev_ts"]) for s in shapes])
    return {"samples": len(shapes), "impressions_per_sample": round(float(k.mean()), 1),
            "impressions_per_sample_p90": int(np.percentile(k, 90)), "requests_per_sample": round(float(r.mean()), 2),
            "actions_per_sample_day": round(float(e.mean()), 1)}


def cap_batches(batches: list, L: int, max_history_events: int, max_batches: int) -> list:
    """The leading batches whose impressions x ``L`` (the point-wise rows' history events) stay
    within ``max_history_events``, at most ``max_batches`` of them; at least the first."""
    kept, imps = [], 0
    for b in batches:
        if kept and ((imps + b.num_impressions) * L > max_history_events or len(kept) >= max_batches):
            break
        kept.append(b)
        imps += b.num_impressions
    return kept


# -- measurement ------------------------------------------------------------------------
def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(batches, L, *, dim, layers, encoder, rows, seconds, device, seed=0) -> dict:
    """User-wise, point-wise and least-plan steps, alternating, each until ``seconds`` of its own."""
    torch.manual_seed(seed)
    kw = dict(dim=dim, heads=2, layers=layers, encoder=encoder, window=L if encoder == "window" else None)
    uw_model = ReferenceRanker(**kw).to(device)
    pw_model = ReferenceRanker(**kw).to(device)
    pw_model.load_state_dict(uw_model.state_dict())
    uw_opt, pw_opt = torch.optim.Adam(uw_model.parameters(), 1e-3), torch.optim.Adam(pw_model.parameters(), 1e-3)
    ubs = [b.to(device) for b in batches]
    pbs = [b.expand("span") for b in batches]
    pw_rows = [pb.slice(i, min(i + rows, pb.num_impressions)).to(device) for pb in pbs
               for i in range(0, pb.num_impressions, rows)]
    h, dh = 2, dim // 2
    g = torch.Generator().manual_seed(seed)
    least = [(b.spans, torch.randn(b.num_impressions, h, dh, generator=g).to(device).requires_grad_(),
              torch.randn(b.spans.num_events, h, dh, generator=g).to(device).requires_grad_(),
              torch.randn(b.spans.num_events, h, dh, generator=g).to(device).requires_grad_()) for b in batches]

    def uw_step(i):
        ub = ubs[i % len(ubs)]
        loss = uw_model.loss(uw_model(ub), ub.labels)
        uw_opt.zero_grad()
        loss.backward()
        uw_opt.step()
        return ub.num_impressions

    def pw_step(i):
        pb = pw_rows[i % len(pw_rows)]
        loss = pw_model.loss(pw_model.forward_pointwise(pb), pb.labels)
        pw_opt.zero_grad()
        loss.backward()
        pw_opt.step()
        return pb.num_impressions

    def least_step(i):
        sp, q, k, v = least[i % len(least)]
        block_attention(q, k, v, Intervals(sp.imp_begin.to(device), sp.imp_end.to(device), sp.num_events)
                        ).sum().backward()
        return q.shape[0]

    steps = {"userwise": uw_step, "pointwise": pw_step, "least_plan": least_step}
    acc = {k: [0.0, 0, 0] for k in steps}  # seconds, impressions, steps
    for fn in steps.values():  # warm-up, not timed
        fn(0)
    i = 0
    t_end = time.perf_counter() + 6 * seconds  # a hard stop for very slow settings
    while min(a[2] for a in acc.values()) < 2 or (any(a[0] < seconds for a in acc.values())
                                                  and time.perf_counter() < t_end):
        for name, fn in steps.items():
            if acc[name][0] >= seconds and acc[name][2] >= 2:
                continue
            _sync(device)
            t0 = time.perf_counter()
            n = fn(i + 1)
            _sync(device)
            acc[name][0] += time.perf_counter() - t0
            acc[name][1] += n
            acc[name][2] += 1
        i += 1
    res = {k: {"impressions_per_s": round(a[1] / a[0], 2), "seconds": round(a[0], 2), "steps": a[2],
               "impressions": a[1]} for k, a in acc.items()}
    # FLOPs per impression (training ~ 3x forward), over all batches
    fu = [uw_model.flops(b) for b in batches]
    fp = [pw_model.flops(pb) for pb in pbs]
    n = sum(f["impressions"] for f in fu)
    per = lambda fs, key: 3 * sum(f[key] for f in fs) / n  # noqa: E731
    res["flops_per_impression"] = {"userwise": round(per(fu, "total")), "pointwise": round(per(fp, "total")),
                                   "least_plan": round(per(fu, "target_attention")),
                                   "userwise_encoder": round(per(fu, "encoder")),
                                   "pointwise_encoder": round(per(fp, "encoder"))}
    uw, pw, lp = (res[k]["impressions_per_s"] for k in ("userwise", "pointwise", "least_plan"))
    f = res["flops_per_impression"]
    res["speedup"] = round(uw / pw, 2)
    res["flops_ratio"] = round(f["pointwise"] / f["userwise"], 2)
    res["userwise_share_of_least_plan"] = round(uw / lp, 3)
    res["least_plan_share_of_userwise_flops"] = round(f["least_plan"] / f["userwise"], 3)
    res["stored_events_per_sample"] = round(sum(b.spans.num_events for b in batches)
                                            / sum(b.spans.num_samples for b in batches), 1)
    return res


# -- plot -------------------------------------------------------------------------------
def plot(result: dict, path: str) -> None:
    try:
        import matplotlib
    except ImportError:  # a GPU image without it: the JSON is the result
        print(f"train_bench: no matplotlib here; {path} not drawn")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    profiles = list(dict.fromkeys(r["profile"] for r in runs))
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.6), gridspec_kw={"width_ratios": [1, 1.25], "wspace": 0.25})
    colors = dict(zip(profiles, ["tab:blue", "tab:orange", "tab:green", "tab:red"]))
    for p in profiles:
        rs = sorted((r for r in runs if r["profile"] == p), key=lambda r: r["L"])
        k = result["profiles"][p]["impressions_per_sample"]
        a.plot([r["L"] for r in rs], [r["speedup"] for r in rs], "o-", color=colors[p],
               label=f"{p} ({k:g} imps/sample): measured")
        a.plot([r["L"] for r in rs], [r["flops_ratio"] for r in rs], "s--", color=colors[p], alpha=0.6,
               label=f"{p}: FLOPs ratio")
    a.set_xscale("log")
    a.set_yscale("log")
    ls = sorted({r["L"] for r in runs})
    a.set_xticks(ls, [str(x) for x in ls])
    a.minorticks_off()
    a.set_xlabel("L (max_seq_len)")
    a.set_ylabel("user-wise / point-wise (impressions per s; FLOPs)")
    a.set_title("User-level training against point-wise")
    a.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    labels = [f"{r['profile'].replace('_', ' ')}\nL={r['L']}" for r in runs]
    x = np.arange(len(runs))
    w = 0.27
    for j, (key, c) in enumerate((("pointwise", "tab:gray"), ("userwise", "tab:blue"), ("least_plan", "tab:purple"))):
        b.bar(x + (j - 1) * w, [r[key]["impressions_per_s"] for r in runs], w, color=c,
              label={"least_plan": "least plan (target attention alone)"}.get(key, key))
    b.set_yscale("log")
    b.set_xticks(x, labels, fontsize=7)
    b.set_ylabel("trained impressions per second")
    h = result["host"]
    threads = f", {h['threads']} thread{'s' if h['threads'] != 1 else ''}" if h["device"] == "cpu" else ""
    b.set_title(f"{h['device']}{threads}, dim {result['config']['dim']}, {result['date']}", fontsize=9)
    b.legend(fontsize=7)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="user-wise vs point-wise training speed")
    p.add_argument("--quick", action="store_true", help="tiny sizes, seconds (the test)")
    p.add_argument("--lengths", type=int, nargs="+", default=None)
    p.add_argument("--profiles", nargs="+", default=None, choices=["demo", "heavy", "one_request"])
    p.add_argument("--seconds", type=float, default=None, help="timed seconds per figure (default 6; quick 0.3)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (default 1; 0: torch's default; see benchmarks/README.md)")
    p.add_argument("--dim", type=int, default=None)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--encoder", default="sample", choices=["sample", "window", "request"])
    p.add_argument("--budget", type=int, default=None,
                   help="tokens (stored events + impressions) per user-wise batch (default 16384)")
    p.add_argument("--rows", type=int, default=None, help="point-wise rows per step (default 16384 // L, >= 8)")
    p.add_argument("--max-history-events", type=int, default=1 << 25,
                   help="per setting, point-wise history events (impressions x L) at most: leading batches kept "
                        "(default 2^25, 1 GiB of int64 event columns)")
    p.add_argument("--max-batches", type=int, default=64, help="per setting, user-wise batches at most (default 64)")
    p.add_argument("--replot", default=None, metavar="JSON", help="only draw --plot (default: the results' png) "
                   "from an earlier run's JSON")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    a = p.parse_args(argv)
    if a.replot:
        with open(a.replot) as f:
            plot(json.load(f), a.plot or os.path.join(RESULTS, "train_bench.png"))
        return 0
    q = a.quick
    lengths = a.lengths or ([16, 48] if q else [200, 1000])
    profiles = a.profiles or ["demo", "heavy", "one_request"]
    seconds = a.seconds if a.seconds is not None else (0.3 if q else 6.0)
    dim = a.dim or (16 if q else 64)
    budget = a.budget or (1024 if q else 16384)
    users, days = (12, 2) if q else (60, 4)
    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("train_bench: no CUDA device; nothing measured")
        return 0
    result = {"date": dt.date.today().isoformat(), "quick": q,
              "host": {"cpus": os.cpu_count(), "threads": torch.get_num_threads(), "torch": torch.__version__,
                       "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
                       "loadavg_start": [round(x, 2) for x in os.getloadavg()]},
              "config": {"dim": dim, "heads": 2, "layers": a.layers, "encoder": a.encoder, "budget": budget,
                         "seconds": seconds, "lengths": lengths, "synth_users": users, "synth_days": days,
                         "max_history_events": a.max_history_events, "max_batches": a.max_batches},
              "profiles": {}, "runs": []}
    shapes, logs = {}, {}
    for prof in profiles:
        base = "heavy" if prof == "heavy" else "demo"
        if base not in logs:
            logs[base] = log_shapes(base, users=users, days=days)
        shapes[prof] = logs[base] if prof != "one_request" else one_request(logs[base])
        if q:  # a few samples are enough to run every path
            shapes[prof] = shapes[prof][:24]
        result["profiles"][prof] = shape_summary(shapes[prof])
        print(f"profile {prof}: {result['profiles'][prof]}", flush=True)
    for prof in profiles:
        for L in lengths:
            rows = a.rows or max(8, 16384 // L)
            batches = to_batches(shapes[prof], L, budget, seed=L)
            total = sum(b.num_impressions for b in batches)
            batches = cap_batches(batches, L, a.max_history_events, a.max_batches)
            kept = sum(b.num_impressions for b in batches)
            r = measure(batches, L, dim=dim, layers=a.layers, encoder=a.encoder, rows=rows, seconds=seconds,
                        device=device)
            r.update(profile=prof, L=L, rows=rows, impressions_in_setting=total, impressions_measured=kept,
                     batches_measured=len(batches), capped=kept < total)
            result["runs"].append(r)
            print(f"{prof:>11} L={L:<5} user-wise {r['userwise']['impressions_per_s']:>10.1f}/s  point-wise "
                  f"{r['pointwise']['impressions_per_s']:>9.1f}/s  speedup {r['speedup']:>7.2f}x  FLOPs ratio "
                  f"{r['flops_ratio']:>7.2f}x  least plan {r['least_plan']['impressions_per_s']:>10.1f}/s "
                  f"(user-wise at {r['userwise_share_of_least_plan']:.2f} of it)"
                  + (f"; {kept} of {total} impressions kept (memory cap)" if kept < total else ""), flush=True)
    finish(result, verdicts, plot, name="train_bench", json_path=a.json, png_path=a.plot, quick=q)
    return 0


def finish(result: dict, verdicts, plot, *, name: str, json_path, png_path, quick: bool) -> None:
    """A benchmark's end, shared by the scripts that keep one result: the load at the end,
    the verdicts printed, the JSON (``results/NAME.json`` unless given; stdout for a quick
    run) and the plot drawn from it."""
    result["host"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    result["verdicts"] = verdicts(result)
    for v in result["verdicts"]:
        print("VERDICT", v)
    out_json = json_path or (None if quick else os.path.join(RESULTS, f"{name}.json"))
    out_png = png_path or (None if quick else os.path.join(RESULTS, f"{name}.png"))
    text = json.dumps(result, indent=1)
    if out_json:
        with open(out_json, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    if out_png:
        plot(result, out_png)


def verdicts(result: dict) -> list[str]:
    """Does the ratio grow with L (per profile) and with impressions per sample (per L)?"""
    out = []
    runs = result["runs"]
    for prof in dict.fromkeys(r["profile"] for r in runs):
        rs = sorted((r for r in runs if r["profile"] == prof), key=lambda r: r["L"])
        if len(rs) > 1:
            grows = all(b["speedup"] > a["speedup"] for a, b in zip(rs, rs[1:]))
            out.append(f"{prof}: speedup {' -> '.join(str(r['speedup']) for r in rs)} over L "
                       f"{' -> '.join(str(r['L']) for r in rs)}: {'grows' if grows else 'does not grow'} with L")
    for L in dict.fromkeys(r["L"] for r in runs):
        rs = sorted((r for r in runs if r["L"] == L),
                    key=lambda r: result["profiles"][r["profile"]]["impressions_per_sample"])
        if len(rs) > 1:
            grows = all(b["speedup"] > a["speedup"] for a, b in zip(rs, rs[1:]))
            seq = " -> ".join(f"{r['speedup']} ({r['profile']})" for r in rs)
            out.append(f"L={L}: speedup {seq} by impressions per sample: "
                       f"{'grows' if grows else 'does not grow'} with impressions per sample")
    return out


if __name__ == "__main__":
    sys.exit(main())
