"""The loader trainers use in place of torch's DataLoader.

Worker processes decode buffers in parallel and hand each batch over as one
shared-memory buffer (one file descriptor, no per-array pickling). The main
process takes batches in the epoch's order (so resumption is exact with any
number of workers), copies them into a pool of reused pinned buffers and on
to the device on a side CUDA stream, ``prefetch`` batches ahead, so the copy
overlaps compute. Without an accelerator the same code yields host batches.
"""

from __future__ import annotations

import collections
import queue as queue_mod
import time
import traceback
from dataclasses import dataclass, field

import torch
import torch.multiprocessing as mp

from ..errors import UserwiseError
from .batch import JaggedBatch
from .dataset import UserwiseDataset, say_once


def shm_alloc(n: int) -> torch.Tensor:
    """A uint8 tensor of n bytes in shared memory (sent between processes as one handle)."""
    return torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(max(1, n)))[:n]


def _worker_main(ds: UserwiseDataset, worker: int, num_workers: int, start: int, epoch: int, q, stop) -> None:
    torch.set_num_threads(1)
    try:
        for b in ds.batches(worker, num_workers, start, alloc=shm_alloc, epoch=epoch):
            q.put(("batch", b.meta["index"], b.buffer, b.spec, b.meta))
        q.put(("done", worker))
    except BaseException as e:  # noqa: BLE001 (everything goes back to the trainer)
        q.put(("error", f"{type(e).__name__}: {e}", traceback.format_exc(), isinstance(e, UserwiseError)))
    # stay alive until the main process has taken every shared buffer (fd passing needs the sender)
    stop.wait()


@dataclass
class LoaderStats:
    """Counters since the last reset: rates and the share of time the consumer waited on data."""

    batches: int = 0
    samples: int = 0
    events: int = 0
    impressions: int = 0
    bytes: int = 0
    wait_s: float = 0.0
    started: float = field(default_factory=time.perf_counter)

    def add(self, b: JaggedBatch, waited: float) -> None:
        self.batches += 1
        self.samples += b.num_samples
        self.events += int(b.meta.get("events", 0))
        self.impressions += int(b.meta.get("impressions", 0))
        self.bytes += b.nbytes
        self.wait_s += waited

    def summary(self) -> dict:
        el = max(time.perf_counter() - self.started, 1e-9)
        return {
            "batches": self.batches, "samples": self.samples, "events": self.events, "impressions": self.impressions,
            "bytes": self.bytes, "elapsed_s": el, "samples_per_s": self.samples / el, "events_per_s": self.events / el,
            "impressions_per_s": self.impressions / el, "bytes_per_s": self.bytes / el,
            "wait_share": min(1.0, self.wait_s / el),
        }

    def reset(self) -> None:
        self.__init__()


