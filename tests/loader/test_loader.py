"""The loader: exactly-once, equal batch counts, resumption, holdout, bad shards, expansion."""

from __future__ import annotations

import collections
import json
import logging
import os
import pickle
import subprocess
import sys
import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from userwise.pipelines.errors import ShardError, UserwiseError
from userwise.pipelines.loader import JaggedBatch, UserwiseDataset, UserwiseLoader, expand_batch
from userwise.pipelines.loader.planning.epochs import Epochs
from userwise.pipelines.shards import manifest as mf
from userwise.pipelines.tools.shardgen import all_rows, write_shard_set


@pytest.fixture(scope="module")
def shardset(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("shards"))
    write_shard_set(root, nodes=1, ranks_per_node=2, row_group_rows=8)
    return root


def run(root, world, workers=0, **kw):
    """sample_ids per batch for every rank."""
    out = {}
    for r in range(world):
        ds = UserwiseDataset(root, rank=r, world_size=world, verify="none", **kw)
        out[r] = [b.numpy("sample_id").tolist() for b in UserwiseLoader(ds, num_workers=workers)]
    return out


@pytest.mark.parametrize("world,workers,mode", [
    (1, 0, "count"), (2, 0, "count"), (2, 2, "count"), (3, 0, "count"), (4, 2, "tokens"), (2, 0, "tokens"), (5, 1, "count"),
])
def test_every_sample_exactly_once_equal_batches_per_rank(shardset, world, workers, mode):
    kw = {"batch_size": 16} if mode == "count" else {"token_budget": 150}
    got = run(shardset, world, workers, **kw)
    ids = [i for r in got.values() for b in r for i in b]
    want = all_rows(shardset).column("sample_id").to_pylist()
    assert collections.Counter(ids) == collections.Counter(want)
    assert len({len(batches) for batches in got.values()}) == 1, {r: len(b) for r, b in got.items()}


def test_uneven_shards_rank_with_fewer_samples_cuts_smaller_batches(shardset):
    man = mf.load(shardset)
    rows = collections.Counter()
    for s in man["shards"]:
        rows[s["rank"]] += s["rows"]
    assert rows[0] != rows[1]  # the fixture really is uneven
    got = run(shardset, 2, batch_size=16)
    assert len(got[0]) == len(got[1])
    small = min(rows, key=rows.get)
    big = max(rows, key=rows.get)
    assert sum(map(len, got[small])) == rows[small] and sum(map(len, got[big])) == rows[big]
    assert max(map(len, got[small])) <= 16 and max(map(len, got[big])) <= 16


def test_more_ranks_than_row_groups_pads_with_empty_batches(tmp_path):
    root = str(tmp_path)
    write_shard_set(root, nodes=1, ranks_per_node=1, row_group_rows=64,
                    sets=(("incremental", "2026-01-04", "2026-01-05", 20),))
    got = run(root, 3, batch_size=4)
    assert len({len(v) for v in got.values()}) == 1
    assert sorted(i for v in got.values() for b in v for i in b) == sorted(all_rows(root).column("sample_id").to_pylist())
    assert any(len(b) == 0 for v in got.values() for b in v)


def test_sets_in_training_order_and_selectable(shardset):
    ds = UserwiseDataset(shardset, batch_size=16, verify="none", world_size=1, rank=0)
    sets = [b.meta["set"] for b in UserwiseLoader(ds)]
    order = [s["id"] for s in mf.load(shardset)["sets"]]
    assert sets == sorted(sets, key=order.index) and set(sets) == set(order)
    inc = UserwiseDataset(shardset, batch_size=16, verify="none", sets=["incremental"], world_size=1, rank=0)
    got = [b for b in UserwiseLoader(inc)]
    assert {b.meta["set"] for b in got} == set(order[1:])
    one = UserwiseDataset(shardset, batch_size=16, verify="none", sets=[order[2]], world_size=1, rank=0)
    n = sum(b.num_samples for b in UserwiseLoader(one))
    assert n == mf.load(shardset)["sets"][2]["rows"]


def test_holdout_window_and_seeded_user_share_partition_the_samples(shardset):
    order = [s["id"] for s in mf.load(shardset)["sets"]]
    kw = dict(batch_size=16, verify="none", world_size=1, rank=0, eval_sets=[order[-1]], eval_user_share=0.2, eval_seed=7)
    train = [i for b in UserwiseLoader(UserwiseDataset(shardset, split="train", **kw)) for i in b.numpy("sample_id")]
    evalb = list(UserwiseLoader(UserwiseDataset(shardset, split="eval", **kw)))
    ev = [i for b in evalb for i in b.numpy("sample_id")]
    allids = all_rows(shardset).column("sample_id").to_pylist()
    assert sorted(train + ev) == sorted(allids) and not set(train) & set(ev)
    end = order[-1].split("/")[1]
    last = {r["sample_id"] for r in all_rows(shardset).to_pylist() if r["window_end"].isoformat() == end}
    assert last <= set(ev)  # the whole held-out window is in eval
    extra = set(ev) - last
    assert 0.05 * (len(allids) - len(last)) < len(extra) < 0.4 * (len(allids) - len(last))
    # the same seed picks the same users again
    again = [i for b in UserwiseLoader(UserwiseDataset(shardset, split="eval", **kw)) for i in b.numpy("sample_id")]
    assert again == ev


