"""The replay serves a build's requests through the cache and through a full recompute: on a
shard set made without Spark (two training nodes; light users, a heavy user and the bot
over a pretrain set and two daily windows), every request's cached logits equal the full
recompute's and the training forward's (float64 1e-9, float32 1e-5; the "sample" and
"window" encoders) while users move through small device, host and disk tiers; the same
seed gives the same report outside its timing; a cache keyed by (user, length) that
ignores the chain is caught; hit rates add up per tier and node; a new window that
starts with the same events keeps the cache and one that does not is invalidated; the
command prints its report and exits 2 when logits differ; docs/serving.md's loop runs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from userwise import schemas
from userwise.pipelines import cli
from userwise.pipelines.errors import ShardError, UserwiseError
from userwise.pipelines.serve import TIERS, KVStore, build_replay, chain_of, nodes_of, read_trace, replay
from userwise.pipelines.shards import preshard
from userwise.pipelines.tools import shardgen
from userwise.pipelines.train import ReferenceRanker
from userwise.schemas.hashing import sequence_chain

L = 20  # shardgen's max_seq_len
SMALL = dict(page_size=8, device_bytes=40_000, host_bytes=80_000, disk_bytes=200_000)  # every tier in use


def _write(table: pa.Table, root) -> str:
    schema = schemas.shard_schema(shardgen.layout()).to_arrow()
    preshard.preshard_arrow(table, str(root), schema=schema, nodes=2, ranks_per_node=1, row_group_rows=16)
    return str(root)


@pytest.fixture(scope="module")
def samples() -> pa.Table:
    return shardgen.build_samples(seed=3, users=14, heavy=1, bot_chunks=2, windows=2)


@pytest.fixture(scope="module")
def shards(samples, tmp_path_factory) -> str:
    return _write(samples, tmp_path_factory.mktemp("replay") / "S")


def _plain(report: dict) -> dict:
    return {k: v for k, v in report.items() if k != "timing"}


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("encoder", ["sample", "window"])
def test_cached_logits_equal_the_full_recompute_and_the_training_forward(shards, samples, encoder, dtype, tmp_path):
    r = replay(shards, serving_nodes=2, encoder=encoder, window=5 if encoder == "window" else None, dtype=dtype,
               dim=16, seed=1, cache_dir=tmp_path, **SMALL)
    eq = r["equality"]
    assert eq["equal"] and eq["over_tolerance"] == eq["over_tolerance_training"] == 0, eq
    assert eq["max_abs_diff"] <= eq["tolerance"] == {"float64": 1e-9, "float32": 1e-5}[dtype]
    assert eq["max_abs_diff_training"] <= eq["tolerance"]
    assert r["requests"] == sum(samples.column("num_requests").to_pylist())
    assert r["impressions"] == sum(samples.column("num_impressions").to_pylist())
    assert r["model"]["max_seq_len"] == L and r["model"]["encoder"] == encoder and r["training_nodes"] == [0, 1]
    assert all(r["hits"][t] > 0 for t in TIERS), r["hits"]  # hits on every tier, so each tier's path is checked
    assert r["invalidated"] > 0 and sum(r["nodes"][k]["offloaded"]["device_to_host"] for k in (0, 1)) > 0
    assert 0 < r["tokens"]["encoded"] < r["tokens"]["full"]


def test_the_same_seed_gives_the_same_report(shards, tmp_path):
    kw = dict(serving_nodes=3, dtype="float32", dim=16, **SMALL)
    a = replay(shards, seed=4, cache_dir=tmp_path / "a", **kw)
    b = replay(shards, seed=4, cache_dir=tmp_path / "b", **kw)
    assert _plain(a) == _plain(b)
    assert json.dumps(_plain(a), sort_keys=True) == json.dumps(_plain(b), sort_keys=True)
    assert set(a["timing"]) >= {"cached_requests_per_s", "full_requests_per_s", "cached_s", "full_s", "wall_s"}
    c = replay(shards, seed=5, cache_dir=tmp_path / "c", max_requests=20, **kw)
    assert c["logloss"] != replay(shards, seed=4, cache_dir=tmp_path / "d", max_requests=20, **kw)["logloss"]  # the report depends on the weights, so the comparison can fail


class KeyedByLength(KVStore):
    """A broken cache: keyed by (user, length), it trusts a user's held state whatever
    events it encodes (the lookup passes the held chain instead of the current one)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.held = {}

    def put(self, user, chain, state):
        self.held[user] = chain
        return super().put(user, chain, state)

    def acquire(self, user, chain):
        h = self.held.get(user)
        if h is not None and h.length <= chain.length:
            chain = h
        return super().acquire(user, chain)


