"""On a shared host every size, count and date a user gives is bounded before anything starts
(issue #54 defects 13, 14 and 15's synth; docs/security.md): a flag out of its bounds, a config
nested thousands deep or holding a 5,000-digit integer, a synth larger than the free disk is one
``error:`` line and exit 2, before a JVM starts or a file is written; a synth that fails while it
writes leaves the destination as it was. No Spark here: the checks come first."""

from __future__ import annotations

import errno
import io
import math
import os

import pytest

from tests.reliability.test_hostile_input import cli, one_error, tree
from userwise import schemas
from userwise.pipelines import cli as userwise_cli
from userwise.pipelines.config import ConfigError, safe_yaml
from userwise.pipelines.errors import ArgumentError, UserwiseError
from userwise.pipelines.shards import preshard
from userwise.pipelines.tools import synth as Y
from userwise.pipelines.tools.shardgen import build_samples, layout


@pytest.fixture(scope="module")
def log(tmp_path_factory):
    """A tiny synthetic log and its config (for `validate`)."""
    out = tmp_path_factory.mktemp("log") / "syn"
    Y.synth(str(out), days=1, users=20, kinds=("lean",), log=io.StringIO())
    return out


# -- 13: synth is bounded by the free disk and by its arguments' bounds -----------------------------


def test_synth_larger_than_the_free_space_is_refused_before_it_writes(tmp_path):
    """`synth --users 1000000000 --days 36500` would write petabytes: it wrote without a check until
    the disk was full. Now its estimate is compared with shutil.disk_usage's free bytes first."""
    out = tmp_path / "a" / "out"
    line = one_error(cli("synth", "--output", str(out), "--users", "1000000000", "--days", "36500", "--kinds", "lean",
                         "--quiet", timeout=60), "free", str(out), "give fewer --users")
    assert "PB" in line or "TB" in line, line  # the estimate is named (petabytes: more than any disk holds)
    assert not (tmp_path / "a").exists()
    with pytest.raises(UserwiseError, match="free there"):  # the library call checks it too
        Y.synth(str(out), days=Y.MAX_DAYS, users=Y.MAX_USERS, kinds=("lean",), log=io.StringIO())
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("flag, value, needle", [
    ("--days", "1000000", "at most 36,500"),
    ("--users", "10000000000", "at most 1,000,000,000"),
    ("--max-seq-len", "1000000", "1 to 10,000"),
    ("--impressions", "1000000000000000000", "at most 1,000,000,000 users"),
])
def test_synth_arguments_have_upper_bounds(tmp_path, flag, value, needle):
    """Before: accepted (--days 1e6 wrote day after day until the disk was full)."""
    out = tmp_path / "out"
    args = ["synth", "--output", str(out), flag, value, "--kinds", "actions", "--quiet"]
    if flag not in ("--users", "--impressions"):
        args += ["--users", "20"]
    if flag != "--days":
        args += ["--days", "1"]
    one_error(cli(*args, timeout=60), flag, needle)
    assert not out.exists()


# -- 14: dates past the representable range, huge counts, hostile configs: exit 2 ------------------


@pytest.mark.parametrize("start", ["9999-12-31", "9999-12-30", "0001-01-01"])
def test_synth_start_outside_the_dates_is_refused_and_writes_nothing(tmp_path, start):
    """`synth --start 9999-12-31` (3 days) was exit 1 (OverflowError) and left lean/, fat/ and
    actions/ behind; a year before 1000 gave request ids that no longer sort by date."""
    out = tmp_path / "out"
    one_error(cli("synth", "--output", str(out), "--start", start, "--users", "20", "--quiet"),
              "--start", "give a date from 1000-01-01 to 9899-12-31")
    assert not out.exists()
    with pytest.raises(UserwiseError, match="--start"):
        Y.synth(str(out), start=start, users=20, log=io.StringIO())
    assert not out.exists()


def test_validate_sample_rows_is_bounded(log):
    """`validate --sample-rows 1000000000000` was exit 1 (OverflowError in the reader)."""
    one_error(cli("validate", "--config", str(log / "config.yaml"), "--input", str(log / "lean"),
                  "--sample-rows", "1000000000000"), "--sample-rows", "give at most 10,000,000")
    r = cli("validate", "--config", str(log / "config.yaml"), "--input", str(log / "lean"), "--sample-rows", "10000000",
            "--quiet")
    assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.parametrize("flag", ["--incremental-days", "--window-days"])
