"""`userwise stage`: parallel verified copy of one node's shards, resume, refusals (no Spark)."""

import json
import os
import subprocess
import sys
import time

import fsspec
import pyarrow.parquet as pq
import pytest

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
                        "--dest", str(tmp_path / "d"), "--workers", "2"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "stage node=0: files" in r.stderr and "MB/s" in r.stderr
    assert json.loads(r.stdout)["copied"] == len(node_files(shards, 0))


def test_stage_does_not_import_pyspark():
    r = subprocess.run([PY, "-c", "import sys, userwise.pipelines.shards.stage, userwise.pipelines.shards.manifest; "
                        "print('pyspark' in sys.modules)"], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "False", r.stderr


def test_resume_after_kill_mid_file(shards, tmp_path):
    dest = tmp_path / "nvme"
    files = node_files(shards, 0)
    total = sum(s for _, s, _ in files)
    # slow enough to be killed mid-way: about 2 s for the whole node
    cmd = [PY, "-m", "userwise.pipelines.cli", "stage", "--shards", shards, "--node", "0", "--dest", str(dest),
           "--workers", "1", "--limit-mbps", str(round(total / 2e6, 3))]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    part = None
    while time.time() < deadline:
        finals = [r for r, _, _ in files if (dest / r).exists()]
        parts = [r for r, s, _ in files if (dest / (r + ".part")).exists()
                 and 0 < (dest / (r + ".part")).stat().st_size < s]
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
                        "--dest", str(dest)], capture_output=True, text=True, timeout=120)
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
