"""The ids' half of the trainer's input (issue 58 points 3 and 4): request features once per
request as TorchRec's variable-batch KJT, and batches deduplicated and routed for row-wise
sharding, checked against TorchRec's and fbgemm's own functions on CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.support.shard_sets import one_day_set
from userwise.pipelines.jagged import np_offsets, np_ranges
from userwise.pipelines.loader import UserwiseDataset, UserwiseLoader, expand_batch

torchrec = pytest.importorskip("torchrec")  # installed (torchrec 1.8 + fbgemm-gpu-cpu 1.8) per the lock files

KEYS = ["imp__item_id", "imp__category", "req__hour", "req__age_bucket", "user", "seq_item", "seq_category"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return one_day_set(str(tmp_path_factory.mktemp("ids")))


@pytest.fixture(scope="module")
def batches(root):
    torch.set_num_threads(1)
    return list(UserwiseLoader(UserwiseDataset(root, batch_size=12, world_size=1, rank=0)))


def _bags(kjt, key):
    jt = kjt[key]
    return jt.values().long(), jt.lengths().long()


def _expand(kjt, key):
    """A VBE KJT's bags of ``key`` expanded to the impressions by its inverse_indices."""
    v, ln = _bags(kjt, key)
    keys, inv = kjt.inverse_indices()
    idx = inv[keys.index(key)].long().numpy()
    off = np_offsets(ln.numpy())
    return v[torch.from_numpy(np_ranges(off[:-1][idx], ln.numpy()[idx]))], ln[torch.from_numpy(idx)]


def test_per_impression_kjt_is_expand_batchs_rows(batches):
    """The per-impression KJT (today's point-wise form) holds, per impression, exactly what
    expand_batch's row for it holds: its item, its request's context and user features, its
    user, the history its request sees."""
    names = {"imp__item_id": "item_id", "imp__category": "category", "req__hour": "hour",
             "req__age_bucket": "age_bucket", "user": "user_id", "seq_item": "seq_item", "seq_category": "seq_category"}
    for b in batches[:3]:
        rows = expand_batch(b)
        kjt = b.to_kjt(KEYS, per="impression")
        assert kjt.stride() == b.num_impressions == rows.num_rows
        for k in KEYS:
            v, ln = _bags(kjt, k)
            col = rows.column(names[k]).combine_chunks()
            if k.startswith("seq_"):
                want_len = np.asarray(col.value_lengths())
                want = np.asarray(col.flatten())
            else:
                want_len = np.ones(rows.num_rows, np.int64)
                want = np.asarray(col.fill_null(0))
            assert np.array_equal(ln.numpy(), want_len), k
            assert np.array_equal(v.numpy(), want.astype(np.int64)), k


def test_vbe_kjt_expands_to_the_per_impression_kjt(batches):
    """Request and user features come once per request (stride R), the user once per sample,
    the items once per impression; expanding every key's bags by inverse_indices gives the
    per-impression KJT's values and lengths exactly."""
    seen_shared = False
    for b in batches:
        N, R, B = b.num_impressions, b.num_requests, b.num_samples
        vbe = b.to_kjt(KEYS, per="impression", vbe=True)
        flat = b.to_kjt(KEYS, per="impression")
        assert vbe.variable_stride_per_key()
        assert vbe.stride_per_key() == [N, N, R, R, B, R, R]
        keys, inv = vbe.inverse_indices()
        assert keys == KEYS and tuple(inv.shape) == (len(KEYS), N)
        for k in KEYS:
            v, ln = _expand(vbe, k)
            fv, fl = _bags(flat, k)
            assert torch.equal(ln, fl) and torch.equal(v, fv), k
        # the request keys hold fewer values than the per-impression form when requests have several impressions
        seen_shared |= R < N and vbe["req__hour"].values().numel() < flat["req__hour"].values().numel()
    assert seen_shared


