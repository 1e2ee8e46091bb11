"""One errors module (CONTRIBUTING, "Errors a user can cause"): every error class of the
product is defined in ``pipelines/errors.py``, under ``UserwiseError``; the exit codes are
named there once and used by name; a loader worker's failure reaches the trainer as a
``WorkerError`` that carries the worker's ``error:`` line. No Spark here."""

from __future__ import annotations

import ast
import builtins
import inspect
import os
from pathlib import Path

import pytest

from userwise.pipelines import errors
from userwise.pipelines.errors import UserwiseError, WorkerError
from userwise.pipelines.loader import UserwiseDataset, UserwiseLoader
from userwise.pipelines.tools.shardgen import write_shard_set

ROOT = Path(__file__).resolve().parents[2]
ERRORS = ROOT / "pipelines" / "errors.py"
BUILTIN_EXCEPTIONS = {n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)}


def sources() -> dict[str, ast.Module]:
    """Every module of pipelines/ and schemas/: path relative to the root -> its tree."""
    return {str(p.relative_to(ROOT)): ast.parse(p.read_text())
            for top in ("pipelines", "schemas") for p in sorted((ROOT / top).rglob("*.py"))}


def _name(node: ast.expr) -> str:
    """``Error`` for ``Error``, ``mod.Error`` or ``pkg.mod.Error``."""
    return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")


def exception_classes(trees: dict[str, ast.Module]) -> dict[str, list[tuple[str, str]]]:
    """Exception classes by the module that defines them: path -> [(class name, line)]. A class is
    one when a base is a builtin exception or a class found to be one (to a fixed point)."""
    known = set(BUILTIN_EXCEPTIONS)
    found: dict[str, list[tuple[str, str]]] = {}
    while True:
        more = False
        for path, tree in trees.items():
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef) and any(_name(b) in known for b in node.bases):
                    entry = (node.name, f"{path}:{node.lineno}")
                    if entry not in found.setdefault(path, []):
                        found[path].append(entry)
                        known.add(node.name)
                        more = True
        if not more:
            return found


def outside_errors(trees) -> list[str]:
    """Exception classes defined outside errors.py, but a module's private signal: a ``_Name``
    that module raises and catches itself and no other module names."""
    bad = []
    for path, classes in exception_classes(trees).items():
        if path == "pipelines/errors.py":
            continue
        for name, where in classes:
            if name.startswith("_"):
                caught = any(isinstance(n, ast.ExceptHandler) and n.type is not None and name in ast.unparse(n.type)
                             for n in ast.walk(trees[path]))
                named_elsewhere = [p for p, t in trees.items() if p != path and any(
                    isinstance(n, (ast.Name, ast.Attribute, ast.alias)) and
                    (getattr(n, "id", None) or getattr(n, "attr", None) or getattr(n, "name", None)) == name
                    for n in ast.walk(t))]
                if caught and not named_elsewhere:
                    continue
            bad.append(f"{where} defines {name}: define it in pipelines/errors.py (under UserwiseError) and import it")
    return sorted(bad)


def test_every_error_class_is_defined_in_the_errors_module():
    assert outside_errors(sources()) == []


def test_the_error_class_check_can_fail():
    trees = sources()
    trees["pipelines/shards/extra.py"] = ast.parse(
        "from userwise.pipelines.errors import ShardError\n\n\nclass Gone(ShardError):\n    pass\n\n\n"
        "class Plain(ValueError):\n    pass\n\n\nclass _Leaks(Exception):\n    pass\n")
    trees["pipelines/shards/other.py"] = ast.parse("from userwise.pipelines.shards.extra import _Leaks\n")
    bad = sorted(set(outside_errors(trees)) - set(outside_errors(sources())))
    assert sorted(b.split(" defines ")[1].split(":")[0] for b in bad) == ["Gone", "Plain", "_Leaks"], bad


def test_every_error_class_is_a_userwise_error_with_its_builtin_base():
    """The classes errors.py defines are its own, under UserwiseError; those callers catch as
    builtins keep the builtin base."""
    classes = {n: c for n, c in vars(errors).items() if inspect.isclass(c) and issubclass(c, BaseException)
               and c.__module__ == errors.__name__}
    defined = {name for name, _ in exception_classes({"pipelines/errors.py": ast.parse(ERRORS.read_text())})
               ["pipelines/errors.py"]}
    assert set(classes) == defined and len(classes) >= 16
    assert all(issubclass(c, UserwiseError) for c in classes.values()), classes
    for name, base in [("ArgumentError", ValueError), ("ConfigError", ValueError), ("SchemaError", ValueError),
                       ("LoaderStateError", ValueError), ("StorageError", OSError), ("JarsError", RuntimeError),
                       ("WorkerError", RuntimeError), ("FileSystemUnavailable", errors.InputError),
                       ("StoreGone", errors.ShardError)]:
        assert issubclass(classes[name], base), name


