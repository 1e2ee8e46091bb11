"""All or nothing: readers see the last complete state of a build folder, never a half-written one.

A build killed half-way leaves commits above the completion record: preshard and expand
refuse the folder with one line naming the job to rerun; the rerun gives the same tables
as an uninterrupted build. While a job runs, readers keep reading the previous complete
state (the versions in ``_userwise/complete.json``)."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import pyarrow as pa
import pytest

from userwise.pipelines import cli, console
from userwise.pipelines.builder import build as build_range
from userwise.pipelines.records import state, writer_lock
from userwise.pipelines.runtime import delta_io
from userwise.pipelines.shards import manifest as mf

pytestmark = [pytest.mark.spark, pytest.mark.slow]
PY = sys.executable
TABLES = ("requests", "events", "history", "samples", "quarantine")


def run(*args, check=True):
    r = subprocess.run([PY, "-m", "userwise.pipelines.cli", *args], capture_output=True, text=True, timeout=600)
    if check:
        assert r.returncode == 0, r.stderr[-3000:]
    return r


def build_args(log, out):
    return ["build", "--config", str(log / "config.yaml"), "--input", str(log / "lean"), "--build-dir", str(out),
            "--as-of", "2026-01-04", "--incremental-days", "2", "--window-days", "1"]


def tables(out) -> dict[str, pa.Table]:
    got = {}
    for t in TABLES:
        tab = delta_io.dataset(os.path.join(out, t)).to_table()
        got[t] = tab.sort_by([(c, "ascending") for c in tab.column_names
                              if not pa.types.is_nested(tab.schema.field(c).type)])
    return got


def shard_digest(root) -> list:
    m = mf.load(str(root))
    return sorted((s["path"], s["rows"], s["sha256"]) for s in m["shards"])


@pytest.fixture(scope="module")
def log(tmp_path_factory):
    d = tmp_path_factory.mktemp("log")
    run("synth", "--output", str(d), "--days", "3", "--users", "40", "--kinds", "lean", "--bad-rows", "0.005")
    return d


@pytest.fixture(scope="module")
def clean_run(log, tmp_path_factory):
    """An uninterrupted build: its folder, the finished process, its JSON report."""
    out = tmp_path_factory.mktemp("clean") / "D"
    rep = out.parent / "report.json"
    r = run(*build_args(log, out), "--report", str(rep))
    return out, r, json.loads(rep.read_text())


@pytest.fixture(scope="module")
def clean(clean_run):
    return clean_run[0]


STEP = re.compile(r"^\[userwise\] (\S+) +(?:([\d,]+) rows)? +(\d+\.\d) s$")


def test_a_build_prints_the_report_on_stdout_its_steps_on_stderr_and_spark_s_log_in_a_file(clean_run, capsys):
    _, r, rep = clean_run
    console.emit(rep, build_range.report_text)
    assert r.stdout == capsys.readouterr().out  # the report alone
    assert rep["bytes_in"] > 0 and rep["bytes_out"] > 0
    steps = {m.group(1): m for m in map(STEP.match, r.stderr.splitlines()) if m}
    rows = {k: int(m.group(2).replace(",", "")) for k, m in steps.items() if m.group(2)}
    assert set(rows) >= {"ingest", "quarantine", "requests", "events", "samples", "history"}, r.stderr
    assert "report" in steps, r.stderr
    assert rows["ingest"] == rep["rows_read"] and rows["samples"] == rep["samples"] > 0
    assert rows["requests"] == rep["requests"] and rows["quarantine"] == sum(rep["quarantined"].values()) > 0
    assert rows["events"] > 0 and rows["history"] > 0
    assert not re.search(r"\b(WARN|INFO|ERROR)\b|log4j|SLF4J|\tat ", r.stdout + r.stderr), r.stderr
    log_file = re.search(r"^\[userwise\] Spark's log: (\S+)$", r.stderr, re.M)
    assert log_file and os.path.getsize(log_file.group(1)) > 0, r.stderr


def one_error(r, *needles):
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith("[userwise]")]
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.stderr[-3000:]
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def test_a_killed_build_is_refused_by_readers_and_its_rerun_equals_an_uninterrupted_build(log, clean, tmp_path):
    out = tmp_path / "D"
    p = subprocess.Popen([PY, "-m", "userwise.pipelines.cli", *build_args(log, out)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    first_commit = out / "requests" / "_delta_log" / f"{0:020d}.json"
    deadline = time.time() + 300
    while not first_commit.exists() and p.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    assert p.poll() is None, "the build ended before it could be killed half-way"
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    assert not (out / "_userwise" / "complete.json").exists()

    line = one_error(run("preshard", "--build-dir", str(out), "--shards", str(tmp_path / "S"), "--nodes", "1",
                         "--ranks-per-node", "1", check=False), "`userwise build", "did not finish", "run it again")
    hint = shlex.split(re.search(r"`userwise ([^`]*)`", line).group(1))
    parse = cli.parser().parse_args
    assert vars(parse(hint)) == vars(parse(build_args(log, out))), hint  # the killed command itself, to paste
    one_error(run("expand", "--build-dir", str(out), "--expanded", str(tmp_path / "x"), check=False),
              "`userwise build", "did not finish")
    assert not (tmp_path / "S" / "manifest.json").exists()

    # the hint, pasted: takes over the dead build's lock and replaces what it wrote; --quiet: no progress lines
    r = run(*hint, "--quiet")
    assert "[userwise]" not in r.stderr and r.stdout.startswith("rows read "), r.stderr
    got, want = tables(str(out)), tables(str(clean))
    for t in TABLES:  # compared as Python values, where NaN labels and scores equal themselves
        assert got[t].schema == want[t].schema and repr(got[t].to_pylist()) == repr(want[t].to_pylist()), t
    rec = state.complete_state(str(out))
    assert rec["job"] == "build" and set(TABLES) <= set(rec["tables"])


def test_readers_keep_the_previous_complete_state_while_a_job_runs(clean, tmp_path):
    out = str(clean)
    args = ["preshard", "--build-dir", out, "--nodes", "1", "--ranks-per-node", "2", "--seed", "3"]
    run(*args, "--shards", str(tmp_path / "before"))
    before = shard_digest(tmp_path / "before")

    # A window job runs (it holds the lock and is marked running) and has committed half its work.
    lock = writer_lock.WriterLock(out, "window").acquire()
    try:
        state.begin(out, "window", config="/conf/c.yaml", date="2026-01-03", window_days=1)
        from deltalake import DeltaTable

        DeltaTable(os.path.join(out, "samples")).delete("kind = 'pretrain'")
        assert delta_io.table_bytes(os.path.join(out, "samples")) < delta_io.table_bytes(
            os.path.join(out, "samples"), version=state.version_of(out, "samples"))
        run(*args, "--shards", str(tmp_path / "during"))
        assert shard_digest(tmp_path / "during") == before  # the previous complete state, byte for byte
    finally:
        lock.release()
    # The job is gone without finishing: readers now refuse the folder, naming it.
    one_error(run(*args, "--shards", str(tmp_path / "after"), check=False),
              f"`userwise window --config /conf/c.yaml --build-dir {out} --date 2026-01-03 --window-days 1`",
              "did not finish")


def test_a_folder_that_no_build_finished_is_refused(tmp_path):
    (tmp_path / "D").mkdir()
    one_error(run("preshard", "--build-dir", str(tmp_path / "D"), "--shards", str(tmp_path / "S"), "--nodes", "1",
                  "--ranks-per-node", "1", check=False))
