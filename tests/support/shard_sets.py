"""Small shard sets written by preshard's and shardgen's own writers (no Spark), as the
reliability and loader tests read and attack them."""

from __future__ import annotations

import functools

from userwise import schemas
from userwise.pipelines.shards import preshard
from userwise.pipelines.tools.shardgen import build_samples, layout, write_shard_set


@functools.lru_cache(maxsize=8)
def _samples(**kw):
    return build_samples(**kw)


def one_node_set(root: str, *, row_group_rows: int = 16, **samples) -> str:
    """``root``: ``build_samples(**samples)`` as a one-node, one-rank shard set of row groups of
    ``row_group_rows`` (the samples are made once per process); returns ``root``."""
    preshard.preshard_arrow(_samples(**samples), root, schema=schemas.shard_schema(layout()).to_arrow(), nodes=1,
                            ranks_per_node=1, seed=1, row_group_rows=row_group_rows)
    return root


def one_day_set(root: str) -> str:
    """``root``: shardgen's one-node set of one daily incremental set of 60 users; returns ``root``."""
    write_shard_set(root, nodes=1, ranks_per_node=1, row_group_rows=16,
                    sets=(("incremental", "2026-01-04", "2026-01-05", 60),))
    return root
