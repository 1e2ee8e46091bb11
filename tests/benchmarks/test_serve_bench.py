"""The serving benchmark end to end on tiny sizes: every variant is timed for every (history,
candidates) pair, the ratios are the medians', the cached paths were checked against the full
recompute before timing, the K/V bytes per user and users per GiB are the store's page
arithmetic (in float32 and in bfloat16), the sizing table is the same arithmetic, and the plot
is drawn from the JSON (also by --replot)."""

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
        _assert_sizes(x, dim=16, layers=2, element=4)
    assert res["verdicts"] == []  # the target's size (4096, 256) is not in a quick run
    assert res["config"]["new_events"] == 24 and res["host"]["threads"] == 1 and res["config"]["dtype"] == "float32"
    assert png.stat().st_size > 10_000
    png.unlink()
    r = subprocess.run([sys.executable, BENCH, "--replot", str(out), "--plot", str(png)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and png.stat().st_size > 10_000, r.stderr[-2000:]


def _assert_sizes(x: dict, *, dim: int, layers: int, element: int, page: int = 64) -> None:
    """A run's memory fields: pages of [2 * layers + 2, P, dim] elements, one per P events."""
    assert x["page_bytes"] == (2 * layers + 2) * page * dim * element
    assert x["kv_bytes_per_user"] == -(-x["history"] // page) * x["page_bytes"]
    assert x["kv_bytes_per_user"] < x["kv_file_bytes_per_user"] < x["kv_bytes_per_user"] + 4096  # + its header
    assert x["users_per_gib"] == (1 << 30) // x["kv_bytes_per_user"]
    assert x["cached_over_full"] == pytest.approx(x["cached_ms"] / x["full_ms"], rel=0.01, abs=6e-5)
    assert x["cached_store_over_full"] == pytest.approx(x["cached_store_ms"] / x["full_ms"], rel=0.01, abs=6e-5)
    assert 0 <= x["max_err_units"] <= 2


def test_serve_bench_in_bfloat16_reports_bytes_per_user(tmp_path):
    """--dtype bfloat16: the model and its pages in bfloat16, half float32's bytes per user; the
    cached paths within the half-precision tolerance of the full recompute."""
    out = tmp_path / "serve.json"
    r = subprocess.run([sys.executable, BENCH, "--quick", "--history", "130", "--candidates", "256", "--new", "24",
                        "--dtype", "bfloat16", "--json", str(out), "--plot", "none"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["config"]["dtype"] == "bfloat16" and not list(tmp_path.glob("*.png"))
    (x,) = res["runs"]
    assert (x["history"], x["candidates"]) == (130, 256)
    _assert_sizes(x, dim=16, layers=2, element=2)
    assert x["kv_bytes_per_user"] == 3 * 6 * 64 * 16 * 2 and "users per GiB" in r.stdout


def test_the_sizing_table_is_the_stores_arithmetic():
    """--sizing: users per tier (80 GiB, 512 GiB, 4 TiB) at L = 1K, 4K, 16K, each budget over the
    bytes a user of L events takes there."""
    r = subprocess.run([sys.executable, BENCH, "--sizing", "--layers", "4", "--dim", "256", "--dtype", "bfloat16"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    page = 10 * 64 * 256 * 2
    assert f"{page // 64:,} bytes ({page:,} bytes a page)" in r.stdout
    rows = [line for line in r.stdout.splitlines() if line.startswith("| 1") or line.startswith("| 4")]
    assert [row.split("|")[1].strip() for row in rows] == ["1,024", "4,096", "16,384"]
    for row, L in zip(rows, (1024, 4096, 16384)):
        cells = [c.strip() for c in row.strip("|").split("|")]
        user = L // 64 * page
        assert int(cells[2].replace(",", "")) == (1 << 30) // user
        assert int(cells[3].replace(",", "")) == (80 << 30) // user
        assert int(cells[4].replace(",", "")) == (512 << 30) // user
        assert (4 << 40) // (user + 4096) <= int(cells[5].replace(",", "")) <= (4 << 40) // user  # + a header
