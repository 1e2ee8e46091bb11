"""TorchRec's planner inputs (#58 point 2): exact LRU stack distances and miss-ratio curves
against a direct LRU simulation, expected lookups against a direct count of each global batch's
distinct ids, and TorchRec's own planner (CPU, a fake CUDA topology) planning with them."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest

from userwise.pipelines.errors import ArgumentError
from userwise.pipelines.train import planner_stats as P


def _lru_misses(stream, k: int) -> tuple[int, int]:
    """A direct LRU cache of k rows over the stream: (misses of reuses, first accesses)."""
    cache: OrderedDict = OrderedDict()
    seen, misses, first = set(), 0, 0
    for x in stream.tolist():
        if x in cache:
            cache.move_to_end(x)
            continue
        if x in seen:
            misses += 1
        else:
            first += 1
            seen.add(x)
        cache[x] = None
        if len(cache) > k:
            cache.popitem(last=False)
    return misses, first


def _zipf(n, items, s, seed):
    rng = np.random.default_rng(seed)
    return (rng.zipf(s, n) - 1) % items


def test_stack_distances_equal_an_lru_simulation_at_every_size():
    assert P.lru_stack_distances(np.array([1, 2, 1, 1, 3, 2])).tolist() == [-1, -1, 1, 0, -1, 2]
    stream = _zipf(3000, 64, 1.2, 0)
    d = P.lru_stack_distances(stream)
    for k in range(1, 65):
        misses, first = _lru_misses(stream, k)
        assert first == (d < 0).sum()
        assert misses == (d >= k).sum(), k
    # the pure-Python tree (numba absent) gives the same distances
    uniq, codes = np.unique(stream, return_inverse=True)
    assert P._distances(codes.astype(np.int64), len(uniq)).tolist() == d.tolist()


def test_table_stats_expected_lookups_and_the_exact_curve_through_torchrec():
    """expected_lookups is the mean distinct ids of the full global batches; with one bin per
    row, TorchRec's EmbeddingOffloadStats.expected_miss_rate(k / height) is the simulated LRU
    miss ratio (of reuses) of a k-row cache over the stream of each batch's distinct ids."""
    height, B, W = 64, 6, 4
    ids = _zipf(2000, height, 1.1, 1)
    lengths = np.random.default_rng(2).integers(0, 4, size=700)
    ids = ids[: lengths.sum()]
    st = P.table_stats(ids, batch_size=B, world_size=W, height=height, lengths=lengths)
    example = np.repeat(np.arange(len(lengths)), lengths)
    batches = [ids[(example >= s) & (example < s + B * W)] for s in range(0, len(lengths), B * W)]
    full = len(lengths) // (B * W)
    assert st.batches == full and st.expected_lookups == np.mean([len(np.unique(b)) for b in batches[:full]])
    stream = np.concatenate([np.unique(b) for b in batches])
    tr = st.to_torchrec(bins=None)
    assert tr.expected_lookups == st.expected_lookups and tr.height == height
    reuses = len(stream) - len(np.unique(stream))
    assert st.reuses == reuses and st.first_accesses == len(np.unique(stream))
    for k in range(0, height + 1):
        misses, _ = _lru_misses(stream, k) if k else (reuses, 0)
        assert st.miss_ratio(k) == pytest.approx(misses / reuses, abs=1e-12), k
        assert tr.expected_miss_rate(k / height) == pytest.approx(misses / reuses, abs=1e-6), k
    # cacheability: the curve's area over load factors, the mean of the miss ratio at 1..height rows
    assert st.cacheability == pytest.approx(np.mean([st.miss_ratio(k) for k in range(1, height + 1)]))
    assert tr.cacheability == st.cacheability
    # coarser bins keep the counts; one global batch of everything has no reuse
    assert P.table_stats(ids, batch_size=B, world_size=W, height=height, lengths=lengths).mrc_hist(8).sum() == reuses
    one = P.table_stats(ids, batch_size=len(ids), world_size=1, height=height)
    assert one.expected_lookups == len(np.unique(ids)) and one.reuses == 0 and one.miss_ratio(3) == 0.0


