"""The epoch plan (``pipelines/loader/planning/plan.py``) on its own: a pure, seeded function of
row-group sizes, checked as properties over random nodes (hypothesis) rather than on one
shard set. For any row-group sizes, sets, rank split, holdout, batch size or token budget:

- every rank of the node has the same number of batches in every set (and so in the epoch),
  and a cross-node target only adds batches;
- every kept sample is in exactly one batch of one rank, and no held-out one is;
- a batch never holds more than ``batch_size`` samples, nor more than ``token_budget`` cost
  unless it is one oversize sample;
- the same seed and epoch give the same plan, ``batch_order`` only reorders inside a batch.
"""

from __future__ import annotations

import collections

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from userwise.pipelines.jagged import np_offsets
from userwise.pipelines.loader.planning.plan import assign, cut, equalize, plan_node

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def nodes(draw):
    """A node: row groups (rows, set, preshard's rank, costs, kept rows) and how to plan it."""
    n_sets = draw(st.integers(1, 3))
    ranks_per_node = draw(st.integers(1, 3))
    n = draw(st.integers(1, 12))
    rows = np.array(draw(st.lists(st.integers(0, 40), min_size=n, max_size=n)), np.int64)
    rg_set = np.array(draw(st.lists(st.integers(0, n_sets - 1), min_size=n, max_size=n)), np.int64)
    rg_rank = np.array(draw(st.lists(st.integers(0, ranks_per_node - 1), min_size=n, max_size=n)), np.int64)
    seed = draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    costs = [rng.integers(1, 60, int(r)).astype(np.int64) for r in rows]
    holdout = draw(st.booleans())
    keep = [rng.random(int(r)) < 0.7 if holdout else None for r in rows]
    world = draw(st.integers(1, 4))
    budget = draw(st.one_of(st.none(), st.integers(1, 200)))
    return dict(rg_rows=rows, rg_set=rg_set, rg_rank=rg_rank, ranks_per_node=ranks_per_node, costs=costs,
                keep=keep, sets=sorted(set(draw(st.lists(st.integers(0, n_sets - 1), min_size=1, max_size=n_sets)))),
                world=world, epoch=draw(st.integers(0, 5)), seed=seed, shuffle=draw(st.booleans()),
                buffer_rgs=draw(st.integers(1, 4)), batch_size=None if budget else draw(st.integers(1, 16)),
                token_budget=budget, batch_order=draw(st.sampled_from(["stored", "shuffled"])))


def plan(node, targets=None):
    """Every rank's plan of the node, and the batches per set."""
    owner = assign(node["rg_set"], node["rg_rank"], node["rg_rows"], node["ranks_per_node"], node["world"])
    kw = {k: node[k] for k in ("rg_rows", "rg_set", "keep", "costs", "sets", "world", "epoch", "seed", "shuffle",
                               "buffer_rgs", "batch_size", "token_budget", "batch_order")}
    return plan_node(rg_owner=owner, targets=targets, **kw)


def batches(node, rank_plan):
    """Each batch of a rank's plan as (set, [(row group, row)...], [cost...])."""
    out = []
    for buf in rank_plan.buffers:
        base = np_offsets(node["rg_rows"][buf.rgs]) if len(buf.rgs) else np.zeros(1, np.int64)
        for k in range(buf.num_batches):
            rows = buf.perm[int(buf.bounds[k]): int(buf.bounds[k + 1])]
            which = np.searchsorted(base, rows, side="right") - 1
            groups = buf.rgs[which] if len(rows) else np.zeros(0, np.int64)
            pairs = [(int(g), int(r)) for g, r in zip(groups, rows - base[which])]
            out.append((buf.set_idx, pairs, [int(node["costs"][g][r]) for g, r in pairs]))
    return out


