"""`userwise diagnose` and the GPU check script on a CPU-only machine."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.support.shardgen import write_shard_set
from userwise.pipelines.cli import main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("diag"))
    write_shard_set(root, nodes=1, ranks_per_node=1, row_group_rows=16,
                    sets=(("incremental", "2026-01-04", "2026-01-05", 60),))
    return root


def test_diagnose_runs_three_steps_and_names_the_bottleneck(staged, capsys):
    rc = main(["diagnose", "--shards", staged, "--device", "cpu", "--batch-size", "8", "--batches", "5"])
    out = capsys.readouterr().out
    assert rc == 0
    for s in ("1. generated on the device", "2. host, copied", "3. read from shards"):
        assert s in out
    assert out.strip().splitlines()[-1].startswith("bottleneck: ")


def test_diagnose_bad_dir_is_a_one_line_error(tmp_path, capsys):
    rc = main(["diagnose", "--shards", str(tmp_path), "--device", "cpu"])
    assert rc == 2 and "manifest.json" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU exit")
def test_gpu_check_exits_cleanly_without_a_gpu():
    r = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "gpu_check.py")], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "no CUDA device" in r.stdout


def test_loader_bench_merge_averages_runs(tmp_path):
    """--merge: the docs' figures are the mean of several runs; counts must agree, numbers average."""
    import json

    def run(share, cpu, pairs):
        return {"profiles": {"long": {"profile": "long", "repeats": 2, "batch_size": 128, "cpus": 2,
                                      "events_per_sample": 200.0, "loadavg_start": [1, 1, 1],
                                      "runs": [{"workers": 1, "buffer_row_groups": 2, "share_of_ceiling": share,
                                                "share_of_ceiling_pairs": pairs, "cpu_efficiency": cpu,
                                                "impressions_vs_pointwise": 100.0,
                                                "loader": {"samples_per_s": 10.0, "epoch_s": pairs}}]}}}
    files = []
    for i, r in enumerate([run(0.6, 0.7, [0.5, 0.7]), run(0.8, 0.9, [0.9, 0.7])]):
        files.append(tmp_path / f"r{i}.json")
        files[-1].write_text(json.dumps(r))
    out = tmp_path / "mean.json"
    bench = os.path.join(REPO, "benchmarks", "loader_bench.py")
    r = subprocess.run([sys.executable, bench, "--merge", *map(str, files), "--json", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    got = json.loads(out.read_text())["profiles"]["long"]
    assert got["runs_averaged"] == 2
    (w,) = got["runs"]
    assert w["workers"] == 1 and w["buffer_row_groups"] == 2
    assert abs(w["share_of_ceiling"] - 0.7) < 1e-9 and abs(w["cpu_efficiency"] - 0.8) < 1e-9
    assert w["share_of_ceiling_pairs"] == [0.5, 0.7, 0.9, 0.7]
    # petastorm's figures from the runs that measured it (the others ran --no-petastorm)
    with_p = [run(0.6, 0.7, [0.5]), run(0.8, 0.9, [0.9]), run(0.7, 0.8, [0.7])]
    with_p[0]["profiles"]["long"]["runs"][0].update(samples_vs_petastorm=9.0, petastorm={"samples_per_s": 2.0})
    with_p[1]["profiles"]["long"]["runs"][0].update(samples_vs_petastorm=None, petastorm=None)
    with_p[2]["profiles"]["long"]["runs"][0].update(samples_vs_petastorm=11.0, petastorm={"samples_per_s": 4.0})
    for f, r in zip(files + [tmp_path / "r2.json"], with_p):
        f.write_text(json.dumps(r))
    r = subprocess.run([sys.executable, bench, "--merge", *map(str, files), str(tmp_path / "r2.json"), "--json", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    (w,) = json.loads(out.read_text())["profiles"]["long"]["runs"]
    assert abs(w["samples_vs_petastorm"] - 10.0) < 1e-9 and abs(w["petastorm"]["samples_per_s"] - 3.0) < 1e-9
    assert abs(w["share_of_ceiling"] - 0.7) < 1e-9
    # runs of different worker counts are not averaged into one
    bad = run(0.6, 0.7, [0.5])
    bad["profiles"]["long"]["runs"][0]["workers"] = 2
    files[1].write_text(json.dumps(bad))
    r = subprocess.run([sys.executable, bench, "--merge", *map(str, files), "--json", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "differ" in r.stderr


def test_loader_bench_runs_with_a_token_budget(tmp_path):
    """A tiny real run of the benchmark, batches cut by tokens: it reports the budget and the
    loader's own batch count for it (the docs compare batch 128 with a token budget)."""
    import json

    from userwise.pipelines.loader import UserwiseDataset

    out, shards = tmp_path / "bench.json", tmp_path / "shards"
    bench = os.path.join(REPO, "benchmarks", "loader_bench.py")
    r = subprocess.run([sys.executable, bench, "--profiles", "short", "--samples", "300", "--pointwise-samples", "60",
                        "--repeats", "1", "--workers", "0", "--token-budget", "500", "--pointwise-cap-s", "0.2",
                        "--shards", str(shards), "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    got = json.loads(out.read_text())["profiles"]["short"]
    assert got["token_budget"] == 500 and got["samples"] == 300
    (run,) = got["runs"]
    want = len(UserwiseDataset(str(shards / "short"), token_budget=500, world_size=1, rank=0, verify="none"))
    assert run["batches_per_epoch"] == want > 300 * 9 // 500
    assert run["share_of_ceiling"] > 0 and run["impressions_vs_pointwise"] > 0
    # the petastorm baseline ran over the same shards (its own environment) with one worker
    assert run["samples_vs_petastorm"] > 0 and run["petastorm"]["workers"] == 1


def test_loader_phases_times_every_phase_of_a_whole_epoch(staged):
    """The one-thread phase benchmark walks every sample of the node once per epoch and
    reports each phase and the loader's multiple of its ceiling."""
    import re

    bench = os.path.join(REPO, "benchmarks", "loader_phases.py")
    r = subprocess.run([sys.executable, bench, staged, "--epochs", "2", "--token-budget", "300"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    line = r.stdout.strip().splitlines()[-1]
    assert " 60 samples per epoch" in line
    for k in ("ceiling", "read", "from_arrow", "check", "prepared", "shuffle", "cut", "total", "gather"):
        assert re.search(rf"\b{k} \d+\.\d", line), (k, line)
    assert float(re.search(r"loader / ceiling (\d+\.\d+)x", line).group(1)) > 0
    assert float(re.search(r"\(ceiling \+ gather alone\) / ceiling (\d+\.\d+)x", line).group(1)) >= 1


def _least_loader():
    import importlib.util

    spec = importlib.util.spec_from_file_location("least_loader", os.path.join(REPO, "benchmarks", "least_loader.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_least_loader_gathers_write_pyarrows_take_of_the_batch(staged):
    """The least-loader benchmark's two gathers move exactly the batch's values: both write the
    bytes of pyarrow's own ``take`` of the batch's rows (offsets rebased to 0), laid out per
    group as offsets, numeric columns by dtype, then strings. A bound that dropped or mixed up
    values would be no bound."""
    import json

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    ll = _least_loader()
    man = json.load(open(os.path.join(staged, "manifest.json")))
    pf = pq.ParquetFile(os.path.join(staged, man["shards"][0]["path"]))
    table = pf.read_row_groups([1, 2])
    cols = ll.wrap(table)
    idx = np.sort(np.random.default_rng(3).choice(table.num_rows, 13, replace=False))
    taken = table.take(pa.array(idx))

    want, written, pos = np.zeros(1 << 20, np.uint8), np.zeros(1 << 20, bool), 0

    def lay(a: np.ndarray, valid=None) -> None:
        nonlocal pos
        pos = (pos + 63) // 64 * 64
        b = np.ascontiguousarray(a).view(np.uint8)
        want[pos: pos + len(b)] = b
        # a null's value is whatever the buffer holds (the least loaders carry no validity)
        written[pos: pos + len(b)] = True if valid is None else np.repeat(valid, a.itemsize)
        pos += len(b)

    groups: dict = {}
    for name in table.column_names:
        t = table.schema.field(name).type
        g = name.split("_")[0] if pa.types.is_list(t) else "sample"
        groups.setdefault(g, []).append(name)
    for g, names in groups.items():
        arrs = {n: taken.column(n).combine_chunks() for n in names}
        if g != "sample":
            lay(np.asarray(arrs[names[0]].offsets, np.int64) - arrs[names[0]].offsets[0].as_py())
        flat = {n: (a.flatten() if g != "sample" else a) for n, a in arrs.items()}
        num = [n for n in names if not pa.types.is_string(flat[n].type)]
        for dt in dict.fromkeys(cols[n][2].dtype.str for n in num):
            for n in num:
                if cols[n][2].dtype.str == dt:
                    f = flat[n]
                    lay(f.fill_null(0).to_numpy(zero_copy_only=False).astype(cols[n][2].dtype),
                        None if not f.null_count else np.asarray(f.is_valid().to_pylist(), bool))
        for n in names:
            if pa.types.is_string(flat[n].type):
                strs = [x.encode() for x in flat[n].to_pylist()]
                lay(np.concatenate([[0], np.cumsum([len(x) for x in strs])]).astype(np.int64))
                lay(np.frombuffer(b"".join(strs), np.uint8))
    assert written[:pos].sum() > 13 * len(table.column_names)
    for gather in (ll.TakeGather(), ll.CompiledGather()):
        slot = np.full(1 << 20, 7, np.uint8)  # a filler that no unwritten byte can pass for
        used = gather(gather.prepare(cols), idx, slot)
        assert used == pos, type(gather).__name__
        w = written[:pos]  # the arrays (not the alignment padding between them)
        assert np.array_equal(slot[:pos][w], want[:pos][w]), type(gather).__name__


def test_least_loader_runs_every_mode_next_to_the_ceiling(tmp_path):
    """A tiny real run: every mode (read only, both least loaders, the loader) delivers every
    sample of the node each epoch (the script checks) and gets a share of the ceiling."""
    import json

    out = tmp_path / "least.json"
    bench = os.path.join(REPO, "benchmarks", "least_loader.py")
    r = subprocess.run([sys.executable, bench, "--shards", str(tmp_path / "shards"), "--profiles", "short",
                        "--samples", "300", "--workers", "1", "--repeats", "1", "--token-budget", "500",
                        "--json", str(out), "--plot", str(tmp_path / "least.png")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    (run,) = json.loads(out.read_text())["profiles"]["short"]
    assert run["workers"] == 1 and run["samples"] == 300
    for m in ("read", "take", "compiled", "loader"):
        assert run[f"{m}_share"] > 0 and run[f"{m}_epoch_ms"] > 0, m
    assert (tmp_path / "least.png").stat().st_size > 0


def test_least_loader_merge_averages_runs():
    """--merge: each figure is the mean over runs per profile and worker count; pairs are pooled."""
    ll = _least_loader()

    def run(share, ms):
        return {"cpus": 2, "token_budget": 8, "profiles": {"short": [
            {"workers": 1, "samples": 10, **{f"{m}_share": share for m in ll.MODES},
             **{f"{m}_epoch_ms": ms for m in ll.MODES}, "pairs": {m: [share] for m in ll.MODES}}]}}

    (got,) = ll.merge([run(0.6, 50.0), run(0.8, 70.0)])["profiles"]["short"]
    assert got["workers"] == 1 and got["samples"] == 10
    for m in ll.MODES:
        assert abs(got[f"{m}_share"] - 0.7) < 1e-12 and abs(got[f"{m}_epoch_ms"] - 60.0) < 1e-12
        assert got["pairs"][m] == [0.6, 0.8]
    other = run(0.6, 50.0)
    other["profiles"]["short"][0]["workers"] = 2
    with pytest.raises(SystemExit, match="different worker counts"):
        ll.merge([run(0.6, 50.0), other])
