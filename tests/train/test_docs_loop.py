"""docs/training.md's loop runs as written: two processes with gloo (the environment torchrun
sets), a checkpoint, a resume that continues exactly where the uninterrupted run went on."""

from __future__ import annotations

import importlib
import os
import re
import shutil
import socket
import sys

import torch.multiprocessing as mp

from userwise.pipelines.tools.shardgen import write_shard_set
from userwise.pipelines.train import Checkpoint

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def loop_code() -> str:
    text = open(os.path.join(REPO, "docs", "training.md")).read()
    section = text[text.index("## A complete loop"):]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert blocks, "docs/training.md: no python block under 'A complete loop'"
    return blocks[0]


def _rank(i: int, code: str, env: dict, out: str) -> None:
    """One rank, as torchrun starts it: its environment, then the script."""
    os.environ.update(env, RANK=str(i), LOCAL_RANK=str(i))
    sys.stdout = open(f"{out}.{i}", "w", buffering=1)
    exec(compile(code, "docs/training.md", "exec"), {"__name__": "__main__"})


def run(code: str, tmp, name: str, nprocs: int = 2, **env) -> list[tuple[int, float]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(nprocs),
           "LOCAL_WORLD_SIZE": str(nprocs), **{k: str(v) for k, v in env.items()}}
    out = str(tmp / name)
    mp.start_processes(_rank, args=(code, env, out), nprocs=nprocs, join=True, start_method="fork")
    lines = open(f"{out}.0").read().split("\n")
    return [(int(m[1]), float(m[2])) for m in (re.match(r"step (\d+) loss (\S+)", x) for x in lines) if m]


def test_the_documented_loop_trains_checkpoints_and_resumes(tmp_path):
    importlib.import_module("torch._dynamo")  # DDP's constructor imports it: once here, not in every forked rank

    code = loop_code()
    assert 25 <= len([x for x in code.splitlines() if x.strip()]) <= 45  # "about 30 lines"
    shards = str(tmp_path / "shards")
    write_shard_set(shards, nodes=1, ranks_per_node=2, max_seq_len=50,
                    sets=(("incremental", "2026-01-04", "2026-01-05", 160),))  # 3 batches a rank per epoch
    first = run(code, tmp_path, "first", SHARDS=shards, CKPT_DIR=tmp_path / "ck", STEPS=5, CKPT_EVERY=2)
    assert [s for s, _ in first] == [1, 2, 3, 4, 5]
    assert sorted(os.listdir(tmp_path / "ck")) == ["step-00000002.pt", "step-00000004.pt", "step-00000005.pt"]
    ck = Checkpoint.read(tmp_path / "ck" / "step-00000002.pt")  # plain values: read with weights_only
    assert ck.extra["step"] == 2 and len(ck.extra["loader"]) == 2  # every rank's loader position: mid-epoch
    assert [(s["epoch"], s["cursor"]) for s in ck.extra["loader"]] == [(0, 2), (0, 2)]
    assert ck.model().config()["encoder"] == "sample"  # the model replay --checkpoint serves
    # restart from the step-2 checkpoint alone: the resumed run continues the uninterrupted one, into
    # the next epoch
    os.makedirs(tmp_path / "ck2")
    shutil.copy(tmp_path / "ck" / "step-00000002.pt", tmp_path / "ck2")
    resumed = run(code, tmp_path, "resumed", SHARDS=shards, CKPT_DIR=tmp_path / "ck2", STEPS=5, CKPT_EVERY=2)
    assert [s for s, _ in resumed] == [3, 4, 5]
    for (_, a), (_, b) in zip(resumed, first[2:]):
        assert abs(a - b) <= 1e-6 * abs(b), (resumed, first)
