"""Forgetting users (pipelines/manage/forget.py): after `userwise forget`, no row of a forgotten user
remains in any current table or shard, every other row is unchanged, the shard sets verify and a
published set stays published; with --vacuum no file under the build folder holds them any more.

One tiny log is built, pre-sharded (a plain set and a published window set) and snapshotted once;
two users are forgotten: the heaviest (several pretrain chunks) and one with quarantined rows.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from userwise.pipelines import cli
from userwise.pipelines.manage import forget
from userwise.pipelines.records import build_record, published, state
from userwise.pipelines.runtime import delta_io
from userwise.pipelines.shards import manifest as mf
from userwise.pipelines.shards import publish
from userwise.pipelines.tools import shardgen

TABLES = ("requests", "events", "history", "samples", "quarantine")
DAY = "2026-01-03"  # the published window's processed day (its set: incremental/2026-01-04)


def run(argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main([str(a) for a in argv])
    return rc, out.getvalue(), err.getvalue()


def ok(argv) -> str:
    rc, out, err = run(argv)
    assert rc == 0, err
    return out


def table_rows(d: Path) -> dict[str, pa.Table]:
    return {t: delta_io.read_small(str(d / t)) for t in TABLES}


def set_roots(s: Path) -> list[str]:
    return sorted(str(p.parent) for p in s.rglob(mf.MANIFEST) if "_staging" not in p.parts)


def shard_rows(root: str) -> dict[str, pa.Table]:
    """path -> rows of every shard of the set, in file order."""
    return {e["path"]: pq.read_table(os.path.join(root, e["path"])) for e in mf.load(root)["shards"]}


def owner(t: pa.Table, name: str, ucol: str) -> list[str]:
    """The user of each row as text (quarantine: read from the rejected row's JSON)."""
    if name == "quarantine":
        return [str(json.loads(r).get(ucol)) for r in t.column("row").to_pylist()]
    return [str(u) for u in t.column("user").to_pylist()]


def canon(t: pa.Table) -> list[str]:
    return [json.dumps(r, sort_keys=True, default=str) for r in t.to_pylist()]


def split(t: pa.Table, name: str, ucol: str, users: set[str]) -> tuple[list[str], list[str]]:
    """(rows of the users, the other rows), each in the table's order, as canonical JSON."""
    rows, who = canon(t), owner(t, name, ucol)
    return [r for r, u in zip(rows, who) if u in users], [r for r, u in zip(rows, who) if u not in users]


def files_holding(d: Path, ucol: str, users: set[str]) -> list[str]:
    """Every Parquet data file under the build folder with a row of the users (logs aside)."""
    found = []
    for p in sorted(d.rglob("*.parquet")):
        if "_delta_log" in p.parts:
            continue
        t = pq.read_table(p)
        name = "keyed" if "user" in t.column_names else "quarantine" if "row" in t.column_names else None
        if name and users & set(owner(t, name, ucol)):
            found.append(str(p.relative_to(d)))
    return found


@pytest.fixture(scope="module")
def world(spark, tmp_path_factory):
    base = tmp_path_factory.mktemp("forget")
    log, d, s = base / "log", base / "D", base / "S"
    ok(["synth", "--output", log, "--days", "3", "--users", "8", "--items", "100", "--impressions", "600",
        "--kinds", "lean", "--bad-rows", "0.005", "--max-seq-len", "5", "--start", "2026-01-01"])
    ok(["build", "--config", log / "config.yaml", "--input", log / "lean", "--build-dir", d, "--as-of", "2026-01-04",
        "--incremental-days", "2", "--window-days", "1"])
    ok(["preshard", "--build-dir", d, "--shards", s / "all", "--nodes", "1", "--ranks-per-node", "2"])
    key = publish.set_key("incremental", date=DAY)
    ok(["preshard", "--build-dir", d, "--shards", publish.staging_root(str(s), key), "--nodes", "1",
        "--ranks-per-node", "2", "--kind", "incremental", "--window", publish.window_of(DAY)[1].isoformat()])
    publish.publish(str(d), date=DAY, shards=str(s))
    ucol = build_record.load(str(d))[0].col("user")
    before = table_rows(d)
    sets = {r: shard_rows(r) for r in set_roots(s)}

    # The heaviest user (most pretrain chunks) and a user with quarantined rows whose samples sit in
    # the published window set.
    smp = before["samples"]
    chunks = Counter(str(u) for u, k in zip(smp.column("user").to_pylist(), smp.column("kind").to_pylist())
                     if k == "pretrain")
    heavy, n_chunks = chunks.most_common(1)[0]
    assert n_chunks >= 2, "the log must give one user several pretrain chunks"
    quarantined = set(owner(before["quarantine"], "quarantine", ucol)) - {"None", heavy}
    published = set(str(u) for t in sets[publish.set_root(str(s), key)].values() for u in t.column("user").to_pylist())
    second = sorted(quarantined & published or quarantined)[0]
    users = {heavy, second}
    f = base / "users.txt"
    f.write_text(f"# forget these\n{heavy}\n\n{second}\n{heavy}\n")
    return {"d": d, "s": s, "ucol": ucol, "before": before, "sets": sets, "users": users, "file": f,
            "key": key, "log": log}


@pytest.fixture(scope="module")
def forgotten(world):
    """The first forget (no vacuum): its report and the state right after it."""
    before_files = files_holding(world["d"], world["ucol"], world["users"])
    out = ok(["forget", "--build-dir", world["d"], "--users", world["file"], "--shards", world["s"], "--json"])
    return {"report": json.loads(out), "after": table_rows(world["d"]),
            "sets": {r: shard_rows(r) for r in set_roots(world["s"])}, "files_before": before_files}


@pytest.mark.spark
@pytest.mark.slow
def test_forget_removes_the_users_from_every_table_and_leaves_every_other_row(world, forgotten):
    ucol, users = world["ucol"], world["users"]
    rep = forgotten["report"]
    assert rep["users"] == 2  # the file repeats one id and has a comment and a blank line
    for t in TABLES:
        gone, kept = split(world["before"][t], t, ucol, users)
        still, now = split(forgotten["after"][t], t, ucol, users)
        assert gone, f"{t}: the chosen users had no rows: the test would prove nothing"
        assert still == [], f"{t}: rows of a forgotten user remain"
        assert Counter(now) == Counter(kept), f"{t}: other rows changed"
        assert rep["tables"][t] == len(gone)
    # The heavy user's chunks are all gone; the other users' samples are the same samples.
    smp = forgotten["after"]["samples"]
    assert not users & {str(u) for u in smp.column("user").to_pylist()}
    rec = json.loads(Path(state.record_path(str(world["d"]))).read_text())
    assert rec["job"] == "forget" and rec["tables"] == state.table_versions(str(world["d"]))
    assert rep["versions"] == rec["tables"]


@pytest.mark.spark
@pytest.mark.slow
def test_forget_rewrites_the_shards_that_held_the_users_and_keeps_the_rest(world, forgotten):
    ucol, users = world["ucol"], world["users"]
    assert sorted(forgotten["sets"]) == sorted(world["sets"])
    rewritten = {r["root"]: r for r in forgotten["report"]["shards"]}
    assert sorted(rewritten) == sorted(world["sets"])  # both sets held a forgotten user
    for root, shards in world["sets"].items():
        mf.verify(root, checksums=True)
        m = mf.load(root)
        changed = 0
        for path, t in shards.items():
            gone, kept = split(t, "shard", ucol, users)
            still, now = split(forgotten["sets"][root][path], "shard", ucol, users)
            assert still == []
            assert now == kept, f"{root}/{path}: other rows changed (or their order)"
            changed += bool(gone)
        assert rewritten[root]["files_rewritten"] == changed > 0
        for st in m["sets"]:
            mine = [e for e in m["shards"] if e["set"] == st["id"]]
            assert st["rows"] == sum(e["rows"] for e in mine) == sum(st["balance"]["rank_rows"][0])
            assert st["cost"] == sum(e["cost"] for e in mine)
        assert not [p for p in Path(root).parent.iterdir() if ".forget-" in p.name]  # no copy left behind
    # The published window is still published: marker and record carry the new manifest checksum.
    assert publish.is_published(str(world["d"]), "incremental", DAY, str(world["s"]))
    rec = published.read(str(world["d"]), "incremental", DAY)
    assert rec["shards"]["rows"] == sum(len(t) for t in forgotten["sets"][rec["shards"]["root"]].values())


@pytest.mark.spark
@pytest.mark.slow
def test_forget_is_idempotent_and_vacuum_deletes_the_old_files(world, forgotten):
    d, ucol, users = world["d"], world["ucol"], world["users"]
    # Without --vacuum, older table versions (time travel) still hold the users' files.
    assert forgotten["files_before"] and files_holding(d, ucol, users)
    out = ok(["forget", "--build-dir", d, "--users", world["file"], "--shards", world["s"], "--vacuum", "--json"])
    rep = json.loads(out)
    assert rep["tables"] == {t: 0 for t in TABLES} and rep["shards"] == []
    assert sorted(rep["vacuumed"]) == sorted(TABLES)
    assert files_holding(d, ucol, users) == []
    after = table_rows(d)
    for t in TABLES:
        assert Counter(canon(after[t])) == Counter(canon(forgotten["after"][t]))
    for root in world["sets"]:
        mf.verify(root, checksums=True)


@pytest.mark.spark
@pytest.mark.slow
def test_bad_users_file_is_one_error_line_and_changes_nothing(world, forgotten, tmp_path):
    d = world["d"]
    versions = state.table_versions(str(d))
    for text, expect in (("12\nnot-a-user\n", "'not-a-user' is not a user id of this build"),
                         ("# nobody\n\n", "holds no user id")):
        f = tmp_path / "u.txt"
        f.write_text(text)
        rc, _, err = run(["forget", "--build-dir", d, "--users", f])
        lines = err.strip().splitlines()
        assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: ") and expect in lines[0], err
    rc, _, err = run(["forget", "--build-dir", d, "--users", tmp_path / "missing.txt"])
    assert rc == 2 and "cannot read it" in err
    rc, _, err = run(["forget", "--build-dir", tmp_path / "nothing", "--users", world["file"]])
    assert rc == 2 and "not a userwise build folder" in err
    assert state.table_versions(str(d)) == versions


# ---------------------------------------------------------------------------
# shard sets alone (no Spark): synthetic sets with GDS side files
# ---------------------------------------------------------------------------
def _users_of(root: str, k: int) -> list[int]:
    u = shardgen.all_rows(root).column("user").to_pylist()
    return [x for x, _ in Counter(u).most_common(k)]


def test_rewrite_set_drops_the_users_keeps_every_other_row_in_order_and_verifies(tmp_path):
    root = str(tmp_path / "S")
    shardgen.write_shard_set(root, nodes=2, ranks_per_node=2, gds=True, seed=3)
    before = shard_rows(root)
    m0 = mf.load(root)
    users = _users_of(root, 2)
    rep = forget.rewrite_set(root, pa.array(users, pa.int64()))
    names = {str(u) for u in users}
    changed = removed = 0
    after = shard_rows(root)
    for path, t in before.items():
        gone, kept = split(t, "shard", "", names)
        still, now = split(after[path], "shard", "", names)
        assert still == [] and now == kept
        changed += bool(gone)
        removed += len(gone)
    assert rep["files_rewritten"] == changed > 0 and rep["rows_removed"] == removed
    assert mf.verify(root, checksums=True)["files"] == 2 * len(before)  # parquet + gds, every shard
    m = mf.load(root)
    untouched = [e for e, e0 in zip(m["shards"], m0["shards"]) if e == e0]
    assert len(untouched) == len(before) - changed  # the other shards' entries (and files) are as they were
    assert sum(s["rows"] for s in m["sets"]) == sum(s["rows"] for s in m0["sets"]) - rep["rows_removed"]
    assert forget.rewrite_set(root, pa.array(users, pa.int64())) is None  # nothing left to forget
    assert sorted(os.listdir(tmp_path)) == ["S"]


def test_a_forget_killed_between_the_two_renames_is_completed_by_the_next_run(tmp_path):
    top = tmp_path / "S"
    root = str(top / "incremental" / "2026-01-05")
    shardgen.write_shard_set(root, seed=4)
    users = pa.array(_users_of(root, 1), pa.int64())
    # A copy a killed run left before its swap (no manifest yet), and a swap killed half-way.
    os.makedirs(f"{root}.forget-new-11/node=0")
    forget.rewrite_set(root, users)
    os.rename(root, f"{root}.forget-new-12")
    assert forget.find_sets(str(top)) == [root]
    assert sorted(p.name for p in (top / "incremental").iterdir()) == ["2026-01-05"]
    mf.verify(root)
    assert forget.rewrite_set(root, users) is None