def test_a_cache_that_ignores_the_chain_is_caught(shards, capsys, monkeypatch):
    r = replay(shards, serving_nodes=2, dtype="float64", dim=16, make_store=lambda node, **kw: KeyedByLength(**kw))
    eq = r["equality"]
    assert not eq["equal"] and eq["over_tolerance"] > 0 and eq["over_tolerance_training"] > 0
    assert eq["max_abs_diff"] > 1e-3
    # the command prints the report, then one error line, and exits 2
    monkeypatch.setattr(build_replay, "KVStore", KeyedByLength)
    capsys.readouterr()
    rc = cli.main(["replay", "--shards", shards, "--serving-nodes", "2", "--dtype", "float64", "--dim", "16", "--json",
                   "--quiet"])
    out, err = capsys.readouterr()
    assert rc == 2 and json.loads(out)["equality"]["over_tolerance"] > 0
    assert err.startswith("error: ") and err.count("\n") == 1 and "cached logits differ" in err


def test_hit_rates_add_up_per_tier_and_node(shards, tmp_path):
    r = replay(shards, serving_nodes=2, dim=16, cache_dir=tmp_path, **SMALL)
    for part in [r, *r["nodes"]]:
        assert part["lookups"] == part["requests"] - part["requests_without_history"]
        reuse = part["reuse"]  # each lookup once: a full reuse (hits per tier), a partial reuse or a miss
        assert reuse == {"full": sum(part["hits"].values()), "partial": sum(part["partial_reuses"].values()),
                         "miss": part["misses"]}
        assert sum(reuse.values()) == part["lookups"] and reuse["full"] > 0
        assert sum(part["reuse_rate"].values()) == pytest.approx(1.0, abs=1e-12)
        assert part["reuse_rate"]["partial"] == pytest.approx(reuse["partial"] / part["lookups"])
        assert part["hit_rate"]["disk"] == pytest.approx(part["hits"]["disk"] / part["lookups"])
        assert reuse["partial"] <= part["invalidated"] <= reuse["partial"] + reuse["miss"]
        tok = part["tokens"]
        assert tok["recomputed_fraction"] == pytest.approx(tok["encoded"] / tok["full"])
        assert 0 <= tok["reencoded"] <= tok["encoded"] <= tok["full"]
        assert tok["new"] + tok["reencoded"] == tok["encoded"]
    for key in ("lookups", "misses", "requests", "impressions", "users", "invalidated"):
        assert r[key] == sum(n[key] for n in r["nodes"]), key
    for t in TIERS:
        assert r["hits"][t] == sum(n["hits"][t] for n in r["nodes"])
        assert r["partial_reuses"][t] == sum(n["partial_reuses"][t] for n in r["nodes"])
        assert r["resident_bytes"][t] == sum(n["resident_bytes"][t] for n in r["nodes"])
        for n in r["nodes"]:
            assert n["resident_bytes"][t] <= n["peak_resident_bytes"][t] <= SMALL[f"{t}_bytes"]
    assert r["requests_without_history"] > 0  # requests that see no event are scored without a lookup


