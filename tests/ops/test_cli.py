import subprocess
import sys

from userwise.pipelines import cli


def test_help_lists_every_command():
    out = subprocess.run([sys.executable, "-m", "userwise.pipelines.cli", "--help"],
                         capture_output=True, text=True, check=True).stdout
    for name in cli.COMMANDS:
        assert name in out


def test_help_does_not_import_spark():
    code = "import sys; from userwise.pipelines import cli; cli.parser(); print('pyspark' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_bad_arguments_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "userwise.pipelines.cli", "build", "--config", "x",
                        "--input", "y", "--output", "z", "--as-of", "2026-13-01",
                        "--pretrain-days", "2", "--window-days", "1"], capture_output=True, text=True)
    assert r.returncode == 2
    assert "not a date" in r.stderr


def test_bad_config_one_line(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("columns: {user: u}\n")
    r = subprocess.run([sys.executable, "-m", "userwise.pipelines.cli", "validate", "--config", str(p),
                        "--input", str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("error: config error at columns.request_time")
    assert "Traceback" not in r.stderr
