"""The README's Train block and docs/training.md's loop on this host's device: on a CPU host
here, and on a GPU host through benchmarks/device_check.sh (its "guide" step), where the
loader puts batches on cuda and the model must follow them.

The staged folder is a synthetic shard set (shardgen, no Spark): the rest of the README's
walk-through (build, preshard, stage) runs in tests/ops/test_docs.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from tests.train.test_docs_loop import loop_code, run
from userwise.pipelines.tools.shardgen import write_shard_set

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def readme_train_block() -> str:
    text = open(os.path.join(REPO, "README.md")).read()
    guide = text[text.index("## Your own log in five steps"):text.index("## What we promise")]
    (code,) = re.findall(r"^```python\n(.*?)^```", guide, re.S | re.M)
    return code


def test_the_readme_train_block_reads_all_of_the_node_on_this_hosts_device(tmp_path):
    """One process, as written: every impression of node 0's staged shards once (both ranks'
    shares), the model on the loader's device (cuda on a GPU host)."""
    write_shard_set(str(tmp_path / "nvme"), nodes=1, ranks_per_node=2, max_seq_len=50,
                    sets=(("incremental", "2026-01-04", "2026-01-05", 120),))
    code = readme_train_block()
    probe = code + ("\nassert next(model.parameters()).device.type == batch.device.type == "
                    f"{'cuda' if torch.cuda.is_available() else 'cpu'!r}\n")
    r = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    m = re.search(r"^(\d+) impressions, last loss \d", r.stdout, re.MULTILINE)
    man = json.load(open(tmp_path / "nvme" / "manifest.json"))
    assert m and int(m[1]) == sum(s["impressions"] for s in man["shards"] if s["node"] == 0), r.stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (GPU machines only)")
def test_the_documented_loop_on_the_gpu(tmp_path):
    """docs/training.md's loop with NCCL on this host's GPU (one rank: NCCL takes one GPU per
    rank): it trains, checkpoints and resumes where the uninterrupted run went on."""
    import importlib
    import shutil

    importlib.import_module("torch._dynamo")
    shards = str(tmp_path / "shards")
    write_shard_set(shards, nodes=1, ranks_per_node=1, max_seq_len=50,
                    sets=(("incremental", "2026-01-04", "2026-01-05", 160),))
    code = loop_code()
    first = run(code, tmp_path, "first", nprocs=1, SHARDS=shards, CKPT_DIR=tmp_path / "ck", STEPS=5, CKPT_EVERY=2)
    assert [s for s, _ in first] == [1, 2, 3, 4, 5]
    os.makedirs(tmp_path / "ck2")
    shutil.copy(tmp_path / "ck" / "step-00000002.pt", tmp_path / "ck2")
    resumed = run(code, tmp_path, "resumed", nprocs=1, SHARDS=shards, CKPT_DIR=tmp_path / "ck2", STEPS=5,
                  CKPT_EVERY=2)
    assert [s for s, _ in resumed] == [3, 4, 5]
    for (_, a), (_, b) in zip(resumed, first[2:]):
        assert abs(a - b) <= 1e-4 * abs(b), (resumed, first)
