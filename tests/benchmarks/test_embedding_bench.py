"""benchmarks/embedding_bench.py end to end on tiny data, and its counts against an independent count.

- The samples it models from the synth log: every request of every sample sees exactly its
  user's newest L events strictly before its time, counted here from the log's rows in plain
  Python (acted impressions at ``action_ts``, action-log events at ``ts``).
- One batch's counts (``count_batch``): ids that reach the embedding layer and ids per owner rank,
  for point-wise rows, user-wise samples, batch dedup and hot sets, against a plain numpy/Python
  count over the batch's sample rows (the owner ``id // ceil(rows / W)``, fbgemm's block rule).
- The script's --quick run: the JSON's variants, its invariants (point-wise >= user-wise >= dedup,
  hot ids crossing less), the throughput rows and the verdict line, the plot and --replot.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter, defaultdict

import numpy as np
import pyarrow.dataset as pds
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(REPO, "benchmarks", "embedding_bench.py")
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import embedding_bench as eb  # noqa: E402

L = 20


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("embedding_bench")
    log = eb.make_log(str(root / "log"), users=40, days=1, items=3000, L=L, seed=3, history_days=2)
    table = eb.log_samples(str(root / "log"), L=L)
    eb.write_shards(table, str(root / "shards"), row_group_rows=4)
    return {"root": root, "rows": log["rows"], "table": table}


def _events(log: str) -> dict[int, list[tuple[int, int]]]:
    """Per user, her events as (time, item), from the log's rows one by one."""
    out = defaultdict(list)
    lean = pds.dataset(os.path.join(log, "lean"), format="parquet", partitioning="hive").to_table().to_pylist()
    for r in lean:
        if r["click"] > 0 or r["like"] > 0:
            out[r["user_id"]].append((r["action_ts"], r["item_id"]))
    acts = pds.dataset(os.path.join(log, "actions"), format="parquet", partitioning="hive").to_table().to_pylist()
    for r in acts:
        out[r["uid"]].append((r["ts"], r["iid"]))
    return out


def test_every_request_sees_its_users_newest_L_events_before_it(tiny):
    events = _events(str(tiny["root"] / "log"))
    rows = tiny["table"].to_pylist()
    assert len(rows) >= 12 and sum(r["num_requests"] for r in rows) > 30
    seen_full = 0
    for r in rows:
        stored = list(zip(r["seq_ts"], r["seq_item"]))
        assert r["num_events"] == len(stored) and r["cost"] == len(stored) + r["num_impressions"]
        assert r["seq_ts"] == sorted(r["seq_ts"])
        for t, b, e in zip(r["req_time"], r["req_seq_begin"], r["req_seq_end"]):
            before = sorted(x for x in events[r["user"]] if x[0] < t)[-L:]
            assert sorted(stored[b:e]) == before
            seen_full += len(before) == L
        # the stored range is exactly what its requests see
        spans = [(b, e) for b, e in zip(r["req_seq_begin"], r["req_seq_end"]) if e > b]
        if spans:
            assert min(b for b, _ in spans) == 0 and max(e for _, e in spans) == len(stored)
        else:
            assert not stored
    assert seen_full > 10  # the history days fill L for most requests


