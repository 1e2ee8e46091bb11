"""The ids of a batch that reach the embedding layer and cross ranks, per sample layout (#58 point 5;
not part of the tests).

    python benchmarks/embedding_bench.py [--quick] [--users 1000] [--days 2] [--items 1000000]
                                         [--max-seq-len 1000] [--token-budget 131072] [--worlds 8 64]
                                         [--hot 0.001 0.01] [--workers 0 2] [--repeats 5]
                                         [--json out.json] [--plot out.png]
    python benchmarks/embedding_bench.py --replot benchmarks/results/embedding_bench.json

The log. ``userwise synth --shape production`` (lean impressions and the action log: 53 days of
actions before the days of impressions, thousands of events per user) over a Zipf catalogue of
``--items`` items (``P(rank r) ~ r^-1.1``, ids a fixed permutation of the ranks, new items each
day). Not timed.

The samples (independent of the build, in numpy; no Spark): one user-wise sample per user and UTC
day of impressions (``incremental`` daily windows), in the shard schema of the synth log's lean
layout. A user's event stream is her impressions with a click or like (at ``action_ts``) and her
action-log events (at ``ts``), by time (ties by the action log first, then item: no count below
depends on them); a request at t sees the newest ``L`` (``--max-seq-len``) of her events strictly
before t (docs/pointer.md, no availability lag); a sample stores the events from the smallest
begin to the largest end of its requests that see one. They are pre-sharded by
``shards.preshard.preshard_arrow`` (the Spark job's assignment and writer) for one rank, and read
by the product's ``UserwiseDataset`` in batches of ``--token-budget`` tokens (stored events +
impressions).

Counted per batch, for the id keys ``seq_item``, ``seq_category``, ``seq_author`` (the history)
and ``imp__item_id``, ``imp__category``, ``imp__author`` (the candidates), each its own table
(items, categories, authors: the catalogue's rows), summed over the keys:

- ``pointwise``: the rows a point-wise sample log stores, one per impression repeating the
  history its request sees (``JaggedBatch.to_kjt(per="impression")``): per sequence key the
  request's visible history times its impressions (checked equal to ``to_kjt(per="impression")``
  on the first batch);
- ``userwise``: each sample's stored stream once, plus its impressions (``to_kjt(per="sample")``);
- ``dedup``: the unique ids per batch and key (``assembly.ids.route_ids``'s ``unique``);
- ``hot0.1%``, ``hot1%``: the same, with the most looked-up 0.1% / 1% of each table's rows
  (lookups counted over all samples, user-wise) replicated data-parallel: they reach the layer
  but do not cross ranks.

Reach: the ids the embedding layer looks up. Cross, for W = ``--worlds`` ranks sharding every
table row-wise as TorchRec does (fbgemm's block bucketization: block ``ceil(rows / W)``, id ``i``
on rank ``i // block``; ``route_ids``): batch ``j`` sits on rank ``j % W`` and sends every id
another rank owns (without dedup every value, ``route_ids``'s ``bucket_lengths``; with dedup the
unique ids, ``RoutedIds.sends``, which leaves out the hot ones). ``busiest``: the most ids one
rank is sent by a batch over the mean per rank (1.0: balanced).

Throughput (points 3 and 4 against the loader without them, side by side): for each worker
count, the same shards through ``UserwiseLoader`` five ways, timed epoch by epoch in rotating
order, ``--repeats`` times after one warm-up epoch: ``base`` (the batches, nothing else),
``vbe`` (each batch's ``to_kjt(per="impression", vbe=True)`` of the candidate keys, the request's
context and user features and the user, in the loop: point 3's request features once),
``vbe_hist`` (the same plus the history ``seq_item`` once per request), ``ids`` (the dataset's
``ids=IdRouting(...)``: every id key above routed for W = the largest world, the largest hot sets
flagged, in the workers: point 4), ``both`` (``ids`` and ``vbe``). Reported: each one's
impressions/s, and its share of ``base``'s (the median of the per-repeat ratios). Target: ``both``
keeps at least 0.9 (a cost of at most 10%) at the largest worker count; the verdict line says
met or not met, with the numbers.

``--quick``: tiny sizes in seconds (tests/benchmarks/test_embedding_bench.py). Defaults write
``benchmarks/results/embedding_bench.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import io
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.compute as pc  # noqa: E402
import pyarrow.dataset as pds  # noqa: E402
import torch  # noqa: E402

from userwise import schemas  # noqa: E402
from userwise.pipelines.jagged import np_offsets, np_ranges  # noqa: E402
from userwise.pipelines.loader import IdRouting, UserwiseDataset, UserwiseLoader  # noqa: E402
from userwise.pipelines.loader.assembly.ids import route_ids  # noqa: E402
from userwise.pipelines.shards import preshard  # noqa: E402
from userwise.pipelines.tools import shardgen, synth  # noqa: E402
from userwise.schemas.hashing import chain_checkpoints, event_hashes, rolling_hashes, sample_id  # noqa: E402

RESULTS = os.path.join(REPO, "benchmarks", "results")
MS_DAY = 86_400_000
KIND = "incremental"
# id key -> its table
KEYS = {"seq_item": "item", "seq_category": "category", "seq_author": "author",
        "imp__item_id": "item", "imp__category": "category", "imp__author": "author"}
SEQ_KEYS = [k for k in KEYS if k.startswith("seq_")]
# to_kjt(vbe=True)'s keys in the throughput run: the candidates, the request's context and user features, the user
VBE_KEYS = ["imp__item_id", "imp__category", "imp__author", "req__hour", "req__age_bucket", "user"]
HIST_KEY = "seq_item"  # vbe_hist: the same and this history, once per request (the R requests' visible events)
# the throughput variants against the loader alone, as the plot labels them
VARIANTS = {"vbe": "to_kjt VBE", "vbe_hist": "VBE + history", "ids": "ids= routing", "both": "VBE + routing"}
TARGET = 0.9  # share of the loader's throughput kept with points 3 and 4 (a cost of at most 10%)


# -- the log ------------------------------------------------------------------------------
def make_log(out: str, *, users: int, days: int, items: int, L: int, seed: int, history_days: int | None) -> dict:
    """``userwise synth --shape production`` into ``out``; its summary and the tables' rows."""
    summary = synth.synth(out, days=days, users=users, items=items, max_seq_len=L, kinds=("lean", "actions"),
                          shape="production", seed=seed, history_days=history_days, log=io.StringIO())
    p = synth.SHAPES["production"]
    total = items + days * max(1, math.ceil(items * p.new_items_per_day))
    # ids as synth draws them: items 1..total, categories 0..ceil(total/50)-1, authors 1..ceil(total/20)
    rows = {"item": total + 1, "category": math.ceil(total / p.items_per_category),
            "author": math.ceil(total / p.items_per_author) + 1}
    return {"summary": summary, "rows": rows}


