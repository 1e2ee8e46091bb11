"""`userwise diagnose` and the GPU check script on a CPU-only machine."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.support.shard_sets import one_day_set
from userwise.pipelines.cli import main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    return one_day_set(str(tmp_path_factory.mktemp("diag")))


def test_diagnose_runs_three_steps_and_names_the_bottleneck(staged, capsys):
    rc = main(["diagnose", "--staged", staged, "--device", "cpu", "--batch-size", "8", "--batches", "5"])
    out = capsys.readouterr().out
    assert rc == 0
    for s in ("1. generated on the device", "2. host, copied", "3. read from shards"):
        assert s in out
    assert out.strip().splitlines()[-1].startswith("bottleneck: ")


def test_diagnose_bad_dir_is_a_one_line_error(tmp_path, capsys):
    rc = main(["diagnose", "--staged", str(tmp_path), "--device", "cpu"])
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
    loader's own batch count for it (the docs compare batch 128 with a token budget), and
    torch's DataLoader over the same dataset beside it."""
    import importlib.util
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
    # torch's own DataLoader over the same dataset, paired with the loader in every repeat
    # (the script stops if it delivered other samples than the loader); StatefulDataLoader
    # only where torchdata is installed
    tdl = run["torch_dataloader"]
    assert tdl["samples_per_s"] > 0 and tdl["events_per_s"] > 0 and tdl["share_of_ceiling"] > 0
    assert len(tdl["share_of_ceiling_pairs"]) == len(tdl["epoch_s"]) == 1 and not tdl["persistent_workers"]
    assert run["torch_vs_loader"] > 0 and len(run["torch_vs_loader_pairs"]) == 1
    assert ("stateful_dataloader" in run) == (importlib.util.find_spec("torchdata") is not None)


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


def test_loader_bench_lengths_scale_the_budget_and_name_where_it_stops(tmp_path):
    """--lengths (issue #56 point 6): one profile per length whose samples hold about that many
    events, the token budget scaled with it, the one-thread phase breakdown beside it and a
    verdict at 2 workers: reaches 0.8 of the ceiling, or stops, naming the largest phase."""
    import json

    out = tmp_path / "bench.json"
    bench = os.path.join(REPO, "benchmarks", "loader_bench.py")
    r = subprocess.run([sys.executable, bench, "--lengths", "200", "800", "--length-events", "24000",
                        "--length-batch-samples", "4", "--workers", "2", "--repeats", "1", "--pointwise-cap-s", "0.2",
                        "--phase-epochs", "1", "--no-petastorm", "--no-torch-loader", "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    got = json.loads(out.read_text())["profiles"]
    assert list(got) == ["L200", "L800"]  # no fixed profile unless asked for
    phases = ("read", "from_arrow", "check", "prepared", "shuffle", "cut")
    for L, res in ((200, got["L200"]), (800, got["L800"])):
        assert res["length"] == L and res["token_budget"] == 4 * L
        assert res["samples"] == 24000 // L
        # a request sees every event before it: the stored range ends at the last request
        assert 0.6 * L < res["events_per_sample"] <= L
        (run,) = res["runs"]
        assert run["workers"] == 2 and "torch_dataloader" not in run and "petastorm" not in run
        assert set(res["phases"]) == {"ceiling", "total", "gather", *phases}
        assert abs(res["phases"]["total"] - sum(res["phases"][k] for k in phases)) < 1e-6
        assert res["limiting_phase"] == max(phases, key=res["phases"].get)
        assert res["target_workers"] == 2 and res["reaches_target"] == (run["share_of_ceiling"] >= 0.8)
        assert res["verdict"].startswith(f"L={L}: {run['share_of_ceiling']:.2f} of the pyarrow ceiling with 2 worker(s)")
        assert res["verdict"].endswith("reaches 0.8") if res["reaches_target"] else \
            f"largest phase on one thread: {res['limiting_phase']}" in res["verdict"]
        assert f"  L={L}: " in r.stdout
