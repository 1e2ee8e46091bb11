"""A worker's ring of reused shared-memory batch buffers, and the pipe messages around it.

A batch buffer's storage crosses from a worker to the trainer once (with the first batch
that used it, or when it had to grow); afterwards a batch is announced by its slot number
alone: no per-batch shared-memory create/unlink, no file-descriptor passing.
"""

from __future__ import annotations

import pickle
import select
import struct
from typing import Any, NamedTuple

import torch


def shm_alloc(n: int) -> torch.Tensor:
    """A uint8 tensor of n bytes in shared memory (sent between processes as one handle)."""
    return torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(max(1, n)))[:n]


class Ring:
    """A worker's ring of reused shared-memory batch buffers.

    The worker writes a batch into a free slot, whose number it reads from ``free``
    (a pipe the trainer writes slot numbers back into once it is done with them:
    after copying the batch out, or, for a batch lent to the consumer without a
    copy, once the consumer dropped it). A slot's storage goes to the trainer once
    (with the first batch that used it, or when it had to grow); afterwards a batch
    is announced by its slot number alone: no per-batch shared-memory
    create/unlink, no file-descriptor passing."""

    def __init__(self, nslots: int, free):
        self.slots: list[torch.Tensor | None] = [None] * nslots
        self.free = free
        self.k = None
        self.fresh = None

    def alloc(self, n: int) -> torch.Tensor:
        k = self.k = SLOT.unpack(self.free.recv_bytes())[0]
        buf = self.slots[k]
        if buf is None or buf.numel() < n:
            buf = self.slots[k] = shm_alloc(max(n, 1) * 5 // 4 + 4096)
            self.fresh = buf
        else:
            self.fresh = None
        return buf[:n]

    def sent(self) -> tuple[int, torch.Tensor | None]:
        """The slot the last batch went into, and its storage if the trainer has not seen it yet."""
        k, fresh = self.k, self.fresh
        self.fresh = None
        return k, fresh


# a slot number on a free pipe
SLOT = struct.Struct("<i")
# One slot number as it sits in the pipe: Connection.send_bytes writes a 4-byte length, then the number.
SLOT_MESSAGE = 4 + SLOT.size
# What a pipe holds without blocking its writer: POSIX guarantees PIPE_BUF bytes (4096 on Linux, where a
# pipe holds 64 KiB by default but only one page once a user's pipes pass fs.pipe-user-pages-soft).
PIPE_BYTES = getattr(select, "PIPE_BUF", 512)
# The most slots a worker's ring may have. The trainer writes a slot's number back into the worker's
# free pipe whether or not the worker is reading it (at start-up every number goes in before the worker
# has its first plan; a worker between epochs reads none), so every number must fit in the pipe at once:
# then handing a slot back never blocks the trainer.
MAX_SLOTS = PIPE_BYTES // SLOT_MESSAGE


# The messages on a worker's pipes. Trainer -> worker: Work (one epoch), or None (exit).
# Worker -> trainer: Ready per batch, in the epoch's order, then Done; or Failed.


class Work(NamedTuple):
    """An epoch's work for one worker: this rank's plan (made once, by the trainer), the first
    batch to send (a resumed epoch's cursor) and how many workers share the plan's buffers."""

    plan: Any  # plan.RankPlan
    start: int
    num_workers: int


class Ready(NamedTuple):
    """Batch ``index`` of the epoch is in the worker's ring slot ``slot``: ``nbytes`` bytes laid
    out by ``spec`` (:class:`~userwise.pipelines.loader.JaggedBatch`), with its ``meta``
    (``columns`` only when it changed; ``roles`` never: the trainer has them). ``fresh``: the
    slot's (new) shared-memory storage, sent once per storage, else None."""

    index: int
    slot: int
    fresh: torch.Tensor | None
    nbytes: int
    spec: tuple
    meta: dict


class Done(NamedTuple):
    """The worker sent every batch of its share of the epoch."""

    worker: int


class Failed(NamedTuple):
    """The worker's epoch failed: ``error`` (``Type: message``), its traceback, and whether it
    is a :class:`~userwise.pipelines.errors.UserwiseError` (then its message is the user's)."""

    error: str
    trace: str
    user: bool


def describe(msg) -> str:
    """A message in a few words, for an error that names what came instead of what was due."""
    if isinstance(msg, Ready):
        return f"batch {msg.index}"
    return f"{type(msg).__name__}" if isinstance(msg, (Done, Failed, Work)) else f"{type(msg).__name__} {msg!r:.80}"


def send(conn, msg) -> None:
    """One message on a one-way pipe, pickled in the sending thread. Plain messages go
    through the standard pickler; one that carries a shared-memory storage (a fresh ring
    slot) through the multiprocessing pickler, which passes its file descriptor."""
    if isinstance(msg, Ready) and msg.fresh is not None:
        conn.send(msg)
    else:
        conn.send_bytes(pickle.dumps(msg, pickle.HIGHEST_PROTOCOL))