def _read(path: str, columns: list[str]) -> pa.Table:
    return pds.dataset(path, format="parquet", partitioning="hive").to_table(columns=columns)


def log_samples(log: str, *, L: int) -> pa.Table:
    """The log's user-wise samples (one per user and day of impressions) in the shard schema of
    :func:`shardgen.layout` (see the module doc), vectorised."""
    lay = shardgen.layout()
    schema = schemas.shard_schema(lay).to_arrow()
    lean = _read(os.path.join(log, "lean"), ["user_id", "request_id", "request_ts", "action_ts", "item_id",
                                             "position", "click", "like", "category", "author", "score",
                                             "device", "hour", "age_bucket", "country", "date"])
    lean = lean.sort_by([("user_id", "ascending"), ("request_ts", "ascending"), ("request_id", "ascending"),
                         ("position", "ascending")])
    acts = _read(os.path.join(log, "actions"), ["uid", "iid", "ts", "bits", "cat", "auth"])
    n = lean.num_rows
    col = {c: lean[c].to_numpy(zero_copy_only=False) for c in ("user_id", "request_ts", "action_ts", "item_id",
                                                                "click", "like", "category", "author")}
    # the event stream: acted impressions at action_ts, action-log events at ts
    act = (col["click"] > 0) | (col["like"] > 0)
    ev = {
        "user": np.r_[acts["uid"].to_numpy(), col["user_id"][act]].astype(np.int64),
        "ts": np.r_[acts["ts"].to_numpy(), col["action_ts"][act]].astype(np.int64),
        "item": np.r_[acts["iid"].to_numpy(), col["item_id"][act]].astype(np.int64),
        "category": np.r_[acts["cat"].to_numpy(), col["category"][act]].astype(np.int32),
        "author": np.r_[acts["auth"].to_numpy(), col["author"][act]].astype(np.int64),
        "action": np.r_[acts["bits"].to_numpy().astype(np.int64),
                        (col["click"][act].astype(np.int64) > 0) | ((col["like"][act].astype(np.int64) > 0) << 1)],
        "lean": np.r_[np.zeros(acts.num_rows, np.int8), np.ones(int(act.sum()), np.int8)],
    }
    order = np.lexsort((ev["item"], ev["lean"], ev["ts"], ev["user"]))
    ev = {k: v[order] for k, v in ev.items()}
    ev_key = (ev["user"] << 42) | ev["ts"]
    # requests: a new one where the request id changes (rows sorted by user, time, id)
    rid = lean["request_id"].combine_chunks()
    new_req = np.ones(n, bool)
    if n > 1:
        new_req[1:] = pc.not_equal(rid.slice(1), rid.slice(0, n - 1)).to_numpy(zero_copy_only=False)
    rs = np.flatnonzero(new_req)
    r_user, r_ts = col["user_id"][rs].astype(np.int64), col["request_ts"][rs].astype(np.int64)
    r_k = np.diff(np.r_[rs, n]).astype(np.int32)
    # samples: a new one where (user, day) changes
    r_day = r_ts // MS_DAY
    new_s = np.ones(len(rs), bool)
    new_s[1:] = (r_user[1:] != r_user[:-1]) | (r_day[1:] != r_day[:-1])
    ss = np.flatnonzero(new_s)
    S = len(ss)
    s_of_r = np.cumsum(new_s) - 1
    # pointers (global event indexes): the events strictly before the request, the newest L of them
    end = np.searchsorted(ev_key, (r_user << 42) | r_ts, side="left")
    first = np.searchsorted(ev_key, r_user << 42, side="left")
    begin = np.maximum(first, end - L)
    sees = end > begin
    big = np.iinfo(np.int64).max
    lo = np.minimum.reduceat(np.where(sees, begin, big), ss)
    hi = np.maximum.reduceat(np.where(sees, end, -1), ss)
    none = hi < 0
    lo[none], hi[none] = 0, 0
    rb = np.where(sees, begin - lo[s_of_r], 0).astype(np.int32)
    re = np.where(sees, end - lo[s_of_r], 0).astype(np.int32)
    n_ev = (hi - lo).astype(np.int64)
    idx = np_ranges(lo, n_ev)
    s_req = np.diff(np.r_[ss, len(rs)]).astype(np.int32)
    s_imp = np.add.reduceat(r_k, ss).astype(np.int64)
    s_user = r_user[ss]
    ws = [dt.date(1970, 1, 1) + dt.timedelta(days=int(d)) for d in r_day[ss]]
    we = [d + dt.timedelta(days=1) for d in ws]

    def lst(values: np.ndarray | pa.Array, lengths: np.ndarray, name: str) -> pa.Array:
        t = schema.field(name).type.value_type
        arr = values if isinstance(values, pa.Array) else pa.array(values)
        return pa.ListArray.from_arrays(pa.array(np_offsets(lengths).astype(np.int32)), arr.cast(t))

    # the event chains (schemas.hashing), as the build writes them
    fields = [schemas.SEQ + f.name for f in schemas.chain_fields(lay)]
    flat = {"seq_item": ev["item"][idx], "seq_category": ev["category"][idx], "seq_author": ev["author"][idx],
            "seq_action": ev["action"][idx], "seq_ts": ev["ts"][idx]}
    off = np_offsets(n_ev)
    h = rolling_hashes(event_hashes([flat[f].astype(np.int64) for f in fields]), off)
    block = shardgen.CHAIN_BLOCK
    cps, ends = [], []
    for a, b in zip(off[:-1].tolist(), off[1:].tolist()):
        c, e = chain_checkpoints(h[a:b], b - a, block)
        cps.append(c.tolist())
        ends.append(e)

    r_rid = rid.take(pa.array(rs))
    rcol = {c: lean[c].combine_chunks().take(pa.array(rs)) for c in ("device", "hour", "age_bucket", "country")}
    date = lean["date"].combine_chunks()
    date = pc.strptime(date.cast(pa.string()), format="%Y-%m-%d", unit="s").cast(pa.date32())
    cols = {
        "format_version": pa.array(np.full(S, schemas.FORMAT_VERSION, np.int32)),
        "sample_id": pa.array([sample_id(KIND, e, int(u), 0) for e, u in zip(we, s_user)], pa.int64()),
        "kind": pa.array([KIND] * S), "window_start": pa.array(ws, pa.date32()),
        "window_end": pa.array(we, pa.date32()), "user": pa.array(s_user),
        "chunk": pa.array(np.zeros(S, np.int32)), "num_requests": pa.array(s_req),
        "num_impressions": pa.array(s_imp.astype(np.int32)), "num_events": pa.array(n_ev.astype(np.int32)),
        "cost": pa.array(n_ev + s_imp),
        "chain_block": pa.array(np.full(S, block, np.int32)),
        "chain_checkpoints": pa.array(cps, pa.list_(pa.int64())), "chain_end": pa.array(ends, pa.int64()),
    }
    for f, v in flat.items():
        cols[f] = lst(v, n_ev, f)
    req = {"req_id": r_rid, "req_time": r_ts, "req_seq_begin": rb, "req_seq_end": re, "req_num_imps": r_k,
           **{f"req__{c}": a for c, a in rcol.items()}}
    for f, v in req.items():
        cols[f] = lst(v, s_req, f)
    imp = {"imp__date": date, **{f"imp__{c}": lean[c].combine_chunks() for c in
                                 ("action_ts", "item_id", "position", "click", "like", "category", "author", "score")}}
    for f, v in imp.items():
        cols[f] = lst(v, s_imp, f)
    missing = set(schema.names) - set(cols)
    if missing:
        raise SystemExit(f"embedding_bench: the shard schema has columns this model does not make: {sorted(missing)}")
    return pa.Table.from_arrays([cols[f].cast(schema.field(f).type) for f in schema.names], schema=schema)