def test_vbe_kjt_through_embedding_bag_collection(batches):
    """TorchRec's EmbeddingBagCollection pools each request's bags once and expands them with
    inverse_indices: the same [N, dims] as the per-impression KJT."""
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name="t_item", embedding_dim=4, num_embeddings=5000, feature_names=["imp__item_id", "seq_item"]),
        EmbeddingBagConfig(name="t_hour", embedding_dim=3, num_embeddings=128, feature_names=["req__hour"]),
        EmbeddingBagConfig(name="t_user", embedding_dim=2, num_embeddings=1 << 20, feature_names=["user"]),
    ], device=torch.device("cpu"))
    keys = ["imp__item_id", "req__hour", "user", "seq_item"]
    b = batches[0]
    user = b.to_kjt(["user"], per="sample")["user"].values()
    if int(user.max()) >= 1 << 20:
        pytest.fail("shardgen users exceed the test table")
    got = ebc(b.to_kjt(keys, per="impression", vbe=True))
    want = ebc(b.to_kjt(keys, per="impression"))
    assert got.values().shape == (b.num_impressions, 4 + 4 + 3 + 2)
    for k in keys:
        assert torch.allclose(got[k], want[k], atol=1e-6), k


def test_vbe_arguments(batches):
    b = batches[0]
    with pytest.raises(ValueError, match="per='impression'"):
        b.to_kjt(["seq_item"], vbe=True)
    with pytest.raises(ValueError, match="string"):
        b.to_kjt(["req__device"], per="impression", vbe=True)
    with pytest.raises(ValueError, match="chain_checkpoints"):
        b.to_kjt(["chain_checkpoints"], per="impression")
    with pytest.raises(ValueError, match="no column"):
        b.to_kjt(["nope"], per="impression", vbe=True)
    with pytest.raises(ValueError, match="per must be"):
        b.to_kjt(["seq_item"], per="impressions")


# -- point 4: deduplicated, routed batches --------------------------------------------------------

ROUTE = {"seq_item": 1000, "imp__item_id": 4000, "seq_category": 7}  # seq_category: ids past the table too


