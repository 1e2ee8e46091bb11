"""The command line as one vocabulary: every flag has help (and its default), one name per
concept (the older names hidden, still parsed with a warning), one definition and one help
text per shared flag, placeholders that say what they hold, ``--json`` and ``--quiet`` on
every command, the exit codes each command can give, ``--version``, ``publish`` as a
subcommand."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

from userwise.pipelines import cli, errors
from userwise.pipelines.errors import one_line

PY = sys.executable


def run(*args, env=None):
    return subprocess.run([PY, "-m", "userwise.pipelines.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})})


def subparsers() -> dict[str, argparse.ArgumentParser]:
    p = cli.parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_help_lists_every_command():
    out = run("--help").stdout
    for name in cli.COMMANDS:
        assert name in out
    assert "exit codes: 0 done" in out and "3 a Spark job failed" in out


def test_help_does_not_import_spark():
    code = "import sys; from userwise.pipelines import cli; cli.parser(); print('pyspark' in sys.modules)"
    out = subprocess.run([PY, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


@pytest.mark.parametrize("name", sorted(cli.COMMANDS))
def test_every_flag_has_help_and_shows_its_default(name):
    sp = subparsers()[name]
    text = sp.format_help()
    for a in sp._actions:
        if not a.option_strings or a.help is argparse.SUPPRESS or isinstance(a, argparse._HelpAction):
            continue
        assert a.help and a.help.strip(), f"userwise {name} {a.option_strings[0]} has no help"
        shown = sp._get_formatter()._get_help_string(a) % {"default": a.default}
        if a.required:
            assert shown.endswith("(required)")
        elif not any(a.default is x for x in (None, False)) and a.default != []:
            assert f"(default: {a.default})" in shown, (name, a.option_strings, shown)
    assert "--json" in text and "--quiet" in text


# the required flags of each command but --build-dir (every command here takes it but stage and diagnose)
REQUIRED = {
    "build": ["--config", "c", "--input", "i", "--as-of", "2026-01-01", "--incremental-days", "2"],
    "requests": ["--config", "c", "--input", "i", "--date", "2026-01-01"],
    "history": ["--config", "c", "--date", "2026-01-01"], "window": ["--config", "c", "--date", "2026-01-01"],
    "pretrain": ["--config", "c", "--as-of", "2026-01-01", "--incremental-days", "2"],
    "backfill": ["--from", "2026-01-01", "--to", "2026-01-02", "--config", "c", "--input", "i"],
    "forget": ["--users", "u"], "publish": [], "expand": ["--expanded", "P"],
    "preshard": ["--shards", "S", "--nodes", "1", "--ranks-per-node", "1"],
    "stage": ["--shards", "S", "--node", "0", "--staged", "/nvme"], "diagnose": ["--staged", "/nvme"],
}
# names some flags had before the CLI and the library shared one vocabulary: nothing accepts them
OLD = [("build", "--output", "D"), ("expand", "--samples", "D"), ("preshard", "--output", "S"),
       ("stage", "--dest", "/nvme"), ("diagnose", "--shards", "/nvme"), ("pretrain", "--date", "2026-01-01"),
       ("build", "--pretrain-days", "2"), ("backfill", "--pretrain-days", "2"), ("publish", "--output", "D")]


@pytest.mark.parametrize("command,old,value", OLD)
def test_an_old_flag_name_is_an_ordinary_usage_error(command, old, value, capsys):
    base = REQUIRED[command] + ([] if command in ("stage", "diagnose") else ["--build-dir", "X"])
    cli.parser().parse_args([command, *base])  # the command line is whole without it
    assert capsys.readouterr().err == ""
    with pytest.raises(SystemExit) as e:
        cli.parser().parse_args([command, *base, old, value])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(f"error: unrecognized arguments: {old} {value}"), err
    assert "warning" not in err and err.count("\n") == 1


def test_no_flag_means_two_things():
    """A flag name is one concept in every command; --output is only synth's own folder."""
    meaning: dict[str, set] = {}
    for name, sp in subparsers().items():
        for line in sp.format_help().splitlines():
            line = line.strip()
            if line.startswith("--"):
                flag = line.split()[0].rstrip(",")
                meaning.setdefault(flag, set()).add(name)
    assert meaning["--output"] == {"synth"}
    for flag in ("--samples", "--dest", "--pretrain-days"):
        assert flag not in meaning