def write_shards(table: pa.Table, root: str, row_group_rows: int) -> None:
    schema = schemas.shard_schema(shardgen.layout()).to_arrow()
    preshard.preshard_arrow(table, root, schema=schema, nodes=1, ranks_per_node=1, row_group_rows=row_group_rows)


def hot_sets(table: pa.Table, rows: dict, shares: list[float]) -> dict:
    """Per share, per key: the ``ceil(share x rows)`` ids of the key's table looked up most over
    the samples (user-wise: each stored event once, each impression once; ties by id)."""
    out = {}
    for share in shares:
        out[share] = {}
        for k, tab in KEYS.items():
            v = pc.list_flatten(table[k]).to_numpy()
            cnt = np.bincount(v, minlength=rows[tab])
            n = math.ceil(share * rows[tab])
            top = np.argsort(-cnt, kind="stable")[:n]
            out[share][k] = np.sort(top[cnt[top] > 0]).astype(np.int64)
    return out


# -- counting -----------------------------------------------------------------------------
def variant_names(shares: list[float]) -> list[str]:
    return ["pointwise", "userwise", "dedup"] + [hot_name(s) for s in shares]


def hot_name(share: float) -> str:
    return f"hot{100 * share:g}%"


def count_batch(b, *, rows: dict, worlds: list[int], hot: dict, check: bool = False) -> dict:
    """One batch: per variant, the ids per key that reach the embedding layer (``reach``) and per
    W the ids each rank owns of those the batch looks up (``per_rank`` [W], summed over the keys;
    without dedup every value, with it the unique ids that are not hot). ``check``: the point-wise
    counts equal ``to_kjt(per="impression")``'s."""
    kjt = b.to_kjt(list(KEYS), per="sample")
    k_imps = b["req_num_imps"].numpy().astype(np.int64)
    names = variant_names(sorted(hot))
    out = {n: {"reach": {}, "per_rank": {W: np.zeros(W, np.int64) for W in worlds}} for n in names}
    pw_kjt = b.to_kjt(list(KEYS), per="impression") if check else None
    for key, tab in KEYS.items():
        jt = kjt[key]
        v, ln = jt.values().numpy(), jt.lengths().numpy()
        if key in SEQ_KEYS:  # point-wise: each request's visible history, once per impression
            vr, lr = (x.numpy() for x in b.jagged(key, "request"))
            pw_v, pw_ln, weight = vr, lr, k_imps
        else:  # one value per impression in both layouts
            pw_v, pw_ln, weight = v, ln, np.ones(len(ln), np.int64)
        out["pointwise"]["reach"][key] = int((pw_ln * weight).sum())
        if pw_kjt is not None and out["pointwise"]["reach"][key] != int(pw_kjt[key].lengths().sum()):
            raise SystemExit(f"embedding_bench: {key}: {out['pointwise']['reach'][key]} point-wise ids, "
                             f"to_kjt(per='impression') has {int(pw_kjt[key].lengths().sum())}")
        out["userwise"]["reach"][key] = int(len(v))
        for W in worlds:
            # without dedup every value goes to its owner: bucket_lengths [W, bags]
            r_pw = route_ids(pw_v, pw_ln, num_embeddings=rows[tab], world_size=W)
            out["pointwise"]["per_rank"][W] += r_pw.bucket_lengths.reshape(W, -1).astype(np.int64) @ weight
            r = route_ids(v, ln, num_embeddings=rows[tab], world_size=W)
            out["userwise"]["per_rank"][W] += r.bucket_lengths.reshape(W, -1).sum(1).astype(np.int64)
            out["dedup"]["reach"][key] = int(len(r.unique))
            out["dedup"]["per_rank"][W] += r.sends
            for share, sets in hot.items():
                rh = route_ids(v, ln, num_embeddings=rows[tab], world_size=W, hot=sets[key])
                out[hot_name(share)]["reach"][key] = int(len(rh.unique))
                out[hot_name(share)]["per_rank"][W] += rh.sends
    return out