def _owner(i: int, rows: int, W: int) -> int:
    block = -(-rows // W)
    return i // block if i < block * W else i % W


def test_one_batch_counts_equal_an_independent_count(tiny):
    from userwise.pipelines.loader import UserwiseDataset

    rows, table = tiny["rows"], tiny["table"]
    hot = eb.hot_sets(table, rows, [0.01, 0.05])
    ds = UserwiseDataset(str(tiny["root"] / "shards"), token_budget=600, world_size=1, rank=0, verify="none",
                         device="cpu", gds=False)
    b = next(iter(ds))
    worlds = [3, 8]
    c = eb.count_batch(b, rows=rows, worlds=worlds, hot=hot, check=True)
    ids = set(b["sample_id"].numpy().tolist())
    samples = [r for r in table.to_pylist() if r["sample_id"] in ids]
    assert len(samples) == b.num_samples >= 2
    for key, tab in eb.KEYS.items():
        n = rows[tab]
        pw, uw = [], []
        for s in samples:
            if key.startswith("seq_"):
                uw += s[key]
                for bg, e, k in zip(s["req_seq_begin"], s["req_seq_end"], s["req_num_imps"]):
                    pw += s[key][bg:e] * k
            else:
                uw += s[key]
                pw += s[key]
        assert max(uw) < n
        assert c["pointwise"]["reach"][key] == len(pw) > 0
        assert c["userwise"]["reach"][key] == len(uw)
        assert c["dedup"]["reach"][key] == len(set(uw))
        for share in (0.01, 0.05):
            assert c[eb.hot_name(share)]["reach"][key] == len(set(uw))
    for W in worlds:
        want = defaultdict(lambda: np.zeros(W, np.int64))
        for key, tab in eb.KEYS.items():
            n = rows[tab]
            vals = [v for s in samples for v in s[key]]
            pwv = [v for s in samples for bg, e, k in zip(s["req_seq_begin"], s["req_seq_end"], s["req_num_imps"])
                   for v in s[key][bg:e] * k] if key.startswith("seq_") else vals
            for v, m in Counter(pwv).items():
                want["pointwise"][_owner(v, n, W)] += m
            for v, m in Counter(vals).items():
                want["userwise"][_owner(v, n, W)] += m
            for v in set(vals):
                want["dedup"][_owner(v, n, W)] += 1
                for share in (0.01, 0.05):
                    if v not in set(hot[share][key].tolist()):
                        want[eb.hot_name(share)][_owner(v, n, W)] += 1
        for name in c:
            assert c[name]["per_rank"][W].tolist() == want[name].tolist(), (name, W)
    # the hot sets: the most looked-up ids of each table, ceil(share x rows) of them at most
    for key, tab in eb.KEYS.items():
        counts = Counter(v for s in table.to_pylist() for v in s[key])
        h = hot[0.05][key]
        assert len(h) <= -(-rows[tab] * 5 // 100) and len(h)
        least_hot = min(counts[int(x)] for x in h)
        assert all(m <= least_hot for v, m in counts.items() if v not in set(h.tolist()))
        assert set(hot[0.01][key].tolist()) <= set(h.tolist())


def test_quick_run_end_to_end(tmp_path):
    out, png = tmp_path / "eb.json", tmp_path / "eb.png"
    r = subprocess.run([sys.executable, BENCH, "--quick", "--users", "16", "--json", str(out), "--plot", str(png)],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    v = res["counts"]["variants"]
    assert list(v) == ["pointwise", "userwise", "dedup", "hot0.1%", "hot1%"]
    assert v["pointwise"]["reach_per_batch"] > v["userwise"]["reach_per_batch"] > v["dedup"]["reach_per_batch"] > 0
    assert v["hot1%"]["reach_per_batch"] == v["hot0.1%"]["reach_per_batch"] == v["dedup"]["reach_per_batch"]
    for W in ("8", "64"):
        assert v["dedup"]["cross_per_batch"][W] >= v["hot0.1%"]["cross_per_batch"][W] >= \
            v["hot1%"]["cross_per_batch"][W]
        for n in v:
            assert 0 < v[n]["cross_per_batch"][W] < v[n]["reach_per_batch"]
            assert v[n]["busiest_over_mean"][W] >= 1
    c = res["counts"]
    assert c["batches"] >= 2 and c["impressions"] == pytest.approx(c["impressions_per_batch"] * c["batches"])
    (tp,) = res["throughput"]
    assert tp["workers"] == 0 and tp["impressions_per_epoch"] == c["impressions"]
    for n in ("vbe", "vbe_hist", "ids", "both"):
        assert tp[n]["share_of_base"] > 0 and len(tp[n]["share_of_base_pairs"]) == 2
    share = tp["both"]["share_of_base"]
    line = next(x for x in r.stdout.splitlines() if x.startswith("verdict: "))
    assert line == res["verdict"] and line.startswith("verdict: met" if share >= 0.9 else "verdict: not met")
    assert f"{share:.3f}" in line
    assert png.stat().st_size > 10_000
    png.unlink()
    r = subprocess.run([sys.executable, BENCH, "--replot", str(out), "--plot", str(png)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and png.stat().st_size > 10_000, r.stderr[-2000:]