def test_build_day_counts_are_bounded_before_spark_starts(log, tmp_path, flag):
    """`build --incremental-days 1000000000` started Spark, then failed with exit 1 (a date before
    year 1); every day count is now at most 36,500, so a command's date plus or minus it is a date."""
    d = tmp_path / "build"
    r = cli("build", "--config", str(log / "config.yaml"), "--input", str(log / "lean"), "--build-dir", str(d),
            "--as-of", "2026-01-02", "--incremental-days", "0", flag, "1000000000")
    one_error(r, flag, "give at most 36,500")
    assert "Spark's log" not in r.stderr and not d.exists()


@pytest.mark.parametrize("args, flag", [
    (("build", "--input", "L", "--incremental-days", "36500", "--as-of", "9999-12-31"), "--as-of"),
    (("window", "--window-days", "36500", "--date", "0001-01-01"), "--date"),
    (("backfill", "--input", "L", "--from", "9999-12-30", "--to", "9999-12-31"), "--from"),
])
def test_dates_a_command_takes_stay_dates_with_any_day_count(log, tmp_path, args, flag):
    """A date within a day count of the calendar's end gave OverflowError (exit 1) once Spark ran."""
    args = [str(log / "lean") if a == "L" else a for a in args]
    r = cli(*args, "--config", str(log / "config.yaml"), "--build-dir", str(tmp_path / "b"))
    one_error(r, flag, "give a date from 1000-01-01 to 9899-12-31")
    assert not (tmp_path / "b").exists()


def test_a_config_nested_50000_deep_is_a_config_error(tmp_path):
    """It was a RecursionError, exit 1 ("internal error")."""
    for i, text in enumerate(["a: " + "[" * 50_000 + "]" * 50_000,
                              "columns:\n  user: " + "{a: " * 50_000 + "1" + "}" * 50_000,
                              "a:\n" + "".join(" " * k + "- \n" for k in range(3_000))]):
        p = tmp_path / f"deep{i}.yaml"
        p.write_text(text)
        one_error(cli("validate", "--config", str(p), "--input", str(tmp_path)), str(p), "nests more than 100 levels")
        with pytest.raises(ConfigError, match="nests more than"):
            safe_yaml(text)
    nested = "a: " + "[" * 50 + "1" + "]" * 50  # a deep but sane document still loads
    v = safe_yaml(nested)["a"]
    for _ in range(49):
        v = v[0]
    assert v == [1]


@pytest.mark.parametrize("digits, needle", [(5_000, "a value cannot be read"), (4_000, "too large")])
def test_a_config_with_a_huge_integer_is_a_config_error(log, tmp_path, digits, needle):
    """A 5,000-digit integer was Python's int-string-conversion ValueError, exit 1; a 4,000-digit
    max_seq_len (within Python's limit) is above what a length can be."""
    p = tmp_path / "big.yaml"
    p.write_text((log / "config.yaml").read_text().replace("max_seq_len: 50", "max_seq_len: " + "9" * digits))
    line = one_error(cli("validate", "--config", str(p), "--input", str(log / "lean")), needle)
    assert "set_int_max_str_digits" not in line and len(line) < 400


# -- 13 and 14: sizes in MiB and counts share one bounded type per kind ------------------------------


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "0", "-1", "2000000"])
def test_preshard_target_shard_mb_must_be_a_finite_size(tmp_path, value):
    """`preshard --target-shard-mb nan` was accepted (and started Spark); the library call too."""
    r = cli("preshard", "--build-dir", str(tmp_path / "b"), "--shards", str(tmp_path / "S"), "--nodes", "1",
            "--ranks-per-node", "1", f"--target-shard-mb={value}")
    one_error(r, "--target-shard-mb", "give a number above 0 and at most 1,048,576 MiB")
    assert "Spark's log" not in r.stderr


@pytest.mark.parametrize("kw", [dict(target_shard_mb=math.nan), dict(target_shard_mb=math.inf),
                                dict(target_shard_mb=-1.0), dict(row_group_mb=math.nan)])
def test_preshard_arrow_refuses_a_size_that_is_not_one(tmp_path, kw):
    table = build_samples(seed=4, users=8, bot_chunks=1, windows=1)
    out = tmp_path / "S"
    with pytest.raises(ArgumentError, match="--target-shard-mb|--row-group-mb"):
        preshard.preshard_arrow(table, str(out), schema=schemas.shard_schema(layout()).to_arrow(), nodes=1,
                                ranks_per_node=1, seed=1, **kw)
    assert not out.exists()