def count(root: str, *, token_budget: int, rows: dict, worlds: list[int], hot: dict, seed: int) -> dict:
    """Every batch of an epoch counted (:func:`count_batch`; batch ``j`` on rank ``j % W`` sends
    what the other ranks own), summed per variant."""
    ds = UserwiseDataset(root, token_budget=token_budget, world_size=1, rank=0, verify="none", device="cpu",
                         gds=False, seed=seed)
    names = variant_names(sorted(hot))
    tot = {n: {"reach": 0, "cross": dict.fromkeys(worlds, 0), "busiest": {W: [] for W in worlds},
               "per_key": {k: 0 for k in KEYS}} for n in names}
    batches = imps = samples = events = 0
    for j, b in enumerate(ds):
        c = count_batch(b, rows=rows, worlds=worlds, hot=hot, check=(j == 0))
        batches += 1
        imps += b.num_impressions
        samples += b.num_samples
        events += b.num_events
        for n in names:
            for k, x in c[n]["reach"].items():
                tot[n]["reach"] += x
                tot[n]["per_key"][k] += x
            for W in worlds:
                pr = c[n]["per_rank"][W]
                tot[n]["cross"][W] += int(pr.sum() - pr[j % W])
                tot[n]["busiest"][W].append(float(pr.max() * W / pr.sum()) if pr.sum() else 1.0)
    res = {"batches": batches, "samples": samples, "impressions": imps, "stored_events": events,
           "impressions_per_batch": imps / max(1, batches), "variants": {}}
    base = tot["pointwise"]["reach"]
    for n in names:
        t = tot[n]
        res["variants"][n] = {
            "reach_per_batch": t["reach"] / max(1, batches), "reach_per_impression": t["reach"] / max(1, imps),
            "reach_vs_pointwise": t["reach"] / base if base else None,
            "reach_per_key_per_batch": {k: x / max(1, batches) for k, x in t["per_key"].items()},
            "cross_per_batch": {str(W): t["cross"][W] / max(1, batches) for W in worlds},
            "cross_per_impression": {str(W): t["cross"][W] / max(1, imps) for W in worlds},
            "cross_vs_pointwise": {str(W): t["cross"][W] / tot["pointwise"]["cross"][W]
                                   if tot["pointwise"]["cross"][W] else None for W in worlds},
            "busiest_over_mean": {str(W): statistics.mean(t["busiest"][W]) if t["busiest"][W] else None
                                  for W in worlds},
        }
    return res


