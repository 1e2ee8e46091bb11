"""The serving benchmark end to end on tiny sizes: every variant is timed for every (history,
candidates) pair, the ratios are the medians', the cached paths were checked against the full
recompute before timing, and the plot is drawn from the JSON (also by --replot)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(REPO, "benchmarks", "serve_bench.py")


def test_serve_bench_runs_end_to_end_on_tiny_sizes(tmp_path):
    out, png = tmp_path / "serve.json", tmp_path / "serve.png"
    r = subprocess.run([sys.executable, BENCH, "--quick", "--history", "80", "140", "--candidates", "1", "4",
                        "--new", "24", "--json", str(out), "--plot", str(png)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert [(x["history"], x["candidates"]) for x in res["runs"]] == [(80, 1), (80, 4), (140, 1), (140, 4)]
    for x in res["runs"]:
        assert x["cached_events"] == x["history"] - 24 and x["new_events"] == 24
        assert all(x[f"{k}_ms"] > 0 for k in ("full", "cached", "cached_store", "score_only", "least_plan"))
        assert x["speedup"] == pytest.approx(x["full_ms"] / x["cached_ms"], rel=0.01, abs=0.006)  # 2 decimals
        assert x["speedup_with_store"] == pytest.approx(x["full_ms"] / x["cached_store_ms"], rel=0.01, abs=0.006)
        # the store reuses the whole held state, its unfinished last page included
        assert x["store_reused_events"] == x["cached_events"]
    assert res["verdicts"] == []  # the target's size (4096, 256) is not in a quick run
    assert res["config"]["new_events"] == 24 and res["host"]["threads"] == 1
    assert png.stat().st_size > 10_000
    png.unlink()
    r = subprocess.run([sys.executable, BENCH, "--replot", str(out), "--plot", str(png)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and png.stat().st_size > 10_000, r.stderr[-2000:]
