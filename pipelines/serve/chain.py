"""A cache that cannot be stale: each held state carries the chain of the events it encodes.

A user's cached K/V are valid for a request exactly as far as the events they encode
are the first events of the user's current sequence, under the same model. The chain
(:class:`Chain`, defined in :mod:`userwise.schemas.hashing` so that Spark computes it
natively) hashes each event's content (``e_i = xxhash64(item, side_1..side_F, action)``,
all as ``long``) and rolls it (``h_{-1} = 42``, ``h_i = xxhash64(h_{i-1}, e_i)``); a chain
of ``n`` events with block size P keeps the checkpoints ``h_{P-1}, h_{2P-1}, ...`` (one per
complete block) and the end ``h_{n-1}``, with the model version.

:func:`longest_valid_prefix` compares a held chain with the current one: the largest
``n`` at which both chains hold a checkpoint (a block boundary, or a chain's end) with
equal hashes, 0 if the versions differ. Any change to the sequence before position
``n`` (a late event inserted in the past, an event forgotten, the window re-anchored at
a later event) changes every later ``h``, so it is caught at the first checkpoint after
it. It is exact at block granularity: a valid held state is reused up to its last
complete block (or whole, when the sequence did not change), so at most P - 1 held
events are encoded again.

Example::

    held = chain_of(history, block=64, version="ckpt-7")
    cur = chain_of(history.cat(new), block=64, version="ckpt-7")
    n = longest_valid_prefix(held, cur)       # 64 * (len(history) // 64)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from userwise.pipelines.errors import UserwiseError
from userwise.pipelines.serve.incremental import Events
from userwise.schemas.hashing import CHAIN_SEED, chain_checkpoints, event_hashes, rolling_hashes

__all__ = ["Chain", "chain_of", "chains_of", "longest_valid_prefix"]


@dataclass(frozen=True)
class Chain:
    """The chain of a sequence of ``length`` events under model ``version``: ``checkpoints``
    (int64 [length // block]: ``h`` after each complete block) and ``end`` (``h_{length-1}``;
    42 for no events).

    Example::

        c = chain_of(events, block=64, version=3)
        c.positions()           # the event counts it can verify: 64, 128, ..., and its length
    """

    version: object
    block: int
    length: int
    checkpoints: np.ndarray
    end: int

    def __post_init__(self):
        cps = np.asarray(self.checkpoints, dtype=np.int64)
        object.__setattr__(self, "checkpoints", cps)
        if self.block < 1 or self.length < 0 or len(cps) != self.length // self.block:
            raise UserwiseError(f"a chain of {self.length} events with block {self.block} holds "
                                f"{self.length // max(self.block, 1)} checkpoints, not {len(cps)}")

    def positions(self) -> list[int]:
        """The event counts this chain verifies: each complete block's end, and its length."""
        out = [self.block * (k + 1) for k in range(len(self.checkpoints))]
        return out if self.length in out or self.length == 0 else out + [self.length]

    def hash_at(self, n: int) -> int:
        """``h_{n-1}`` at one of :meth:`positions` (42 at 0)."""
        if n == 0:
            return CHAIN_SEED
        if n == self.length:
            return self.end
        if n % self.block or not 0 < n < self.length:
            raise UserwiseError(f"a chain of {self.length} events (block {self.block}) holds no hash at {n}")
        return int(self.checkpoints[n // self.block - 1])

    def truncate(self, n: int) -> "Chain":
        """The chain of the first ``n`` events (``n`` one of :meth:`positions`, or 0)."""
        return Chain(self.version, self.block, n, self.checkpoints[:n // self.block], self.hash_at(n))


def chain_of(events, *, block: int, version) -> Chain:
    """The :class:`Chain` of one sequence: ``events`` an :class:`Events` or an int array
    ``[n, k]`` of each event's fields in order (``Events.fields()``).

    Example::

        held = chain_of(history, block=64, version="ckpt-7")
    """
    return chains_of(events.fields() if isinstance(events, Events) else np.asarray(events, dtype=np.int64),
                     np.array([0, len(events)]), block=block, versions=[version])[0]


def chains_of(fields, offsets, *, block: int, versions) -> list[Chain]:
    """The chains of many sequences at once (vectorised across them): ``fields`` int64
    ``[T, k]`` (every event's fields), ``offsets`` [S+1] cutting it into sequences,
    ``versions`` one model version per sequence (or one for all).

    Example::

        chains = chains_of(fields, offsets, block=64, versions="ckpt-7")   # one per user
    """
    fields = np.asarray(fields, dtype=np.int64)
    off = np.asarray(offsets, dtype=np.int64)
    if fields.ndim != 2 or not len(off) or off[0] != 0 or off[-1] != len(fields) or (np.diff(off) < 0).any():
        raise UserwiseError(f"chains_of: fields must be [T, k] and offsets [S+1] from 0 to T={len(fields)} "
                            "(non-decreasing)")
    if block < 1:
        raise UserwiseError(f"block={block}: use a number of events >= 1 (the cache's page size)")
    n_seq = len(off) - 1
    if isinstance(versions, (list, tuple, np.ndarray)):
        if len(versions) != n_seq:
            raise UserwiseError(f"chains_of: {len(versions)} versions for {n_seq} sequences")
    else:
        versions = [versions] * n_seq
    e = event_hashes(fields) if fields.shape[1] else np.full(len(fields), CHAIN_SEED, dtype=np.int64)
    h = rolling_hashes(e, off)
    out = []
    for s in range(n_seq):
        a, b = int(off[s]), int(off[s + 1])
        cps, end = chain_checkpoints(h[a:b], b - a, block)
        out.append(Chain(versions[s], block, b - a, cps, end))
    return out


def longest_valid_prefix(held: Chain, current: Chain) -> int:
    """The largest ``n`` (events) that both chains verify: a position both hold a checkpoint
    at (a multiple of the block, or a chain's end) where their hashes are equal; 0 when the
    versions differ (a state of another model is never reused). Exact at block granularity:
    a partial tail of a held state is encoded again (at most ``block - 1`` events).

    Example::

        n = longest_valid_prefix(entry_chain, chain_of(current_events, block=64, version=v))
        state = state.truncate(n)   # then extend with current_events[n:]
    """
    if held.block != current.block:
        raise UserwiseError(f"chains of block {held.block} and {current.block}: compare chains of the cache's one "
                            "page size")
    if held.version != current.version:
        return 0
    if held.length == current.length and held.end == current.end:
        return held.length
    k = min(len(held.checkpoints), len(current.checkpoints))
    eq = np.flatnonzero(held.checkpoints[:k] == current.checkpoints[:k])
    return int(eq[-1] + 1) * held.block if len(eq) else 0