# -- throughput ---------------------------------------------------------------------------
def _epoch(ld, vbe: list[str] | None) -> dict:
    t = time.perf_counter()
    imps = samples = 0
    for b in ld:
        if vbe:
            b.to_kjt(vbe, per="impression", vbe=True)
        imps += b.num_impressions
        samples += b.num_samples
    return {"s": time.perf_counter() - t, "impressions": imps, "samples": samples}


def throughput(root: str, *, token_budget: int, workers: list[int], repeats: int, routing: IdRouting,
               seed: int) -> list[dict]:
    """Per worker count: base / vbe / vbe_hist / ids / both epochs, rotating order (see the module doc)."""
    out = []
    for w in workers:
        def loader(ids):
            ds = UserwiseDataset(root, token_budget=token_budget, world_size=1, rank=0, verify="none", device="cpu",
                                 gds=False, seed=seed, ids=ids)
            return UserwiseLoader(ds, num_workers=w, device="cpu")

        plain, routed = loader(None), loader(routing)
        runs = {"base": (plain, None), "vbe": (plain, VBE_KEYS), "vbe_hist": (plain, VBE_KEYS + [HIST_KEY]),
                "ids": (routed, None), "both": (routed, VBE_KEYS)}
        names = list(runs)
        for n in names:  # warm-up: worker start-up, first decode
            _epoch(*runs[n])
        times: dict[str, list[dict]] = {n: [] for n in names}
        for i in range(repeats):
            for n in names[i % len(names):] + names[:i % len(names)]:
                times[n].append(_epoch(*runs[n]))
        for ld in (plain, routed):
            getattr(ld, "close", lambda: None)()
        imps = times["base"][0]["impressions"]
        if any(t["impressions"] != imps for ts in times.values() for t in ts):
            raise SystemExit("embedding_bench: the variants' loaders delivered different impressions per epoch")
        row = {"workers": w, "impressions_per_epoch": imps, "batches_per_epoch": len(plain)}
        for n in names:
            s = statistics.median(t["s"] for t in times[n])
            row[n] = {"impressions_per_s": imps / s, "epoch_s": [t["s"] for t in times[n]]}
            if n != "base":
                pairs = [b["s"] / t["s"] for b, t in zip(times["base"], times[n])]
                row[n]["share_of_base"] = statistics.median(pairs)
                row[n]["share_of_base_pairs"] = pairs
        out.append(row)
    return out


