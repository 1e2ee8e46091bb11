"""`userwise stage`: parallel verified copy of one node's shards, resume, refusals (no Spark)."""

import json
import os
import subprocess
import sys
import time

import fsspec
import pyarrow.parquet as pq
import pytest
from fsspec.implementations.local import LocalFileSystem

from userwise import schemas
from userwise.pipelines.errors import ShardError
from userwise.pipelines.shards import manifest as mf
from userwise.pipelines.shards import preshard, stage
from userwise.pipelines.tools.shardgen import build_samples, layout

PY = sys.executable


@pytest.fixture(scope="module")
def table():
    return build_samples(seed=1)


@pytest.fixture
def shards(tmp_path, table):
    root = str(tmp_path / "S")
    preshard.preshard_arrow(table, root, schema=schemas.shard_schema(layout()).to_arrow(), nodes=2,
                            ranks_per_node=2, seed=4, compression="none", target_shard_mb=0.1)
    return root


def node_files(root, node):
    m = mf.load(root)
    return [f for s in mf.node_shards(m, node) for f in mf.shard_files(s)]


def test_stage_copies_and_verifies(shards, tmp_path):
    dest = str(tmp_path / "nvme")
    rep = stage.stage(shards, 1, dest, workers=3, out=open(os.devnull, "w"))
    files = node_files(shards, 1)
    assert rep["files"] == rep["copied"] == len(files) and rep["skipped"] == 0
    assert rep["bytes"] == sum(s for _, s, _ in files)
    m = mf.load(dest)
    assert m["staged_node"] == 1
    assert mf.verify(dest, node=1)["files"] == len(files)
    assert not any(n.endswith(".part") for _, _, ns in os.walk(dest) for n in ns)
    assert not os.path.exists(os.path.join(dest, "node=0"))
    # a second run copies nothing
    rep2 = stage.stage(shards, 1, dest, out=open(os.devnull, "w"))
    assert rep2["copied"] == 0 and rep2["skipped"] == len(files)


