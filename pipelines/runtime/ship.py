"""Ship the project to Spark executors: the wheel, and a --py-files zip made from it.

``userwise ship`` builds both from a source checkout (the wheel for ``pip install``, the zip
for ``spark-submit --py-files``); :func:`installed_zip` makes the zip from the code the
running interpreter imports, which is what a command ships itself when it is given a
cluster's master (``runtime.spark.get_spark``).

Why a zip beside the wheel: ``userwise`` is a namespace package (PEP 420, no
``__init__.py``), and Python's zipimport finds a namespace package only when
the archive holds an entry for its directory. ``pip wheel`` writes no
directory entries, so ``--py-files userwise-0.1.0-py3-none-any.whl`` leaves
``import userwise.pipelines`` failing on executors (Python 3.11). The zip
holds the same files as the wheel plus those directory entries (and no
``.dist-info``).

    userwise ship            # -> dist/userwise-<version>-py3-none-any.whl, dist/userwise-<version>-pyfiles.zip
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from userwise.pipelines.errors import UserwiseError

PROJECT = Path(__file__).resolve().parents[2]


def build_wheel(dist: str | Path = "dist", project: str | Path = PROJECT) -> Path:
    """``pip wheel --no-deps`` of the project into ``dist``; returns the wheel's path."""
    dist = Path(dist).resolve()
    dist.mkdir(parents=True, exist_ok=True)
    for old in glob.glob(str(dist / "userwise-*.whl")):
        Path(old).unlink()
    had_build = (Path(project) / "build").exists()
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                        "-w", str(dist), str(project)], capture_output=True, text=True)
    if not had_build:  # setuptools leaves build/ in the project; not ours to keep
        shutil.rmtree(Path(project) / "build", ignore_errors=True)
    wheels = glob.glob(str(dist / "userwise-*.whl"))
    if r.returncode != 0 or len(wheels) != 1:
        raise UserwiseError(f"pip wheel of {project} failed: {(r.stdout + r.stderr)[-800:]}")
    return Path(wheels[0])


def _write_zip(files, out: Path) -> Path:
    """A zip of ``files`` ((archive name, bytes), sorted) with an entry for every directory
    (see the module doc), fixed timestamps: the same files give the same bytes."""
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    out.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zo:
        dirs: set[str] = set()
        for name, data in files:
            parts = name.split("/")[:-1]
            for i in range(1, len(parts) + 1):
                d = "/".join(parts[:i]) + "/"
                if d not in dirs:
                    dirs.add(d)
                    zo.writestr(zipfile.ZipInfo(d, date_time=(1980, 1, 1, 0, 0, 0)), b"")
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            zo.writestr(info, data)
    tmp.replace(out)
    return out


def pyfiles_zip(wheel: str | Path, out: str | Path | None = None) -> Path:
    """Copy the wheel's modules into a zip with directory entries (see the module doc)."""
    wheel = Path(wheel)
    out = Path(out) if out else wheel.with_name(wheel.name.split("-py")[0] + "-pyfiles.zip")
    with zipfile.ZipFile(wheel) as zi:
        files = [(n, zi.read(n)) for n in sorted(zi.namelist()) if ".dist-info/" not in n and not n.endswith("/")]
    return _write_zip(files, out)


SHIPPED = (".py", ".xml")  # modules and package data (the jar poms)


def version() -> str:
    """The installed distribution's version (its metadata: pyproject's ``version``, the one place
    it is spelled); ``0+unknown`` where the code runs from a zip or an uninstalled checkout."""
    from importlib import metadata

    try:
        return metadata.version("userwise")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def installed_files() -> list[tuple[str, bytes]]:
    """The importable ``userwise`` packages as (archive name, bytes): what this interpreter
    imports, whether installed from a wheel or editable from a checkout."""
    import userwise.schemas

    out = []
    pipelines_root = Path(__file__).resolve().parents[1]  # this module is pipelines/runtime/ship.py
    for root, name in ((pipelines_root, "userwise/pipelines"),
                       (Path(userwise.schemas.__path__[0]), "userwise/schemas")):
        for f in sorted(root.rglob("*")):
            if f.suffix in SHIPPED and f.is_file() and "__pycache__" not in f.parts:
                out.append((f"{name}/{f.relative_to(root).as_posix()}", f.read_bytes()))
    return sorted(out)


def installed_zip(dest: str | Path | None = None) -> Path:
    """The ``--py-files`` zip of the code this process runs (no pip, no source tree needed),
    under ``dest`` (default a cache folder), named by its content: the zip a command ships to
    a cluster's executors itself (``userwise <job> --master spark://...|yarn``)."""
    import hashlib
    import tempfile

    files = installed_files()
    h = hashlib.sha256()
    for n, data in files:
        h.update(n.encode() + b"\0" + data)
    dest = Path(dest) if dest else Path(tempfile.gettempdir()) / "userwise-ship"
    out = dest / f"userwise-{version()}-{h.hexdigest()[:12]}-pyfiles.zip"
    return out if out.is_file() else _write_zip(files, out)


def build(dist: str | Path = "dist", project: str | Path = PROJECT) -> Path:
    """Build the wheel and the --py-files zip; returns the zip's path."""
    return pyfiles_zip(build_wheel(dist, project))


def cli(args) -> int:
    """``userwise ship``: the wheel and the zip, for ``pip install`` and ``spark-submit --py-files``."""
    from userwise.pipelines import console

    zip_path = build(args.dist)
    wheel = next(Path(zip_path).parent.glob("userwise-*.whl"))
    console.emit({"wheel": str(wheel), "py_files": str(zip_path)},
                 f"wheel: {wheel}\n--py-files: {zip_path}")
    return 0
