"""Small shard sets written by preshard's own writer (no Spark), as the reliability tests
attack them."""

from __future__ import annotations

from userwise import schemas
from userwise.pipelines.shards import preshard
from userwise.pipelines.tools.shardgen import layout


def one_node_set(table, root: str, *, row_group_rows: int = 16) -> str:
    """``root``: ``table``'s samples as a one-node, one-rank shard set of row groups of
    ``row_group_rows``; returns ``root``."""
    preshard.preshard_arrow(table, root, schema=schemas.shard_schema(layout()).to_arrow(), nodes=1,
                            ranks_per_node=1, seed=1, row_group_rows=row_group_rows)
    return root
