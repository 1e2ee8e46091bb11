"""jobs/: thin spark-submit entry points, and the zip that ships the project."""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest

from tests.support.standalone import isolated_python
from tests.support.uwchain import ROOT
from userwise.pipelines import cli
from userwise.pipelines.runtime import ship

JOBS = ("requests", "history", "window", "pretrain", "preshard", "publish", "build", "expand", "backfill")


@pytest.mark.parametrize("name", JOBS)
def test_job_delegates_to_the_cli_subcommand(name):
    src = (ROOT / "jobs" / f"{name}.py").read_text()
    tree = ast.parse(src)
    assert name in cli.COMMANDS
    assert f'main(["{name}", *sys.argv[1:]])' in src
    # no argument parsing and no Spark code of its own
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    assert "argparse" not in src and "SparkSession" not in names


def test_backfill_handler_is_wired():
    assert cli.COMMANDS["backfill"][2] == "userwise.pipelines.manage.backfill:cli"


def test_pyfiles_zip_imports_where_the_wheel_alone_does_not(tmp_path):
    """A Python without userwise installed imports it from the zip (namespace dirs present)."""
    py = isolated_python(tmp_path / "iso")
    z = ship.build(tmp_path / "dist")
    wheel = next((tmp_path / "dist").glob("userwise-*.whl"))
    code = "import userwise.schemas, userwise.pipelines.cli as c; print(userwise.schemas.__file__)"
    bare = subprocess.run([py, "-c", code], capture_output=True, text=True)
    assert bare.returncode != 0 and "No module named 'userwise'" in bare.stderr
    got = subprocess.run([py, "-c", code], capture_output=True, text=True, env={"PYTHONPATH": str(z)})
    assert got.returncode == 0, got.stderr
    assert got.stdout.strip().startswith(str(z))
    # why the zip exists: zipimport finds no namespace package in pip's wheel (no directory entries)
    whl = subprocess.run([py, "-c", code], capture_output=True, text=True, env={"PYTHONPATH": str(wheel)})
    assert whl.returncode != 0


def test_job_help_runs_through_the_job_file():
    r = subprocess.run([sys.executable, str(ROOT / "jobs" / "window.py"), "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "--window-days" in r.stdout