@pytest.mark.parametrize("args, flag", [
    (("preshard", "--build-dir", "B", "--shards", "S", "--ranks-per-node", "1", "--nodes", "1000000000"), "--nodes"),
    (("preshard", "--build-dir", "B", "--shards", "S", "--nodes", "1", "--ranks-per-node", "1000000"),
     "--ranks-per-node"),
    (("preshard", "--build-dir", "B", "--shards", "S", "--nodes", "1", "--ranks-per-node", "1",
      "--row-group-rows", "1000000000000"), "--row-group-rows"),
    (("preshard", "--build-dir", "B", "--shards", "S", "--nodes", "1", "--ranks-per-node", "1",
      "--row-group-mb", "nan"), "--row-group-mb"),
    (("preshard", "--build-dir", "B", "--shards", "S", "--nodes", "1", "--ranks-per-node", "1",
      "--seed", "-1"), "--seed"),
    (("stage", "--shards", "S", "--node", "0", "--staged", "D", "--workers", "1000000"), "--workers"),
    (("stage", "--shards", "S", "--node", "0", "--staged", "D", "--retries", "1000000000"), "--retries"),
    (("stage", "--shards", "S", "--staged", "D", "--node", "1000000000"), "--node"),
    (("synth", "--output", "O", "--users", "9" * 5_000), "--users"),
])
def test_counts_and_sizes_are_bounded_where_they_are_parsed(tmp_path, args, flag):
    """Each was accepted (a JVM started, or a million threads were asked for) or read as an internal
    error; now the flag's type refuses it, naming the bound."""
    args = [str(tmp_path / a) if a in ("B", "S", "D", "O") else a for a in args]
    r = cli(*args, timeout=60)
    line = one_error(r, flag)
    assert "at most" in line or "at least" in line, line
    assert "Spark's log" not in r.stderr and os.listdir(tmp_path) == []


# -- 15: a failed synth leaves nothing behind -----------------------------------------------------------


def failing_write(monkeypatch, exc, after=2):
    """Make synth's file writer raise ``exc`` on its ``after + 1``-th file (a disk that fills up)."""
    real, n = Y._write, [0]

    def write(*a):
        n[0] += 1
        if n[0] > after:
            raise exc
        return real(*a)

    monkeypatch.setattr(Y, "_write", write)


def test_a_failed_synth_leaves_no_partial_output(tmp_path, monkeypatch, capsys):
    """Before, the files written up to the failure stayed (lean/, fat/ of the first day, no
    synth.json): a later synth refused the folder and a build read half a log."""
    from userwise.pipelines.runtime import progress

    monkeypatch.setattr(progress, "QUIET", progress.QUIET)  # main() sets it
    out = tmp_path / "new" / "out"
    failing_write(monkeypatch, OSError(errno.ENOSPC, "No space left on device"))
    rc = userwise_cli.main(["synth", "--output", str(out), "--users", "20", "--days", "2", "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: the disk is full"), err
    assert not (tmp_path / "new").exists()  # the folders it created are gone too

    empty = tmp_path / "empty"  # a folder that was there stays, empty
    empty.mkdir()
    with pytest.raises(OSError):
        Y.synth(str(empty), users=20, days=2, log=io.StringIO())
    assert empty.is_dir() and os.listdir(empty) == []


def test_a_failed_synth_keeps_the_earlier_output_it_would_replace(tmp_path, monkeypatch):
    """Before, an earlier synth output was deleted first and the failed run left half of a new one."""
    out = tmp_path / "out"
    Y.synth(str(out), users=20, days=2, log=io.StringIO())
    before = {k: (out / k).read_bytes() if v is not None else None for k, v in tree(out).items()}
    for exc in (OSError(errno.ENOSPC, "No space left on device"), KeyboardInterrupt()):
        monkeypatch.undo()
        failing_write(monkeypatch, exc)
        with pytest.raises(type(exc)):
            Y.synth(str(out), users=30, days=2, seed=5, log=io.StringIO())
        assert {k: (out / k).read_bytes() if v is not None else None for k, v in tree(out).items()} == before
    monkeypatch.undo()
    s = Y.synth(str(out), users=30, days=2, seed=5, log=io.StringIO())  # a finished run replaces it
    assert s["users"] == 30 and set(os.listdir(out)) == {"lean", "fat", "actions", "config.yaml", "config_fat.yaml",
                                                         "bad_rows.json", "synth.json"}