def test_counts_give_a_shuffled_stream_of_those_lookups():
    ids, lookups = np.array([10, 20, 30, 40]), np.array([50, 20, 5, 0])
    st = P.table_stats_from_counts(ids, lookups, batch_size=5, world_size=1)
    assert st.height == 4 and st.first_accesses == 3 and st.batches == 15
    whole = P.table_stats_from_counts(ids, lookups, batch_size=75, world_size=1)
    assert whole.expected_lookups == 3
    assert P.table_stats_from_counts(ids, lookups, batch_size=1, world_size=1).expected_lookups == 1
    with pytest.raises(ArgumentError, match="lookups"):
        P.table_stats_from_counts(ids, lookups[:3], batch_size=1, world_size=1)
    with pytest.raises(ArgumentError, match="batch_size"):
        P.table_stats(ids, batch_size=0, world_size=1)


def test_torchrec_planner_sizes_uvm_caches_from_the_stats():
    """EmbeddingShardingPlanner (CPU; a 2-GPU topology too small for the tables in HBM) with
    the scale-up proposer: each table is planned as a UVM cache that carries our stats, and the
    proposer moves the load factors from the start it was given, more cache to the table whose
    ids miss more (uniform ids) than to the one whose hot ids a small cache holds (Zipf)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("torchrec")
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.proposers import EmbeddingOffloadScaleupProposer, GreedyProposer
    from torchrec.distributed.types import ShardingType

    rows, dim = 1_000_000, 128
    rng = np.random.default_rng(3)
    skewed = P.table_stats(_zipf(200_000, rows, 1.3, 4), batch_size=512, world_size=2, height=rows)
    flat = P.table_stats(rng.integers(0, 20_000, 200_000), batch_size=512, world_size=2, height=rows)
    assert skewed.cacheability < flat.cacheability
    stats = {"t_skewed": skewed, "t_flat": flat}
    tables = [EmbeddingBagConfig(name=n, embedding_dim=dim, num_embeddings=rows, feature_names=[n + "_f"])
              for n in stats]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    cons = P.planner_constraints(stats, load_factor=0.1, sharding_types=[ShardingType.ROW_WISE.value])
    topo = Topology(world_size=2, compute_device="cuda", hbm_cap=300 << 20, ddr_cap=8 << 30)
    planner = EmbeddingShardingPlanner(topology=topo, batch_size=512, constraints=cons,
                                       proposer=[GreedyProposer(), EmbeddingOffloadScaleupProposer()])
    plan = planner.plan(ebc, [EmbeddingBagCollectionSharder()]).plan[""]
    clf = {}
    for name, st in stats.items():
        ps = plan[name]
        assert ps.compute_kernel == "fused_uvm_caching"
        assert ps.cache_params.stats.expected_lookups == st.expected_lookups
        assert ps.cache_params.stats.cacheability == st.cacheability
        clf[name] = ps.cache_params.load_factor
        assert clf[name] != 0.1
    assert clf["t_skewed"] < clf["t_flat"], clf


def test_the_guides_planner_example_runs(capsys):
    """docs/embeddings.md's runnable example, as written: the planner caches the table in UVM
    with the stats it was given."""
    import pathlib
    import re

    pytest.importorskip("torchrec")
    doc = (pathlib.Path(__file__).parents[2] / "docs" / "embeddings.md").read_text()
    (code,) = [b for b in re.findall(r"```python\n(.*?)```", doc, re.S) if "EmbeddingShardingPlanner" in b]
    scope: dict = {}
    exec(compile(code, "docs/embeddings.md", "exec"), scope)
    assert scope["plan"].compute_kernel == "fused_uvm_caching"
    assert scope["plan"].cache_params.stats.expected_lookups == scope["st"].expected_lookups
    assert "fused_uvm_caching" in capsys.readouterr().out
