"""Hostile and damaged input is refused before it touches anything (docs/security.md).

A shard set's manifest is written by whoever can write the cluster storage; `userwise stage`
and the loader must not let it write, delete or read outside their folders. Configs, loader
arguments and saved loader states are checked the same way: one clear error, nothing left
behind. No Spark here."""

from __future__ import annotations

import base64
import io
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import pyarrow.parquet as pq
import pytest

from tests.loader.test_loader_integrity import Flipped, footer
from tests.support.shard_sets import one_node_set
from userwise import schemas
from userwise.pipelines import errors
from userwise.pipelines.config import ConfigError, safe_yaml
from userwise.pipelines.errors import ArgumentError, ShardError, UserwiseError
from userwise.pipelines.loader import UserwiseDataset, UserwiseLoader
from userwise.pipelines.loader.planning.resume import LoaderStateError
from userwise.pipelines.records.writer_lock import FolderLock, LockedError, WriterLock
from userwise.pipelines.shards import stage

PY = sys.executable
QUIET = open(os.devnull, "w")


def cli(*args, timeout=120):
    return subprocess.run([PY, "-m", "userwise.pipelines.cli", *args], capture_output=True, text=True, timeout=timeout)


def one_error(r, *needles):
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr and len(lines) == 1 and lines[0].startswith("error: "), r.stderr[-2000:]
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


@pytest.fixture
def shards(tmp_path):
    """``tmp/S``: a one-node shard set of two small shards."""
    return one_node_set(str(tmp_path / "S"), seed=4, users=8, bot_chunks=1, windows=1)


def edit(root, fn):
    """Rewrite ``root/manifest.json`` with ``fn(manifest)`` applied, as an attacker would (no checks)."""
    p = os.path.join(root, "manifest.json")
    m = json.load(open(p))
    fn(m)
    with open(p, "w") as f:
        json.dump(m, f)


def tree(path):
    """Every name under ``path`` (links not followed), with file sizes."""
    out = {}
    for d, dirs, files in os.walk(path):
        for n in dirs + files:
            p = os.path.join(d, n)
            out[os.path.relpath(p, path)] = None if os.path.isdir(p) else os.lstat(p).st_size
    return out


# -- 1. manifest paths stay inside their folders ---------------------------------------------------


@pytest.mark.parametrize("bad", ["../payload.parquet", "../victim.txt", "ABS", "node=0/../../../newdir/x.parquet",
                                 "node=0/./shard.parquet", "s3://bucket/x.parquet", "node=0//x.parquet",
                                 "node=0\\..\\x.parquet"])
def test_a_manifest_path_outside_the_set_is_refused_before_anything_is_touched(shards, tmp_path, bad):
    """The cases of the report: a payload beside the destination (stage wrote it there), a
    victim beside it (the resume step deleted it), an absolute path (deleted too), a path
    that climbs out of node=0/ (created a folder two levels up). Each is one error line,
    exit 2, naming the entry; nothing outside the destination changes, and the destination
    itself is not even created."""
    top = tmp_path / "top"
    (top / "a").mkdir(parents=True)
    dest = top / "a" / "nvme"
    victim = top / "a" / "victim.txt"
    victim.write_text("precious")
    absolute = tmp_path / "abs-victim.txt"
    absolute.write_text("precious")
    bad = str(absolute) if bad == "ABS" else bad
    shutil.copy(os.path.join(shards, "node=0", "shard-00000.parquet"), tmp_path / "payload.parquet")

    def plant(m):
        m["shards"][0]["path"] = bad

    edit(shards, plant)
    before = tree(tmp_path)
    line = one_error(cli("stage", "--shards", shards, "--node", "0", "--staged", str(dest)), "shards[0].path")
    assert "refused before anything was read or written" in line
    assert tree(tmp_path) == before
    assert victim.read_text() == "precious" and absolute.read_text() == "precious"
    assert not dest.exists() and not (tmp_path / "newdir").exists() and not (top / "newdir").exists()
    # the loader refuses the same manifest (a staged copy holds the shard set's own paths)
    with pytest.raises(ShardError, match=r"shards\[0\]\.path"):
        UserwiseDataset(shards, device="cpu")


