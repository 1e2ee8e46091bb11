"""The loader trainers use in place of torch's DataLoader.

Persistent worker processes (:mod:`~userwise.pipelines.loader.workers.pool`, started once, fed
one epoch plan per iteration) decode buffers in parallel and write each batch into a ring
of reused shared-memory buffers (:mod:`~userwise.pipelines.loader.workers.ring`). The main process
takes batches in the epoch's order (so resumption is exact with any number of workers),
copies them out of the ring into a pool of reused pinned buffers
(:mod:`~userwise.pipelines.loader.workers.pinned`) and on to the device on a side CUDA stream,
``prefetch`` batches ahead, so the copy overlaps compute. Without an accelerator the same
code yields host batches.
"""

from __future__ import annotations

import collections
import os
import time
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.multiprocessing as mp

from userwise.pipelines.errors import ArgumentError, WorkerError, expect
from userwise.pipelines.loader.assembly import segcopy
from userwise.pipelines.loader.assembly.batch import JaggedBatch, as_device, full_device
from userwise.pipelines.loader.dataset import UserwiseDataset
from userwise.pipelines.loader.logs import say_once
from userwise.pipelines.loader.workers.pinned import PinnedPool
from userwise.pipelines.loader.workers.pool import WorkerPool
from userwise.pipelines.loader.workers.ring import MAX_SLOTS, PIPE_BYTES, Done, Failed, Ready, Work, describe

# The most batches a worker may hold ready: its ring has worker_queue + 2 slots (one the consumer
# holds, one lent), and every slot number must fit in the pipe that hands them back (ring.MAX_SLOTS).
MAX_WORKER_QUEUE = MAX_SLOTS - 2


@dataclass
class LoaderStats:
    """A loader's counters since the last reset (``loader.stats``): batches, samples, events,
    impressions and bytes handed out, and the seconds the trainer waited for them;
    :meth:`summary` adds the elapsed time, the rates and the share of time spent waiting.

    Example::

        for batch in loader:
            ...
        s = loader.stats.summary()
        print(s["impressions_per_s"], s["wait_share"])   # wait_share near 1: the trainer starves
        loader.stats.reset()
    """

    batches: int = 0
    samples: int = 0
    events: int = 0
    impressions: int = 0
    bytes: int = 0
    wait_s: float = 0.0
    started: float = field(default_factory=time.perf_counter)

    def add(self, b: JaggedBatch, waited: float) -> None:
        """Count one batch handed out after ``waited`` seconds."""
        self.batches += 1
        self.samples += b.num_samples
        self.events += int(b.meta.get("events", 0))
        self.impressions += int(b.meta.get("impressions", 0))
        self.bytes += b.nbytes
        self.wait_s += waited

    def summary(self) -> dict:
        """The counters, ``elapsed_s``, the rates per second and ``wait_share``."""
        el = max(time.perf_counter() - self.started, 1e-9)
        return {
            "batches": self.batches, "samples": self.samples, "events": self.events, "impressions": self.impressions,
            "bytes": self.bytes, "elapsed_s": el, "samples_per_s": self.samples / el, "events_per_s": self.events / el,
            "impressions_per_s": self.impressions / el, "bytes_per_s": self.bytes / el,
            "wait_share": min(1.0, self.wait_s / el),
        }

    def reset(self) -> None:
        """Start counting again from now."""
        self.__init__()