class PinnedPool:
    """Reused pinned host buffers; a buffer is reused only after its copy's event completed."""

    def __init__(self, max_buffers: int):
        self.max_buffers = max_buffers
        self.free: list[torch.Tensor] = []
        self.busy: collections.deque = collections.deque()
        self.count = 0

    def acquire(self, n: int) -> torch.Tensor:
        while True:
            while self.busy and self.busy[0][1].query():
                self.free.append(self.busy.popleft()[0])
            fit = [b for b in self.free if b.numel() >= n]
            if fit:
                b = min(fit, key=lambda t: t.numel())
                self.free.remove(b)
                return b
            if self.count < self.max_buffers:
                self.count += 1
                return torch.empty(max(n, 1) * 5 // 4 + 64, dtype=torch.uint8, pin_memory=True)
            if self.free:  # grow the smallest free buffer
                self.free.remove(min(self.free, key=lambda t: t.numel()))
                self.count -= 1
                continue
            buf, ev = self.busy.popleft()
            ev.synchronize()
            self.free.append(buf)

    def release(self, buf: torch.Tensor, event) -> None:
        self.busy.append((buf, event))


class UserwiseLoader:
    """Iterate a :class:`UserwiseDataset` with worker processes, pinned memory and prefetch.

    Args (keyword-only after ``dataset``):
        num_workers (int): decoding processes (0: decode in the main process).
        device (str | torch.device | None): where batches go (default cuda if available, else cpu).
        prefetch (int): batches copied ahead on the side stream (CUDA; default 2).
        worker_queue (int): batches each worker may hold ready (default 2).
        pin_memory (bool | None): default: when the device is CUDA.
        multiprocessing_context (str): default "fork".
        timeout (float): seconds to wait for one batch before failing (default 600).

    State (``state_dict``/``load_state_dict``): ``{"epoch", "cursor", "seed"}``;
    ``cursor`` is the number of batches of the epoch already handed out, so a
    reloaded loader continues at exactly the next batch.

    Example::

        ds = UserwiseDataset("/nvme/shards", batch_size=256, seed=1)
        loader = UserwiseLoader(ds, num_workers=4, device="cuda")
        for batch in loader:              # JaggedBatch on the device
            loss = model(batch); ...
        ckpt["loader"] = loader.state_dict()
    """

    def __init__(self, dataset: UserwiseDataset, *, num_workers=0, device=None, prefetch=2, worker_queue=2,
                 pin_memory=None, multiprocessing_context="fork", timeout=600.0):
        self.dataset = dataset
        self.num_workers = int(num_workers)
        self.device = torch.device(device) if device is not None else dataset.device
        self.prefetch = max(1, int(prefetch))
        self.worker_queue = max(1, int(worker_queue))
        cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self.pin = cuda if pin_memory is None else bool(pin_memory and torch.cuda.is_available())
        self.ctx = mp.get_context(multiprocessing_context)
        self.timeout = float(timeout)
        if dataset.data_path == "gds" and self.num_workers:
            say_once("userwise loader: the GDS path reads in the main process; num_workers ignored")
            self.num_workers = 0
        self.epoch = dataset.epoch
        self.cursor = 0
        self.stats = LoaderStats()
        self._pool = PinnedPool(self.prefetch + 2) if self.pin else None

    # -- state ---------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.dataset.seed}

    def load_state_dict(self, state: dict) -> None:
        """Queue the state for the next iterator (epoch and batch cursor)."""
        if "seed" in state and int(state["seed"]) != self.dataset.seed:
            raise ValueError(f"state was saved with seed {state['seed']}, this dataset has seed {self.dataset.seed}")
        self.epoch = int(state.get("epoch", 0))
        self.cursor = int(state.get("cursor", 0))

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.cursor = int(epoch), 0

    def __len__(self) -> int:
        return self.dataset.plan(self.epoch).num_batches

    # -- iteration -------------------------------------------------------------
    def __iter__(self):
        epoch, start = self.epoch, self.cursor
        self.dataset.set_epoch(epoch)
        plan = self.dataset.plan(epoch)
        if start >= plan.num_batches:  # resumed at the very end of an epoch
            self.epoch, self.cursor = epoch + 1, 0
            return
        host = self._host_batches(plan, epoch, start)
        dev = self._device_batches(host)
        try:
            while True:
                t0 = time.perf_counter()
                try:
                    b = next(dev)
                except StopIteration:
                    break
                self.stats.add(b, time.perf_counter() - t0)
                self.cursor = int(b.meta["index"]) + 1
                yield b
        finally:
            dev.close()
            host.close()
        self.epoch, self.cursor = epoch + 1, 0

    def _alloc(self):
        if self.dataset.data_path == "gds":  # columns are already in device memory: assemble there
            return lambda n: torch.empty(n, dtype=torch.uint8, device=self.device)
        if self._pool is None or self.num_workers:
            return None
        holder = self._last_pinned = []

        def alloc(n):
            buf = self._pool.acquire(n)
            holder.append(buf)
            return buf[:n]
        return alloc

    def _host_batches(self, plan, epoch, start):
        ds = self.dataset
        if self.num_workers == 0:
            for b in ds.batches(0, 1, start, alloc=self._alloc(), epoch=epoch):
                _count(b)
                yield b
            return
        k = self.num_workers
        owner = plan.batch_owner(k)
        queues = [self.ctx.Queue(maxsize=self.worker_queue) for _ in range(k)]
        stop = self.ctx.Event()
        procs = [self.ctx.Process(target=_worker_main, args=(ds, w, k, start, epoch, queues[w], stop), daemon=True)
                 for w in range(k)]
        for p in procs:
            p.start()
        try:
            for j in range(start, plan.num_batches):
                w = int(owner[j])
                msg = self._get(queues[w], procs[w], w)
                if msg[0] == "error":
                    if msg[3]:
                        raise UserwiseError(msg[1])
                    raise RuntimeError(f"loader worker {w} failed:\n{msg[2]}")
                if msg[0] != "batch" or msg[1] != j:
                    raise RuntimeError(f"loader worker {w} sent {msg[:2]} where batch {j} was due")
                b = JaggedBatch(msg[2], msg[3], msg[4])
                _count(b)
                yield b
        finally:
            stop.set()
            for p in procs:
                p.join(timeout=2)
            for p in procs:
                if p.is_alive():
                    p.terminate()
                    p.join(timeout=10)
            for q in queues:
                q.close()
                q.cancel_join_thread()

    def _get(self, q, proc, w):
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                return q.get(timeout=1.0)
            except queue_mod.Empty:
                if not proc.is_alive():
                    raise RuntimeError(f"loader worker {w} exited (code {proc.exitcode}) without sending its next batch")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"loader worker {w} sent nothing for {self.timeout:.0f}s")

    def _device_batches(self, host):
        if self.device.type != "cuda":
            yield from host
            return
        side = torch.cuda.Stream(device=self.device)
        inflight: collections.deque = collections.deque()
        for b in host:
            if b.device == self.device:  # GDS path: assembled on the device already
                yield b
                continue
            if self.pin:
                if self.num_workers == 0 and self._last_pinned:
                    pinned = self._last_pinned.pop()
                    src = b
                else:
                    pinned = self._pool.acquire(b.nbytes)
                    pinned[: b.nbytes].copy_(b.buffer)
                    src = JaggedBatch(pinned[: b.nbytes], b.spec, b.meta)
            else:
                pinned, src = None, b
            with torch.cuda.stream(side):
                d = src.to(self.device, non_blocking=self.pin)
                ev = torch.cuda.Event()
                ev.record(side)
            if pinned is not None:
                self._pool.release(pinned, ev)
            inflight.append((d, ev))
            if len(inflight) > self.prefetch:
                yield self._ready(*inflight.popleft())
        while inflight:
            yield self._ready(*inflight.popleft())

    @staticmethod
    def _ready(d: JaggedBatch, ev) -> JaggedBatch:
        cur = torch.cuda.current_stream(d.device)
        cur.wait_event(ev)
        d.record_stream(cur)
        return d


def _count(b: JaggedBatch) -> None:
    """Per-batch totals for the counters (read on the host before any copy)."""
    b.meta["events"] = int(b["seq.offsets"][-1]) if "seq.offsets" in b and b.num_samples else 0
    b.meta["impressions"] = b.spec_numel("imp.req")
