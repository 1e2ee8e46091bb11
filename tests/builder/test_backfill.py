"""backfill and publish: ordered, resumable, idempotent; the published marker is written last."""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.support.uwchain import (
    DAYS,
    TABLES,
    env_with_spark_bin,
    fast_session_conf,
    shard_digest,
    submit_conf_args,
    synth,
    table_digest,
)
from userwise.pipelines.errors import ShardError, UserwiseError
from userwise.pipelines.manage import backfill
from userwise.pipelines.records import published, state
from userwise.pipelines.shards import publish


def _fake_table(root, name, versions):
    log = root / name / "_delta_log"
    log.mkdir(parents=True)
    for v in versions:
        (log / f"{v:020d}.json").write_text("{}")
    (log / f"{max(versions):020d}.checkpoint.parquet").write_text("")


def test_days_are_inclusive_and_ordered():
    assert backfill.days("2026-01-30", "2026-02-01") == [dt.date(2026, 1, 30), dt.date(2026, 1, 31),
                                                         dt.date(2026, 2, 1)]
    with pytest.raises(UserwiseError, match="before --from"):
        backfill.days("2026-01-02", "2026-01-01")


def test_window_and_set_layout():
    assert publish.window_of("2026-01-04", 3) == (dt.date(2026, 1, 2), dt.date(2026, 1, 5))
    assert publish.set_key("incremental", date="2026-01-04") == "incremental/2026-01-05"
    assert publish.set_key("pretrain", as_of="2026-02-01") == "pretrain/2026-02-01"
    assert publish.staging_root("/s", "incremental/2026-01-05") == "/s/_staging/incremental/2026-01-05"


def test_delta_version_from_the_log(tmp_path):
    _fake_table(tmp_path, "requests", [0, 1, 2, 7])
    assert state.delta_version(tmp_path / "requests") == 7
    assert state.delta_version(tmp_path / "missing") is None
    assert state.table_versions(tmp_path) == {"requests": 7}


def test_publish_without_shards_marks_the_day_and_unpublish_clears_it(tmp_path):
    _fake_table(tmp_path, "requests", [0, 1])
    _fake_table(tmp_path, "samples", [0, 1, 2])
    state.finish(str(tmp_path), "window")  # what the day's last job leaves: publish records its versions
    assert not publish.is_published(tmp_path, "incremental", "2026-01-01")
    rec = publish.publish(str(tmp_path), date="2026-01-01")
    assert rec["tables"] == {"requests": 1, "samples": 2} and rec["window_end"] == "2026-01-02"
    assert publish.is_published(tmp_path, "incremental", "2026-01-01")
    # asked with a shard root, a day published without shards is not published there
    assert not publish.is_published(tmp_path, "incremental", "2026-01-01", shards=str(tmp_path / "s"))
    publish.unpublish(str(tmp_path), "incremental", "2026-01-01")
    assert not publish.is_published(tmp_path, "incremental", "2026-01-01")


def test_publish_refuses_without_samples_or_staged_set(tmp_path):
    with pytest.raises(UserwiseError, match="no finished build"):
        publish.publish(str(tmp_path), date="2026-01-01")
    state.finish(str(tmp_path), "requests")
    with pytest.raises(UserwiseError, match="no samples table"):
        publish.publish(str(tmp_path), date="2026-01-01")
    _fake_table(tmp_path, "samples", [0])
    state.finish(str(tmp_path), "window")
    with pytest.raises(ShardError, match="no staged shard set"):
        publish.publish(str(tmp_path), date="2026-01-01", shards=str(tmp_path / "s"))
    assert not publish.is_published(tmp_path, "incremental", "2026-01-01")


# --------------------------------------------------------------------------- Spark + Delta, end to end
# One tiny generated log (3 days, 8 users) and one chain of daily runs shared by the tests below:
# every Spark chain runs as few times as possible (CI has 2 cores).
ARGS = ["--nodes", "2", "--ranks-per-node", "1"]


def _cli_backfill(data, out, shards, d1, d2, *extra):
    return [sys.executable, "-m", "userwise.pipelines.cli", "backfill", "--from", d1, "--to", d2,
            "--config", str(data / "config.yaml"), "--input", str(data / "lean"), "--build-dir", str(out),
            "--shards", str(shards), *ARGS, *extra]


