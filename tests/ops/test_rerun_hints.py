"""Every "run it again" hint the code can print is a command a user can paste: the CLI's own
parser takes it, with the job's config, its build folder and the values it ran with, in the
CLI's names. The hints come from the jobs themselves (each job function is run up to the
point where it records itself, its record is then left behind as a killed job's would be)
and from the functions that make them. No Spark: the jobs stop before their first Spark call."""

from __future__ import annotations

import ast
import contextlib
import datetime as dt
import json
import re
import shlex
from pathlib import Path

import pytest

from tests.support.common import config as config_dict
from userwise.pipelines import cli
from userwise.pipelines import config as C
from userwise.pipelines.errors import UserwiseError
from userwise.pipelines.records import state

ROOT = Path(__file__).resolve().parents[2]


class _Recorded(Exception):
    """Stops a job where it records itself (before its first write)."""


@pytest.fixture
def cfg(tmp_path):
    p = tmp_path / "my config.yaml"  # a space: the hint must quote it
    p.write_text(json.dumps(config_dict()))
    return C.load(str(p))


@pytest.fixture
def recorded(monkeypatch):
    """Each job's (name, build folder, detail) as :func:`state.begin` would record it."""
    got = []

    def begin(build_dir, job, **detail):
        got.append((job, build_dir, detail))
        raise _Recorded

    @contextlib.contextmanager
    def job(build_dir, name, **detail):
        begin(build_dir, name, **detail)
        yield

    monkeypatch.setattr(state, "begin", begin)
    monkeypatch.setattr(state, "job", job)
    return got


def _run_jobs(cfg, d: str, monkeypatch):
    from userwise.pipelines.builder import build, daily
    from userwise.pipelines.manage import backfill, forget
    from userwise.pipelines.records import build_record

    monkeypatch.setattr(build_record, "load", lambda _: (cfg, None, {}))  # the jobs that read build.json
    calls = [
        lambda: build.build(None, cfg, "/logs/lean", d, "2026-01-10", 4, 2, "/logs/actions"),
        lambda: build.build(None, cfg, "/logs/lean", d, "2026-01-10", 0, 1),
        lambda: daily.requests_day(None, cfg, "/logs/lean", d, "2026-01-03", actions_path="/logs/a b"),
        lambda: daily.history_day(None, cfg, d, "2026-01-03"),
        lambda: daily.window_day(None, cfg, d, "2026-01-03", 2),
        lambda: daily.pretrain(None, cfg, d, "2026-01-10", 3),
        lambda: backfill.build_days(None, cfg, input_path="/logs/lean", build_dir=d, first=dt.date(2026, 1, 2),
                                    last=dt.date(2026, 1, 4), window_days=1, shards="/S", nodes=2, ranks_per_node=4),
        lambda: backfill.build_days(None, cfg, input_path="/logs/lean", build_dir=d, first=dt.date(2026, 1, 2),
                                    last=dt.date(2026, 1, 2)),
        lambda: forget.forget(None, d, [], detail=forget.rerun_detail(cli.parser().parse_args(
            ["forget", "--build-dir", d, "--users", "/u.txt", "--shards", "/S1", "--shards", "/S 2", "--vacuum"]))),
        lambda: forget.forget(None, d, [], detail=forget.rerun_detail(cli.parser().parse_args(
            ["forget", "--build-dir", d, "--users", "/u.txt"]))),
    ]
    for call in calls:
        with pytest.raises(_Recorded):
            call()


def _parse(hint: str):
    """The hint between backticks, parsed by the CLI's own parser (an error exits)."""
    argv = shlex.split(hint)
    assert argv[0] == "userwise", hint
    return cli.parser().parse_args(argv[1:])