def test_the_modules_that_name_an_error_hold_the_errors_module_s_class():
    """A name imported where the error is raised (``schemas.SchemaError``, ``config.ConfigError``,
    ``storage.StorageError``...) is the errors module's class, not a twin."""
    from userwise import schemas
    from userwise.pipelines import config
    from userwise.pipelines.runtime import jars, storage
    from userwise.pipelines.tools import hdfs_store, s3_store

    assert schemas.SchemaError is errors.SchemaError
    assert config.ConfigError is errors.ConfigError
    assert storage.StorageError is errors.StorageError and jars.JarsError is errors.JarsError
    assert hdfs_store.StoreError is s3_store.StoreError is errors.StoreError


def test_the_errors_module_imports_nothing_of_the_product():
    """It is the floor: ``schemas`` (layer 0) imports its SchemaError from it."""
    for node in ast.walk(ast.parse(ERRORS.read_text())):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            assert not any(n.startswith("userwise") for n in names), ast.unparse(node)


# -- exit codes ----------------------------------------------------------------------------

EXIT_LITERALS = {2, 3, 130}  # and 1, as a return of the modules that give a command's code


def literal_exits(trees) -> list[str]:
    """Exit codes written as numbers: ``sys.exit(2)``, ``parser.exit(2, ...)``, ``SystemExit(3)``
    anywhere; ``return 130`` or ``return 2, line`` in the modules that give the command's exit
    code (cli, console, errors)."""
    bad = []
    for path, tree in trees.items():
        exits_here = path in ("pipelines/cli.py", "pipelines/console.py", "pipelines/errors.py")
        for node in ast.walk(tree):
            value = None
            codes = EXIT_LITERALS
            if isinstance(node, ast.Call) and _name(node.func) in ("exit", "SystemExit") and node.args:
                value = node.args[0]
            elif exits_here and isinstance(node, ast.Return) and node.value is not None:
                value = node.value.elts[0] if isinstance(node.value, ast.Tuple) and node.value.elts else node.value
                codes = EXIT_LITERALS | {1}
            if isinstance(value, ast.Constant) and type(value.value) is int and value.value in codes:
                bad.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
    return sorted(bad)


def test_exit_codes_are_used_by_name():
    assert literal_exits(sources()) == []


def test_the_exit_code_check_can_fail():
    trees = sources()
    trees["pipelines/cli.py"] = ast.parse("def main():\n    return 130\n\n\ndef f():\n    return 1, 'x'\n")
    trees["pipelines/tools/x.py"] = ast.parse("import sys\nsys.exit(2)\nraise SystemExit(3)\n")
    assert len(literal_exits(trees)) == 4


def test_exit_codes_are_defined_once():
    """EXIT_* integers are assigned in errors.py alone; console and cli use those."""
    from userwise.pipelines import cli, console

    owners = []
    for path, tree in sources().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) \
                    and type(node.value.value) is int:
                owners += [path for t in node.targets if isinstance(t, ast.Name) and t.id.startswith("EXIT_")]
    assert set(owners) == {"pipelines/errors.py"}, owners
    assert not any(n.startswith("EXIT_") for n in vars(console))
    assert (errors.EXIT_OK, errors.EXIT_INTERNAL, errors.EXIT_USER, errors.EXIT_SPARK) == (0, 1, 2, 3)
    assert errors.EXIT_INTERRUPTED == 130
    assert cli.EPILOG == "exit codes: " + "; ".join(f"{k} {v}" for k, v in errors.EXIT_CODES.items())


# -- worker failures -----------------------------------------------------------------------

def test_a_worker_error_s_line_and_exit_code():
    """A worker's bug is an internal error (exit 1), its one line naming the worker's error; a
    worker's user error is the user's line (exit 2). The traceback rides as a note."""
    bug = WorkerError("loader worker 1 failed: ZeroDivisionError: x", 1, "ZeroDivisionError: x",
                      "Traceback (most recent call last):\n  ...\nZeroDivisionError: x\n")
    code, line = errors.one_line(bug)
    assert code == errors.EXIT_INTERNAL and "loader worker 1 failed: ZeroDivisionError: x" in line
    assert "Traceback" not in line and "Traceback" in "".join(bug.__notes__)
    user = WorkerError("ShardError: s.parquet: unreadable", 0, "ShardError: s.parquet: unreadable", "tb", user=True)
    assert errors.one_line(user) == (errors.EXIT_USER, "ShardError: s.parquet: unreadable")
    import pickle

    back = pickle.loads(pickle.dumps(bug))
    assert (type(back), back.worker, back.error, back.trace, back.user) == (WorkerError, 1, bug.error, bug.trace, False)