def _batches(loader, n=None):
    out = []
    for b in loader:
        out.append((b.meta["index"], b.numpy("sample_id").tolist(), bytes(b.buffer.cpu().numpy())))
        if n is not None and len(out) == n:
            break
    return out


@pytest.mark.parametrize("workers_before,workers_after", [(0, 0), (2, 2), (0, 2), (2, 1)])
def test_resume_mid_epoch_equals_uninterrupted_run(shardset, workers_before, workers_after):
    kw = dict(batch_size=8, verify="none", world_size=1, rank=0, seed=3)
    full = UserwiseLoader(UserwiseDataset(shardset, **kw), num_workers=workers_before)
    full.set_epoch(1)
    want = _batches(full)
    first = UserwiseLoader(UserwiseDataset(shardset, **kw), num_workers=workers_before)
    first.set_epoch(1)
    head = _batches(first, 7)
    state = first.state_dict()
    assert {k: state[k] for k in ("epoch", "cursor", "seed", "samples")} == {
        "epoch": 1, "cursor": 7, "seed": 3, "samples": sum(len(x[1]) for x in head)}
    second = UserwiseLoader(UserwiseDataset(shardset, **kw), num_workers=workers_after)
    second.load_state_dict(json.loads(json.dumps(state)))
    tail = _batches(second)
    assert head + tail == want
    assert {k: v for k, v in second.state_dict().items() if k in ("epoch", "cursor", "seed", "samples")} == {
        "epoch": 2, "cursor": 0, "seed": 3, "samples": 0}


def test_same_seed_same_batches_epochs_differ(shardset):
    kw = dict(batch_size=16, verify="none", world_size=2, rank=1)
    a = _batches(UserwiseLoader(UserwiseDataset(shardset, seed=5, **kw)))
    b = _batches(UserwiseLoader(UserwiseDataset(shardset, seed=5, **kw), num_workers=2))
    assert a == b
    l2 = UserwiseLoader(UserwiseDataset(shardset, seed=5, **kw))
    e0, e1 = _batches(l2), _batches(l2)  # the loader moves to the next epoch by itself
    assert [x[1] for x in e0] != [x[1] for x in e1]
    assert sorted(i for x in e0 for i in x[1]) == sorted(i for x in e1 for i in x[1])
    c = _batches(UserwiseLoader(UserwiseDataset(shardset, seed=6, **kw)))
    assert [x[1] for x in a] != [x[1] for x in c]


def test_batch_order_stored_keeps_the_drawn_batches_in_row_order(shardset):
    """The default ``batch_order="stored"`` draws the same batches as ``"shuffled"`` (same
    samples per batch, same cuts, same row groups) and only sorts each batch by row; the
    loader's batches then hold the buffer's rows in that order."""
    kw = dict(batch_size=8, verify="none", world_size=1, rank=0, seed=4, device="cpu")
    st = UserwiseDataset(shardset, **kw)
    sh = UserwiseDataset(shardset, batch_order="shuffled", **kw)
    for epoch in (0, 1):
        unsorted = 0
        for bs, bd in zip(st.epochs.plan(epoch).buffers, sh.epochs.plan(epoch).buffers, strict=True):
            assert bs.rgs.tolist() == bd.rgs.tolist() and bs.bounds.tolist() == bd.bounds.tolist()
            for k in range(bs.num_batches):
                x, y = bs.perm[bs.bounds[k]: bs.bounds[k + 1]], bd.perm[bd.bounds[k]: bd.bounds[k + 1]]
                assert (np.diff(x) > 0).all()
                assert sorted(y.tolist()) == x.tolist()
                unsorted += bool((np.diff(y) < 0).any())
        assert unsorted  # "shuffled" keeps an order that is not the stored one
    got = [b.numpy("sample_id").tolist() for b in st.batches(st.epochs.plan(0))]
    want = []
    for buf in st.epochs.plan(0).buffers:
        ids = np.asarray(st._read_table(buf.rgs)["sample_id"])
        want += [ids[buf.perm[buf.bounds[k]: buf.bounds[k + 1]]].tolist() for k in range(buf.num_batches)]
    assert got == want
    drawn = [b.numpy("sample_id").tolist() for b in sh.batches(sh.epochs.plan(0))]
    assert [sorted(x) for x in drawn] == [sorted(x) for x in got] and drawn != got
    with pytest.raises(ValueError, match="batch_order"):
        UserwiseDataset(shardset, batch_order="random", **kw)


