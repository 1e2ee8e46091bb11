"""The loader's worker processes end with their trainer and leave nothing behind.

Each test runs a real trainer process (a small script iterating ``UserwiseLoader`` with two
workers) with a private ``TMPDIR``, stops it one way or another, and checks that the
workers are gone within seconds and that no temporary folder is left.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from userwise.pipelines.tools.shardgen import write_shard_set

TRAINER = r'''
import json, os, sys, threading, time
from userwise.pipelines.loader import UserwiseDataset, UserwiseLoader

root, mode = sys.argv[1], sys.argv[2]
ld = UserwiseLoader(UserwiseDataset(root, verify="none", batch_size=4, seed=1, device="cpu"), num_workers=2,
                    timeout=60)


def say(*a):
    print(*a, flush=True)


n = 0


def train():
    global n
    for b in ld:
        n += 1
        if n == 1:
            say("PIDS", json.dumps([p.pid for p in ld._workers.procs]))
        if n == 3:
            if mode == "break":
                break
            if mode == "raise":
                raise ValueError("stand-in training error")
            if mode == "wait-thread":  # a child that holds the trainer's pipe ends open: no EOF for the workers
                holder = os.fork()
                if holder == 0:
                    time.sleep(600)
                    os._exit(0)
                say("HOLDER", holder)
            if mode.startswith("wait"):
                say("WAITING")
                time.sleep(600)


try:
    if mode == "wait-thread":  # the workers start from a thread: no kernel signal, the watchdog's case
        threading.Thread(target=train, daemon=True).start()
        time.sleep(600)
    else:
        train()
except ValueError:
    pass
if mode == "close":
    ld.close()
say("LEFT", json.dumps(sorted(os.listdir(os.environ["TMPDIR"]))))
say("END", n)
'''


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("shards"))
    write_shard_set(root, nodes=1, ranks_per_node=1, row_group_rows=8)
    return root


def start(tmp_path, shards, mode):
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    # a short private folder: multiprocessing's socket path must fit AF_UNIX's 108 bytes, which
    # pytest-xdist's deep tmp_path does not leave room for
    tmp = Path(tempfile.mkdtemp(prefix="uwlc-", dir="/tmp"))
    env = {**os.environ, "TMPDIR": str(tmp)}
    p = subprocess.Popen([sys.executable, str(script), shards, mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env, start_new_session=True)
    return p, tmp


def read_until(p, tag: str, timeout: float = 120) -> list[str]:
    """The trainer's stdout lines up to and including the first starting with ``tag``."""
    lines, t = [], time.monotonic() + timeout
    while time.monotonic() < t:
        line = p.stdout.readline()
        if not line:
            break
        lines.append(line.rstrip("\n"))
        if line.startswith(tag):
            return lines
    p.kill()
    raise AssertionError(f"the trainer never said {tag}: {lines}\n{p.stderr.read()}")


def pids(lines) -> list[int]:
    return json.loads(next(x for x in lines if x.startswith("PIDS")).split(" ", 1)[1])


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_gone(workers, within: float) -> float:
    """Seconds until every worker exited; fails after ``within``."""
    t0 = time.monotonic()
    while not all(gone(w) for w in workers):
        if time.monotonic() - t0 > within:
            left = [(w, psutil.Process(w).ppid()) for w in workers if not gone(w)]
            for w, _ in left:
                os.kill(w, signal.SIGKILL)
            raise AssertionError(f"loader workers (pid, parent) {left} still run {within}s after their trainer stopped")
        time.sleep(0.05)
    return time.monotonic() - t0


def wait_empty(tmp, within: float = 10.0) -> None:
    t0 = time.monotonic()
    while os.listdir(tmp) and time.monotonic() - t0 < within:
        time.sleep(0.05)
    assert os.listdir(tmp) == [], "temporary folders left behind"


@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM", "Ctrl-C", "SIGKILL-thread"])
def test_workers_end_with_a_killed_trainer(tmp_path, shards, how):
    """Mid-epoch, the workers blocked on a full ring: the trainer is killed (SIGKILL: no
    code of its own runs), terminated, or interrupted (SIGINT to its whole process group,
    as Ctrl-C sends it). Its workers exit within seconds, their temporary folders gone.
    "SIGKILL-thread": the trainer iterates in a thread of its own and has forked a child
    that holds the trainer's ends of the workers' pipes, so the workers' exit rests on
    their watchdog alone (the kernel's signal would follow the thread; the pipes stay open)."""
    p, tmp = start(tmp_path, shards, "wait-thread" if how.endswith("-thread") else "wait")
    lines = read_until(p, "WAITING")
    workers = pids(lines)
    assert len(workers) == 2 and not any(gone(w) for w in workers)
    assert all(psutil.Process(w).ppid() == p.pid for w in workers)
    time.sleep(0.5)  # the workers fill their rings and block on their pipes
    if how == "Ctrl-C":
        os.killpg(p.pid, signal.SIGINT)
    else:
        p.send_signal(getattr(signal, how.split("-")[0]))
    p.wait(timeout=30)
    holder = [int(x.split()[1]) for x in lines if x.startswith("HOLDER")]
    try:
        assert wait_gone(workers, within=10.0) < 10.0  # a few seconds; slack for a loaded CI machine
    finally:
        for h in holder:
            os.kill(h, signal.SIGKILL)
    wait_empty(tmp)
    err = p.stderr.read()
    if how == "Ctrl-C":
        assert "KeyboardInterrupt" in err
    assert "Process Process-" not in err  # no worker printed a traceback of its own


@pytest.mark.parametrize("mode", ["end", "close", "break", "raise"])
def test_a_stopped_loader_leaves_no_folders(tmp_path, shards, mode):
    """A whole epoch (the workers kept for the next one, stopped at exit), a whole epoch
    then close(), a ``break`` and an exception mid-epoch: once the loader has stopped its
    workers (right away for a stop mid-epoch), no temporary folder remains, in the trainer
    and after it exits."""
    p, tmp = start(tmp_path, shards, mode)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    lines = out.splitlines()
    workers = pids(lines)
    left = json.loads(next(x for x in lines if x.startswith("LEFT")).split(" ", 1)[1])
    if mode in ("close", "break", "raise"):  # stopped: nothing left while the trainer still runs
        assert left == []
    assert int(lines[-1].split()[1]) >= 3
    wait_gone(workers, within=10.0)
    wait_empty(tmp)
    assert "Traceback" not in err