def _cli_env():
    env = env_with_spark_bin()
    env["PYSPARK_SUBMIT_ARGS"] = " ".join([*submit_conf_args(), "--driver-memory", "1g", "pyspark-shell"])
    return env


@pytest.fixture(scope="module")
def fast_spark(spark):
    restore = fast_session_conf(spark)
    yield spark
    restore()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return synth(tmp_path_factory.mktemp("bf") / "synth", days=len(DAYS))


@pytest.fixture(scope="module")
def daily_runs(fast_spark, data, tmp_path_factory):
    """Three daily runs, one day at a time (what the DAG does); digests after each day."""
    from userwise.pipelines import config

    root = tmp_path_factory.mktemp("daily")
    out, shards = root / "out", root / "shards"
    cfg = config.load(str(data / "config.yaml"))
    after = []
    for d in DAYS:
        backfill.run_day(fast_spark, cfg, input_path=str(data / "lean"), build_dir=str(out), shards=str(shards),
                         date=dt.date.fromisoformat(d), nodes=2, ranks_per_node=1)
        after.append((table_digest(out), shard_digest(shards)))
    return {"out": out, "shards": shards, "after": after, "cfg": cfg}


@pytest.mark.spark
@pytest.mark.slow
def test_backfill_equals_daily_runs_skips_published_and_force_is_identical(fast_spark, data, daily_runs, tmp_path):
    cfg = daily_runs["cfg"]
    kw = dict(input_path=str(data / "lean"), nodes=2, ranks_per_node=1, build_dir=str(tmp_path / "bf"),
              shards=str(tmp_path / "bf_s"))
    # one backfill over the three days
    res = backfill.backfill(fast_spark, cfg, date_from=DAYS[0], date_to=DAYS[-1], **kw)
    assert res == {"built": list(DAYS), "skipped": []}
    tables, shards = table_digest(tmp_path / "bf"), shard_digest(tmp_path / "bf_s")
    assert set(tables) == set(TABLES)
    assert len(shards) == 2 * len(DAYS)  # one shard per node per day
    assert (tables, shards) == daily_runs["after"][-1]
    # rerun: everything published, nothing built
    again = backfill.backfill(fast_spark, cfg, date_from=DAYS[0], date_to=DAYS[-1], **kw)
    assert again == {"built": [], "skipped": list(DAYS)}
    # --force on the last day: identical outputs
    forced = backfill.backfill(fast_spark, cfg, date_from=DAYS[-1], date_to=DAYS[-1], force=True, **kw)
    assert forced == {"built": [DAYS[-1]], "skipped": []}
    assert table_digest(tmp_path / "bf") == tables and shard_digest(tmp_path / "bf_s") == shards
    rec = json.loads((tmp_path / "bf_s" / "incremental" / "2026-01-04" / publish.MARKER).read_text())
    assert rec["date"] == DAYS[-1] and set(rec["tables"]) >= {"requests", "history", "samples"}
    assert published.read(str(tmp_path / "bf"), "incremental", DAYS[-1]) == rec


@pytest.mark.spark
@pytest.mark.slow
def test_killed_backfill_resumes_and_matches_an_uninterrupted_run(data, daily_runs, tmp_path):
    """SIGKILL the backfill once day 1 is published (its tables are built in one go, then the
    days are sharded and published in order), rerun it: it skips day 1, rebuilds day 2, and the
    tables and shards equal the uninterrupted daily runs'."""
    env = _cli_env()
    out, shards = tmp_path / "out", tmp_path / "out_s"
    p = subprocess.Popen(_cli_backfill(data, out, shards, DAYS[0], DAYS[1]), env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 900
        while not publish.is_published(out, "incremental", DAYS[0], str(shards)):
            assert p.poll() is None, f"backfill ended (exit {p.returncode}) before day 1 was published"
            assert time.monotonic() < deadline, "day 1 was never published"
            time.sleep(0.05)
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    assert publish.is_published(out, "incremental", DAYS[0], str(shards))
    assert not publish.is_published(out, "incremental", DAYS[1], str(shards))
    resumed = subprocess.run(_cli_backfill(data, out, shards, DAYS[0], DAYS[1], "--json"), env=env,
                             capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads(resumed.stdout.strip().splitlines()[-1]) == {"built": [DAYS[1]], "skipped": [DAYS[0]]}
    assert (table_digest(out), shard_digest(shards)) == daily_runs["after"][1]