def test_a_gds_side_path_is_checked_too(shards, tmp_path):
    def plant(m):
        s = m["shards"][1]
        s["gds_path"], s["gds_bytes"], s["gds_sha256"] = "../x.gds", 10, "0" * 64

    edit(shards, plant)
    with pytest.raises(ShardError, match=r"shards\[1\]\.gds_path"):
        stage.stage(shards, 0, str(tmp_path / "d"), out=QUIET)
    assert not (tmp_path / "d").exists() and not (tmp_path / "x.gds").exists()


def test_a_source_that_links_outside_the_set_is_refused(shards, tmp_path):
    secret = tmp_path / "secret.parquet"
    shard = os.path.join(shards, "node=0", "shard-00000.parquet")
    shutil.move(shard, secret)
    os.symlink(secret, shard)
    with pytest.raises(ShardError, match="outside the shard set's root"):
        stage.stage(shards, 0, str(tmp_path / "d"), out=QUIET)
    assert not (tmp_path / "d").exists()


def test_a_destination_folder_that_links_outside_is_refused(shards, tmp_path):
    """dest/node=0 a link to a folder elsewhere: the shards would land there."""
    dest, elsewhere = tmp_path / "d", tmp_path / "elsewhere"
    dest.mkdir()
    elsewhere.mkdir()
    os.symlink(elsewhere, dest / "node=0")
    with pytest.raises(ShardError, match="outside the destination"):
        stage.stage(shards, 0, str(dest), out=QUIET)
    assert os.listdir(elsewhere) == []


# -- 2. a symlinked .part is not written through ---------------------------------------------------


@pytest.mark.parametrize("ranged", [False, True])
def test_a_symlinked_part_is_not_written_through(shards, tmp_path, ranged):
    dest = tmp_path / "d"
    (dest / "node=0").mkdir(parents=True)
    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"do not touch")
    os.symlink(victim, dest / "node=0" / "shard-00000.parquet.part")
    if ranged:
        os.symlink(victim, dest / "node=0" / "shard-00000.parquet.part.ranges")
    rep = stage.stage(shards, 0, str(dest), out=QUIET, range_mb=0.01 if ranged else 64)
    assert victim.read_bytes() == b"do not touch"
    assert rep["resumed"] == 0
    assert not os.path.islink(dest / "node=0" / "shard-00000.parquet")
    UserwiseDataset(str(dest), device="cpu")  # verified with checksums


def test_a_symlinked_final_file_is_replaced_not_trusted(shards, tmp_path):
    """A link at a shard's final name whose target holds the right bytes is not 'already there'."""
    dest = tmp_path / "d"
    (dest / "node=0").mkdir(parents=True)
    outside = tmp_path / "outside.parquet"
    shutil.copy(os.path.join(shards, "node=0", "shard-00000.parquet"), outside)
    os.symlink(outside, dest / "node=0" / "shard-00000.parquet")
    rep = stage.stage(shards, 0, str(dest), out=QUIET)
    assert rep["skipped"] == 0 and not os.path.islink(dest / "node=0" / "shard-00000.parquet")
    assert outside.exists()


# -- 3. the manifest's own schema ------------------------------------------------------------------


