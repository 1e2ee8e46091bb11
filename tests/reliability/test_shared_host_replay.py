"""`userwise replay` on a shared host (issue 54; docs/security.md): it reads shards through the
loader's verified reader, so a damaged page is one error line, never a report on other data;
every size flag is bounded by the data or the host before anything is built; its disk tier's
files live in a folder of its run alone, gone when the run ends, fails, is terminated or
interrupted, and a killed run's folder is removed by the next run. No Spark here."""

from __future__ import annotations

import errno
import json
import os
import random
import resource
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest
import torch

from tests.loader.test_loader_integrity import Flipped, footer
from tests.reliability.test_hostile_input import one_error
from userwise import schemas
from userwise.pipelines import cli as cli_main
from userwise.pipelines.errors import ShardError
from userwise.pipelines.serve import KVStore, build_replay, read_trace, replay
from userwise.pipelines.shards import preshard
from userwise.pipelines.tools.shardgen import build_samples, layout

PY = sys.executable
# tiers small enough that states move to the disk tier after a few requests (MiB)
TIERS = ["--page-size", "8", "--device-mb", "0.01", "--host-mb", "0.02", "--disk-mb", "1"]
SMALL = dict(page_size=8, device_bytes=10_000, host_bytes=20_000, disk_bytes=1 << 20)
FAST = ["--dim", "8", "--layers", "1", "--quiet"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> str:
    """A one-node shard set of two shards (12 users; pages with CRCs, as preshard writes them)."""
    root = str(tmp_path_factory.mktemp("replay") / "S")
    preshard.preshard_arrow(build_samples(seed=4, users=8, bot_chunks=1, windows=1), root,
                            schema=schemas.shard_schema(layout()).to_arrow(), nodes=1, ranks_per_node=1, seed=1,
                            row_group_rows=16)
    return root


def run(capsys, *argv) -> tuple[int, str, str]:
    """``userwise replay ...`` in this process: (exit code, stdout, stderr)."""
    capsys.readouterr()
    try:
        rc = cli_main.main(["replay", *argv])
    except SystemExit as e:  # a usage error
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def error_line(rc: int, err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, (rc, err[-2000:])
    return lines[0]


def files_under(path) -> list:
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs)


def _trace_key(root: str, verify: str) -> tuple:
    tr = read_trace(root, verify=verify)
    arrays = [tr.sample_ids, tr.seq_offsets, tr.ev_item, tr.ev_side, tr.ev_action, tr.hashes, tr.req_offsets,
              tr.req_begin, tr.req_end, tr.req_time, tr.imp_offsets, tr.tgt_item, tr.tgt_side, tr.labels,
              tr.node_of_sample, *([] if tr.ev_time is None else [tr.ev_time])]
    return (tuple(np.ascontiguousarray(a).tobytes() for a in arrays), repr(tr.users), repr(list(tr.req_id)),
            [o.tolist() for o in tr.order])


# -- defect 9: one reader, the loader's ------------------------------------------------------------


def test_flipped_data_pages_never_change_the_trace_nor_escape(shards):
    """The report's case: bits flipped in a shard's data pages silently changed the candidates
    (the replay read without page checks) or escaped as an OSError. Read through the loader's
    reader, under each ``verify`` mode, a flip is a ShardError naming the file or changes
    nothing; under ``checksum`` every flip is caught before a page is read."""
    path = os.path.join(shards, "node=0", "shard-00000.parquet")
    ref = _trace_key(shards, "checksum")
    assert _trace_key(shards, "none") == ref
    f0, _ = footer(path)
    rnd = random.Random(54)
    seen = {"error": 0, "same": 0}
    for k in range(150):
        verify = ("none", "size", "checksum")[k % 3]
        with Flipped(path, rnd.randrange(4, f0), rnd.randrange(8)):
            try:
                got = _trace_key(shards, verify)
            except ShardError as e:
                assert path in str(e), e
                if verify == "checksum":
                    assert "checksum mismatch" in str(e)
                seen["error"] += 1
            else:
                assert verify != "checksum" and got == ref, f"a flip changed the trace under verify={verify}"
                seen["same"] += 1
    assert seen["error"] > 100, seen


def test_the_command_gives_the_same_report_or_one_error_line(shards, capsys):
    """Through the command, ``--verify size`` (pages still checked): every flip gives the undamaged
    set's report or exit 2 with one error line naming the shard, never exit 1; the default,
    ``--verify checksum``, refuses a flipped file before reading it."""
    path = os.path.join(shards, "node=0", "shard-00000.parquet")
    argv = ["--shards", shards, *FAST, "--max-requests", "15", "--json"]
    rc, out, err = run(capsys, *argv, "--verify", "size")
    assert rc == 0, err
    ref = {k: v for k, v in json.loads(out).items() if k != "timing"}
    f0, _ = footer(path)
    rnd = random.Random(9)
    errors = 0
    for _ in range(12):
        with Flipped(path, rnd.randrange(4, f0), rnd.randrange(8)):
            rc, out, err = run(capsys, *argv, "--verify", "size")
            if rc == 0:
                assert {k: v for k, v in json.loads(out).items() if k != "timing"} == ref
            else:
                assert path in error_line(rc, err)
                errors += 1
    assert errors > 6
    with Flipped(path, f0 // 2):
        rc, _, err = run(capsys, *argv)
        assert "checksum mismatch" in error_line(rc, err) and path in err


# -- defects 13 and 14: every size bounded, one error line -----------------------------------------


def _limited():
    _, hard = resource.getrlimit(resource.RLIMIT_AS)  # a model built anyway fails, not the host
    limit = 8 << 30 if hard == resource.RLIM_INFINITY else min(8 << 30, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


@pytest.mark.parametrize("flags,needle", [
    (["--serving-nodes", "1000000"], "more serving nodes than the 12 users"),
    (["--layers", "100000"], "at most 1,024 layers"),
    (["--dim", "1000000", "--heads", "1"], "use a smaller --dim or --layers"),
    (["--dim", "4096", "--layers", "1000"], "use a smaller --dim or --layers"),
])
def test_a_size_beyond_the_data_or_the_host_is_refused_at_once(shards, flags, needle):
    """The report: 1,000,000 serving nodes took 3.4 GB and 132 s for five requests, 100,000
    layers 8 GB after 14 minutes. Serving nodes are bounded by the trace's users, layers by a
    fixed depth, the model and its working memory by the memory available."""
    t0 = time.monotonic()
    r = subprocess.run([PY, "-m", "userwise.pipelines.cli", "replay", "--shards", shards, "--quiet", *flags],
                       capture_output=True, text=True, timeout=120, preexec_fn=_limited)
    one_error(r, needle)
    assert time.monotonic() - t0 < 60


def test_a_checkpoints_config_is_bounded_by_its_weights(shards, tmp_path):
    """A checkpoint's config is read before its weights are loaded: a config of 100,000 layers
    (or a huge dim) with the weights of a small model built for minutes before it failed."""
    from userwise.pipelines.train import ReferenceRanker

    cfg = dict(dim=8, heads=2, layers=1, side_features=2, num_labels=2)
    sd = ReferenceRanker(**cfg).state_dict()
    for i, big in enumerate([dict(layers=100_000), dict(dim=10**9)]):
        path = tmp_path / f"ck{i}.pt"
        torch.save({"config": {**cfg, **big}, "state_dict": sd}, path)
        t0 = time.monotonic()
        r = subprocess.run([PY, "-m", "userwise.pipelines.cli", "replay", "--shards", shards, "--quiet",
                            "--checkpoint", str(path)], capture_output=True, text=True, timeout=120,
                           preexec_fn=_limited)
        one_error(r, str(path), "its weights hold")
        assert time.monotonic() - t0 < 30  # refused before the model is built


@pytest.mark.parametrize("flags,needle", [
    (["--device-mb", "nan"], "--device-mb"),
    (["--host-mb", "inf"], "--host-mb"),
    (["--device-mb", "1e12"], "--device-mb"),
    (["--host-mb", "1e12"], "--host-mb"),
    (["--disk-mb", "1e12"], "--disk-mb"),
    (["--seed", "1" + "0" * 30], "seed"),
])
def test_a_flag_out_of_range_is_one_error_line(shards, capsys, flags, needle):
    """``--device-mb nan`` and ``1e12`` exited 1 (an internal error), and so did a seed torch cannot
    take; a disk tier larger than its disk ran on."""
    rc, _, err = run(capsys, "--shards", shards, *FAST, "--max-requests", "3", *flags)
    assert needle in error_line(rc, err)


def test_cuda_without_a_gpu_is_one_error_line(shards, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rc, _, err = run(capsys, "--shards", shards, *FAST, "--device", "cuda", "--max-requests", "3")
    assert "no CUDA device here" in error_line(rc, err)


# -- defects 7, 12, 15: the disk tier's files go with the run --------------------------------------


def test_the_cache_dir_holds_nothing_after_a_replay(shards, tmp_path):
    """The report: --cache-dir files stayed after a replay, counted nowhere."""
    d = tmp_path / "cache"
    r = replay(shards, serving_nodes=2, dim=8, layers=1, cache_dir=d, **SMALL)
    assert r["equality"]["equal"] and sum(n["offloaded"]["host_to_disk"] for n in r["nodes"]) > 0
    assert files_under(d) == [] and os.listdir(d) == []


class _FullDisk(KVStore):
    """A store whose disk fills up after some states were written to it."""

    def put(self, *a, **kw):
        self.n = getattr(self, "n", 0) + 1
        if self.n == 30:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super().put(*a, **kw)


def test_a_full_disk_is_the_disk_is_full_line_and_leaves_nothing(shards, capsys, monkeypatch, tmp_path):
    d = tmp_path / "cache"
    monkeypatch.setattr(build_replay, "KVStore", _FullDisk)
    rc, _, err = run(capsys, "--shards", shards, *FAST, *TIERS, "--cache-dir", str(d))
    assert "the disk is full" in error_line(rc, err)
    assert files_under(d) == []


HANG = """
import os, sys, time
from userwise.pipelines import cli
from userwise.pipelines.serve import KVStore, build_replay

marker, watch = sys.argv[1], sys.argv[2]


class Hang(KVStore):  # waits to be killed once the disk tier holds files
    def put(self, *a, **kw):
        out = super().put(*a, **kw)
        if any(files for _, _, files in os.walk(watch)):
            open(marker, "w").close()
            time.sleep(600)
        return out


build_replay.KVStore = Hang
sys.exit(cli.main(sys.argv[3:]))
"""


def _hanging_replay(tmp_path, watch, *argv) -> tuple[subprocess.Popen, str]:
    """A replay that stops mid-run, its disk tier's files written: (process, stderr file)."""
    script, marker, err = tmp_path / "hang.py", tmp_path / "marker", tmp_path / "stderr"
    (tmp_path / "tmp").mkdir(exist_ok=True)
    script.write_text(HANG)
    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp"), "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen([PY, str(script), str(marker), str(watch), "replay", *argv], env=env,
                         stdout=subprocess.DEVNULL, stderr=open(err, "w"))
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert p.poll() is None, err.read_text()[-2000:]
        assert time.monotonic() < deadline, "the replay never wrote its disk tier"
        time.sleep(0.05)
    return p, str(err)


def test_a_killed_replay_leaves_nothing_in_the_temp_folder(shards, tmp_path, monkeypatch, capsys):
    """The report: a killed `userwise replay` left /tmp/userwise-replay-*. Its files are in this
    user's private folder (0700), in a folder of the run, and the next replay removes a folder
    whose process is gone."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    p, _ = _hanging_replay(tmp_path, tmp, "--shards", shards, *FAST, *TIERS)
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=60)
    assert not [n for n in os.listdir(tmp) if n.startswith("userwise-replay")], os.listdir(tmp)
    private = tmp / f"userwise-{os.getuid()}" / "replay"
    assert os.stat(private).st_mode & 0o777 == 0o700
    (stale,) = os.listdir(private)
    assert str(p.pid) in stale and os.stat(private / stale).st_mode & 0o777 == 0o700
    # the next replay (another process: the killed one's pid is gone) removes the folder it left
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    rc, _, err = run(capsys, "--shards", shards, *FAST, *TIERS, "--max-requests", "20")
    assert rc == 0, err
    assert os.listdir(private) == [] and files_under(tmp) == []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_terminated_or_interrupted_replay_removes_its_files(shards, tmp_path, sig):
    """A ``kill`` (SIGTERM) ended the replay at once, its files left; Ctrl-C left them in
    --cache-dir. Both now end as an interrupt: the run's files removed, exit 130."""
    d = tmp_path / "cache"
    p, err = _hanging_replay(tmp_path, d, "--shards", shards, *FAST, *TIERS, "--cache-dir", str(d))
    assert files_under(d)
    p.send_signal(sig)
    assert p.wait(timeout=60) == 130, open(err).read()[-2000:]
    assert "error: interrupted" in open(err).read()
    assert files_under(d) == [] and os.listdir(d) == []
    assert not [n for n in os.listdir(tmp_path / "tmp") if n.startswith("userwise-replay")]
