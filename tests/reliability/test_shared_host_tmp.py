"""Nothing in a shared temp folder is trusted, and stage keeps its own names (docs/security.md).

Another local user can write ``/tmp``: the zip a command ships to a cluster's executors and
Spark's log files live in this user's private ``<tmp>/userwise-<uid>/`` (0700, owner checked),
a zip found there is shipped only when its bytes are the zip this code builds, and files are
created without following links. ``userwise stage`` refuses a destination that is a file, a
link planted at its lock, non-finite or negative rates and range sizes, and manifest entries
named as its own files. Each case here is one the report reproduced. No Spark here."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import stat
import tempfile
import zipfile
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from tests.reliability import test_hostile_input as hostile
from tests.reliability.test_hostile_input import QUIET, cli, edit, one_error
from userwise.pipelines import errors
from userwise.pipelines.errors import ArgumentError, ShardError, UserwiseError
from userwise.pipelines.loader import UserwiseDataset
from userwise.pipelines.records.writer_lock import FolderLock
from userwise.pipelines.runtime import ship, spark
from userwise.pipelines.shards import manifest as mf
from userwise.pipelines.shards import stage

OTHER_UID = 65534  # nobody

# the hostile-input tests' shard set: one node, two small shards, no Spark
shards = hostile.shards


@pytest.fixture
def shared_tmp(tmp_path, monkeypatch):
    """A temp folder made for the test, standing in for the host's ``/tmp`` (world-writable, sticky)."""
    d = tmp_path / "tmp"
    d.mkdir()
    os.chmod(d, 0o1777)
    monkeypatch.setattr(tempfile, "tempdir", str(d))
    monkeypatch.setenv("TMPDIR", str(d))
    monkeypatch.delenv("USERWISE_LOG_DIR", raising=False)
    return d


