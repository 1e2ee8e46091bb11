"""benchmarks/train_bench.py end to end on tiny sizes: its JSON fields and plot."""

from __future__ import annotations

import importlib.util
import json
import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_train_bench_quick_writes_its_figures(tmp_path):
    out, png = tmp_path / "t.json", tmp_path / "t.png"
    spec = importlib.util.spec_from_file_location("train_bench", os.path.join(REPO, "benchmarks", "train_bench.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)  # in this process: torch is imported already
    rc = bench.main(["--quick", "--profiles", "demo", "one_request", "--lengths", "16", "32", "--seconds", "0.05",
                     "--json", str(out), "--plot", str(png)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    dim, layers = res["config"]["dim"], res["config"]["layers"]
    prof = res["profiles"]
    assert prof["one_request"]["requests_per_sample"] == 1.0
    assert prof["demo"]["impressions_per_sample"] > prof["one_request"]["impressions_per_sample"]
    assert [(x["profile"], x["L"]) for x in res["runs"]] == [("demo", 16), ("demo", 32), ("one_request", 16),
                                                             ("one_request", 32)]
    for x in res["runs"]:
        L = x["L"]
        for k in ("userwise", "pointwise", "least_plan"):
            assert x[k]["impressions_per_s"] > 0 and x[k]["steps"] >= 2
        f = x["flops_per_impression"]
        # every request sees exactly L events here (the log's users have long histories): the least plan is
        # the target attention over L keys, and a point-wise row encodes L events causally
        assert f["least_plan"] == 3 * 4 * dim * L
        assert f["pointwise_encoder"] == 3 * layers * (24 * dim * dim * L + 4 * dim * L * (L + 1) // 2)
        assert f["pointwise"] > f["userwise"] > f["least_plan"] > 0
        assert abs(x["speedup"] - x["userwise"]["impressions_per_s"] / x["pointwise"]["impressions_per_s"]) < 0.01
        assert abs(x["flops_ratio"] - f["pointwise"] / f["userwise"]) < 0.01
    assert any("grows" in v for v in res["verdicts"]) and len(res["verdicts"]) == 4
    # nothing capped at these sizes: every batch measured
    assert all(not x["capped"] and x["impressions_measured"] == x["impressions_in_setting"] for x in res["runs"])


def test_train_bench_caps_the_pointwise_histories_it_holds(tmp_path):
    """--max-history-events (issue #56 point 7, L = 4,000 on a 24 GiB machine): a setting keeps
    its leading batches while impressions x L stay within the cap (at least one batch), and
    says so; both sides are measured over the same kept batches."""
    out = tmp_path / "t.json"
    spec = importlib.util.spec_from_file_location("train_bench", os.path.join(REPO, "benchmarks", "train_bench.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rc = bench.main(["--quick", "--profiles", "demo", "--lengths", "16", "40", "--seconds", "0.05",
                     "--max-history-events", "30000", "--json", str(out), "--plot", str(tmp_path / "t.png")])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["config"]["max_history_events"] == 30000
    for x in res["runs"]:
        L = x["L"]
        assert x["capped"] and x["impressions_measured"] < x["impressions_in_setting"]
        assert x["impressions_measured"] * L <= 30000 or x["batches_measured"] == 1
    assert res["runs"][0]["impressions_in_setting"] == res["runs"][1]["impressions_in_setting"]
    assert res["runs"][0]["impressions_measured"] > res["runs"][1]["impressions_measured"]
    shapes = bench.to_batches(bench.log_shapes("demo", users=12, days=2)[:24], 16, 1024, seed=16)
    kept = bench.cap_batches(shapes, 16, 30000, 64)
    assert kept == shapes[:len(kept)] and 0 < len(kept) < len(shapes)
    assert sum(b.num_impressions for b in kept) * 16 <= 30000 < sum(b.num_impressions for b in shapes[:len(kept) + 1]) * 16
    assert len(bench.cap_batches(shapes, 16, 1 << 40, 2)) == 2 and len(bench.cap_batches(shapes, 10**6, 1, 64)) == 1
