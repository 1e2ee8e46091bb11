"""Long samples: a sample over the loader's token budget, and one heavy user end to end.

- A sample that costs more than ``token_budget`` is a batch of its own, never dropped: every
  sample is delivered exactly once across an epoch with budgets below the longest sample, on 1
  and 2 ranks (equal batch counts per rank), with 0 and 1 workers; each batch is within the
  budget or is that one sample; the loader says once per process, in the ``userwise.loader``
  logger, how many of the node's samples are over it (docs/loader.md, Arguments).
- A user with 100K events and requests at L = 16,000, end to end (generated, pre-sharded,
  staged, loaded, served): ``tests/serve/test_long_user.py``.

No Spark here.
"""

from __future__ import annotations

import collections
import logging

import numpy as np
import pytest

from userwise.pipelines.loader import UserwiseDataset, UserwiseLoader, logs
from userwise.pipelines.shards import preshard
from userwise.pipelines.tools.shardgen import HEAVY, all_rows, layout, long_user_samples, write_shard_set
from userwise.schemas import shard_schema

SETS = (
    ("pretrain", "2025-12-01", "2026-01-03", 30),
    ("incremental", "2026-01-03", "2026-01-04", 20),
)


@pytest.fixture(scope="module")
def long_set(tmp_path_factory):
    """Two sets, light users under 60 events plus heavy users' chunks and the bot's (costs up
    to 400), uneven shards over 2 ranks."""
    root = str(tmp_path_factory.mktemp("long"))
    write_shard_set(root, nodes=1, ranks_per_node=2, row_group_rows=4, sets=SETS, heavy=2, bot_chunks=3,
                    cap=400, max_events=60)
    return root


def epoch(root, world, workers, budget):
    """Per rank, the batches of one epoch as lists of (sample_id, cost)."""
    out = {}
    for r in range(world):
        ds = UserwiseDataset(root, rank=r, world_size=world, token_budget=budget, verify="none", device="cpu")
        out[r] = [list(zip(b.numpy("sample_id").tolist(), b.numpy("cost").tolist()))
                  for b in UserwiseLoader(ds, num_workers=workers)]
    return out


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("workers", [0, 1])
@pytest.mark.parametrize("share", [0.25, 0.9])
def test_a_sample_over_the_budget_is_a_batch_of_its_own_and_delivered_once(long_set, world, workers, share):
    t = all_rows(long_set)
    costs = dict(zip(t.column("sample_id").to_pylist(), t.column("cost").to_pylist()))
    budget = int(max(costs.values()) * share)  # below the longest sample: some (or many) are over it
    over = {i for i, c in costs.items() if c > budget}
    assert over and len(over) < len(costs)

    got = epoch(long_set, world, workers, budget)
    ids = [i for r in got.values() for b in r for i, _ in b]
    assert collections.Counter(ids) == collections.Counter(t.column("sample_id").to_pylist())  # each exactly once
    assert len({len(b) for b in got.values()}) == 1, {r: len(b) for r, b in got.items()}
    for r, batches in got.items():
        for b in batches:
            assert sum(c for _, c in b) <= budget or len(b) == 1, (r, b)
    alone = {b[0][0] for r in got.values() for b in r if len(b) == 1}
    assert over <= alone  # each oversize sample came alone


def test_the_samples_over_the_budget_are_said_once_per_process(long_set, caplog):
    t = all_rows(long_set)
    cost = np.asarray(t["cost"])
    budget = int(cost.max()) // 2
    over = int((cost > budget).sum())
    logs._SAID.clear()
    with caplog.at_level(logging.INFO, logger="userwise.loader"):
        for r in (0, 1):  # both ranks of the node, two epochs each: one notice
            ds = UserwiseDataset(long_set, rank=r, world_size=2, token_budget=budget, verify="none", device="cpu")
            for _ in range(2):
                for _ in UserwiseLoader(ds):
                    pass
        UserwiseDataset(long_set, rank=0, world_size=1, token_budget=int(cost.max()), verify="none",
                        device="cpu").epochs.plan()  # every sample within this budget: nothing to say
    said = [r.getMessage() for r in caplog.records if "token_budget" in r.getMessage()]
    assert len(said) == 1, said
    assert said[0].startswith(f"userwise loader: {over} of {t.num_rows} samples on this node cost more "
                              f"than token_budget={budget} (the largest {int(cost.max())} events")
    assert all(r.levelno == logging.WARNING and r.name == "userwise.loader" for r in caplog.records
               if "token_budget" in r.getMessage())


def test_a_long_user_obeys_the_pointer_and_loads_alone_under_a_smaller_budget(tmp_path, caplog):
    """The generator of the long user (tests/serve/test_long_user.py at 100K events, L = 16,000),
    small: stored times increase, each request comes strictly after the last event it sees and
    no later than the next, spans are ``[max(0, end - L), end)``, the last request sees every
    stored event; under a budget a quarter of its cost it loads as a batch of its own."""
    L = 800
    t = long_user_samples(events=5_000, max_seq_len=L, requests=6, light=4, seed=2)
    row = t.slice(t.column("user").to_pylist().index(HEAVY), 1).to_pylist()[0]
    ts, rt = np.array(row["seq_ts"]), np.array(row["req_time"])
    end, begin = np.array(row["req_seq_end"]), np.array(row["req_seq_begin"])
    assert row["num_events"] == len(ts) == 5_000 and row["cost"] == 5_000 + sum(row["req_num_imps"])
    assert (np.diff(ts) > 0).all() and (np.diff(rt) > 0).all() and end[-1] == len(ts)
    assert (ts[end - 1] < rt).all() and (ts[np.minimum(end, len(ts) - 1)][:-1] >= rt[:-1]).all()
    assert begin.tolist() == np.maximum(0, end - L).tolist() and (end - begin).max() == L
    preshard.preshard_arrow(t, str(tmp_path / "S"), schema=shard_schema(layout()).to_arrow(), nodes=1,
                            ranks_per_node=1)
    logs._SAID.clear()
    ds = UserwiseDataset(str(tmp_path / "S"), token_budget=row["cost"] // 4, verify="none", device="cpu",
                         world_size=1, rank=0)
    with caplog.at_level(logging.INFO, logger="userwise.loader"):
        batches = [b.numpy("sample_id").tolist() for b in UserwiseLoader(ds)]
    assert sorted(i for b in batches for i in b) == sorted(t.column("sample_id").to_pylist())
    assert [row["sample_id"]] in batches
    assert any(f"1 of {t.num_rows} samples on this node cost more" in r.getMessage() for r in caplog.records)