def _fbgemm_buckets(kjt, keys, tables, W):
    """TorchRec's own bucketization (fbgemm's block_bucketize_sparse_features) of ``kjt``:
    lengths [W, F, B], values, and the unbucketize permutation."""
    from torchrec.distributed.embedding_sharding import bucketize_kjt_before_all2all

    blocks = torch.tensor([-(-tables[k] // W) for k in keys])
    out, perm = bucketize_kjt_before_all2all(kjt, W, blocks, output_permute=True)
    return out.lengths().long().view(W, len(keys), -1).numpy(), out.values().long().numpy(), perm.long().numpy()


@pytest.mark.parametrize("W", [3, 8])
def test_buckets_equal_torchrecs_bucketize(batches, W):
    from userwise.pipelines.loader.assembly.ids import IdRouting, route_batch

    keys = list(ROUTE)
    for b in batches[:4]:
        routed = route_batch(b, IdRouting(ROUTE, world_size=W))
        kjt = b.to_kjt(keys)
        lengths, values, perm = _fbgemm_buckets(kjt, keys, ROUTE, W)
        seg = lengths.sum(axis=2)  # [W, F] values per (rank, key), laid out rank-major then key
        seg_start = np.concatenate([[0], np.cumsum(seg.ravel())])[:-1].reshape(W, len(keys))
        key_off = np.concatenate([[0], np.cumsum([kjt[k].values().numel() for k in keys])])
        for f, k in enumerate(keys):
            r = routed[k]
            assert r.block_size == -(-ROUTE[k] // W)
            mine = r.bucket_lengths.reshape(W, -1)
            assert np.array_equal(mine, lengths[:, f, :]), k
            own_start = np.concatenate([[0], np.cumsum(mine.sum(axis=1))])
            for w in range(W):
                got = r.bucket_values[own_start[w]:own_start[w + 1]]
                assert np.array_equal(got, values[seg_start[w, f]:seg_start[w, f] + seg[w, f]]), (k, w)
            # each value's place: fbgemm's global permutation restated through ours
            v = kjt[k].values().long().numpy()
            blk = r.block_size
            owner = np.where(v < blk * W, v // blk, v % W)
            want = perm[key_off[f]:key_off[f + 1]]
            assert np.array_equal(seg_start[owner, f] + r.unbucketize_permute - own_start[owner], want), k
        assert (kjt["seq_category"].values() >= ROUTE["seq_category"]).any()  # the overflow rule was exercised


def test_unique_inverse_and_hot_flags(batches):
    from userwise.pipelines.loader.assembly.ids import IdRouting, route_batch

    for b in batches[:4]:
        items = b.to_kjt(["seq_item"], per="impression").values().numpy()  # each impression's history: repeats
        hot = np.unique(items)[::3][:5]
        r = route_batch(b, IdRouting({"seq_item": 1000}, world_size=4, hot={"seq_item": np.append(hot, 10**9)},
                                     per="impression"))
        r = r["seq_item"]
        assert np.array_equal(r.unique[r.inverse], items)
        assert np.array_equal(r.unique, np.unique(items)) and len(r.unique) < len(items)
        assert np.array_equal(r.hot, np.isin(r.unique, hot)) and r.hot.sum() == len(hot)
        own = np.where(r.unique < r.block_size * 4, r.unique // r.block_size, r.unique % 4)
        assert np.array_equal(r.owner, own)
        assert np.array_equal(r.sends, np.bincount(own[~r.hot], minlength=4))


def test_workers_route_every_batch(root):
    """ids= computes the routing in the worker processes; it rides in batch.meta["ids"] and
    equals the routing of the batch the trainer got."""
    from userwise.pipelines.loader.assembly.ids import IdRouting, RoutedIds, route_batch

    routing = IdRouting({"seq_item": 1000, "imp__item_id": 4000}, world_size=8, hot={"imp__item_id": [1, 2, 3]},
                        per="impression")
    got = list(UserwiseLoader(UserwiseDataset(root, batch_size=12, world_size=1, rank=0, ids=routing),
                              num_workers=2))
    assert len(got) > 2
    for b in got:
        routed = b.meta["ids"]
        assert set(routed) == {"seq_item", "imp__item_id"}
        want = route_batch(b, routing)
        for k, r in routed.items():
            assert isinstance(r, RoutedIds)
            for name in ("unique", "inverse", "owner", "hot", "bucket_lengths", "bucket_values", "unbucketize_permute"):
                assert np.array_equal(getattr(r, name), getattr(want[k], name)), (k, name)
        assert len(routed["seq_item"].inverse) == int(b.to_kjt(["seq_item"], per="impression").values().numel())
    plain = next(iter(UserwiseLoader(UserwiseDataset(root, batch_size=12, world_size=1, rank=0))))
    assert "ids" not in plain.meta


def test_routing_arguments(root):
    from userwise.pipelines.loader.assembly.ids import IdRouting, route_ids

    with pytest.raises(ValueError, match="world_size"):
        IdRouting({"seq_item": 10}, world_size=0)
    with pytest.raises(ValueError, match="num_embeddings"):
        IdRouting({"seq_item": 0}, world_size=2)
    with pytest.raises(ValueError, match="hot has keys"):
        IdRouting({"seq_item": 10}, world_size=2, hot={"imp__item_id": [1]})
    with pytest.raises(ValueError, match="per must be"):
        IdRouting({"seq_item": 10}, world_size=2, per="bag")
    with pytest.raises(ValueError, match="does not read"):
        UserwiseDataset(root, world_size=1, rank=0, ids=IdRouting({"nope": 10}, world_size=2))
    with pytest.raises(ValueError, match="IdRouting"):
        UserwiseDataset(root, world_size=1, rank=0, ids={"seq_item": 10})
    with pytest.raises(ValueError, match=">= 0"):
        route_ids(np.array([-1]), np.array([1]), num_embeddings=10, world_size=2)


# -- route_ids' fast paths: a bitset instead of np.unique's sort, a counting sort on the owner ----


def _sorting_route(v, ln, n, W, hot):
    """The routing restated by sorting (np.unique; a stable argsort of owner * bags + bag): the
    oracle the bitset and counting-sort paths must equal, array for array."""
    v, ln = np.asarray(v, np.int64), np.asarray(ln, np.int64)
    block = -(-n // W)
    unique, inverse = np.unique(v, return_inverse=True)
    own = lambda x: np.where(x < block * W, x // block, x % W)  # noqa: E731
    local = np.where(v < block * W, v % block, v // W)
    key = own(v) * len(ln) + np.repeat(np.arange(len(ln)), ln)
    order = np.argsort(key, kind="stable")
    perm = np.empty(len(v), np.int64)
    perm[order] = np.arange(len(v))
    return {"unique": unique, "inverse": inverse.ravel(), "owner": own(unique), "hot": np.isin(unique, hot),
            "bucket_lengths": np.bincount(key, minlength=W * len(ln)), "bucket_values": local[order],
            "unbucketize_permute": perm}


FIELDS = ("unique", "inverse", "owner", "hot", "bucket_lengths", "bucket_values", "unbucketize_permute")


def _cases():
    """(name, values, lengths, num_embeddings, world_size, hot): ids inside the table, past it
    (fbgemm's overflow rule), spread so wide that the bitset gives way to a sort, none at all,
    empty bags, and world sizes past 8 and 16 bits."""
    rng = np.random.default_rng(58)
    ln = rng.integers(0, 40, 300)
    ln[::7] = 0
    n = int(ln.sum())
    zipf = np.minimum(rng.zipf(1.2, n), 10**6) - 1
    return [
        ("inside", zipf % 5000, ln, 5000, 8, np.arange(0, 5000, 13)),
        ("past the table", zipf % 9000, ln, 5000, 64, [3, 4, 7000]),
        ("wide: sorted", np.where(rng.random(n) < 0.5, zipf, rng.integers(0, 1 << 62, n)), ln, 1 << 40, 8, [0, 1]),
        ("one rank", zipf, ln, 10**6, 1, []),
        ("300 ranks", zipf % 7000, ln, 7000, 300, [5]),
        ("70000 ranks", zipf, ln, 10**6, 70_000, [5]),
        ("no ids", np.zeros(0, np.int64), np.zeros(5, np.int64), 10, 4, [1]),
        ("no bags", np.zeros(0, np.int64), np.zeros(0, np.int64), 10, 4, None),
        ("int32 ids", (zipf % 3000).astype(np.int32), ln.astype(np.int32), 3000, 5, [2]),
    ]


@pytest.mark.parametrize("impl", ["numba", "numpy"])
def test_route_ids_equals_the_sorting_route(impl, monkeypatch):
    """Compiled and numpy, every path (bitset, sort fallback, counting and radix sorts) gives
    the arrays of the plain sorting route; the bitset runs where the ids' span is small, the sort
    where it is not."""
    from userwise.pipelines.loader.assembly import ids, kernels, segcopy

    # the compiled kernels even under USERWISE_NO_NUMBA=1 (numba is installed with the suite)
    monkeypatch.setattr(segcopy, "batch_kernels", lambda: None if impl == "numpy" else kernels)
    sorts = []  # np.unique(..., return_inverse=True): the sorting path
    monkeypatch.setattr(np, "unique", lambda *a, f=np.unique, **k: sorts.append(k.get("return_inverse")) or f(*a, **k))
    for name, v, ln, n, W, hot in _cases():
        want = _sorting_route(v, ln, n, W, [] if hot is None else hot)
        sorts.clear()
        r = ids.route_ids(v, ln, num_embeddings=n, world_size=W, hot=hot)
        for f in FIELDS:
            got = getattr(r, f)
            assert np.array_equal(got, want[f]) and got.shape == want[f].shape, (name, f)
        assert r.unique.dtype == r.bucket_values.dtype == np.int64 and r.hot.dtype == bool, name
        assert r.inverse.dtype == r.unbucketize_permute.dtype == r.owner.dtype == r.bucket_lengths.dtype == np.int32, name
        assert any(sorts) == (name == "wide: sorted"), (name, sorts)


def test_route_ids_compiled_equals_numpy_and_the_sort_fallback(monkeypatch):
    """The compiled route, the numpy route and both with the bitset turned off (every span
    sorted) give equal arrays of equal dtypes on a batch-sized Zipf key."""
    from userwise.pipelines.loader.assembly import ids, kernels, segcopy

    rng = np.random.default_rng(4)
    ln = rng.integers(0, 600, 200)
    v = np.minimum(rng.zipf(1.1, int(ln.sum())), 2 * 10**6) - 1
    hot = np.arange(0, 20_000, 7)
    runs = {}
    for impl in ("numba", "numpy"):
        for bound in ("bitset", "sorted"):
            with monkeypatch.context() as m:
                m.setattr(segcopy, "batch_kernels", lambda impl=impl: None if impl == "numpy" else kernels)
                if bound == "sorted":
                    m.setattr(ids, "DENSE_BITS", 0)
                    m.setattr(ids, "NUMPY_DENSE", 0)
                    m.setattr(ids, "_dense", lambda *a: False)
                runs[impl, bound] = ids.route_ids(v, ln, num_embeddings=10**6, world_size=64, hot=hot)
    ref = runs["numba", "bitset"]
    for key, r in runs.items():
        for f in FIELDS:
            a, b = getattr(r, f), getattr(ref, f)
            assert a.dtype == b.dtype and np.array_equal(a, b), (key, f)


def test_route_ids_without_numba_in_a_fresh_process(tmp_path, monkeypatch):
    """USERWISE_NO_NUMBA=1: route_ids runs in numpy (the loader's choice, logged) and gives the
    compiled route's arrays."""
    import os
    import subprocess
    import sys

    from userwise.pipelines.loader.assembly import kernels, segcopy
    from userwise.pipelines.loader.assembly.ids import route_ids

    monkeypatch.setattr(segcopy, "batch_kernels", lambda: kernels)  # here: compiled, whatever the environment

    rng = np.random.default_rng(9)
    ln = rng.integers(0, 50, 100)
    v = rng.integers(0, 3000, int(ln.sum()))
    np.savez(tmp_path / "in.npz", v=v, ln=ln)
    code = ("import numpy as np; from userwise.pipelines.loader.assembly import ids, segcopy; "
            f"d = np.load({str(tmp_path / 'in.npz')!r}); "
            "r = ids.route_ids(d['v'], d['ln'], num_embeddings=2500, world_size=6, hot=[1, 2]); "
            f"np.savez({str(tmp_path / 'out.npz')!r}, **{{f: getattr(r, f) for f in {FIELDS!r}}}); "
            "print(segcopy.implementation())")
    env = dict(os.environ, USERWISE_NO_NUMBA="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["numpy"]
    got = np.load(tmp_path / "out.npz")
    want = route_ids(v, ln, num_embeddings=2500, world_size=6, hot=[1, 2])
    for f in FIELDS:
        assert got[f].dtype == getattr(want, f).dtype and np.array_equal(got[f], getattr(want, f)), f


def test_past_the_table_and_wide_ids_against_fbgemm():
    """Ids past the table's rows (overflow: rank i % W) and ids too wide for the bitset (sorted)
    bucket as fbgemm's block_bucketize_sparse_features does."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from userwise.pipelines.loader.assembly.ids import route_ids

    rng = np.random.default_rng(1)
    ln = rng.integers(0, 30, 64)
    n = int(ln.sum())
    for name, v, rows, W in [("past", rng.integers(0, 9000, n), 5000, 8),
                             ("wide", np.where(rng.random(n) < 0.5, rng.integers(0, 1 << 40, n),
                                               rng.integers(0, 100, n)), 1 << 38, 4)]:
        kjt = KeyedJaggedTensor.from_lengths_sync(["k"], torch.from_numpy(v), torch.from_numpy(ln))
        lengths, values, perm = _fbgemm_buckets(kjt, ["k"], {"k": rows}, W)
        r = route_ids(v, ln, num_embeddings=rows, world_size=W)
        assert np.array_equal(r.bucket_lengths.reshape(W, -1), lengths[:, 0, :]), name
        assert np.array_equal(r.bucket_values, values), name
        assert np.array_equal(r.unbucketize_permute, perm), name
        assert np.array_equal(r.unique[r.inverse], v), name