@pytest.mark.parametrize("field,value,needle", [
    ("bytes", "abc", "'bytes' must be an integer >= 0"),
    ("path", None, "'path' must be a string"),
    ("node", "zero", "'node' must be an integer >= 0"),
    ("sha256", 12, "'sha256' must be a string"),
    ("rows", -1, "'rows' must be an integer >= 0"),
    ("node", True, "'node' must be an integer >= 0"),
    ("sha256", "xyz", "'sha256' must be 64 hex digits"),
    ("set", ["a"], "'set' must be a string"),
])
def test_an_ill_typed_manifest_field_is_exit_2_naming_it(shards, tmp_path, field, value, needle):
    edit(shards, lambda m: m["shards"][0].__setitem__(field, value))
    one_error(cli("stage", "--shards", shards, "--node", "0", "--staged", str(tmp_path / "d")), "shards[0]", needle)
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("change,needle", [
    (lambda m: m.__setitem__("nodes", "2"), "'nodes' must be an integer >= 1"),
    (lambda m: m.__setitem__("sets", {}), "'sets' must be a list"),
    (lambda m: m["sets"][0].__setitem__("rows", "x"), "sets[0]: field 'rows'"),
    (lambda m: m["shards"][0].pop("sha256"), "lacks ['sha256']"),
    (lambda m: m.__setitem__("shards", [1]), "shards[0] must be an object"),
    (lambda m: m["shards"].append(dict(m["shards"][0])), "listed twice"),
])
def test_the_manifest_schema_is_checked_whole(shards, tmp_path, change, needle):
    edit(shards, change)
    one_error(cli("stage", "--shards", shards, "--node", "0", "--staged", str(tmp_path / "d")), needle)


# -- 4. one stage per destination ------------------------------------------------------------------


def test_a_second_stage_into_one_destination_is_refused_naming_the_first(shards, tmp_path):
    dest = str(tmp_path / "d")
    os.makedirs(dest)
    with FolderLock(os.path.join(dest, stage.LOCK), "stage", what="node 0 of elsewhere"):
        r = cli("stage", "--shards", shards, "--node", "0", "--staged", dest)
        one_error(r, "is being written by", f"pid {os.getpid()}", "stage (node 0 of elsewhere)")
        with pytest.raises(LockedError):
            stage.stage(shards, 0, dest, out=QUIET)
    stage.stage(shards, 0, dest, out=QUIET)  # released: the next one runs
    assert not os.path.exists(os.path.join(dest, stage.LOCK))


def test_concurrent_stages_one_wins_and_a_killed_stage_lock_is_taken_over(shards, tmp_path):
    """Two stages started together: exactly one copies, the other is refused at once (before,
    both failed or copied more than the set). Then a stage killed with -9 mid-copy leaves its
    lock file, and the next stage takes it over and finishes."""
    dest = str(tmp_path / "d")
    total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(shards) for f in fs)
    slow = ["--workers", "1", "--limit-mbps", str(round(total / 3e6, 4))]  # about 3 s
    cmd = [PY, "-m", "userwise.pipelines.cli", "stage", "--shards", shards, "--node", "0", "--staged", dest]
    ps = [subprocess.Popen(cmd + slow + ["--range-mb", "0.01"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in ps]
    codes = sorted(p.returncode for p in ps)
    assert codes == [0, 2], outs
    loser = outs[[p.returncode for p in ps].index(2)][1]
    assert "is being written by" in loser and "Traceback" not in loser
    UserwiseDataset(dest, device="cpu")
    assert sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(dest) for f in fs
               if f.endswith(".parquet")) == sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(shards)
                                                 for f in fs if f.endswith(".parquet"))

    dest2 = str(tmp_path / "d2")
    p = subprocess.Popen(cmd[:-1] + [dest2] + slow, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while not os.path.exists(os.path.join(dest2, stage.LOCK)) and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert os.path.exists(os.path.join(dest2, stage.LOCK))  # left behind by the killed stage
    stage.stage(shards, 0, dest2, out=QUIET)
    UserwiseDataset(dest2, device="cpu")


# -- 5. bounded config loading, readable error lines -----------------------------------------------


def bomb(depth: int) -> str:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    for i in range(1, depth + 1):
        lines.append(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]")
    return "\n".join(lines) + "\ncolumns: *a%d\n" % depth


def test_a_yaml_alias_bomb_is_refused_at_once(tmp_path):
    """The report's 735-byte file (anchors nested nine levels) ran 28 s and 1.3 GB before an
    internal error; now it is refused in well under a second, as is depth six (whose error
    line was 3.1 MB)."""
    for depth in (6, 9):
        p = tmp_path / f"bomb{depth}.yaml"
        p.write_text(bomb(depth))
        t = time.monotonic()
        r = cli("validate", "--config", str(p), "--input", str(tmp_path))
        line = one_error(r, "aliases expand to more than", str(p))
        assert len(line) < 400 and time.monotonic() - t < 30
    with pytest.raises(ConfigError, match="its own anchor|not valid YAML"):
        safe_yaml("a: &a [*a]")
    assert safe_yaml("a: &x [1, 2]\nb: *x") == {"a": [1, 2], "b": [1, 2]}  # plain aliases still work
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "airflow"))
    try:
        from userwise_dag_common import load_file

        p = tmp_path / "settings.yaml"
        p.write_text(bomb(9))
        with pytest.raises(ConfigError, match="aliases expand"):
            load_file(p)
    finally:
        sys.path.pop(0)


