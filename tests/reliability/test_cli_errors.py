"""Every failure a user can cause ends in one `error:` line and exit code 2, never a traceback.

Each case runs the real `userwise` CLI in its own process and checks what a user sees:
stderr's last line starts with `error:`, says what to do, and no traceback or Java
stack is printed (Spark's own log goes to a file)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import yaml

PY = sys.executable


def cli(*args, code: str | None = None, timeout=300, env=None):
    cmd = [PY, "-c", code, *args] if code else [PY, "-m", "userwise.pipelines.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def one_error(r, *needles):
    """The process failed with exit 2 and exactly one `error:` line naming every needle."""
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith("[userwise]")]
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    assert "Traceback" not in r.stderr and "\tat " not in r.stderr and "java." not in r.stdout, r.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr[-3000:]
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def log(tmp_path_factory):
    d = tmp_path_factory.mktemp("log")
    r = cli("synth", "--output", str(d), "--days", "2", "--users", "12", "--kinds", "lean")
    assert r.returncode == 0, r.stderr
    return d


def _config(log, tmp_path, **change):
    cfg = yaml.safe_load(open(log / "config.yaml"))
    for k, v in change.items():
        cfg["columns"][k] = v
    p = tmp_path / "config.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return str(p)


def test_a_config_naming_a_missing_label_column(log, tmp_path):
    cfg = _config(log, tmp_path, labels=["clik"])
    line = one_error(cli("validate", "--config", cfg, "--input", str(log / "lean")), "clik", "labels")
    # the build refuses the same config with the same line, before Spark starts
    assert one_error(cli("build", "--config", cfg, "--input", str(log / "lean"), "--build-dir", str(tmp_path / "D"),
                         "--as-of", "2026-01-03", "--incremental-days", "1", "--window-days", "1")) == line


@pytest.mark.parametrize("date", ["2026-13-01", "yesterday", "2026-1-2x"])
def test_a_wrong_date_for_the_daily_jobs(tmp_path, date):
    for job in ("requests", "history", "window"):
        one_error(cli(job, "--config", "c.yaml", "--input", "x", "--build-dir", str(tmp_path), "--date", date)
                  if job == "requests" else
                  cli(job, "--config", "c.yaml", "--build-dir", str(tmp_path), "--date", date), date, "--date")


def test_an_output_folder_that_is_a_file(log, tmp_path):
    out = tmp_path / "D"
    out.write_text("not a folder")
    one_error(cli("build", "--config", str(log / "config.yaml"), "--input", str(log / "lean"), "--build-dir", str(out),
                  "--as-of", "2026-01-03", "--incremental-days", "1", "--window-days", "1"), str(out))


def test_a_missing_input(log, tmp_path):
    one_error(cli("validate", "--config", str(log / "config.yaml"), "--input", str(tmp_path / "nothing")),
              "nothing")


def test_an_unknown_command_or_flag():
    one_error(cli("bild"), "bild")
    one_error(cli("stage", "--shards", "s", "--node", "0", "--staged", "d", "--wrkers", "2"), "--wrkers")


@pytest.fixture
def shard_set(tmp_path):
    from userwise import schemas
    from userwise.pipelines.shards import preshard
    from userwise.pipelines.tools.shardgen import build_samples, layout

    root = str(tmp_path / "S")
    preshard.preshard_arrow(build_samples(seed=2), root, schema=schemas.shard_schema(layout()).to_arrow(),
                            nodes=1, ranks_per_node=1, seed=1, compression="none", target_shard_mb=0.05)
    return root


def test_stage_when_the_manifest_names_a_missing_file(shard_set, tmp_path):
    m = json.load(open(os.path.join(shard_set, "manifest.json")))
    gone = m["shards"][-1]["path"]
    os.remove(os.path.join(shard_set, gone))
    one_error(cli("stage", "--shards", shard_set, "--node", "0", "--staged", str(tmp_path / "nvme")),
              gone, "rerun `userwise preshard`")


def test_stage_when_the_disk_fills_during_the_copy_then_a_rerun_resumes(shard_set, tmp_path):
    """The copy's writes hit a real ENOSPC (/dev/full) after the space check passed."""
    dest = str(tmp_path / "nvme")
    code = textwrap.dedent("""
        import os, sys
        from userwise.pipelines.shards import stage
        from userwise.pipelines.cli import main
        real = stage._open_part
        def full(part, flags):
            if flags & os.O_WRONLY:
                return os.open("/dev/full", os.O_WRONLY)
            return real(part, flags)
        stage._open_part = full
        sys.exit(main(sys.argv[1:]))
    """)
    one_error(cli("stage", "--shards", shard_set, "--node", "0", "--staged", dest, code=code), "disk is full")
    r = cli("stage", "--shards", shard_set, "--node", "0", "--staged", dest, "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["files"] > 0


def test_an_internal_error_is_one_line_and_debug_shows_the_traceback(tmp_path):
    code = textwrap.dedent("""
        import sys
        from userwise.pipelines import cli
        from userwise.pipelines.shards import stage
        def boom(*args, **kw):
            raise ZeroDivisionError("a bug")
        stage.stage = boom
        sys.exit(cli.main(sys.argv[1:]))
    """)
    args = ("stage", "--shards", "s", "--node", "0", "--staged", str(tmp_path))
    r = cli(*args, code=code)
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        "error: internal error (ZeroDivisionError: a bug); rerun with `userwise --debug ...` for the traceback "
        "and report it"]
    r = cli("--debug", *args, code=code)
    assert r.returncode == 1 and "Traceback" in r.stderr and "ZeroDivisionError: a bug" in r.stderr