class UserwiseLoader:
    """Iterate a :class:`UserwiseDataset` with worker processes, pinned memory and prefetch.

    Args (keyword-only after ``dataset``):
        num_workers (int): decoding processes (0: decode in the main process); at most the
            host's CPU count (``os.cpu_count()``).
        device (str | torch.device | None): where batches go, "cpu", "cuda" or "cuda:N" (a CUDA
            device that is there); default the dataset's (cuda if available, else cpu).
        prefetch (int): batches copied ahead on the side stream (CUDA; default 2).
        worker_queue (int): batches each worker may hold ready (default 4: fewer leave a worker
            of small batches waiting on the trainer's slot returns; each is one batch of shared
            memory); at most ``MAX_WORKER_QUEUE`` (510), so that handing slots back to a
            worker never blocks on its pipe.
        pin_memory (bool | None): default: when the device is CUDA.
        multiprocessing_context (str): default "fork".
        timeout (float): seconds to wait for one batch before failing (default 600).
        zero_copy (bool): with workers, hand each host batch out as a view of the worker's
            shared-memory slot instead of copying it (on CUDA hosts: copy it to the device
            straight from the slot, page-locked once with cudaHostRegister); the slot is
            reused once the batch and every view of it are gone (or its copy completed). A
            consumer that holds on to more than ``worker_queue`` batches of one worker
            gets copies from then on, so the workers never stall. Default True.

    State (``state_dict``/``load_state_dict``): a small JSON-able dict, ``{"epoch",
    "cursor", "seed", "samples", ...}`` with what it depends on (node, rank, world size,
    batch size or token budget, the shard set, the selection; :mod:`~userwise.pipelines.loader.planning.resume`).
    ``cursor`` is the number of batches of the epoch already handed out, so a reloaded
    loader continues at exactly the next batch. A state that does not fit is refused
    (:class:`~userwise.pipelines.loader.planning.resume.LoaderStateError`); a world size or batch
    cut changed mid-epoch is remapped by the samples consumed, from every rank's state.

    Example::

        ds = UserwiseDataset("/nvme/shards", batch_size=256, seed=1)
        loader = UserwiseLoader(ds, num_workers=4, device="cuda")
        for batch in loader:              # JaggedBatch on the device
            loss = model(batch); ...
        ckpt["loader"] = loader.state_dict()
    """

    def __init__(self, dataset: UserwiseDataset, *, num_workers: int = 0, device: str | torch.device | None = None,
                 prefetch: int = 2, worker_queue: int = 4, pin_memory: bool | None = None,
                 multiprocessing_context: str = "fork", timeout: float = 600.0, zero_copy: bool = True) -> None:
        self.dataset = dataset
        self.num_workers = expect(num_workers, "int>=0", "num_workers", fix="0 decodes in this process")
        cpus = os.cpu_count() or 1
        if self.num_workers > cpus:  # each worker is a process with its own buffers: never more than the cores
            raise ArgumentError(f"num_workers must be at most this host's {cpus} CPUs, got {num_workers}; "
                                "more workers than cores only compete for them (and for memory)")
        self.device = full_device(as_device(device, available=True) if device is not None
                                  else as_device(dataset.device, "the dataset's device", available=True))
        self.prefetch = expect(prefetch, "int>=1", "prefetch")
        self.worker_queue = expect(worker_queue, "int>=1", "worker_queue")
        if self.worker_queue > MAX_WORKER_QUEUE:
            raise ArgumentError(f"worker_queue must be at most {MAX_WORKER_QUEUE}, got {worker_queue}: a worker's "
                                "free slot numbers must fit in the pipe that hands them back, which holds "
                                f"{PIPE_BYTES} bytes without blocking (the default 4 is enough; see docs/loader.md)")
        if expect(timeout, "number", "timeout") <= 0:
            raise ArgumentError(f"timeout must be > 0 seconds, got {timeout!r}")
        expect(pin_memory, "bool", "pin_memory", nullable=True, fix="None pins when the device is CUDA")
        expect(zero_copy, "bool", "zero_copy")
        cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self.pin = cuda if pin_memory is None else bool(pin_memory and torch.cuda.is_available())
        try:
            self.ctx = mp.get_context(multiprocessing_context)
        except ValueError:
            raise ArgumentError(f"multiprocessing_context must be one of {mp.get_all_start_methods()}, "
                                f"got {multiprocessing_context!r:.80}") from None
        self.timeout = float(timeout)
        self.zero_copy = bool(zero_copy)
        if dataset.data_path == "gds" and self.num_workers:
            say_once("userwise loader: the GDS path reads in the main process; num_workers ignored")
            self.num_workers = 0
        self._epochs = dataset.epochs  # the epochs' plans, the cursor and resume: the dataset's
        self.stats = LoaderStats()
        self._pool = PinnedPool(self.prefetch + 2) if self.pin else None
        self._workers: WorkerPool | None = None
        self._last_pinned: list = []

    # -- state ---------------------------------------------------------------
    @property
    def epoch(self) -> int:
        """The epoch the next iteration yields (it moves on when an epoch runs out)."""
        return self._epochs.epoch

    @property
    def cursor(self) -> int:
        """Batches of the epoch already handed out: the next iteration starts there."""
        return self._epochs.cursor

    def state_dict(self) -> dict:
        """Where this rank is and what that depends on (docs/loader.md, Resuming)."""
        return self._epochs.state_dict()

    def load_state_dict(self, state) -> None:
        """Queue a state for the next iterator: this rank's ``state_dict()``, or the list of
        every rank's (as ``dist.all_gather_object`` collects them; needed to change the world
        size, batch size or token budget mid-epoch). Its fields are checked now (a few
        comparisons); the plan is checked when the epoch is planned, at the next iteration.
        Raises :class:`~userwise.pipelines.loader.planning.resume.LoaderStateError` for a state
        that does not fit this loader."""
        self._epochs.load_state_dict(state)

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its first batch at the next iteration."""
        self._epochs.set_epoch(epoch)

    def __len__(self) -> int:
        return self._epochs.plan().num_batches

    # -- iteration -------------------------------------------------------------
    def __iter__(self):
        ep = self._epochs
        plan, start = ep.begin()
        if start >= plan.num_batches:  # resumed at the very end of an epoch
            ep.finish()
            return
        host = self._host_batches(plan, start)
        dev = self._device_batches(host)
        try:
            while True:
                t0 = time.perf_counter()
                try:
                    b = next(dev)
                except StopIteration:
                    break
                self.stats.add(b, time.perf_counter() - t0)
                ep.handed(int(b.meta["index"]), b.num_samples)
                yield b
        finally:
            dev.close()
            host.close()
        ep.finish()

    def _alloc(self):
        if self.dataset.data_path == "gds":  # columns are already in device memory: assemble there
            return lambda n: torch.empty(n, dtype=torch.uint8, device=self.dataset.device)
        if self._pool is None:
            return None
        holder = self._last_pinned = []

        def alloc(n):
            buf = self._pool.acquire(n)
            holder.append(buf)
            return buf[:n]
        return alloc

    def _host_batches(self, plan, start):
        ds = self.dataset
        if self.num_workers == 0:
            for b in ds.batches(plan, start=start, alloc=self._alloc()):
                _count(b)
                yield b
            return
        k = self.num_workers
        owner = plan.batch_owner(k)
        if self._workers is None:  # started once, kept across epochs
            segcopy.implementation()  # compiled here once; forked workers inherit it
            # one more slot when batches are lent: the consumer usually holds the current one
            self._workers = WorkerPool(self.ctx, ds, k, self.worker_queue + 1 + int(self.zero_copy))
            self._workers.register = self.zero_copy and self._pool is not None  # CUDA hosts: page-lock slots
            self._finalizer = weakref.finalize(self, self._workers.close)
        pool = self._workers
        pool.busy = True
        for w in range(k):
            try:
                pool.cmd[w].send(Work(plan, start, k))
            except OSError:  # it exited between epochs: the wait for its first batch reports it
                pass
        self._epochs.plan_ahead(plan.epoch + 1)  # while the workers read their first buffers (the trainer waits anyway)
        alloc = self._alloc() or _host_alloc
        # batches are lent straight out of the ring, no copy: host batches, and on CUDA hosts
        # batches in slots page-locked with cudaHostRegister (copied to the device from there)
        lend = self.zero_copy
        roles, columns = ds.roles, [None] * k
        clean = False
        try:
            for j in range(start, plan.num_batches):
                w = int(owner[j])
                pool.reclaim(w)
                msg = self._get(pool, w)
                if isinstance(msg, Failed):  # the user's error as its own line, a bug as the worker's
                    raise WorkerError(msg.error if msg.user else f"loader worker {w} failed: {msg.error}", w,
                                      msg.error, msg.trace, msg.user)
                if not isinstance(msg, Ready) or msg.index != j:
                    raise WorkerError(f"loader worker {w} sent {describe(msg)} where batch {j} was due", w)
                slot, fresh, n, spec, meta = msg.slot, msg.fresh, msg.nbytes, msg.spec, msg.meta
                if "columns" in meta:
                    columns[w] = meta["columns"]
                else:
                    meta["columns"] = columns[w]
                meta["roles"] = roles
                if fresh is not None:
                    pool.put_slot(w, slot, fresh)
                if (lend and pool.lent[w] < pool.nslots - 1  # the worker always keeps one slot
                        and (self._pool is None or (w, slot) in pool.registered)):
                    dst = pool.lend(w, slot, n)
                else:
                    dst = alloc(n)
                    if n:  # numpy copy: no torch intra-op threads (see jagged.ranges)
                        np.copyto(dst.numpy(), pool.slots[w][slot][:n].numpy())
                    pool.give(w, slot)
                b = JaggedBatch(dst, spec, meta)
                _count(b)
                yield b
            for w in range(k):
                msg = self._get(pool, w)
                if not isinstance(msg, Done):
                    raise WorkerError(f"loader worker {w} sent {describe(msg)} after the last batch of the epoch", w)
            pool.busy = False
            clean = True
        finally:
            if not clean:  # stopped mid-epoch (or failed): workers hold stale work, start fresh ones next time
                self._stop_workers(graceful=False)

    def close(self) -> None:
        """Stop the worker processes (they are otherwise kept for the next epoch)."""
        self._stop_workers(graceful=True)

    def _stop_workers(self, graceful: bool) -> None:
        if self._workers is not None:
            self._finalizer.detach()
            self._workers.close(graceful)
            self._workers = None

    def _get(self, pool, w):
        """Worker w's next message; fails when the worker exits or stays silent past the timeout."""
        conn, proc, ready = pool.out[w], pool.procs[w], pool.ready[w]

        def exited():
            return WorkerError(f"loader worker {w} exited (code {proc.exitcode}) without sending its next batch", w)

        deadline = time.monotonic() + self.timeout
        while True:
            try:
                if ready.poll(1000):  # readable, or its writer closed
                    return conn.recv()
            except (EOFError, OSError) as e:  # its end of the pipe closed, or a slot it sent went with it
                proc.join(timeout=5)
                if proc.is_alive():
                    raise WorkerError(f"loader worker {w}: its pipe failed ({type(e).__name__}: {e}) while it "
                                      "still runs", w) from e
                raise exited() from None
            if not proc.is_alive():
                raise exited()
            if time.monotonic() > deadline:
                raise WorkerError(f"loader worker {w} sent nothing for {self.timeout:.0f}s", w)

    def _device_batches(self, host):
        if self.device.type != "cuda":  # host batches (a GDS dataset's come from its device)
            for b in host:
                yield b if b.device == self.device else b.to(self.device)
            return
        side = torch.cuda.Stream(device=self.device)
        inflight: collections.deque = collections.deque()
        lent: collections.deque = collections.deque()  # (host batch in a worker's slot, its copy's event)
        for b in host:
            while lent and lent[0][1].query():  # copied: the slot may go back to its worker
                lent.popleft()
            if b.device == self.device:  # GDS path: assembled on the device already
                yield b
                continue
            keep = False
            if self.pin:
                if self._last_pinned:  # assembled (or copied from a worker) straight into the pinned pool
                    pinned = self._last_pinned.pop()
                    src = b
                elif b.buffer.is_pinned():  # a worker's page-locked slot, lent: copied from where it is
                    pinned, src, keep = None, b, True
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
            if keep:
                lent.append((b, ev))
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


def _host_alloc(n: int) -> torch.Tensor:
    return torch.empty(n, dtype=torch.uint8)


def _count(b: JaggedBatch) -> None:
    """Per-batch totals for the counters (read on the host before any copy)."""
    if "events" in b.meta and "impressions" in b.meta:  # set by the assembler
        return
    b.meta["events"] = int(b["seq.offsets"][-1]) if "seq.offsets" in b and b.num_samples else 0
    b.meta["impressions"] = b.spec_numel("imp.req")
