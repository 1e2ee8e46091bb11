"""A cache that cannot be stale: each held state carries the chain of the events it encodes.

A user's cached K/V are valid for a request exactly as far as the events they encode
are the first events of the user's current sequence, under the same model. The chain
(:class:`Chain`, defined in :mod:`userwise.schemas.hashing` so that Spark computes it
natively) hashes each event's content (``e_i = xxhash64(item, side_1..side_F, action)``,
all as ``long``) and rolls it (``h_{-1} = 42``, ``h_i = xxhash64(h_{i-1}, e_i)``); a chain
of ``n`` events with block size P keeps the checkpoints ``h_{P-1}, h_{2P-1}, ...`` (one per
complete block) and the end ``h_{n-1}``, with the model version. A chain made from the
events (:func:`chain_of`, :func:`chains_of`, :meth:`Chain.from_hashes`) also keeps every
``h_i`` (``hashes``), so it answers "the hash after the first ``n`` events" for any ``n``;
a held entry keeps only its checkpoints and its end (:meth:`Chain.compact`).

:func:`longest_valid_prefix` compares a held chain with the current one (0 if the versions
differ). The held state is valid whole when the current chain's hash at the held length
equals the held end: a state that ends inside a page (the unfinished last page, a user of
fewer than P events) is reused whole when events were only appended. Otherwise the answer
is the largest block boundary at which both chains hold equal checkpoints. Any change
to the sequence before position ``n`` (a late event inserted in the past, an event
forgotten, the window re-anchored at a later event) changes every later ``h``, so it is
caught at its end and at the first checkpoint after it: the reused prefix is never stale,
and a held state that no longer verifies whole gives back at most P - 1 valid events
beyond its last verified block.

Example::

    held = chain_of(history, block=64, version="ckpt-7")
    cur = chain_of(history.cat(new), block=64, version="ckpt-7")
    n = longest_valid_prefix(held, cur)       # len(history): all of it
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from userwise.pipelines.errors import ArgumentError
from userwise.pipelines.serve.incremental import Events
from userwise.schemas.hashing import CHAIN_SEED, chain_checkpoints, event_hashes, rolling_hashes

__all__ = ["Chain", "chain_of", "chains_of", "longest_valid_prefix"]


@dataclass(frozen=True)
class Chain:
    """The chain of a sequence of ``length`` events under model ``version``: ``checkpoints``
    (int64 [length // block]: ``h`` after each complete block), ``end`` (``h_{length-1}``;
    42 for no events) and, for a chain made from the events, ``hashes`` (int64 [length]: ``h``
    after every event; None for a held chain, which keeps its checkpoints and end only).

    Example::

        c = chain_of(events, block=64, version=3)
        c.positions()           # the event counts every chain verifies: 64, 128, ..., and its length
        c.verifies(70), c.hash_at(70)   # any count, from the events' hashes
    """

    version: object
    block: int
    length: int
    checkpoints: np.ndarray
    end: int
    hashes: np.ndarray | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        cps = np.asarray(self.checkpoints, dtype=np.int64)
        object.__setattr__(self, "checkpoints", cps)
        if self.block < 1 or self.length < 0 or len(cps) != self.length // self.block:
            raise ArgumentError(f"a chain of {self.length} events with block {self.block} holds "
                                f"{self.length // max(self.block, 1)} checkpoints, not {len(cps)}")
        if self.hashes is not None:
            h = np.asarray(self.hashes, dtype=np.int64)
            object.__setattr__(self, "hashes", h)
            if h.shape != (self.length,) or (self.length and int(h[-1]) != int(self.end)) or \
                    not np.array_equal(h[self.block - 1::self.block], cps):
                raise ArgumentError(f"a chain of {self.length} events: its hashes {h.shape} are not the ones its "
                                    "checkpoints and end were taken from; make it with chain_of or Chain.from_hashes")

    @classmethod
    def from_hashes(cls, hashes, *, block: int, version) -> "Chain":
        """The chain of a sequence from its rolling hashes ``hashes`` (int64 [n], ``h_i``
        after each event, as :func:`userwise.schemas.hashing.rolling_hashes` gives them).

        Example::

            cur = Chain.from_hashes(rolling_hashes(event_hashes(fields)), block=64, version=v)
        """
        h = np.asarray(hashes, dtype=np.int64)
        if h.ndim != 1:
            raise ArgumentError(f"Chain.from_hashes: hashes must be [n], got shape {h.shape}")
        if block < 1:
            raise ArgumentError(f"block={block}: use a number of events >= 1 (the cache's page size)")
        cps, end = chain_checkpoints(h, len(h), block)
        return cls(version, block, len(h), cps, end, h)

    def positions(self) -> list[int]:
        """The event counts every chain verifies, held or made from events: each complete
        block's end, and its length."""
        out = [self.block * (k + 1) for k in range(len(self.checkpoints))]
        return out if self.length in out or self.length == 0 else out + [self.length]

    def verifies(self, n: int) -> bool:
        """Whether this chain knows ``h_{n-1}``: at 0, a block's end or its length, and at any
        ``n`` up to its length when it keeps its ``hashes``."""
        n = int(n)
        if not 0 <= n <= self.length:
            return False
        return n in (0, self.length) or n % self.block == 0 or self.hashes is not None

    def hash_at(self, n: int) -> int:
        """``h_{n-1}`` (42 at 0) at a count this chain :meth:`verifies`."""
        n = int(n)
        if not self.verifies(n):
            raise ArgumentError(f"a chain of {self.length} events (block {self.block}) holds no hash at {n}")
        if n == 0:
            return CHAIN_SEED
        if n == self.length:
            return int(self.end)
        if self.hashes is not None:
            return int(self.hashes[n - 1])
        return int(self.checkpoints[n // self.block - 1])

    def truncate(self, n: int) -> "Chain":
        """The chain of the first ``n`` events (a count this chain :meth:`verifies`)."""
        end = self.hash_at(n)
        return Chain(self.version, self.block, n, self.checkpoints[:n // self.block], end,
                     None if self.hashes is None else self.hashes[:n])

    def compact(self) -> "Chain":
        """This chain without its per-event ``hashes`` (its checkpoints and end: what a held
        entry keeps).

        Example::

            held = chain_of(events, block=64, version=v).compact()
        """
        return self if self.hashes is None else Chain(self.version, self.block, self.length, self.checkpoints,
                                                      self.end)


def chain_of(events: Events | np.ndarray, *, block: int, version: str | int) -> Chain:
    """The :class:`Chain` of one sequence (with every event's hash): ``events`` an
    :class:`Events` or an int array ``[n, k]`` of each event's fields in order
    (``Events.fields()``), cut into blocks of ``block`` events, for the model ``version``.

    Example::

        held = chain_of(history, block=64, version="ckpt-7")
    """
    return chains_of(events.fields() if isinstance(events, Events) else np.asarray(events, dtype=np.int64),
                     np.array([0, len(events)]), block=block, versions=[version])[0]


def chains_of(fields: np.ndarray, offsets: np.ndarray, *, block: int, versions: str | int | Sequence[str | int]) -> list[Chain]:
    """The chains of many sequences at once (vectorised across them), each with every
    event's hash: ``fields`` int64 ``[T, k]`` (every event's fields), ``offsets`` [S+1]
    cutting it into sequences, ``versions`` one model version per sequence (or one for all).

    Example::

        chains = chains_of(fields, offsets, block=64, versions="ckpt-7")   # one per user
    """
    fields = np.asarray(fields, dtype=np.int64)
    off = np.asarray(offsets, dtype=np.int64)
    if fields.ndim != 2 or not len(off) or off[0] != 0 or off[-1] != len(fields) or (np.diff(off) < 0).any():
        raise ArgumentError(f"chains_of: fields must be [T, k] and offsets [S+1] from 0 to T={len(fields)} "
                            "(non-decreasing)")
    if block < 1:
        raise ArgumentError(f"block={block}: use a number of events >= 1 (the cache's page size)")
    n_seq = len(off) - 1
    if isinstance(versions, (list, tuple, np.ndarray)):
        if len(versions) != n_seq:
            raise ArgumentError(f"chains_of: {len(versions)} versions for {n_seq} sequences")
    else:
        versions = [versions] * n_seq
    e = event_hashes(fields) if fields.shape[1] else np.full(len(fields), CHAIN_SEED, dtype=np.int64)
    h = rolling_hashes(e, off)
    return [Chain.from_hashes(h[int(off[s]):int(off[s + 1])], block=block, version=versions[s]) for s in range(n_seq)]


def longest_valid_prefix(held: Chain, current: Chain) -> int:
    """The largest ``n`` (events) of the held state that ``current`` verifies; 0 when the
    versions differ (a state of another model is never reused):

    - the held length, when ``current`` knows its hash there (a chain made from the events
      knows it at every count up to its length) and it equals the held end: the whole held
      state, its unfinished last page included;
    - else the largest block end at which both chains hold equal checkpoints.

    The held chain's own per-event ``hashes``, if it kept them, are not read: a held state
    that no longer verifies whole falls back to its blocks (at most ``block - 1`` valid
    events past the last one are encoded again).

    Example::

        n = longest_valid_prefix(entry_chain, chain_of(current_events, block=64, version=v))
        state = state.truncate(n)   # then extend with current_events[n:]
    """
    if held.block != current.block:
        raise ArgumentError(f"chains of block {held.block} and {current.block}: compare chains of the cache's one "
                            "page size")
    if held.version != current.version:
        return 0
    if current.verifies(held.length) and current.hash_at(held.length) == held.end:
        return held.length
    k = min(len(held.checkpoints), len(current.checkpoints))
    eq = np.flatnonzero(held.checkpoints[:k] == current.checkpoints[:k])
    return int(eq[-1] + 1) * held.block if len(eq) else 0
