"""One writer per build folder (pipelines/records/writer_lock.py): a second writer fails at once with
one line naming the running job and changes nothing; stale locks are taken over; the daily
`requests` jobs of different dates may run side by side."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import time

import pytest

from userwise.pipelines.cli import main
from userwise.pipelines.records import writer_lock as W

HOST = socket.gethostname()


def _fake_lock(out, name, pid, host=HOST, age=0.0, job="build"):
    d = W.lock_dir(str(out))
    os.makedirs(d, exist_ok=True)
    p = os.path.join(d, name)
    with open(p, "w") as f:
        json.dump({"job": job, "pid": pid, "host": host, "started": "2026-01-01T00:00:00+00:00",
                   "started_ts": time.time() - age}, f)
    if age:
        os.utime(p, (time.time() - age, time.time() - age))
    return p


@pytest.fixture
def sleeper():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield p
    p.kill()
    p.wait()


def _snapshot(root):
    return sorted((os.path.relpath(os.path.join(d, f), root), os.path.getsize(os.path.join(d, f)))
                  for d, _, fs in os.walk(root) for f in fs)


def test_a_second_build_fails_at_once_naming_the_running_job_and_changes_nothing(tmp_path, sleeper, capsys):
    out = tmp_path / "D"
    _fake_lock(out, W.EXCLUSIVE, sleeper.pid)
    before = _snapshot(out)
    t = time.time()
    rc = main(["build", "--config", str(tmp_path / "missing.yaml"), "--input", str(tmp_path / "in"),
               "--build-dir", str(out), "--as-of", "2026-01-03", "--incremental-days", "1", "--window-days", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and time.time() - t < 5
    assert len(err) == 1 and err[0].startswith("error: ") and "being written by `userwise build`" in err[0]
    assert f"pid {sleeper.pid}" in err[0]
    assert _snapshot(out) == before  # the config was not even read: the lock comes first


@pytest.mark.parametrize("job,args", [
    ("history", ["--date", "2026-01-02"]),
    ("window", ["--date", "2026-01-02"]),
    ("pretrain", ["--as-of", "2026-01-02", "--incremental-days", "1"]),
    ("requests", ["--date", "2026-01-02", "--input", "x"]),
    ("backfill", ["--from", "2026-01-01", "--to", "2026-01-02", "--input", "x"]),
])
def test_every_writing_command_is_refused_while_a_build_runs(tmp_path, sleeper, capsys, job, args):
    out = tmp_path / "D"
    _fake_lock(out, W.EXCLUSIVE, sleeper.pid)
    rc = main([job, "--config", "c.yaml", "--build-dir", str(out), *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "being written by `userwise build`" in err[0]


def test_a_dead_holder_on_this_host_is_taken_over(tmp_path):
    out = tmp_path / "D"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    path = _fake_lock(out, W.EXCLUSIVE, dead.pid)
    with W.WriterLock(str(out), "build") as lock:
        assert lock.held and json.load(open(path))["pid"] == os.getpid()
    assert not os.path.exists(path)  # released on exit


def test_a_lock_of_another_host_is_stale_only_without_a_heartbeat(tmp_path):
    out = tmp_path / "D"
    _fake_lock(out, W.EXCLUSIVE, 1, host="elsewhere")
    with pytest.raises(W.LockedError, match="on elsewhere"):
        W.WriterLock(str(out), "build").acquire()
    _fake_lock(out, W.EXCLUSIVE, 1, host="elsewhere", age=W.STALE_S + 5)
    with W.WriterLock(str(out), "build") as lock:
        assert lock.held


def test_the_heartbeat_keeps_a_long_job_s_lock_fresh(tmp_path, monkeypatch):
    monkeypatch.setattr(W, "HEARTBEAT_S", 0.05)
    out = tmp_path / "D"
    with W.WriterLock(str(out), "build") as lock:
        os.utime(lock.path, (0, 0))
        time.sleep(0.3)
        assert time.time() - os.stat(lock.path).st_mtime < 5


def test_requests_jobs_of_different_dates_run_side_by_side_but_not_the_same_date(tmp_path):
    out = str(tmp_path / "D")
    with W.WriterLock(out, "requests", "2026-01-01"), W.WriterLock(out, "requests", "2026-01-02"):
        with pytest.raises(W.LockedError, match="requests --date 2026-01-01"):
            W.WriterLock(out, "requests", "2026-01-01").acquire()
        with pytest.raises(W.LockedError, match="requests --date"):
            W.WriterLock(out, "build").acquire()  # an exclusive job waits for every daily job
    with W.WriterLock(out, "build"):
        with pytest.raises(W.LockedError, match="userwise build"):
            W.WriterLock(out, "requests", "2026-01-03").acquire()
    assert not os.path.exists(out)  # the folders the first job made go with the last lock


def _race(out, barrier, results, i):
    barrier.wait()
    try:
        lock = W.WriterLock(out, "build").acquire()
        results.put(i)
        time.sleep(0.5)
        lock.release()
    except W.LockedError:
        pass


def test_of_racing_writers_exactly_one_wins(tmp_path):
    ctx = mp.get_context("fork")
    for round_ in range(5):
        out = str(tmp_path / f"D{round_}")
        barrier, results = ctx.Barrier(4), ctx.Queue()
        ps = [ctx.Process(target=_race, args=(out, barrier, results, i)) for i in range(4)]
        for p in ps:
            p.start()
        for p in ps:
            p.join(10)
        winners = []
        while not results.empty():
            winners.append(results.get())
        assert len(winners) == 1, winners