def kept(node):
    """Every sample of the selected sets the holdout keeps, as (row group, row)."""
    return collections.Counter((g, r) for g, n in enumerate(node["rg_rows"]) if node["rg_set"][g] in node["sets"]
                               for r in range(int(n)) if node["keep"][g] is None or node["keep"][g][r])


@SETTINGS
@given(nodes())
def test_every_rank_has_the_same_batches_per_set(node):
    plans, targets = plan(node)
    assert [p.rank for p in plans] == list(range(node["world"]))
    for p in plans:
        per_set = collections.Counter(s for s, _, _ in batches(node, p))
        assert [per_set[s] for s in node["sets"]] == [targets[s] for s in node["sets"]]
        assert p.num_batches == sum(targets.values())
        assert [s for s, _, _ in batches(node, p)] == sorted((s for s, _, _ in batches(node, p)),
                                                             key=node["sets"].index)  # sets in training order


@SETTINGS
@given(nodes())
def test_no_sample_is_lost_or_repeated(node):
    plans, _ = plan(node)
    got = collections.Counter(pair for p in plans for _, pairs, _ in batches(node, p) for pair in pairs)
    assert got == kept(node)


@SETTINGS
@given(nodes())
def test_a_batch_keeps_to_the_batch_size_or_the_token_budget(node):
    plans, _ = plan(node)
    for p in plans:
        for _, pairs, costs in batches(node, p):
            if node["token_budget"] is None:
                assert len(pairs) <= node["batch_size"]
            else:
                assert sum(costs) <= node["token_budget"] or len(pairs) == 1


@SETTINGS
@given(nodes(), st.integers(0, 6))
def test_a_cross_node_target_adds_batches_and_keeps_every_sample(node, extra):
    _, natural = plan(node)
    want = {s: natural[s] + extra for s in node["sets"]}
    plans, got = plan(node, want)
    assert got == want
    for p in plans:
        per_set = collections.Counter(s for s, _, _ in batches(node, p))
        assert [per_set[s] for s in node["sets"]] == [want[s] for s in node["sets"]]
    assert collections.Counter(pair for p in plans for _, pairs, _ in batches(node, p) for pair in pairs) == kept(node)


@SETTINGS
@given(nodes())
def test_a_plan_is_a_function_of_its_seed_and_epoch(node):
    a, _ = plan(node)
    b, _ = plan(node)
    assert [batches(node, p) for p in a] == [batches(node, p) for p in b]
    other = dict(node, batch_order="shuffled" if node["batch_order"] == "stored" else "stored")
    c, _ = plan(other)
    assert [[(s, sorted(x)) for s, x, _ in batches(node, p)] for p in a] == \
        [[(s, sorted(x)) for s, x, _ in batches(other, p)] for p in c]


def test_the_properties_can_fail():
    """The checks above see a lost sample, a repeated one and a batch over the budget."""
    node = dict(rg_rows=np.array([5]), rg_set=np.array([0]), rg_rank=np.array([0]), ranks_per_node=1,
                costs=[np.array([3, 3, 3, 3, 3])], keep=[None], sets=[0], world=1, epoch=0, seed=1, shuffle=False,
                buffer_rgs=1, batch_size=None, token_budget=6, batch_order="stored")
    (p,), _ = plan(node)
    assert [len(x) for _, x, _ in batches(node, p)] == [2, 2, 1]
    p.buffers[0].perm = p.buffers[0].perm[[0, 1, 2, 3, 3]]  # the last sample lost, the one before repeated
    got = collections.Counter(pair for _, pairs, _ in batches(node, p) for pair in pairs)
    assert got != kept(node)
    p.buffers[0].bounds = np.array([0, 3, 5])
    assert sum(batches(node, p)[0][2]) > node["token_budget"]
    assert cut(np.array([10, 1]), None, 6).tolist() == [0, 1, 2]  # an oversize sample is a batch of its own
    bufs = [p.buffers[0]]
    equalize(bufs, 5)  # more batches than samples: empty batches pad the rank
    assert bufs[0].num_batches == 5
