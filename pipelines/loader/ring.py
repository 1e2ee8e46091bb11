"""A worker's ring of reused shared-memory batch buffers, and the pipe messages around it.

A batch buffer's storage crosses from a worker to the trainer once (with the first batch
that used it, or when it had to grow); afterwards a batch is announced by its slot number
alone: no per-batch shared-memory create/unlink, no file-descriptor passing.
"""

from __future__ import annotations

import pickle
import struct

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
        k, fresh = self.k, self.fresh
        self.fresh = None
        return k, fresh


# a slot number on a free pipe
SLOT = struct.Struct("<i")


def send(conn, msg) -> None:
    """One message on a one-way pipe, pickled in the sending thread. Plain messages go
    through the standard pickler; one that carries a shared-memory storage (a fresh ring
    slot) through the multiprocessing pickler, which passes its file descriptor."""
    if msg[0] == "batch" and msg[3] is not None:
        conn.send(msg)
    else:
        conn.send_bytes(pickle.dumps(msg, pickle.HIGHEST_PROTOCOL))