@pytest.fixture(scope="module")
def shard_set(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("shards"))
    write_shard_set(root, nodes=1, ranks_per_node=1, row_group_rows=8)
    return root


def fail_in_workers(monkeypatch, action):
    """Worker processes (forked children, not the trainer) run ``action`` when they read a buffer."""
    parent, real = os.getpid(), UserwiseDataset._read_buffer

    def read_buffer(self, rgs):
        if os.getpid() != parent:
            action()
        return real(self, rgs)

    monkeypatch.setattr(UserwiseDataset, "_read_buffer", read_buffer)


def worker_error(shard_set) -> WorkerError:
    ld = UserwiseLoader(UserwiseDataset(shard_set, batch_size=4, seed=1, world_size=1, rank=0, verify="none",
                                        device="cpu"), num_workers=1, timeout=60)
    try:
        with pytest.raises(WorkerError) as e:
            list(ld)
    finally:
        ld.close()
    return e.value


def test_a_worker_failure_surfaces_as_a_worker_error_with_the_worker_s_line(shard_set, monkeypatch):
    """A worker's bug: a WorkerError (still a RuntimeError) naming the worker and carrying its
    ``error:`` line and traceback; the CLI's line says the same, exit 1 (a bug, not the user's)."""
    fail_in_workers(monkeypatch, lambda: 1 // 0)
    e = worker_error(shard_set)
    assert isinstance(e, RuntimeError) and isinstance(e, UserwiseError)
    assert (e.worker, e.error, e.user) == (0, "ZeroDivisionError: integer division or modulo by zero", False)
    assert str(e) == "loader worker 0 failed: ZeroDivisionError: integer division or modulo by zero"
    assert "Traceback (most recent call last)" in e.trace and "read_buffer" in e.trace
    assert any(e.trace.strip() in note for note in e.__notes__)
    code, line = errors.one_line(e)
    assert code == errors.EXIT_INTERNAL and "loader worker 0 failed: ZeroDivisionError" in line


def test_a_worker_s_user_error_keeps_its_line(shard_set, monkeypatch):
    """A worker's ShardError: a WorkerError whose message is the worker's ``error:`` line, exit 2."""
    def corrupt():
        raise errors.ShardError("shard-00000.parquet: row group 1 unreadable (stand-in)")

    fail_in_workers(monkeypatch, corrupt)
    e = worker_error(shard_set)
    line = "ShardError: shard-00000.parquet: row group 1 unreadable (stand-in)"
    assert (e.worker, e.error, e.user, str(e)) == (0, line, True, line)
    assert errors.one_line(e) == (errors.EXIT_USER, line)


def test_a_worker_that_dies_is_a_worker_error(shard_set, monkeypatch):
    fail_in_workers(monkeypatch, lambda: os._exit(7))
    e = worker_error(shard_set)
    assert e.worker == 0 and e.trace == "" and not e.user
    assert str(e) == e.error == "loader worker 0 exited (code 7) without sending its next batch"


# -- bad arguments -------------------------------------------------------------------------

def _bad_calls():
    import numpy as np
    import torch

    from userwise.pipelines import serve, train
    from userwise.pipelines.train import stochastic

    t = torch.tensor
    return {
        "train.attend(impl=)": lambda: train.attend(None, None, None, None, impl="nope"),
        "train.causal_over(window=0)": lambda: train.causal_over(t([0, 3]), window=0),
        "train.spans(overrides=)": lambda: train.spans({}, overrides="nope"),
        "stochastic.keep_mask(alpha=3)": lambda: stochastic.keep_mask(t([0, 2]), t([1]), max_len=8, alpha=3.0, seed=0),
        "serve.nodes_of(nodes=0)": lambda: serve.nodes_of(np.arange(3), 0),
        "serve.Events(float items)": lambda: serve.Events(item=t([1.5]), side=t([[1]]), action=t([1])),
        "serve.Events(ragged)": lambda: serve.Events(item=t([1, 2]), side=t([[1]]), action=t([1, 2])),
        "serve.Chain.from_hashes(block=0)": lambda: serve.Chain.from_hashes(np.zeros(3, np.int64), block=0, version=1),
        "train.ReferenceRanker(dim=5, heads=2)": lambda: train.ReferenceRanker(dim=5, heads=2),
        "train.ReferenceRanker(encoder=)": lambda: train.ReferenceRanker(encoder="nope"),
    }


@pytest.mark.parametrize("call", sorted(_bad_calls()))
def test_a_bad_argument_of_train_or_serve_is_an_argument_error(call):
    """Train and serve raise ArgumentError (a UserwiseError and a ValueError) for a bad
    argument, as the loader does."""
    with pytest.raises(errors.ArgumentError):
        _bad_calls()[call]()