def test_the_next_epoch_is_planned_while_the_workers_read(shardset, monkeypatch):
    """With workers, the trainer plans epoch e + 1 right after it sends epoch e's plan; the
    next epoch then starts from that plan (the same batches as planning it then), and where
    planning takes a collective nothing is planned ahead."""
    kw = dict(batch_size=4, seed=3, world_size=1, rank=0, verify="none", device="cpu")
    calls = []
    real = Epochs.rank_plans
    monkeypatch.setattr(Epochs, "rank_plans", lambda self, epoch=None: calls.append(epoch) or real(self, epoch))
    ld = UserwiseLoader(UserwiseDataset(shardset, **kw), num_workers=2)
    _batches(ld)
    assert calls == [0, 1]
    second = _batches(ld)
    assert calls == [0, 1, 2]
    alone = UserwiseLoader(UserwiseDataset(shardset, **kw))
    alone.set_epoch(1)
    assert second == _batches(alone)
    calls.clear()
    monkeypatch.setattr(Epochs, "spans_nodes", lambda self: True)
    monkeypatch.setattr(Epochs, "agreed_targets", lambda self, targets: targets)  # as if agreed
    _batches(ld)  # epoch 2 was planned ahead; epoch 3 is not
    assert calls == []
    _batches(ld)
    assert calls == [3]


def test_token_budget_never_exceeded_except_single_oversize_sample(shardset):
    budget = 60
    ds = UserwiseDataset(shardset, token_budget=budget, verify="none", world_size=2, rank=0)
    costs = [b.numpy("cost") for b in UserwiseLoader(ds)]
    assert any(len(c) == 1 and c[0] > budget for c in costs)  # the fixture has oversize samples
    for c in costs:
        assert c.sum() <= budget or len(c) == 1
    for c in costs:  # cost is events + impressions
        pass
    b = next(iter(UserwiseLoader(UserwiseDataset(shardset, token_budget=budget, verify="none", world_size=1, rank=0))))
    ev = b.numpy("seq.offsets")[-1]
    assert b.numpy("cost").sum() == ev + b.num_impressions


def test_jagged_structure_points_into_the_sequence(shardset):
    ds = UserwiseDataset(shardset, batch_size=32, verify="none", world_size=1, rank=0)
    rows = {r["sample_id"]: r for r in all_rows(shardset).to_pylist()}
    for b in UserwiseLoader(ds):
        so, ro, io = b.numpy("seq.offsets"), b.numpy("req.offsets"), b.numpy("imp.offsets")
        req_sample, imp_req = b.numpy("req.sample"), b.numpy("imp.req")
        for i, sid in enumerate(b.numpy("sample_id")):
            r = rows[int(sid)]
            assert b.numpy("seq_item")[so[i]:so[i + 1]].tolist() == r["seq_item"]
            assert b.numpy("req_seq_end")[ro[i]:ro[i + 1]].tolist() == r["req_seq_end"]
            assert b.numpy("imp__item_id")[io[i]:io[i + 1]].tolist() == r["imp__item_id"]
            assert (req_sample[ro[i]:ro[i + 1]] == i).all()
            assert (req_sample[imp_req[io[i]:io[i + 1]]] == i).all()
        assert np.all(np.diff(imp_req) >= 0)


def expand_rows_python(row: dict, roles: dict) -> list[dict]:
    """An independent, plain-Python expansion of one sample row."""
    out, k = [], 0
    imp_cols = [c for c in row if c.startswith("imp__")]
    req_cols = [c for c in row if c.startswith("req__")]
    seq_cols = [c for c in row if c.startswith("seq_") and isinstance(row[c], list)]
    for r in range(row["num_requests"]):
        b, e = row["req_seq_begin"][r], row["req_seq_end"][r]
        for _ in range(row["req_num_imps"][r]):
            d = {roles["user"]: row["user"]}
            d.update({c[5:]: row[c][r] for c in req_cols})
            d.update({name: row[canon][r] for name, canon in (roles.get("request_derived") or {}).items()})
            d.update({c[5:]: row[c][k] for c in imp_cols})
            d.update({c: row[c][b:e] for c in seq_cols})
            out.append(d)
            k += 1
    return out


def test_expand_batch_matches_plain_python_expansion(shardset):
    man = mf.load(shardset)
    rows = {r["sample_id"]: r for r in all_rows(shardset).to_pylist()}
    ds = UserwiseDataset(shardset, batch_size=24, verify="none", world_size=1, rank=0)
    n = 0
    for b in UserwiseLoader(ds, num_workers=1):
        got = expand_batch(b)
        want = [x for sid in b.numpy("sample_id") for x in expand_rows_python(rows[int(sid)], man["roles"])]
        assert got.to_pylist() == want
        assert got.schema.names[:16] == man["roles"]["input_columns"]
        n += got.num_rows
    assert n == sum(s["impressions"] for s in man["shards"])
    assert any(r["score"] is None for r in got.to_pylist())  # nulls survive


