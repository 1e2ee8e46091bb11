"""Wheels for the install tests: the project's own (built from a copy of the tree, so that a
build never meets another in the checkout), and stand-ins: a wheel of any name and version
that installs a module with ``__version__`` and declares the given requirements."""

from __future__ import annotations

import base64
import hashlib
import shutil
import zipfile
from pathlib import Path

from packaging.utils import canonicalize_name

from tests.support.metadata import ROOT

SOURCES = ("pyproject.toml", "README.md", "pipelines", "schemas")  # what setuptools reads (pyproject's [tool.setuptools])


def build_userwise_wheel(dest: Path) -> Path:
    """``userwise ship``'s wheel (``ship.build_wheel``) of a copy of the checkout, into ``dest``."""
    from userwise.pipelines.runtime import ship

    src = Path(dest) / "src"
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            src.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    return ship.build_wheel(Path(dest) / "dist", project=src)


def stand_in_wheel(dest: Path, name: str, version: str, requires=()) -> Path:
    """A pure-Python wheel ``name-version`` whose module (``import name``) holds ``__version__``."""
    mod = canonicalize_name(name).replace("-", "_")
    dist = f"{mod}-{version}"
    files = {
        f"{mod}/__init__.py": f"__version__ = {version!r}\n",
        f"{dist}.dist-info/METADATA": "".join([f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
                                               *(f"Requires-Dist: {r}\n" for r in requires)]),
        f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    Path(dest).mkdir(parents=True, exist_ok=True)
    path = Path(dest) / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for n, text in files.items():
            z.writestr(n, text)
            digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
            record.append(f"{n},sha256={digest},{len(text.encode())}")
        z.writestr(f"{dist}.dist-info/RECORD", "\n".join([*record, f"{dist}.dist-info/RECORD,,"]) + "\n")
    return path
