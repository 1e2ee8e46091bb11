"""`userwise diagnose` and the GPU check script on a CPU-only machine."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from userwise.pipelines.cli import main

from .shardgen import write_shard_set

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
