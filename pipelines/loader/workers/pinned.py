"""Pinned host memory for the copies to the device: a pool of reused pinned buffers, and
page-locking a worker's shared-memory slots in place (cudaHostRegister) on CUDA hosts."""

from __future__ import annotations

import collections

import torch


def _pinned(n: int) -> torch.Tensor:
    return torch.empty(n, dtype=torch.uint8, pin_memory=True)


class PinnedPool:
    """Reused pinned host buffers; a buffer is reused only after its copy's event completed.

    At most ``max_buffers`` exist; a request larger than every free buffer replaces the
    smallest free one (buffers are sized 1.25x the request, so growth is rare)."""

    def __init__(self, max_buffers: int, alloc=_pinned):
        self.max_buffers = max_buffers
        self.alloc = alloc
        self.free: list[torch.Tensor] = []
        self.busy: collections.deque = collections.deque()
        self.count = 0

    def _take_free(self, i: int) -> torch.Tensor:
        return self.free.pop(i)  # by position: list.remove would compare tensors element-wise

    def acquire(self, n: int) -> torch.Tensor:
        while True:
            while self.busy and self.busy[0][1].query():
                self.free.append(self.busy.popleft()[0])
            fit = [i for i, b in enumerate(self.free) if b.numel() >= n]
            if fit:
                return self._take_free(min(fit, key=lambda i: self.free[i].numel()))
            if self.count < self.max_buffers:
                self.count += 1
                return self.alloc(max(n, 1) * 5 // 4 + 64)
            if self.free:  # grow the smallest free buffer
                self._take_free(min(range(len(self.free)), key=lambda i: self.free[i].numel()))
                self.count -= 1
                continue
            buf, ev = self.busy.popleft()
            ev.synchronize()
            self.free.append(buf)

    def release(self, buf: torch.Tensor, event) -> None:
        self.busy.append((buf, event))


def host_register(t: torch.Tensor) -> bool:
    """Page-lock a host tensor's memory in place (cudaHostRegister); False when refused."""
    try:
        rt = torch.cuda.cudart()
        return rt.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0) == rt.cudaError.success
    except Exception:  # noqa: BLE001 (no driver, old torch)
        return False


def host_unregister(ptr: int) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:  # noqa: BLE001 (interpreter shutdown)
        pass