def test_progress_on_stderr(shards, tmp_path):
    r = subprocess.run([PY, "-m", "userwise.pipelines.cli", "stage", "--shards", shards, "--node", "0",
                        "--staged", str(tmp_path / "d"), "--workers", "2", "--json"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "stage node=0: files" in r.stderr and "MB/s" in r.stderr
    assert json.loads(r.stdout)["copied"] == len(node_files(shards, 0))


def test_stage_does_not_import_pyspark():
    r = subprocess.run([PY, "-c", "import sys, userwise.pipelines.shards.stage, userwise.pipelines.shards.manifest; "
                        "print('pyspark' in sys.modules)"], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "False", r.stderr


def _size(path) -> int:
    """A file's size, 0 when it is not there (a .part the stage is renaming right now)."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def test_resume_after_kill_mid_file(shards, tmp_path):
    dest = tmp_path / "nvme"
    files = node_files(shards, 0)
    total = sum(s for _, s, _ in files)
    # slow enough to be killed mid-way: about 2 s for the whole node
    cmd = [PY, "-m", "userwise.pipelines.cli", "stage", "--shards", shards, "--node", "0", "--staged", str(dest),
           "--workers", "1", "--limit-mbps", str(round(total / 2e6, 3))]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    part = None
    while time.time() < deadline:
        finals = [r for r, _, _ in files if (dest / r).exists()]
        parts = [r for r, s, _ in files if 0 < _size(dest / (r + ".part")) < s]
        if finals and parts:
            p.kill()
            part = parts[0]
            break
        time.sleep(0.005)
    p.wait()
    assert part is not None, "stage finished before it could be interrupted"
    assert not (dest / "manifest.json").exists()      # incomplete: no manifest
    before = {r: (dest / r).stat().st_ino for r in finals}
    mtimes = {r: (dest / r).stat().st_mtime_ns for r in finals}
    rep = stage.stage(shards, 0, str(dest), out=open(os.devnull, "w"))
    assert rep["skipped"] >= len(finals) and rep["resumed"] >= 1
    assert rep["bytes"] < total                        # verified files and the partial prefix not copied again
    for r in finals:
        assert (dest / r).stat().st_ino == before[r] and (dest / r).stat().st_mtime_ns == mtimes[r]
    assert mf.verify(str(dest), node=0)["files"] == len(files)


def test_bad_partial_file_is_copied_again(shards, tmp_path):
    dest = tmp_path / "nvme"
    rel, size, _ = node_files(shards, 0)[0]
    (dest / rel).parent.mkdir(parents=True)
    (dest / (rel + ".part")).write_bytes(b"\x00" * (size // 2))  # garbage prefix
    stage.stage(shards, 0, str(dest), out=open(os.devnull, "w"))
    assert mf.verify(str(dest), node=0)


def test_flipped_byte_is_caught(shards, tmp_path):
    rel = node_files(shards, 0)[1][0]
    path = os.path.join(shards, rel)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x01
    open(path, "wb").write(bytes(data))
    with pytest.raises(ShardError, match="checksum mismatch"):
        mf.verify(shards, node=0)
    dest = tmp_path / "nvme"
    with pytest.raises(ShardError, match=f"{rel}: checksum mismatch"):
        stage.stage(shards, 0, str(dest), out=open(os.devnull, "w"))
    assert not (dest / "manifest.json").exists()
    assert not (dest / rel).exists() and not (dest / (rel + ".part")).exists()
    # the CLI says it in one line
    r = subprocess.run([PY, "-m", "userwise.pipelines.cli", "stage", "--shards", shards, "--node", "0",
                        "--staged", str(dest)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "error:" in r.stderr and "checksum mismatch" in r.stderr
    assert "Traceback" not in r.stderr


def test_missing_manifest_refused(shards, tmp_path):
    os.remove(os.path.join(shards, "manifest.json"))
    with pytest.raises(ShardError, match="no manifest"):
        stage.stage(shards, 0, str(tmp_path / "d"))


def _edit_manifest(root, fn):
    # by hand, not through mf.write: the edits make manifests the module refuses
    p = os.path.join(root, "manifest.json")
    m = json.load(open(p))
    fn(m)
    json.dump(m, open(p, "w"))


def test_newer_format_refused(shards, tmp_path):
    _edit_manifest(shards, lambda m: m.update(format_version=schemas.FORMAT_VERSION + 1))
    with pytest.raises(ShardError, match="newer"):
        stage.stage(shards, 0, str(tmp_path / "d"))


def test_a_shard_of_an_unlisted_set_is_refused_by_stage_and_the_loader(shards, tmp_path):
    """One manifest reader (shards/manifest.py) for stage and the loader: the same refusal."""
    from userwise.pipelines.loader import UserwiseDataset

    _edit_manifest(shards, lambda m: m["shards"][0].update(set="incremental/2099-01-01"))
    for read in (lambda: stage.stage(shards, 0, str(tmp_path / "d")),
                 lambda: UserwiseDataset(shards, node=0, verify="none")):
        with pytest.raises(ShardError, match=r"shards\[0\] .* belongs to set 'incremental/2099-01-01', which is not listed"):
            read()


def test_schema_that_differs_refused(shards, tmp_path):
    def rename(m):
        m["schema"][-1][0] = "imp__renamed"
        m["schema_fingerprint"] = mf.schema_fingerprint_of(m["schema"])
    _edit_manifest(shards, rename)
    with pytest.raises(ShardError, match="schema fingerprint"):
        stage.stage(shards, 0, str(tmp_path / "d"), out=open(os.devnull, "w"))
    _edit_manifest(shards, lambda m: m.update(schema_fingerprint="0" * 16))
    with pytest.raises(ShardError, match="does not match its schema"):
        stage.stage(shards, 0, str(tmp_path / "d"))


def test_dest_of_another_set_refused(shards, tmp_path, table):
    dest = str(tmp_path / "d")
    stage.stage(shards, 0, dest, out=open(os.devnull, "w"))
    with pytest.raises(ShardError, match="different shard set or node"):
        stage.stage(shards, 1, dest)


def test_too_little_space_refused_before_copying(shards, tmp_path, monkeypatch):
    monkeypatch.setattr(stage, "disk_free", lambda p: 1000)
    dest = tmp_path / "d"
    with pytest.raises(ShardError, match="GB free"):
        stage.stage(shards, 0, str(dest))
    assert not any(f for _, _, f in os.walk(dest))


def test_stage_from_fsspec_filesystem(shards, tmp_path):
    mem = fsspec.filesystem("memory")
    for d, _, names in os.walk(shards):
        for n in names:
            rel = os.path.relpath(os.path.join(d, n), shards)
            mem.pipe(f"/uwset/{rel}", open(os.path.join(d, n), "rb").read())
    rep = stage.stage("memory://uwset", 1, str(tmp_path / "d"), workers=2, out=open(os.devnull, "w"))
    assert rep["copied"] == len(node_files(shards, 1))
    t = pq.read_table(str(tmp_path / "d" / "node=1"))
    assert t.num_rows == sum(s["rows"] for s in mf.node_shards(mf.load(shards), 1))


class _Dropping(LocalFileSystem):
    """A store whose connections drop: every file's first ``drops`` reads raise
    ConnectionResetError after some bytes (as a reset TCP stream does), later ones succeed."""

    def __init__(self, drops: int, **kw):
        super().__init__(**kw)
        self.drops, self.failed = drops, {}

    def _open(self, path, mode="rb", **kw):
        f = super()._open(path, mode, **kw)
        if "r" not in mode or not path.endswith((".parquet", ".gds")):
            return f
        fs, real_read = self, f.read

        def read(n=-1):
            got = real_read(min(n, 4096) if n and n > 0 else 4096)
            if fs.failed.get(path, 0) < fs.drops and f.tell() > 1024:
                fs.failed[path] = fs.failed.get(path, 0) + 1
                raise ConnectionResetError(104, "Connection reset by peer")
            return got

        f.read = read
        return f


@pytest.mark.parametrize("range_mb", [64.0, 0.0625])  # whole files, and files cut into ranges
def test_a_store_that_drops_connections_is_retried_then_the_copy_completes(shards, tmp_path, range_mb):
    fs = _Dropping(drops=2)
    dest = str(tmp_path / "nvme")
    err = tmp_path / "err.txt"
    with open(err, "w") as out:
        rep = stage.stage(shards, 0, dest, fs=fs, workers=2, out=out, range_mb=range_mb, backoff=0.01)
    files = node_files(shards, 0)
    assert rep["files"] == len(files) and rep["retries"] >= 2 * sum(1 for p, _, _ in files if p.endswith(".parquet"))
    assert mf.verify(dest, node=0)["files"] == len(files)  # sizes and sha256 against the manifest
    lines = err.read_text().splitlines()
    assert any("ConnectionResetError" in x and "retry 2 in 0.0 s" in x for x in lines)


def test_a_store_that_keeps_dropping_fails_in_one_line_after_the_retries(shards, tmp_path):
    fs = _Dropping(drops=100)
    with pytest.raises(stage.StoreGone, match=r"stopped answering .* run the same command again") as e:
        stage.stage(shards, 0, str(tmp_path / "nvme"), fs=fs, workers=1, out=open(os.devnull, "w"),
                    retries=2, backoff=0.01)
    assert "\n" not in str(e.value) and "ConnectionResetError" in str(e.value)
    assert max(fs.failed.values()) == 3  # the first try and two retries


class _Tty:
    def __init__(self, tty):
        self.tty, self.text = tty, ""

    def isatty(self):
        return self.tty

    def write(self, s):
        self.text += s

    def flush(self):
        pass


@pytest.mark.parametrize("tty", [True, False])
def test_progress_is_one_updating_line_on_a_terminal_and_sparse_lines_in_a_log(tty, monkeypatch):
    clock = iter(range(0, 10_000))
    monkeypatch.setattr(stage.time, "monotonic", lambda: float(next(clock)))
    out = _Tty(tty)
    p = stage._Progress(0, 3, 3_000_000, out=out, every=1.0, every_log=10.0)
    for _ in range(30):  # a second apart
        p.add(100_000)
    p.finish()
    if tty:
        assert out.text.count("\n") == 1 and out.text.endswith("\n") and out.text.count("\r") >= 29
        assert "\x1b[K" in out.text
    else:
        assert "\r" not in out.text and 2 <= out.text.count("\n") <= 4  # every ten seconds, then the end
    last = out.text.split("\r")[-1].splitlines()[-1].replace("\x1b[K", "")
    assert last.startswith("stage node=0: files 0/3, 3.0/3.0 MB, ") and last.endswith(" MB/s")


def test_quiet_stage_prints_no_progress(shards, tmp_path, monkeypatch):
    from userwise.pipelines.runtime import progress

    monkeypatch.setattr(progress, "QUIET", True)
    out = _Tty(True)
    stage.stage(shards, 0, str(tmp_path / "nvme"), out=out)
    assert out.text == ""