def test_the_trace_is_each_nodes_requests_in_time_order(shards, samples):
    tr = read_trace(shards, serving_nodes=3)
    assert tr.max_seq_len == L and sum(len(o) for o in tr.order) == tr.num_requests
    users = samples.column("user").to_pylist()
    for k in range(3):
        reqs = list(tr.requests(k))
        assert [(q.time, q.id) for q in reqs] == sorted((q.time, q.id) for q in reqs)
        assert {q.user for q in reqs} == {u for u, n in zip(users, nodes_of(users, 3)) if n == k}
        for q in reqs[::7]:
            assert q.node == k and len(q.events) == q.seq_end and q.seq_begin == max(0, q.seq_end - L)
            assert len(q.visible) == q.seq_end - q.seq_begin and len(q.candidates) == len(q.labels) > 0
            s = int(np.flatnonzero(tr.sample_ids == q.sample_id)[0])
            assert _same_chain(tr.chain(s, q.seq_end, block=8, version="v"), chain_of(q.events, block=8, version="v"))


def _same_chain(a, b) -> bool:
    return (a.version, a.block, a.length, a.end) == (b.version, b.block, b.length, b.end) and \
        np.array_equal(a.checkpoints, b.checkpoints)


def test_a_pointer_that_breaks_the_rule_is_refused(shards):
    with pytest.raises(UserwiseError, match="not the newest L=5 before it"):
        read_trace(shards, max_seq_len=5)
    with pytest.raises(UserwiseError, match="at least one serving node"):
        read_trace(shards, serving_nodes=0)


def _chained(samples: pa.Table, *, alter: bool) -> tuple[pa.Table, int]:
    """Each light user's daily sample (chunk 0) begins with the events of its pretrain sample,
    as a build's samples do when the user's history is shorter than L (both anchored at its
    first event). ``alter``: the copy's first item changed (a different history)."""
    rows = samples.to_pylist()
    first = {}
    chained = 0
    for row in rows:
        if row["user"] >= shardgen.HEAVY or row["chunk"]:
            continue
        if row["kind"] == "pretrain":
            first[row["user"]] = row
            continue
        prev = first.get(row["user"])
        if prev is None or not prev["num_events"] or not row["num_requests"]:
            continue
        n0 = prev["num_events"]
        for c in ("seq_ts", "seq_item", "seq_category", "seq_author", "seq_action"):
            row[c] = list(prev[c]) + list(row[c])
        if alter:
            row["seq_item"][0] += 1
        row["seq_ts"][n0:] = [max(t, row["seq_ts"][n0 - 1]) for t in row["seq_ts"][n0:]]
        row["req_seq_end"] = [e + n0 for e in row["req_seq_end"]]
        row["req_seq_begin"] = [max(0, e - L) for e in row["req_seq_end"]]
        row["num_events"] += n0
        row["cost"] += n0
        cps, row["chain_end"] = sequence_chain([row[c] for c in ("seq_item", "seq_category", "seq_author",
                                                                 "seq_action")], row["chain_block"])
        row["chain_checkpoints"] = [int(x) for x in cps]
        chained += 1
    return pa.Table.from_pylist(rows, schema=samples.schema), chained


def test_the_chain_the_build_wrote_is_checked_against_the_events(samples, tmp_path):
    """Every sample's chain columns (what the data says its history is) equal the chain the
    replay computes from its events; a sample whose events or chain were changed apart is
    refused naming it."""
    assert "chain_end" in samples.column_names
    read_trace(_write(samples, tmp_path / "ok"))
    rows = samples.to_pylist()
    k = next(i for i, r in enumerate(rows) if r["num_events"] > 2 * r["chain_block"] or r["num_events"] > 3)
    rows[k]["seq_item"][1] += 1  # an event changed, the chain left as the build wrote it
    bad = pa.Table.from_pylist(rows, schema=samples.schema)
    with pytest.raises(ShardError, match=f"sample {rows[k]['sample_id']} .*the chain the build wrote differs"):
        read_trace(_write(bad, tmp_path / "bad"))