def sha(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def private(path: Path) -> None:
    """``path`` is a real folder of this user's alone (0700)."""
    st = os.lstat(path)
    assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid(), path
    assert stat.S_IMODE(st.st_mode) == 0o700, (path, oct(st.st_mode))


def planted_zip() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("userwise/pipelines/runtime/spark.py", "import os; os.system('echo pwned')\n")
    return buf.getvalue()


# -- 1. the shipped zip ----------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["file", "symlink"])
def test_a_zip_planted_at_the_cache_path_is_never_shipped(shared_tmp, tmp_path, how):
    """The report's case: a file at the cached zip's name (computable by anyone) was shipped as
    is. Now the cache is a private folder in the temp folder, and what lies at that name (a
    planted zip, a link to another file) is replaced by the zip this code builds: the shipped
    bytes equal a zip built afresh elsewhere, and a link's target is untouched."""
    real = ship.installed_zip(tmp_path / "ref")  # a fresh folder: built, not found
    first = ship.installed_zip()
    assert first.is_relative_to(shared_tmp) and sha(first) == sha(real)
    victim = tmp_path / "victim.zip"
    victim.write_bytes(planted_zip())
    first.unlink()
    if how == "file":
        first.write_bytes(planted_zip())
    else:
        os.symlink(victim, first)
    shipped = ship.installed_zip()
    assert shipped == first and not shipped.is_symlink()
    assert sha(shipped) == sha(real)
    assert victim.read_bytes() == planted_zip()
    assert not [p for p in shipped.parent.iterdir() if ".tmp-" in p.name]  # no temporary left
    assert ship.installed_zip() == shipped and sha(shipped) == sha(real)  # a good cached zip is reused
    private(shipped.parent)
    private(shipped.parent.parent)
    assert stat.S_IMODE(os.lstat(shipped).st_mode) & 0o077 == 0


# -- 2. Spark's log files --------------------------------------------------------------------------


def plant_log_links(d: Path, victim: Path) -> None:
    """Links at the names of the log files a process started in the next seconds would write."""
    now = datetime.now(timezone.utc)
    for s in range(0, 15):
        stamp = (now + timedelta(seconds=s)).strftime("%Y%m%d-%H%M%S")
        os.symlink(victim, d / f"spark-{stamp}-{os.getpid()}.log")
    os.symlink(victim, d / f"log4j2-{os.getpid()}.properties")


@pytest.mark.parametrize("where", ["USERWISE_LOG_DIR", "default"])
def test_a_symlink_planted_at_the_log_files_does_not_overwrite_its_target(shared_tmp, tmp_path, monkeypatch,
                                                                           where):
    """Both log files used to be opened following links: a planted link overwrote a victim.
    Now they are new files (O_EXCL | O_NOFOLLOW), in the folder the user named or in the
    private default folder."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    if where == "USERWISE_LOG_DIR":
        d = tmp_path / "mylogs"
        d.mkdir()
        monkeypatch.setenv("USERWISE_LOG_DIR", str(d))
    else:
        d = shared_tmp / f"userwise-{os.getuid()}" / "logs"
        d.mkdir(parents=True, mode=0o700)
        os.chmod(d.parent, 0o700)
        # the old shared folder, for the code before the fix
        (shared_tmp / "userwise-logs").mkdir()
        plant_log_links(shared_tmp / "userwise-logs", victim)
    plant_log_links(d, victim)
    path, props = spark._log_to_file()
    assert victim.read_text() == "precious"
    assert Path(path).parent == d and Path(props).parent == d
    for p in (path, props):
        st = os.lstat(p)
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600, p
    assert f"fileName = {path}" in Path(props).read_text()


def test_the_default_log_folder_is_private(shared_tmp):
    """It was the shared ``<tmp>/userwise-logs`` (0755, created with exist_ok)."""
    path, props = spark._log_to_file()
    assert Path(path).is_relative_to(shared_tmp / f"userwise-{os.getuid()}")
    private(Path(path).parent)
    private(Path(path).parent.parent)


def test_a_log_dir_that_is_a_file_is_refused_in_one_line(tmp_path, monkeypatch):
    f = tmp_path / "afile"
    f.write_text("keep")
    monkeypatch.setenv("USERWISE_LOG_DIR", str(f))
    with pytest.raises(UserwiseError, match="USERWISE_LOG_DIR.*not a folder"):
        spark._log_to_file()
    assert f.read_text() == "keep"


def foreign(d: Path, monkeypatch, how: str) -> None:
    """Make ``d`` (``<tmp>/userwise-<uid>``) a folder this user must not trust: another user's
    (chowned to nobody as root; else this process is made to look like another uid), a link to a
    folder of ours, or a folder open to others."""
    if how == "other-owner":
        d.mkdir(mode=0o700)
        if os.getuid() == 0:
            os.chown(d, OTHER_UID, OTHER_UID)
        else:
            uid = os.getuid()
            monkeypatch.setattr(os, "getuid", lambda: uid + 1)
            d.rename(d.with_name(f"userwise-{uid + 1}"))
    elif how == "symlink":
        target = d.with_name("elsewhere")
        target.mkdir(mode=0o700)
        os.symlink(target, d)
    else:
        d.mkdir()
        os.chmod(d, 0o755)


@pytest.mark.parametrize("how", ["other-owner", "symlink", "open-mode"])
@pytest.mark.parametrize("what", ["ship", "log"])
def test_a_private_folder_owned_by_someone_else_is_refused_in_one_line(shared_tmp, monkeypatch, how, what):
    """A folder pre-created by another user made everyone's Spark commands fail, or let it read
    and replace what they write. Now it is refused in one line naming it, and nothing is
    written into it."""
    d = shared_tmp / f"userwise-{os.getuid()}"
    foreign(d, monkeypatch, how)
    d = shared_tmp / f"userwise-{os.getuid()}"  # the uid this process now has
    before = sorted(os.listdir(d))
    with pytest.raises(UserwiseError) as e:
        ship.installed_zip() if what == "ship" else spark._log_to_file()
    code, line = errors.one_line(e.value)
    assert code == 2 and "\n" not in str(e.value) and str(d) in line, line
    assert sorted(os.listdir(d)) == before
    assert not (shared_tmp / "userwise-ship").exists() and not (shared_tmp / "userwise-logs").exists()


# -- 3. stage's arguments and destination ----------------------------------------------------------


@pytest.mark.parametrize("flag,value", [("--limit-mbps", "-1"), ("--limit-mbps", "nan"), ("--limit-mbps", "inf"),
                                        ("--limit-mbps", "0"), ("--range-mb", "nan"), ("--range-mb", "inf"),
                                        ("--range-mb", "-1")])
def test_stage_refuses_a_rate_or_range_that_is_not_a_finite_positive_number(shards, tmp_path, flag, value):
    """``--limit-mbps -1`` was accepted (a negative cap, no cap at all), ``--range-mb nan`` was an
    internal error (exit 1)."""
    dest = tmp_path / "d"
    one_error(cli("stage", "--shards", shards, "--node", "0", "--staged", str(dest), flag, value), flag)
    assert not dest.exists()
    with pytest.raises(ArgumentError, match=flag):
        stage.stage(shards, 0, str(dest), out=QUIET, **{flag[2:].replace("-", "_"): float(value)})


def test_stage_into_a_file_is_exit_2_and_leaves_it(shards, tmp_path):
    """``stage --staged <a file>`` was an internal error (FileExistsError, exit 1)."""
    f = tmp_path / "afile"
    f.write_text("keep")
    one_error(cli("stage", "--shards", shards, "--node", "0", "--staged", str(f)), str(f), "not a folder")
    assert f.read_text() == "keep"


@pytest.mark.parametrize("dangling", [False, True])
def test_a_symlinked_stage_lock_is_exit_2_and_its_target_untouched(shards, tmp_path, dangling):
    """A link planted at ``dest/.stage.lock`` was an internal error (ELOOP, exit 1); its target is
    neither written, truncated nor created."""
    dest = tmp_path / "d"
    dest.mkdir()
    victim = tmp_path / "victim.txt"
    if not dangling:
        victim.write_text("precious")
    os.symlink(victim, dest / stage.LOCK)
    one_error(cli("stage", "--shards", shards, "--node", "0", "--staged", str(dest)), stage.LOCK, "remove it")
    assert (victim.read_text() == "precious") if not dangling else not os.path.lexists(victim)
    assert os.path.islink(dest / stage.LOCK) and os.listdir(dest) == [stage.LOCK]
    with pytest.raises(ShardError, match="symbolic link"):
        stage.stage(shards, 0, str(dest), out=QUIET)


# -- 4. manifest entries named as stage's own files -------------------------------------------------


def test_a_manifest_entry_named_stage_lock_is_refused_and_the_lock_holds(shards, tmp_path):
    """The report's case: an entry ``.stage.lock`` of valid size and sha256 made stage delete its
    own lock and copy the payload there, so a second stage ran at the same time. Now the entry is
    refused naming it (stage and the loader), and a stage that holds the lock keeps it: the
    second is refused and the lock file is the first's, unchanged."""
    shutil.copy(os.path.join(shards, "node=0", "shard-00000.parquet"), os.path.join(shards, stage.LOCK))
    n = len(json.load(open(os.path.join(shards, mf.MANIFEST)))["shards"])
    edit(shards, lambda m: m["shards"].append(dict(m["shards"][0], path=stage.LOCK)))
    dest = tmp_path / "d"
    dest.mkdir()
    lock = dest / stage.LOCK
    with FolderLock(str(lock), "stage", what="node 0 of the first"):
        held = (os.lstat(lock).st_ino, lock.read_bytes())
        one_error(cli("stage", "--shards", shards, "--node", "0", "--staged", str(dest)),
                  f"shards[{n}].path", stage.LOCK, "keep for themselves")
        assert (os.lstat(lock).st_ino, lock.read_bytes()) == held
        with pytest.raises(ShardError, match=r"shards\[\d+\]\.path"):
            stage.stage(shards, 0, str(dest), out=QUIET)
        assert (os.lstat(lock).st_ino, lock.read_bytes()) == held
    assert os.listdir(dest) == []
    with pytest.raises(ShardError, match=r"shards\[\d+\]\.path"):
        UserwiseDataset(shards, device="cpu")


@pytest.mark.parametrize("field,name", [
    ("path", "manifest.json"), ("path", "node=0/shard-00000.parquet.part"), ("path", "node=0/x.part.ranges"),
    ("path", "node=0/x.part.ranges.tmp"), ("path", ".stage.lock/x.parquet"), ("path", "node=0/.manifest.json.tmp-7"),
    ("gds_path", ".stage.lock"), ("gds_path", "node=0/shard-00000.parquet.part"),
])
def test_every_name_stage_uses_for_itself_is_refused_as_a_shard_path(shards, tmp_path, field, name):
    def plant(m):
        s = m["shards"][0]
        s[field] = name
        if field == "gds_path":
            s.update(gds_bytes=1, gds_sha256="0" * 64)

    edit(shards, plant)
    dest = tmp_path / "d"
    one_error(cli("stage", "--shards", shards, "--node", "0", "--staged", str(dest)),
              f"shards[0].{field}", "keep for themselves")
    assert not dest.exists()
    with pytest.raises(ShardError, match=rf"shards\[0\]\.{field}"):
        mf.load(shards)
    assert stage.LOCK in mf.RESERVED and mf.MANIFEST in mf.RESERVED  # stage's lock name is one of them


def test_the_reserved_names_leave_ordinary_shard_names_alone():
    for ok in ("node=0/shard-00000.parquet", "node=0/shard-00000.gds", "node=0/partial.parquet",
               "node=0/shard.parts/x.parquet", "stage.lock", "node=0/manifest.json.bak"):
        assert mf.safe_relpath(ok, "x") == ok
