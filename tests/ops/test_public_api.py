"""Every package says what is public, and only that is: its ``__init__`` docstring's
``Public names::`` block is exactly its ``__all__`` (a package that binds public names has
one), it binds no other public name (the rest is ``_``-prefixed or in internal modules),
every public class and function documents itself with an ``Example::`` (as torchrec's module
linter asks of every module), and no package attribute hides a submodule of the same name
(a function ``spans`` over the module ``spans``)."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = sorted(p.parent for p in [*(ROOT / "pipelines").rglob("__init__.py"), ROOT / "schemas" / "__init__.py"])


def dotted(pkg: Path) -> str:
    return "userwise." + ".".join(pkg.relative_to(ROOT).parts)


def public_block(doc: str | None) -> list[str] | None:
    """The names a docstring's ``Public names::`` block imports, in order (None: no block)."""
    if not doc or "Public names::" not in doc:
        return None
    block = doc[doc.index("Public names::"):].split("\n\n")[1]
    return re.findall(r"\w+", block.split(" import ", 1)[1])


def bound_names(init: Path) -> list[str]:
    """The public names an ``__init__.py`` binds at its top level (imports, defs, assignments)."""
    names = []
    for node in ast.parse(init.read_text()).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names += [(a.asname or a.name).split(".")[0] for a in node.names]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.append(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names += [t.id for t in targets if isinstance(t, ast.Name)]
    return [n for n in names if not n.startswith("_") and n != "annotations"]


def submodules(pkg: Path) -> list[str]:
    return sorted({p.stem for p in pkg.glob("*.py") if p.stem != "__init__"} |
                  {p.parent.name for p in pkg.glob("*/__init__.py")})


def problems(pkg: Path, module: types.ModuleType) -> list[str]:
    """What breaks the rules above in one package (its directory and the imported package)."""
    out = []
    block = public_block(module.__doc__)
    names = bound_names(pkg / "__init__.py")
    exported = getattr(module, "__all__", None)
    if block is None:
        if exported is not None or names:
            out.append(f"binds public names {exported or names} but its docstring has no 'Public names::' block")
    else:
        if list(exported or []) != block:
            out.append(f"__all__ {list(exported or [])} is not its 'Public names::' block {block}")
        extra = sorted(set(names) - set(block))
        if extra:
            out.append(f"binds {extra}, which its 'Public names::' block does not list (make them _private or "
                       "import them from their module)")
        for name in block:
            obj = getattr(module, name, None)
            if (inspect.isclass(obj) or inspect.isfunction(obj)) and "Example::" not in (obj.__doc__ or ""):
                out.append(f"{name}: its docstring has no 'Example::'")
    for m in submodules(pkg):
        obj = module.__dict__.get(m)
        if obj is not None and not inspect.ismodule(obj):
            out.append(f"{m}: the package attribute {obj!r} hides its submodule {m}")
    return out


@pytest.mark.parametrize("pkg", PACKAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_package_exports_exactly_what_it_documents(pkg):
    assert problems(pkg, importlib.import_module(dotted(pkg))) == []


def test_the_packages_that_export_names_say_so():
    with_block = [str(p.relative_to(ROOT)) for p in PACKAGES
                  if public_block(importlib.import_module(dotted(p)).__doc__) is not None]
    assert {"pipelines/loader", "pipelines/train", "pipelines/serve", "schemas"} <= set(with_block)


def test_the_check_finds_each_fault(tmp_path, monkeypatch):
    pkg = tmp_path / "fakepkg"
    pkg.mkdir()
    (pkg / "spans.py").write_text('def spans():\n    """No example."""\n\n\ndef helper():\n    pass\n')
    (pkg / "__init__.py").write_text(
        '"""A package.\n\nPublic names::\n\n    from fakepkg import spans\n\nModules: ``spans``.\n"""\n\n'
        "from fakepkg.spans import helper, spans\n\n__all__ = ['spans', 'helper']\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "fakepkg", raising=False)
    monkeypatch.delitem(sys.modules, "fakepkg.spans", raising=False)
    got = problems(pkg, importlib.import_module("fakepkg"))
    assert any("is not its 'Public names::' block" in p for p in got)
    assert any("binds ['helper']" in p for p in got)
    assert any(p.startswith("spans: its docstring has no 'Example::'") for p in got)
    assert any("hides its submodule spans" in p for p in got)
    assert public_block("x\n\nPublic names::\n\n    from a import (b, c,\n    d)\n\nrest") == ["b", "c", "d"]


def arg_problems(name: str, obj) -> list[str]:
    """A public function's or constructor's parameters: each has a type hint, and each
    keyword-only one is named in the docstring (the class's or its ``__init__``'s)."""
    fn = obj.__init__ if inspect.isclass(obj) else obj
    if inspect.isclass(obj) and fn is object.__init__:
        return []
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin's
        return []
    doc = (obj.__doc__ or "") + ((fn.__doc__ or "") if inspect.isclass(obj) else "")
    out = []
    for p in sig.parameters.values():
        if p.name in ("self", "cls") or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.annotation is p.empty:
            out.append(f"{name}({p.name}): no type hint")
        if p.kind is p.KEYWORD_ONLY and not re.search(rf"\b{p.name}\b", doc):
            out.append(f"{name}({p.name}): the docstring does not say what it is")
    return out


@pytest.mark.parametrize("pkg", PACKAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_public_function_and_constructor_has_typed_documented_args(pkg):
    module = importlib.import_module(dotted(pkg))
    bad = []
    for name in public_block(module.__doc__) or []:
        obj = getattr(module, name)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            bad += arg_problems(f"{module.__name__}.{name}", obj)
    assert bad == []


def test_the_spark_side_api_is_keyword_only_in_the_clis_words():
    """``build``, ``expand``, ``preshard``, ``publish`` and ``stage`` take keyword arguments
    only, named as the command's flags (``--build-dir`` is ``build_dir``)."""
    from userwise.pipelines import api, cli

    flags = {}
    for a in next(a for a in cli.parser()._actions if a.__class__.__name__ == "_SubParsersAction").choices.items():
        flags[a[0]] = {x.dest for x in a[1]._actions if x.help != "==SUPPRESS=="}  # not publish's hidden --master
    extra = {"spark", "lock", "progress", "input_version"}  # a session, the lock cli.main holds, stderr
    for name in api.__all__:
        sig = inspect.signature(getattr(api, name))
        assert all(p.kind is p.KEYWORD_ONLY for p in sig.parameters.values()), name
        assert set(sig.parameters) - extra <= flags[name], (name, set(sig.parameters) - extra - flags[name])
        # the printing (--json, --quiet, --report: the returned report written to a file) and --conf stay the CLI's
        cli_only = {"help", "json", "quiet", "conf", "report"}
        assert flags[name] - cli_only <= set(sig.parameters), (name, flags[name] - cli_only - set(sig.parameters))


def test_the_check_finds_an_untyped_or_undocumented_arg():
    def f(a, *, b: int, c: int = 0):
        """Takes ``c``.

        Example::

            f(1, c=2)
        """

    assert arg_problems("f", f) == ["f(a): no type hint", "f(b): the docstring does not say what it is"]


def test_stage_and_publish_run_without_pyspark(tmp_path):
    """Importing the API and calling ``stage`` or ``publish`` never loads pyspark (a trainer's
    host stages shards without a JVM); both fail here on a missing set, as the commands do."""
    import subprocess

    code = f"""
import sys
from userwise.pipelines import api
from userwise.pipelines.errors import UserwiseError
for call in (lambda: api.stage(shards={str(tmp_path / 'S')!r}, node=0, staged={str(tmp_path / 'd')!r}, progress=None),
             lambda: api.publish(build_dir={str(tmp_path / 'D')!r}, date="2026-01-01")):
    try:
        call()
    except UserwiseError as e:
        print("refused:", e)
print("pyspark" in sys.modules)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and lines[-1] == "False" and len(lines) == 3, r.stdout + r.stderr
