"""Long samples: a sample over the loader's token budget, and one heavy user end to end.

- A sample that costs more than ``token_budget`` is a batch of its own, never dropped: every
  sample is delivered exactly once across an epoch with budgets below the longest sample, on 1
  and 2 ranks (equal batch counts per rank), with 0 and 1 workers; each batch is within the
  budget or is that one sample; the loader says once per process, in the ``userwise.loader``
  logger, how many of the node's samples are over it (docs/loader.md, Options).
- A user with 100K events and requests at L = 16,000 is generated without Spark
  (:func:`~userwise.pipelines.tools.shardgen.long_user_samples`), pre-sharded
  (:func:`~userwise.pipelines.shards.preshard.preshard_arrow`), staged, loaded and served
  (:mod:`userwise.pipelines.serve`: prefill, then extend, pages of 64; cached equals
  recompute) in bounded memory.

No Spark here.
"""

from __future__ import annotations

import collections
import logging

import numpy as np
import pytest

from userwise.pipelines.loader import UserwiseDataset, UserwiseLoader, logs
from userwise.pipelines.tools.shardgen import all_rows, write_shard_set

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