def verdict(rows: list[dict]) -> str:
    r = max(rows, key=lambda x: x["workers"])
    share = r["both"]["share_of_base"]
    parts = ", ".join(f"{n} {r[n]['share_of_base']:.3f}" for n in VARIANTS)
    ok = share >= TARGET
    return (f"verdict: {'met' if ok else 'not met'}: at {r['workers']} workers the loader with VBE and routing keeps "
            f"{share:.3f} of its impressions/s (cost {100 * (1 - share):.1f}%, target <= {100 * (1 - TARGET):.0f}%; "
            f"{parts}; base {r['base']['impressions_per_s']:,.0f} impressions/s)")


# -- plot ---------------------------------------------------------------------------------
def plot(result: dict, path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        print(f"embedding_bench: no matplotlib here; {path} not drawn")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = result["counts"]
    names = list(c["variants"])
    worlds = result["config"]["worlds"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.6), gridspec_kw={"width_ratios": [1.5, 1], "wspace": 0.3})
    x = np.arange(len(names))
    wd = 0.8 / (1 + len(worlds))
    reach = [c["variants"][n]["reach_per_impression"] for n in names]
    a.bar(x - 0.4 + wd / 2, reach, wd, label="reach the embedding layer", color="#4c72b0")
    colors = ["#dd8452", "#c44e52", "#8172b3"]
    for i, W in enumerate(worlds):
        ys = [c["variants"][n]["cross_per_impression"][str(W)] for n in names]
        a.bar(x - 0.4 + wd * (i + 1.5), ys, wd, label=f"cross ranks, W = {W}", color=colors[i % len(colors)])
    for xi, y in zip(x, reach):
        a.text(xi - 0.4 + wd / 2, y, f"{y:,.0f}" if y >= 10 else f"{y:.1f}", ha="center", va="bottom", fontsize=7)
    a.set_yscale("log")
    a.set_xticks(x, names)
    a.set_ylabel("ids per impression (log)")
    cfg = result["config"]
    a.set_title(f"ids per batch / impressions (L = {cfg['max_seq_len']:,}, {c['impressions_per_batch']:,.0f} "
                f"impressions a batch)", fontsize=10)
    a.legend(fontsize=8)
    tp = result["throughput"]
    vs = list(VARIANTS)
    wd2 = 0.8 / max(1, len(tp))
    for i, r in enumerate(tp):
        ys = [r[n]["share_of_base"] for n in vs]
        b.bar(np.arange(len(vs)) - 0.4 + wd2 * (i + 0.5), ys, wd2, label=f"{r['workers']} workers")
        for xi, y in enumerate(ys):
            b.text(xi - 0.4 + wd2 * (i + 0.5), y, f"{y:.2f}", ha="center", va="bottom", fontsize=8)
    b.axhline(TARGET, color="k", ls="--", lw=1, label=f"target {TARGET}")
    b.set_xticks(np.arange(len(vs)), [VARIANTS[n] for n in vs], fontsize=8)
    top = max([r[n]["share_of_base"] for r in tp for n in vs] + [1.0])
    b.set_ylim(0, top * 1.15)
    b.set_ylabel("impressions/s, share of the loader without them")
    b.set_title("loader throughput with points 3 and 4", fontsize=10)
    b.legend(fontsize=8, loc="upper right")
    fig.suptitle(f"embedding_bench: production-shaped synth log, {cfg['users']:,} users, {cfg['items']:,}-item "
                 f"Zipf catalogue ({result['date']})", fontsize=10)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