@pytest.mark.spark
@pytest.mark.slow
def test_build_inputs_that_cannot_be_read(log, tmp_path):
    """An empty folder and a folder of CSV files: one line each, not a Java stack (one JVM each)."""
    empty = tmp_path / "empty"
    empty.mkdir()
    csv = tmp_path / "csv"
    csv.mkdir()
    (csv / "part-0.csv").write_text("user_id,item_id\n1,2\n")
    for bad, needle in ((empty, "empty"), (csv, "csv")):
        r = cli("build", "--config", str(log / "config.yaml"), "--input", str(bad), "--build-dir", str(tmp_path / "D"),
                "--as-of", "2026-01-03", "--incremental-days", "1", "--window-days", "1")
        one_error(r, str(bad))
    shutil.rmtree(tmp_path / "D", ignore_errors=True)


@pytest.mark.spark
@pytest.mark.slow
def test_a_refused_build_names_the_config_key_behind_its_main_reason(log, tmp_path):
    cfg = yaml.safe_load(open(log / "config.yaml"))
    cfg["min_year"] = 2030  # every row of the 2026 log is now out of range
    p = tmp_path / "config.yaml"
    p.write_text(yaml.safe_dump(cfg))
    one_error(cli("build", "--config", str(p), "--input", str(log / "lean"), "--build-dir", str(tmp_path / "D"),
                  "--as-of", "2026-01-03", "--incremental-days", "1", "--window-days", "1"),
              "max_quarantine_share", "bad_time: check min_year")


@pytest.mark.spark
@pytest.mark.slow
def test_an_input_whose_schema_changed_between_days(log, tmp_path):
    """Day 1 built; the log's `hour` column turns into a string before day 2: the daily job
    refuses it with one line naming the column, and day 1's tables stay as they were."""
    import pyarrow.compute as pc
    import pyarrow.dataset as ds

    out, cfg = tmp_path / "D", str(log / "config.yaml")
    r = cli("requests", "--config", cfg, "--input", str(log / "lean"), "--build-dir", str(out), "--date", "2026-01-01")
    assert r.returncode == 0, r.stderr[-3000:]
    before = sorted(os.listdir(out / "requests" / "_delta_log"))
    t = ds.dataset(str(log / "lean"), partitioning="hive").to_table()
    t = t.set_column(t.schema.get_field_index("hour"), "hour", pc.cast(t["hour"], "string"))
    changed = tmp_path / "changed"
    ds.write_dataset(t, changed, format="parquet", partitioning=["date"], partitioning_flavor="hive")
    one_error(cli("requests", "--config", cfg, "--input", str(changed), "--build-dir", str(out), "--date", "2026-01-02"),
              "'hour'", "new folder")
    assert sorted(os.listdir(out / "requests" / "_delta_log")) == before