def _check(args, job: str, d: str, cfg, detail: dict) -> None:
    assert args.command == job and args.build_dir == d
    if job != "forget":
        assert args.config == cfg.source
    for k, v in detail.items():
        if k == "config":
            continue
        dest = {"from_": "date_from", "to": "date_to", "input": "input", "actions": "actions"}.get(k, k)
        got = getattr(args, dest)
        if v is None:
            continue
        want = v if isinstance(v, (bool, list)) else type(got)(v) if got is not None else v
        assert got == want, (job, k, got, v)


def test_every_jobs_rerun_hint_parses_with_the_cli(cfg, tmp_path, recorded, monkeypatch):
    d = str(tmp_path / "my build")
    _run_jobs(cfg, d, monkeypatch)
    assert {j for j, _, _ in recorded} == {"build", "requests", "history", "window", "pretrain", "backfill",
                                           "forget"}
    for job, build_dir, detail in recorded:
        hint = state.describe(job, build_dir, detail)
        assert hint.startswith("`userwise ") and hint.endswith("`"), hint
        _check(_parse(hint.strip("`")), job, build_dir, cfg, detail)
    # the values a job ran with, in the CLI's names: build's M and N, pretrain's as-of, backfill's shards
    hints = {j: state.describe(j, b, det) for j, b, det in recorded}
    assert "--incremental-days 4 --window-days 2 --actions /logs/actions" in \
        state.describe(*[(j, b, det) for j, b, det in recorded if j == "build"][0])
    assert "--as-of 2026-01-10 --incremental-days 3" in hints["pretrain"]


def test_a_dead_jobs_hint_in_the_readers_error_is_pasteable(cfg, tmp_path, recorded, monkeypatch):
    """The situation itself: a job marked running and gone; a reader's error names it, and
    what it names parses, with --config and --build-dir."""
    d = str(tmp_path / "my build")
    _run_jobs(cfg, d, monkeypatch)
    monkeypatch.undo()
    for job, build_dir, detail in recorded:
        state.begin(build_dir, job, **detail)  # what a killed job leaves
        with pytest.raises(state.IncompleteError) as e:
            state.complete_state(build_dir)
        msg = str(e.value)
        assert "did not finish" in msg and "--build-dir" in msg, msg
        hints = re.findall(r"`(userwise [^`]*)`", msg)
        assert len(hints) == 1, msg
        args = _parse(hints[0])
        _check(args, job, build_dir, cfg, detail)
        if job != "forget":
            assert args.config == cfg.source


def test_a_history_gap_names_a_pasteable_history_run(cfg, tmp_path):
    from userwise.pipelines.builder.history import History

    d = str(tmp_path / "D")
    h = History(None, cfg, None, d)
    with pytest.raises(UserwiseError) as e:
        h._check_gap({dt.date(2026, 1, 1): 1}, dt.date(2026, 1, 5))
    (hint,) = re.findall(r"`(userwise [^`]*)`", str(e.value))
    args = _parse(hint)
    assert (args.command, args.config, args.build_dir, args.date) == ("history", cfg.source, d, "2026-01-04")


def test_a_config_made_in_python_gets_the_placeholder_the_help_shows(tmp_path):
    argv = state.rerun_args("window", "/D", {"config": None, "date": "2026-01-03", "window_days": 1})
    assert argv[:5] == ["window", "--config", "C.yaml", "--build-dir", "/D"]
    assert cli.parser().parse_args(argv).window_days == 1


def _printed_strings(tree: ast.AST):
    """The string constants of a module that are not docstrings (what it can print)."""
    docs = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docs.add(id(first.value))
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            yield node.lineno, node.value


def test_every_hint_with_flags_comes_from_state_describe():
    """A hint written by hand (`userwise history --date X`) drifts from the parser; every
    command line the code prints with flags and values is made by :func:`state.describe`."""
    bad = []
    for path in sorted((ROOT / "pipelines").rglob("*.py")):
        for line, s in _printed_strings(ast.parse(path.read_text())):
            if re.search(r"`userwise [a-z]+ --[a-z-]+ ", s):  # a command with a flag and its value
                bad.append(f"{path.relative_to(ROOT)}:{line}: {s!r}")
    assert bad == []