# -- main ---------------------------------------------------------------------------------
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="ids per batch that reach the embedding layer and cross ranks, per layout")
    p.add_argument("--quick", action="store_true", help="tiny sizes, seconds (the test)")
    p.add_argument("--users", type=int, default=None, help="synth users (default 1000; quick 30)")
    p.add_argument("--days", type=int, default=None, help="days of impressions (default 2; quick 1)")
    p.add_argument("--history-days", type=int, default=None,
                   help="days of action log before them (default: the production shape's 53; quick 3)")
    p.add_argument("--items", type=int, default=None, help="the Zipf catalogue's items (default 1000000; quick 5000)")
    p.add_argument("--max-seq-len", type=int, default=None, help="L, the history a request sees (default 1000; quick 50)")
    p.add_argument("--token-budget", type=int, default=None,
                   help="tokens (stored events + impressions) a batch (default 131072; quick 2048)")
    p.add_argument("--worlds", type=int, nargs="+", default=[8, 64], help="ranks sharding the tables")
    p.add_argument("--hot", type=float, nargs="+", default=[0.001, 0.01], help="hot shares of each table's rows")
    p.add_argument("--workers", type=int, nargs="+", default=None, help="loader workers (default 0 2; quick 0)")
    p.add_argument("--repeats", type=int, default=None, help="timed epochs per variant (default 5; quick 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="default benchmarks/results/embedding_bench.json (quick: stdout)")
    p.add_argument("--plot", default=None, help="default benchmarks/results/embedding_bench.png ('none': no plot)")
    p.add_argument("--replot", default=None, metavar="JSON", help="only draw --plot from an earlier run's JSON")
    a = p.parse_args(argv)
    if a.replot:
        with open(a.replot) as f:
            plot(json.load(f), a.plot or os.path.join(RESULTS, "embedding_bench.png"))
        return 0
    q = a.quick
    pick = lambda v, full, quick: v if v is not None else (quick if q else full)  # noqa: E731
    users, days = pick(a.users, 1000, 30), pick(a.days, 2, 1)
    hdays, items = pick(a.history_days, None, 3), pick(a.items, 1_000_000, 5000)
    L, tb = pick(a.max_seq_len, 1000, 50), pick(a.token_budget, 131072, 2048)
    workers, repeats = pick(a.workers, [0, 2], [0]), pick(a.repeats, 5, 2)
    if any(s <= 0 or s >= 1 for s in a.hot) or any(W < 1 for W in a.worlds):
        p.error("--hot takes shares in (0, 1), --worlds ranks >= 1")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="embedding_bench-") as tmp:
        log = make_log(os.path.join(tmp, "log"), users=users, days=days, items=items, L=L, seed=a.seed,
                       history_days=hdays)
        table = log_samples(os.path.join(tmp, "log"), L=L)
        root = os.path.join(tmp, "shards")
        write_shards(table, root, row_group_rows=256)
        rows = log["rows"]
        hot = hot_sets(table, rows, sorted(a.hot))
        t_prep = time.perf_counter() - t0
        print(f"embedding_bench: {table.num_rows:,} samples, {int(pc.sum(table['num_impressions']).as_py()):,} "
              f"impressions, {int(pc.sum(table['num_events']).as_py()):,} stored events ({t_prep:.0f} s)", flush=True)
        counts = count(root, token_budget=tb, rows=rows, worlds=a.worlds, hot=hot, seed=a.seed)
        routing = IdRouting({k: rows[t] for k, t in KEYS.items()}, world_size=max(a.worlds),
                            hot=hot[max(hot)], per="sample")
        tp = throughput(root, token_budget=tb, workers=workers, repeats=repeats, routing=routing, seed=a.seed)
    measured = log["summary"].get("measured", {})
    result = {
        "date": dt.date.today().isoformat(), "quick": q,
        "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "threads": torch.get_num_threads()},
        "config": {"users": users, "days": days, "history_days": hdays if hdays is not None
                   else synth.SHAPES["production"].history_days, "items": items, "max_seq_len": L,
                   "token_budget": tb, "worlds": a.worlds, "hot": sorted(a.hot), "workers": workers,
                   "repeats": repeats, "seed": a.seed, "keys": KEYS, "vbe_keys": VBE_KEYS, "hist_key": HIST_KEY,
                   "table_rows": rows},
        "log": {"requests": measured.get("requests"), "history_at_request": measured.get("history_at_request"),
                "impressions_per_request": measured.get("impressions_per_request")},
        "counts": counts, "throughput": tp, "target_share": TARGET,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    result["verdict"] = verdict(tp)
    report(result)
    out_json = a.json or (None if q else os.path.join(RESULTS, "embedding_bench.json"))
    out_png = a.plot or (None if q else os.path.join(RESULTS, "embedding_bench.png"))
    text = json.dumps(result, indent=1)
    if out_json:
        with open(out_json, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    if out_png and out_png != "none":
        plot(result, out_png)
    return 0


def report(result: dict) -> None:
    c = result["counts"]
    worlds = result["config"]["worlds"]
    print(f"{c['batches']} batches, {c['impressions_per_batch']:,.0f} impressions a batch; ids per batch "
          f"(per impression):")
    head = f"{'':10} {'reach':>22} " + " ".join(f"{'cross W=' + str(W):>22} {'busiest':>7}" for W in worlds)
    print(head)
    for n, v in c["variants"].items():
        cells = " ".join(f"{v['cross_per_batch'][str(W)]:>12,.0f} ({v['cross_per_impression'][str(W)]:>6.1f}) "
                         f"{v['busiest_over_mean'][str(W)]:>7.2f}" for W in worlds)
        print(f"{n:10} {v['reach_per_batch']:>12,.0f} ({v['reach_per_impression']:>7.1f}) {cells}")
    for r in result["throughput"]:
        print(f"workers {r['workers']}: base {r['base']['impressions_per_s']:,.0f} impressions/s; share kept: "
              + ", ".join(f"{n} {r[n]['share_of_base']:.3f}" for n in VARIANTS))
    print(result["verdict"])


if __name__ == "__main__":
    sys.exit(main())