SHARED = ("--build-dir", "--shards", "--staged", "--as-of", "--date", "--incremental-days", "--window-days",
          "--config", "--input", "--seed", "--nodes", "--ranks-per-node", "--master", "--conf")


def test_a_shared_flag_has_one_help_text_and_one_placeholder():
    seen: dict[str, set] = {}
    for name, sp in subparsers().items():
        for a in sp._actions:
            if a.option_strings and a.option_strings[0] in SHARED and a.help is not argparse.SUPPRESS:
                base = (a.help or "").split(" (here:")[0].split(" to pre-shard")[0].split("; the set was")[0]
                base = base.split(" (written)")[0].split("; here also")[0]
                seen.setdefault(a.option_strings[0], set()).add((base if a.option_strings[0] != "--seed" else "",
                                                                 a.metavar))
    bad = {k: v for k, v in seen.items() if len(v) > 1}
    assert not bad, bad


def test_placeholders_say_what_they_hold():
    """No argparse default placeholder (the flag's name in capitals) except where that is the
    word (NODES, DAYS); single letters only for the glossary's symbols."""
    letters = {"D", "S", "T", "M", "N", "L", "K", "P", "A", "R", "L'", "MB"}
    for name, sp in subparsers().items():
        for a in sp._actions:
            if not a.option_strings or a.nargs == 0 or a.choices or isinstance(a, argparse._HelpAction):
                continue
            if a.help is argparse.SUPPRESS or a.const is not None:
                continue
            assert a.metavar, f"userwise {name} {a.option_strings[0]} has argparse's default placeholder"
            if len(a.metavar) <= 2:
                assert a.metavar in letters, (name, a.option_strings[0], a.metavar)
            if a.metavar == "N":
                assert a.option_strings[0] == "--window-days", (name, a.option_strings[0])


@pytest.mark.parametrize("name", sorted(cli.COMMANDS))
def test_each_command_lists_the_exit_codes_it_can_give(name):
    sp = subparsers()[name]
    spark = any(a.dest == "conf" for a in sp._actions)
    assert sp.epilog.startswith("exit codes: 0 done")
    assert ("3 a Spark job failed" in sp.epilog) == spark
    assert spark == (name in {"build", "expand", "requests", "history", "window", "pretrain", "preshard",
                              "backfill", "forget"})


def test_jars_honours_json():
    r = run("jars", "--json")
    assert r.returncode == 0, r.stderr
    jars = json.loads(r.stdout)["jars"]
    assert jars and all(j.endswith(".jar") for j in jars)
    assert run("jars").stdout.split() == jars


def test_one_name_per_concept():
    """The canonical flags are the same in every command that takes the concept."""
    for name, sp in subparsers().items():
        flags = {o for a in sp._actions for o in a.option_strings}
        for a in sp._actions:
            if a.dest == "build_dir":
                assert a.option_strings[0] == "--build-dir", name
            if a.dest == "staged":
                assert a.option_strings[0] == "--staged", name
            if a.dest == "incremental_days":
                assert a.option_strings[0] == "--incremental-days", name
        if name in ("preshard", "stage", "publish", "backfill", "forget"):
            assert "--shards" in flags, name


def test_version():
    r = run("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"userwise {cli.version()}"
    assert cli.version().count(".") >= 2


def test_usage_errors_exit_2_in_one_line():
    r = run("build", "--config", "x", "--input", "y", "--build-dir", "z", "--as-of", "2026-13-01",
            "--incremental-days", "2")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "error: argument --as-of: '2026-13-01' is not a date YYYY-MM-DD (see `userwise build --help`)"]
    r = run("stage", "--no-such-flag")
    assert r.returncode == 2 and r.stderr.startswith("error: ")


