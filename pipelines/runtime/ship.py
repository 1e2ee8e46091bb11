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

The zip a command ships itself is cached in this user's private temp folder
(:func:`private_tmp`: ``<tmp>/userwise-<uid>/ship``, 0700, owner checked) and named by its
content; a file found at that name is shipped only when its bytes hash to the zip built
now, else it is replaced. Files are written through a new temporary name (``O_EXCL |
O_NOFOLLOW``) and a rename, never through a file or link already there.

    userwise ship            # -> dist/userwise-<version>-py3-none-any.whl, dist/userwise-<version>-pyfiles.zip
"""

from __future__ import annotations

import contextlib
import glob
import io
import os
import secrets
import shutil
import stat
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


def _zip_bytes(files) -> bytes:
    """A zip of ``files`` ((archive name, bytes), sorted) with an entry for every directory
    (see the module doc), fixed timestamps: the same files give the same bytes."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zo:
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
    return buf.getvalue()


def write_new(out: str | Path, data: bytes, mode: int = 0o644) -> Path:
    """Write ``data`` to ``out`` through a new file of a unique name beside it (created with
    ``O_EXCL | O_NOFOLLOW``: nothing planted there is written through) and a rename over ``out``.

    Example::

        write_new("/tmp/userwise-0/ship/x.zip", b"...", mode=0o600)
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}-{secrets.token_hex(6)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return out


def _write_zip(files, out: Path) -> Path:
    return write_new(out, _zip_bytes(files))


def _read_nofollow(path: Path) -> bytes | None:
    """The bytes of the regular file ``path``, opened without following a link (None: no such
    file, a link, or not a regular file)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return None
        return f.read()


def private_tmp(name: str) -> Path:
    """``<tmp>/userwise-<uid>/<name>``: a folder of this user's alone, in the shared temp folder
    (``tempfile.gettempdir()``: ``$TMPDIR``, else ``/tmp``). Each level is created with mode 0700,
    or, when it exists, must be a real folder (not a link) owned by this user with no access for
    group or others; anything else is refused in one line (another local user could have planted
    it, to read or replace what is written there).

    Example::

        logs = private_tmp("logs")   # /tmp/userwise-1000/logs, 0700, owned by uid 1000
    """
    import tempfile

    uid = os.getuid()
    root = Path(tempfile.gettempdir()) / f"userwise-{uid}"
    for d in (root, root / name):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            pass
        st = os.lstat(d)
        why = ("is a symbolic link" if stat.S_ISLNK(st.st_mode) else
               "is not a folder" if not stat.S_ISDIR(st.st_mode) else
               f"is owned by uid {st.st_uid}, not by you (uid {uid})" if st.st_uid != uid else
               f"has mode {stat.S_IMODE(st.st_mode):04o}, open to other users" if st.st_mode & 0o077 else None)
        if why:
            raise UserwiseError(f"{d} {why}; userwise keeps its shipped code and logs in a folder of yours "
                                f"alone: remove {d} (another user may have planted it) or set TMPDIR to a "
                                "folder of your own")
    return root / name


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
    under ``dest`` (default this user's private cache, :func:`private_tmp`), named by its content:
    the zip a command ships to a cluster's executors itself (``userwise <job> --master
    spark://...|yarn``). A zip already at that name is shipped only when its bytes hash to the
    zip built here (the same files give the same bytes); anything else there is replaced."""
    import hashlib

    data = _zip_bytes(installed_files())
    digest = hashlib.sha256(data).hexdigest()
    dest = Path(dest) if dest else private_tmp("ship")
    out = dest / f"userwise-{version()}-{digest[:16]}-pyfiles.zip"
    have = _read_nofollow(out)
    if have is not None and hashlib.sha256(have).hexdigest() == digest:
        return out
    return write_new(out, data, 0o600)


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