def test_a_new_window_keeps_the_cache_only_when_it_starts_with_the_same_events(samples, tmp_path):
    kw = dict(serving_nodes=1, dtype="float64", dim=16, page_size=2, device_bytes=64 << 20, host_bytes=0)
    same, n = _chained(samples, alter=False)
    other, n2 = _chained(samples, alter=True)
    assert n == n2 > 3
    a = replay(_write(same, tmp_path / "same"), **kw)
    b = replay(_write(other, tmp_path / "other"), **kw)
    assert a["equality"]["equal"] and b["equality"]["equal"]
    # the same events: the held pretrain state is reused (a hit); changed: invalidated, encoded again
    assert b["invalidated"] - a["invalidated"] == a["hits"]["device"] - b["hits"]["device"] > 3
    assert a["tokens"]["encoded"] < b["tokens"]["encoded"]


def test_a_checkpoint_is_replayed_as_saved(shards, tmp_path):
    cfg = dict(dim=16, heads=2, layers=1, side_features=2, num_labels=2, encoder="window", window=4)
    torch.manual_seed(9)
    model = ReferenceRanker(**cfg)
    path = tmp_path / "ck.pt"
    torch.save({"config": cfg, "state_dict": model.state_dict(), "version": "ckpt-9"}, path)
    r = replay(shards, serving_nodes=2, checkpoint=path, dtype="float64", max_requests=40)
    assert r["equality"]["equal"] and r["requests"] == 80
    assert r["model"]["version"] == "ckpt-9" and r["model"]["encoder"] == "window" and r["model"]["window"] == 4
    torch.save({"state_dict": model.state_dict()}, tmp_path / "bare.pt")
    with pytest.raises(UserwiseError, match="holds {'config'"):
        replay(shards, checkpoint=tmp_path / "bare.pt")
    torch.save({"config": {**cfg, "num_labels": 3}, "state_dict": ReferenceRanker(**{**cfg, "num_labels": 3})
                .state_dict()}, tmp_path / "other.pt")
    with pytest.raises(UserwiseError, match="another build's model"):
        replay(shards, checkpoint=tmp_path / "other.pt")
    with pytest.raises(UserwiseError, match="not prefix-stable"):
        replay(shards, encoder="request")


def test_the_command_prints_its_report(shards, capsys):
    argv = ["replay", "--shards", shards, "--serving-nodes", "2", "--dim", "16", "--max-requests", "25", "--quiet"]
    assert cli.main([*argv, "--json"]) == 0
    out = capsys.readouterr().out
    r = json.loads(out)
    assert out.count("\n") == 1 and r["requests"] == 50 and r["equality"]["equal"]
    assert {"reuse", "reuse_rate", "hit_rate", "tokens", "resident_bytes", "nodes", "timing", "model", "cache"} <= set(r)
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "logits equal: yes" in text and "reuse: full" in text and "  node 1:" in text
    with pytest.raises(SystemExit) as e:
        cli.main(["replay", "--shards", shards, "--dtype", "float16"])
    assert e.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_the_serving_loop_in_the_docs_runs_as_written(shards, monkeypatch, capsys):
    text = (Path(__file__).resolve().parents[2] / "docs" / "serving.md").read_text()
    section = text[text.index("## A serving loop"):]
    block = re.search(r"^```python\n(.*?)^```", section, flags=re.MULTILINE | re.DOTALL).group(1)
    monkeypatch.setenv("SHARDS", shards)
    scope = {"__name__": "serving_loop"}
    exec(compile(block, "docs/serving.md", "exec"), scope)
    assert len(scope["trace"].order[0]) > 0 and scope["store"].stats()["lookups"] > 0
    assert "'device'" in capsys.readouterr().out