def test_expand_batch_gives_odd_input_names_back(tmp_path, monkeypatch):
    """Input columns whose names Spark or Delta refuse are stored under escaped names
    (``imp__score%20%28raw%29``); expanded rows carry the input's own names again."""
    from userwise import schemas
    from userwise.pipelines import config
    from userwise.pipelines.tools import shardgen, synth

    odd = {"user_id": "user.id", "score": "score (raw)"}
    src = schemas.SYNTH_IMPRESSIONS.to_arrow()
    src = pa.schema([f.with_name(odd.get(f.name, f.name)) for f in src])
    cfg = synth.make_config(20, 0, fat=False, actions=False)
    cfg["columns"]["user"] = odd["user_id"]
    lay = config.parse(cfg).layout(src)
    stored = "imp__" + schemas.layout.storage_name(odd["score"])
    assert stored in schemas.shard_schema(lay).to_arrow().names  # the case really escapes a name
    row = shardgen._row
    monkeypatch.setattr(shardgen, "layout", lambda item_features=2, labels=2: lay)
    monkeypatch.setattr(shardgen, "_row", lambda *a, **k: {stored if c == "imp__score" else c: v
                                                            for c, v in row(*a, **k).items()})
    root = str(tmp_path)
    shardgen.write_shard_set(root, nodes=1, ranks_per_node=1, sets=(("incremental", "2026-01-04", "2026-01-05", 6),))
    ds = UserwiseDataset(root, batch_size=8, verify="none", world_size=1, rank=0)
    got = pa.concat_tables([expand_batch(b) for b in UserwiseLoader(ds)])
    assert got.schema.names[:16] == src.names
    assert not [n for n in got.schema.names if "%" in n]
    rows = all_rows(root)
    assert sorted(got["user.id"].to_pylist()) == sorted(u for u, k in zip(rows["user"].to_pylist(),
                                                                            rows["num_impressions"].to_pylist())
                                                        for _ in range(k))
    assert sorted(got["score (raw)"].to_pylist(), key=str) == sorted(
        (x for v in rows[stored].to_pylist() for x in v), key=str)


def test_batch_memory_methods_on_cpu(shardset):
    ds = UserwiseDataset(shardset, batch_size=8, verify="none", world_size=1, rank=0, device="cpu")
    b = next(iter(UserwiseLoader(ds)))
    assert isinstance(b, JaggedBatch) and b.buffer.dtype == torch.uint8 and b.buffer.dim() == 1
    assert b.to("cpu", non_blocking=True) is b
    assert b.record_stream(None) is b
    for _, _, off, _ in b.spec:
        assert off % 64 == 0  # every array aligned: one buffer, typed views
    if torch.cuda.is_available():  # pragma: no cover (GPU machines)
        p = b.pin_memory()
        assert p.is_pinned()
        d = p.to("cuda", non_blocking=True)
        assert torch.equal(d["seq_item"].cpu(), b["seq_item"])
    else:
        with pytest.raises(RuntimeError):
            b.pin_memory()


def test_stats_count_samples_events_and_wait_share(shardset):
    ld = UserwiseLoader(UserwiseDataset(shardset, batch_size=16, verify="none", world_size=1, rank=0))
    for _ in ld:
        pass
    s = ld.stats.summary()
    t = all_rows(shardset)
    assert s["samples"] == t.num_rows
    assert s["events"] == int(np.asarray(t["num_events"]).sum())
    assert s["impressions"] == int(np.asarray(t["num_impressions"]).sum())
    assert s["samples_per_s"] > 0 and s["bytes_per_s"] > 0 and 0 < s["wait_share"] <= 1


def test_data_path_said_once(shardset, caplog):
    from userwise.pipelines.loader import logs

    logs._SAID.clear()
    with caplog.at_level(logging.INFO, logger="userwise.loader"):
        UserwiseDataset(shardset, verify="none", world_size=1, rank=0, device="cpu")
        UserwiseDataset(shardset, verify="none", world_size=1, rank=0, device="cpu")
    msgs = [r.getMessage() for r in caplog.records if "data path" in r.getMessage()]
    assert len(msgs) == 1 and "parquet" in msgs[0]


# -- bad shards: clear errors naming the file, before training -----------------
def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return str(dst)


def test_missing_manifest_and_missing_file(shardset, tmp_path):
    root = _copy(shardset, tmp_path / "a")
    os.remove(os.path.join(root, "node=0/shard-00003.parquet"))
    with pytest.raises(ShardError, match=r"shard-00003\.parquet: missing"):
        UserwiseDataset(root)
    os.remove(os.path.join(root, "manifest.json"))
    with pytest.raises(ShardError, match=r"manifest\.json: (missing|no manifest)"):
        UserwiseDataset(root)


def test_checksum_mismatch_names_the_file(shardset, tmp_path):
    root = _copy(shardset, tmp_path / "b")
    p = os.path.join(root, "node=0/shard-00001.parquet")
    data = bytearray(open(p, "rb").read())
    data[200] ^= 0xFF  # same size, different content
    open(p, "wb").write(bytes(data))
    with pytest.raises(ShardError, match=r"shard-00001\.parquet: checksum mismatch"):
        UserwiseDataset(root)
    UserwiseDataset(root, verify="size")  # the size still matches: only the checksum catches it