def test_every_error_line_is_cut_to_a_readable_length():
    code, line = errors.one_line(UserwiseError("config error at columns: " + "x" * 3_000_000 + "; fix it"))
    assert code == 2 and len(line) < 700 and line.startswith("config error at columns") and line.endswith("fix it")
    code, line = errors.one_line(RuntimeError("y" * 100_000))
    assert code == 1 and len(line) < 700


# -- 6. every decode failure is a ShardError naming the file ---------------------------------------


def _batches(root, verify):
    ds = UserwiseDataset(root, verify=verify, batch_size=8, seed=1, device="cpu", buffer_row_groups=2)
    return [bytes(b.buffer.numpy()) for b in UserwiseLoader(ds)]


def _damage_format_version(path: str) -> tuple[int, int]:
    """(position, byte) of a one-byte change in the footer that leaves it readable but makes the
    format version its Arrow schema carries (base64 in ``ARROW:schema``) a non-number."""
    data = open(path, "rb").read()
    run = re.compile(rb"[A-Za-z0-9+/]{64,}={0,2}").search(data, data.rindex(b"ARROW:schema"))
    # the value's Thrift length prefix may read as a base64 character: skip it
    skip = next(k for k in range(4) if (run.end() - run.start() - k) % 4 == 0
                and b"userwise.format_version" in base64.b64decode(run.group(0)[k:]))
    start = run.start() + skip
    decoded = base64.b64decode(run.group(0)[skip:])
    v = str(schemas.FORMAT_VERSION).encode()
    j = decoded.index(len(v).to_bytes(4, "little") + v + b"\x00") + 4  # the value: a flatbuffer string
    for c in range((j // 3) * 4, (j // 3) * 4 + 4):
        for ch in b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/":
            b = bytearray(data)
            b[start + c] = ch
            try:
                v = pq.ParquetFile(io.BytesIO(bytes(b))).schema_arrow.metadata.get(b"userwise.format_version")
            except Exception:  # noqa: BLE001 - not this one
                continue
            if v is not None and not v.isdigit():
                return start + c, ch
    raise AssertionError("no such byte")


def test_a_damaged_format_version_in_the_footer_is_a_shard_error(shards, tmp_path):
    """The report's escape: one footer byte made the format version a non-number, ``int()``
    failed and a bare ValueError left the loader (`userwise diagnose` exited 1)."""
    path = os.path.join(shards, "node=0", "shard-00000.parquet")
    pos, byte = _damage_format_version(path)
    orig = open(path, "rb").read()
    damaged = bytearray(orig)
    damaged[pos] = byte
    try:
        open(path, "wb").write(damaged)
        for verify in ("size", "none"):
            with pytest.raises(ShardError, match="format version"):
                _batches(shards, verify)
        r = cli("diagnose", "--staged", shards, "--device", "cpu", "--batch-size", "8", "--batches", "5")
        one_error(r, path)
    finally:
        open(path, "wb").write(orig)


def test_a_few_hundred_flips_never_change_a_batch_nor_escape(shards):
    """Single-bit flips, half of them in the footer, read under every ``verify`` mode: each
    read either fails with a ShardError naming the file or gives exactly the batches of the
    undamaged set, never another exception."""
    rnd = random.Random(50)
    path = os.path.join(shards, "node=0", "shard-00000.parquet")
    ref = _batches(shards, "checksum")
    f0, _ = footer(path)
    size = os.path.getsize(path)
    seen = {"error": 0, "same": 0}
    for k in range(360):
        verify = ("none", "size", "checksum")[k % 3]
        pos = rnd.randrange(f0, size) if k % 2 else rnd.randrange(0, size)
        with Flipped(path, pos, rnd.randrange(8)):
            try:
                got = _batches(shards, verify)
            except ShardError as e:
                assert path in str(e), e
                seen["error"] += 1
            else:
                assert got == ref, f"a flip at byte {pos} (verify={verify}) changed the batches"
                seen["same"] += 1
    assert seen["error"] > 100 and seen["same"] > 10, seen


# -- 7. loader arguments and states ----------------------------------------------------------------


@pytest.mark.parametrize("kw,needle", [
    (dict(batch_size=2.5), "batch_size must be an integer >= 1"),
    (dict(batch_size=0), "batch_size must be an integer >= 1"),
    (dict(batch_size="8"), "batch_size must be an integer >= 1"),
    (dict(token_budget=-3), "token_budget must be an integer >= 1"),
    (dict(eval_user_share=1.5), "eval_user_share must be in [0, 1)"),
    (dict(eval_user_share=-0.1), "eval_user_share must be in [0, 1)"),
    (dict(eval_user_share=float("nan")), "eval_user_share must be a number"),
    (dict(seed="1"), "seed must be an integer"),
    (dict(rank=-1, world_size=1), "rank must be an integer >= 0"),
    (dict(rank=0, world_size=0), "world_size must be an integer >= 1"),
    (dict(node="0"), "node must be an integer >= 0"),
    (dict(shuffle="no"), "shuffle must be true or false"),
    (dict(sets="pretrain"), "sets must be a list"),
    (dict(buffer_row_groups=0), "buffer_row_groups must be an integer >= 1"),
    (dict(verify="md5"), "verify must be one of"),
])
def test_an_ill_typed_dataset_argument_is_one_clear_error(shards, kw, needle):
    with pytest.raises(ArgumentError) as e:
        UserwiseDataset(shards, device="cpu", **kw)
    assert needle in str(e.value) and isinstance(e.value, ValueError)


@pytest.mark.parametrize("kw,needle", [
    (dict(num_workers=-1), "num_workers must be an integer >= 0"),
    (dict(num_workers=1.5), "num_workers must be an integer >= 0"),
    (dict(prefetch=0), "prefetch must be an integer >= 1"),
    (dict(worker_queue="4"), "worker_queue must be an integer >= 1"),
    (dict(timeout=0), "timeout must be > 0"),
])
def test_an_ill_typed_loader_argument_is_one_clear_error(shards, kw, needle):
    ds = UserwiseDataset(shards, device="cpu", batch_size=8)
    with pytest.raises(ArgumentError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        UserwiseLoader(ds, **kw)


@pytest.mark.parametrize("state,needle", [
    ({"resumed": [{"garbage": 1}]}, "resumed[0] lacks 'world_size'"),
    ({"epoch": 0, "cursor": "abc", "seed": 0}, "cursor must be an integer >= 0"),
    ({"epoch": 0, "cursor": -1, "seed": 0}, "cursor must be an integer >= 0"),
    ({"epoch": -5, "cursor": 0, "seed": 0}, "epoch must be an integer >= 0"),
    ({"epoch": 0, "cursor": 1, "seed": 0, "bogus": 1}, "unknown fields ['bogus']"),
    ({"epoch": 0, "cursor": 0, "seed": 0, "targets": [1, "x"]}, "targets[1] must be an integer >= 0"),
    ([{"world_size": 1}, 3], "every rank's state"),
])
def test_an_ill_typed_state_is_refused(shards, state, needle):
    ld = UserwiseLoader(UserwiseDataset(shards, device="cpu", batch_size=8, seed=0))
    with pytest.raises(LoaderStateError) as e:
        ld.load_state_dict(state)
    assert needle in str(e.value), str(e.value)


def test_a_state_resumes_exactly_or_is_refused(shards):
    """A saved state resumes at its ``cursor`` of this loader's plan, exactly; a cursor past the
    epoch's batches is refused (it yielded 0 batches without a word); a state lacking what
    state_dict() saves (``{epoch, cursor, seed}``) is refused naming the fields."""
    def loader():
        return UserwiseLoader(UserwiseDataset(shards, device="cpu", batch_size=4, seed=0))

    ref = [bytes(b.buffer.numpy()) for b in loader()]
    assert len(ref) > 3
    def state_after(n: int) -> dict:
        ld = loader()
        it = iter(ld)
        for _ in range(n):
            next(it)
        return ld.state_dict()

    st = state_after(2)
    ld = loader()
    ld.load_state_dict(st)
    assert [bytes(b.buffer.numpy()) for b in ld] == ref[2:]
    ld = loader()
    ld.load_state_dict(state_after(len(ref)))  # the epoch's end: nothing left, rightly
    assert list(ld) == []
    ld = loader()
    ld.load_state_dict({**st, "epoch": 1, "cursor": 10**9, "targets": None})
    with pytest.raises(LoaderStateError, match="past the"):
        list(ld)
    with pytest.raises(LoaderStateError, match=r"lacks \['samples', 'node', 'rank', 'world_size'"):
        loader().load_state_dict({"epoch": 0, "cursor": 2, "seed": 0})


# -- 8. a refusal leaves nothing behind ------------------------------------------------------------


def test_a_refused_declared_size_leaves_no_part(shards, tmp_path):
    """A manifest that declares 200 MiB for a small file: stage refuses before it writes
    (it used to leave a 200 MiB sparse .part)."""
    edit(shards, lambda m: m["shards"][0].__setitem__("bytes", 200 << 20))
    dest = tmp_path / "d"
    with pytest.raises(ShardError, match="the manifest says 209715200"):
        stage.stage(shards, 0, str(dest), out=QUIET, range_mb=1)
    assert not dest.exists()
    dest.mkdir()  # an existing destination keeps only what it had
    with pytest.raises(ShardError):
        stage.stage(shards, 0, str(dest), out=QUIET, range_mb=1)
    assert os.listdir(dest) == []


def test_a_refused_job_leaves_no_build_folder(tmp_path):
    """A job refused after taking the build folder's lock (a bad config, a missing input)
    used to leave an empty ``D/_userwise/locks``; the folders it made go with the lock."""
    out = tmp_path / "D"
    lock = WriterLock(str(out), "build").acquire()
    assert (out / "_userwise" / "locks").is_dir()
    lock.release()
    assert not out.exists()
    (out / "keep").mkdir(parents=True)  # a folder that existed keeps what it had
    WriterLock(str(out), "build").acquire().release()
    assert sorted(os.listdir(out)) == ["keep"]
    cfg = tmp_path / "c.yaml"
    cfg.write_text("columns: {user: u}\n")
    one_error(cli("build", "--config", str(cfg), "--input", str(tmp_path / "none"), "--build-dir",
                  str(tmp_path / "D2"), "--as-of", "2026-01-02"))
    assert not (tmp_path / "D2").exists()
