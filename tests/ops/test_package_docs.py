"""Every package's ``__init__`` docstring lists every module of the package, and
CONTRIBUTING.md's layout table lists every package: a newcomer finds each file by reading."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = sorted(p.parent for p in [*(ROOT / "pipelines").rglob("__init__.py"), ROOT / "schemas" / "__init__.py"])


def missing(pkg: Path) -> list[str]:
    doc = ast.get_docstring(ast.parse((pkg / "__init__.py").read_text())) or ""
    mods = sorted(p.stem for p in pkg.glob("*.py") if p.stem != "__init__")
    subs = sorted(p.parent.name for p in pkg.glob("*/__init__.py"))
    return [m for m in mods + subs if f"``{m}``" not in doc and f".{m}`" not in doc]


@pytest.mark.parametrize("pkg", PACKAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_init_docstring_lists_every_module(pkg):
    assert missing(pkg) == []


def test_contributing_lists_every_package():
    text = (ROOT / "CONTRIBUTING.md").read_text()
    rels = [str(p.relative_to(ROOT)) + "/" for p in PACKAGES if p.parent != ROOT]
    assert [r for r in rels if f"`{r}`" not in text] == []


def test_the_check_finds_a_module_left_out(tmp_path):
    (tmp_path / "__init__.py").write_text('"""- ``a``: one."""\n')
    (tmp_path / "a.py").write_text("")
    (tmp_path / "b.py").write_text("")
    assert missing(tmp_path) == ["b"]


def test_pyproject_installs_every_package():
    """A package pyproject does not list is missing from the wheel, the editable install of a clean
    clone and the zip shipped to executors (``userwise.pipelines.api`` was, for a while)."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    want = {"userwise." + ".".join(p.relative_to(ROOT).parts) for p in PACKAGES}
    assert sorted(want - listed) == []