def test_schema_differing_from_manifest_names_the_file(shardset, tmp_path):
    root = _copy(shardset, tmp_path / "c")
    man = mf.load(root)
    rel = "node=0/shard-00002.parquet"
    p = os.path.join(root, rel)
    t = pq.read_table(p)
    t = t.set_column(t.schema.get_field_index("seq_item"), "seq_item", t["seq_item"].cast(pa.list_(pa.int32())))
    pq.write_table(t, p, row_group_size=8)
    for s in man["shards"]:
        if s["path"] == rel:  # size and checksum agree: only the schema is wrong
            s["bytes"], s["sha256"] = os.path.getsize(p), mf.file_sha256(p)
    mf.write(root, man)
    with pytest.raises(ShardError, match=r"shard-00002\.parquet: schema differs from the manifest"):
        UserwiseDataset(root)


def test_newer_format_refused(shardset, tmp_path):
    root = _copy(shardset, tmp_path / "d")
    man = mf.load(root)
    man["format_version"] = 99
    json.dump(man, open(os.path.join(root, "manifest.json"), "w"))  # by hand: mf.write refuses it
    with pytest.raises(ShardError, match="newer"):
        UserwiseDataset(root)


def test_loader_never_imports_pyspark(shardset):
    code = (
        "import sys\n"
        "from userwise.pipelines.loader import UserwiseDataset, UserwiseLoader, expand_batch\n"
        "from userwise.pipelines.loader import diagnose\n"
        "from userwise.pipelines.shards import gds\n"
        f"ds = UserwiseDataset({shardset!r}, batch_size=16, world_size=1, rank=0)\n"
        "b = [expand_batch(x) for x in UserwiseLoader(ds, num_workers=1)]\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('pyspark', 'py4j', 'delta'))\n"
        "print('BAD', bad)\n"
        "sys.exit(1 if bad else 0)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr


def test_two_node_set_reads_only_its_node(tmp_path):
    root = str(tmp_path)
    write_shard_set(root, nodes=2, ranks_per_node=2, row_group_rows=8,
                    sets=(("incremental", "2026-01-04", "2026-01-05", 60),))
    with pytest.raises(ShardError, match="pass node="):
        UserwiseDataset(root)
    for node in (0, 1):
        got = run(root, 2, node=node, batch_size=8)
        ids = sorted(i for v in got.values() for b in v for i in b)
        assert ids == sorted(all_rows(root, node).column("sample_id").to_pylist())


def test_run_copies_of_long_lists_give_the_same_bytes_as_gathers(shardset, monkeypatch):
    """Long sequences are copied run by run (stacked.Runs), short ones gathered element-wise:
    both paths must produce byte-identical batches."""
    from userwise.pipelines.loader.assembly import stacked

    def batches(threshold):
        monkeypatch.setattr(stacked, "RUN_COPY_MIN", threshold)
        ds = UserwiseDataset(shardset, batch_size=7, verify="none", world_size=1, rank=0, seed=3)
        return [(b.spec, b.buffer.clone()) for b in UserwiseLoader(ds)]

    gathered, runs = batches(10**9), batches(0)
    assert len(gathered) == len(runs) > 3
    for (s1, b1), (s2, b2) in zip(gathered, runs):
        assert s1 == s2 and torch.equal(b1, b2)


def test_shard_reads_allocate_from_the_chosen_pool_and_leave_the_default_alone(shardset, monkeypatch):
    """The loader's shard readers decode into Arrow's default pool, or into the system
    allocator with USERWISE_READ_POOL=system (see reading.open_parquet); either way the
    process-wide default pool is left as it was, and an unknown pool is refused when the
    dataset is made, before any worker starts."""
    default = pa.default_memory_pool()
    assert default.backend_name != "system"  # else the two cases below cannot be told apart
    for pool, expect in (("arrow", default), ("system", pa.system_memory_pool())):
        monkeypatch.setenv("USERWISE_READ_POOL", pool)
        ds = UserwiseDataset(shardset, verify="none", world_size=1, rank=0)
        f = ds._file(0)
        assert pa.default_memory_pool().backend_name == default.backend_name
        before = expect.bytes_allocated()
        t = f.read_row_groups([0])
        assert t.num_rows > 0 and expect.bytes_allocated() > before, pool
        del t
    monkeypatch.setenv("USERWISE_READ_POOL", "jemalloc-please")
    with pytest.raises(ValueError, match="USERWISE_READ_POOL"):
        UserwiseDataset(shardset, verify="none", world_size=1, rank=0)


def test_read_ahead_lanes_keep_order_own_their_files_and_stop_with_the_epoch(shardset, monkeypatch):
    """A process that decodes alone reads READ_LANES buffers ahead, each on its own thread with
    its own file handles (a ParquetFile is never read from two threads), while the caller
    shuffles and cuts: same batches as without read-ahead, a read's error reaches the consumer
    after the batches before it, no read outlives an epoch stopped early, and the dataset still
    pickles (spawned workers) after its lanes started."""
    from userwise.pipelines.loader.io import reading

    kw = dict(batch_size=4, seed=3, world_size=1, rank=0, verify="none", device="cpu")
    ds = UserwiseDataset(shardset, **kw)
    bufs = ds.epochs.plan(0).buffers
    assert len(bufs) > reading.READ_LANES + 1  # more buffers than lanes: reads run ahead and overlap
    want = [bytes(b.buffer.numpy()) for b in ds.batches(ds.epochs.plan(0), read_ahead=False)]
    lock, readers, active, most = threading.Lock(), collections.defaultdict(set), [0], [0]
    read = pq.ParquetFile.read_row_groups

    def spy(self, *a, **k):
        with lock:
            readers[id(self)].add(threading.get_ident())
            active[0] += 1
            most[0] = max(most[0], active[0])
        try:
            time.sleep(0.02)  # long enough for the lanes' reads to overlap
            return read(self, *a, **k)
        finally:
            with lock:
                active[0] -= 1

    monkeypatch.setattr(pq.ParquetFile, "read_row_groups", spy)
    assert [bytes(b.buffer.numpy()) for b in ds.batches(ds.epochs.plan(0), read_ahead=True)] == want
    assert most[0] == reading.READ_LANES
    assert all(len(t) == 1 for t in readers.values())  # one thread per handle
    lanes = set().union(*readers.values())
    assert len(lanes) == reading.READ_LANES and threading.get_ident() not in lanes
    # stopped after the first batch: nothing still reads once the generator is closed
    g = ds.batches(ds.epochs.plan(0), read_ahead=True)
    next(g)
    g.close()
    assert active[0] == 0
    pickle.dumps(ds)
    # a read that fails: the batches of the buffers before it, then its error
    rb = UserwiseDataset._read_buffer

    def fail_third(self, rgs):
        if list(rgs) == list(bufs[2].rgs):
            raise ShardError("shard-00000.parquet: row group 5 unreadable (stand-in)")
        return rb(self, rgs)

    monkeypatch.setattr(UserwiseDataset, "_read_buffer", fail_third)
    got = []
    with pytest.raises(ShardError, match="stand-in"):
        for b in ds.batches(ds.epochs.plan(0), read_ahead=True):
            got.append(bytes(b.buffer.numpy()))
    assert got == want[: bufs[0].num_batches + bufs[1].num_batches]
    assert active[0] == 0


class _Event:
    """A stand-in for a CUDA event: done once the test says so."""

    def __init__(self):
        self.done = False

    def query(self):
        return self.done

    def synchronize(self):
        self.done = True


def test_pinned_pool_reuses_buffers_only_after_their_copy_and_grows_within_its_cap():
    from userwise.pipelines.loader.workers.pinned import PinnedPool

    made = []
    pool = PinnedPool(3, alloc=lambda n: made.append(torch.empty(n, dtype=torch.uint8)) or made[-1])
    a, b = pool.acquire(100), pool.acquire(400)
    ea, eb = _Event(), _Event()
    pool.release(a, ea)
    pool.release(b, eb)
    c = pool.acquire(100)  # a's copy still in flight: a third buffer, not a
    assert c.data_ptr() not in (a.data_ptr(), b.data_ptr()) and len(made) == 3
    ea.done = True
    assert pool.acquire(50).data_ptr() == a.data_ptr()  # the smallest free buffer that fits
    pool.release(c, _Event())
    d = pool.acquire(300)  # none free fits (b busy, c busy): the oldest copy is waited for
    assert d.data_ptr() == b.data_ptr() and eb.done and len(made) == 3
    pool.release(d, _Event())
    big = pool.acquire(10_000)  # larger than every buffer, cap reached: waits, then replaces a small one
    assert big.numel() >= 10_000 and pool.count <= 3
    assert len(made) == 4
    # several free buffers: the one that fits is taken by position (not by comparing tensors)
    pool = PinnedPool(4, alloc=lambda n: torch.zeros(n, dtype=torch.uint8))
    bufs = [pool.acquire(n) for n in (10, 10, 500)]
    for x in bufs:
        e = _Event()
        e.done = True
        pool.release(x, e)
    assert pool.acquire(400).data_ptr() == bufs[2].data_ptr()
    assert pool.acquire(10).data_ptr() in (bufs[0].data_ptr(), bufs[1].data_ptr())


def _reference(root, **kw):
    ds = UserwiseDataset(root, world_size=1, rank=0, verify="none", device="cpu", **kw)
    return [bytes(b.buffer.numpy()) for b in UserwiseLoader(ds)]


@pytest.mark.parametrize("workers", [1, 2])
def test_zero_copy_batches_stay_intact_while_held_and_slots_come_back(shardset, workers):
    """Host batches from workers are views of the workers' shared-memory slots. Hold some
    (every third, out of order with the others' drops) to the end of the epoch, drop the rest
    at once: every batch keeps its bytes, batches were lent (no copy), and the slots of
    dropped batches went back to the workers."""
    kw = dict(batch_size=4, seed=9)
    ref = _reference(shardset, **kw)
    ld = UserwiseLoader(UserwiseDataset(shardset, world_size=1, rank=0, verify="none", device="cpu", **kw),
                        num_workers=workers)
    held, seen, most_lent = [], [], 0
    for i, b in enumerate(ld):
        seen.append(bytes(b.buffer.numpy()))
        most_lent = max(most_lent, sum(ld._workers.lent))
        if i % 3 == 0:
            held.append((i, b))
        del b
    assert seen == ref and len(ref) > 12 and most_lent >= 1
    assert all(bytes(b.buffer.numpy()) == ref[i] for i, b in held)  # not overwritten while held
    pool = ld._workers
    assert sum(pool.lent) <= len(held) + workers  # dropped batches' slots were reclaimed
    held.clear()
    import gc
    gc.collect()
    for w in range(workers):
        pool.reclaim(w)
    assert pool.lent == [0] * workers
    ld.close()


def test_zero_copy_consumer_holding_every_batch_gets_copies_and_never_stalls(shardset):
    kw = dict(batch_size=3, seed=4)
    ref = _reference(shardset, **kw)
    ld = UserwiseLoader(UserwiseDataset(shardset, world_size=1, rank=0, verify="none", device="cpu", **kw),
                        num_workers=2, timeout=30)
    got = list(ld)  # holds everything: at most nslots - 1 lent per worker, the rest copied
    assert [bytes(b.buffer.numpy()) for b in got] == ref
    assert all(n == ld._workers.nslots - 1 for n in ld._workers.lent)
    off = UserwiseLoader(UserwiseDataset(shardset, world_size=1, rank=0, verify="none", device="cpu", **kw),
                         num_workers=2, zero_copy=False)
    assert [bytes(b.buffer.numpy()) for b in off] == ref and off._workers.lent == [0, 0]
    ld.close()
    off.close()


_HEAP_PROBE = r"""
import ctypes, resource, sys
from userwise.pipelines.loader.workers.pool import keep_heap
if sys.argv[1] == "keep":
    assert keep_heap()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
MB = 1 << 20
for r in range(3):  # a decoder's pattern: columns of a few MB (one above glibc's 32 MB cap), written, freed
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    sizes = [7 * MB, 3 * MB, 40 * MB, 5 * MB, 1 * MB] * 2
    ps = [libc.malloc(n) for n in sizes]
    for p, n in zip(ps, sizes):
        ctypes.memset(p, 1, n)
    for p in ps:
        libc.free(p)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)  # the third round's page faults
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_workers_keep_freed_buffers_in_the_heap():
    """Workers decode buffers of the same sizes over and over: after keep_heap() a round of
    freed blocks comes back without faulting its pages in again (glibc's default unmaps
    big blocks and trims the heap, so every round faults ~all of its 110 MB in again)."""
    faults = {m: int(subprocess.run([sys.executable, "-c", _HEAP_PROBE, m], capture_output=True, text=True,
                                    check=True).stdout) for m in ("default", "keep")}
    pages = (110 << 20) // 4096
    assert faults["default"] > pages // 2, faults  # the probe sees the refaults it is meant to remove
    assert faults["keep"] < pages // 20, faults


def test_worker_processes_keep_their_heap_the_trainer_does_not(shardset, tmp_path, monkeypatch):
    from userwise.pipelines.loader.workers import pool as loader_mod

    def mark():
        (tmp_path / f"keep-{os.getpid()}").touch()
        return True

    monkeypatch.setattr(loader_mod, "keep_heap", mark)  # forked workers inherit the stand-in
    ds = UserwiseDataset(shardset, rank=0, world_size=1, batch_size=16)
    ld = UserwiseLoader(ds, num_workers=2, device="cpu")
    assert sum(b.num_samples for b in ld) == sum(ds.epochs.settings.shards.rg_rows)
    ld.close()
    pids = {int(p.name.split("-")[1]) for p in tmp_path.glob("keep-*")}
    assert len(pids) == 2 and os.getpid() not in pids


def test_auto_buffer_size(tmp_path, monkeypatch):
    """buffer_row_groups="auto" (the default): about 4096 samples per buffer, at least 2 row
    groups, at most 64 MB decoded by the footers' sizes; an int is taken as given."""
    from userwise.pipelines.loader import dataset

    monkeypatch.setattr(dataset, "BUFFER_ROWS", 4096)  # the product's values (conftest scales them down)
    monkeypatch.setattr(dataset, "BUFFER_BYTES", 64 << 20)
    assert dataset.auto_buffer_row_groups(np.full(10, 2048)) == 2
    assert dataset.auto_buffer_row_groups(np.full(10, 512)) == 8
    assert dataset.auto_buffer_row_groups(np.full(10, 30000)) == 2  # big groups: never fewer than 2
    assert dataset.auto_buffer_row_groups(np.full(10, 512), np.full(10, 16 << 20)) == 4  # the bytes cap
    root = str(tmp_path / "s")
    write_shard_set(root, nodes=1, ranks_per_node=1, row_group_rows=128,
                    sets=(("incremental", "2026-01-04", "2026-01-05", 2048),))
    ds = UserwiseDataset(root, world_size=1, rank=0, verify="none")
    assert ds.buffer_row_groups == 32
    assert max(len(b.rgs) for b in ds.epochs.plan().buffers) == 16  # the node's 16 row groups, one buffer
    assert UserwiseDataset(root, world_size=1, rank=0, verify="none", buffer_row_groups=3).buffer_row_groups == 3
    with pytest.raises(ValueError, match="buffer_row_groups"):
        UserwiseDataset(root, world_size=1, rank=0, verify="none", buffer_row_groups=0)
    monkeypatch.setattr(dataset, "BUFFER_BYTES", int(np.mean(ds.epochs.settings.shards.rg_bytes) * 5.5))
    assert UserwiseDataset(root, world_size=1, rank=0, verify="none").buffer_row_groups == 5


def _fail_in_workers(monkeypatch, action, at=2):
    """Workers (forked children, not the trainer) run ``action`` when they read their
    ``at``-th buffer; the trainer's own reads (workers=0, reference runs) are left alone."""
    parent = os.getpid()
    real = UserwiseDataset._read_buffer
    calls = collections.Counter()

    def read_buffer(self, rgs):
        if os.getpid() != parent:
            calls[os.getpid()] += 1
            if calls[os.getpid()] == at:
                action()
        return real(self, rgs)

    monkeypatch.setattr(UserwiseDataset, "_read_buffer", read_buffer)


@pytest.mark.parametrize("workers", [1, 2])
def test_a_worker_error_reaches_the_trainer_and_the_next_epoch_starts_clean(shardset, monkeypatch, workers):
    """A worker that raises mid-epoch: the trainer raises it (a UserwiseError such as a
    ShardError as a UserwiseError with its message; anything else as a RuntimeError with the
    worker's traceback), the workers are replaced, and the next iteration yields the whole
    epoch again."""
    kw = dict(batch_size=4, seed=2, world_size=1, rank=0, verify="none", device="cpu")
    ref = [bytes(b.buffer.numpy()) for b in UserwiseLoader(UserwiseDataset(shardset, **kw))]

    def epoch_fails(exc, expect, match):
        def fail():
            raise exc

        _fail_in_workers(monkeypatch, fail)
        ld = UserwiseLoader(UserwiseDataset(shardset, **kw), num_workers=workers, timeout=60)
        with pytest.raises(expect, match=match):
            list(ld)
        return ld

    ld = epoch_fails(ShardError("shard-00001.parquet: row group 3 unreadable (stand-in)"), UserwiseError,
                     r"ShardError: shard-00001\.parquet: row group 3 unreadable \(stand-in\)")
    assert ld._workers is None  # stopped: the next iteration starts fresh workers
    monkeypatch.undo()
    ld.set_epoch(0)
    assert [bytes(b.buffer.numpy()) for b in ld] == ref
    ld.close()
    epoch_fails(ZeroDivisionError("stand-in bug"), RuntimeError,
                r"(?s)loader worker \d failed:.*ZeroDivisionError: stand-in bug").close()


@pytest.mark.parametrize("hold", [True, False])
def test_a_worker_that_dies_is_reported_not_waited_for(shardset, monkeypatch, hold):
    """A worker killed mid-epoch (os._exit: no message, its pipes close): the trainer says
    which worker exited, well before its timeout. Here it dies in the second epoch, after
    every ring slot has reached the trainer, so the trainer still hands slots back to it
    after it died (the consumer drops its batches) or copies them out (the consumer holds
    every batch): a slot handed back to a dead worker is no error of its own."""
    import time

    kw = dict(batch_size=4, seed=2, world_size=1, rank=0, verify="none", device="cpu")
    ld = UserwiseLoader(UserwiseDataset(shardset, **kw), num_workers=2, timeout=120)
    per_worker = -(-len(ld.dataset.epochs.plan().buffers) // 2)  # buffers a worker reads per epoch, at most
    _fail_in_workers(monkeypatch, lambda: os._exit(7), at=per_worker + 2)
    assert sum(b.num_samples for b in ld) == sum(ld.dataset.epochs.settings.shards.rg_rows)  # the first epoch is whole
    t = time.monotonic()
    held = []
    with pytest.raises(RuntimeError, match=r"loader worker \d exited \(code 7\)"):
        for b in ld:
            if hold:
                held.append(b)
            time.sleep(0.01)  # the dying worker is gone before the trainer is done with its batches
    assert time.monotonic() - t < 60
    ld.close()


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_workers_started_without_fork_get_their_pipes(shardset, context):
    """Workers started by spawn or forkserver receive their three pipe ends by pickling (the
    trainer closes its copies once the worker started): the same batches as without workers."""
    kw = dict(batch_size=4, seed=3, world_size=1, rank=0, verify="none", device="cpu")
    ref = [bytes(b.buffer.numpy()) for b in UserwiseLoader(UserwiseDataset(shardset, **kw))]
    ld = UserwiseLoader(UserwiseDataset(shardset, **kw), num_workers=2, multiprocessing_context=context, timeout=120)
    assert [bytes(b.buffer.numpy()) for b in ld] == ref
    ld.close()