def test_bad_config_one_line(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("columns: {user: u}\n")
    r = run("validate", "--config", p, "--input", tmp_path)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("error: config error at columns.request_time")
    assert "Traceback" not in r.stderr


def test_exit_codes_tell_a_user_error_from_a_failed_spark_job_and_a_bug():
    from userwise.pipelines.errors import UserwiseError

    class AnalysisException(Exception):
        pass

    AnalysisException.__module__ = "pyspark.errors.exceptions.captured"
    assert one_line(UserwiseError("fix this"))[0] == errors.EXIT_USER == 2
    code, line = one_line(AnalysisException("[PATH_NOT_FOUND] gone"), "/tmp/spark.log")
    assert code == errors.EXIT_SPARK == 3 and line.startswith("Spark failed: [PATH_NOT_FOUND] gone")
    assert "/tmp/spark.log" in line
    worker = AnalysisException(
        "[PYTHON_EXCEPTION] An exception was thrown from the Python worker: Traceback (most recent call last):\n"
        '  File "worker.py", line 1, in read_command\n    command = loads(obj)\n'
        "ModuleNotFoundError: No module named 'pyarrow'\n SQLSTATE: 38000")
    code, line = one_line(worker)
    assert code == 3 and line.startswith("Spark failed: [PYTHON_EXCEPTION] An exception was thrown from the Python "
                                         "worker: ModuleNotFoundError: No module named 'pyarrow'"), line
    assert one_line(ZeroDivisionError("x"))[0] == errors.EXIT_INTERNAL == 1
    assert one_line(OSError(28, "No space left", "/nvme/x"))[0] == 2


@pytest.fixture(scope="module")
def synth_log(tmp_path_factory):
    d = tmp_path_factory.mktemp("log")
    r = run("synth", "--output", d, "--days", "2", "--users", "12", "--kinds", "lean", "--json")
    assert r.returncode == 0, r.stderr
    return d, r


def test_json_is_one_object_and_text_is_the_default(synth_log, tmp_path):
    d, r = synth_log
    rep = json.loads(r.stdout)
    assert len(r.stdout.strip().splitlines()) == 1 and rep["rows"]["lean"] > 0 and rep["output"] == str(d)
    text = run("synth", "--output", tmp_path / "t", "--days", "1", "--users", "5", "--kinds", "lean")
    assert text.returncode == 0 and text.stdout.startswith("synth: wrote ")
    v = run("validate", "--config", d / "config.yaml", "--input", d / "lean", "--json")
    got = json.loads(v.stdout)
    assert v.returncode == 0 and got["ok"] is True and got["kind"] == "lean log" and isinstance(got["warnings"], list)
    assert run("validate", "--config", d / "config.yaml", "--input", d / "lean").stdout.startswith("config ")


def _finished_build_folder(d):
    """A build folder whose complete state names a samples table (its log alone: publish reads
    no rows)."""
    from userwise.pipelines.records import state

    log = d / "samples" / "_delta_log"
    log.mkdir(parents=True)
    (log / f"{0:020d}.json").write_text("{}\n")
    state.finish(str(d), "build")


def test_publish_is_a_subcommand(tmp_path):
    from userwise.pipelines.records import published

    d = tmp_path / "D"
    _finished_build_folder(d)
    r = run("publish", "--build-dir", d, "--date", "2026-01-04", "--json")
    assert r.returncode == 0, r.stderr
    rec = json.loads(r.stdout)
    assert rec["kind"] == "incremental" and rec["window_end"] == "2026-01-05" and rec["tables"] == {"samples": 0}
    assert published.read(str(d), "incremental", "2026-01-04") == rec
    r = run("publish", "--build-dir", d, "--kind", "pretrain", "--as-of", "2026-02-01")
    assert r.returncode == 0 and r.stdout.startswith("published pretrain 2026-02-01")
    r = run("publish", "--build-dir", tmp_path / "nothing", "--date", "2026-01-04")
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "userwise build" in r.stderr


def test_quiet_leaves_the_report_and_drops_the_progress(tmp_path):
    from userwise.pipelines.tools import shardgen

    shards = str(tmp_path / "S")
    shardgen.write_shard_set(shards, nodes=1, ranks_per_node=1)
    loud = run("stage", "--shards", shards, "--node", "0", "--staged", tmp_path / "a")
    quiet = run("stage", "--shards", shards, "--node", "0", "--staged", tmp_path / "b", "--quiet")
    assert loud.returncode == quiet.returncode == 0, loud.stderr + quiet.stderr
    assert "stage node=0" in loud.stderr and quiet.stderr == ""
    assert loud.stdout.startswith(f"staged node 0 into {tmp_path / 'a'}: ")
    assert quiet.stdout.startswith(f"staged node 0 into {tmp_path / 'b'}: ")
