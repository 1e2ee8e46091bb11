"""The loader's persistent worker processes: started once, fed one epoch plan per iteration.

Each worker decodes its buffers and writes each batch into its ring of shared-memory slots
(:mod:`~userwise.pipelines.loader.workers.ring`); the trainer takes the batches in the epoch's
order, lends them out without a copy or copies them into pinned memory, and gives the
slots back. How a worker ends with its trainer is :mod:`~userwise.pipelines.loader.workers.lifeline`.
"""

from __future__ import annotations

import collections
import ctypes
import os
import select
import shutil
import tempfile
import threading
import traceback
import weakref

import torch

from userwise.pipelines.errors import ArgumentError, UserwiseError
from userwise.pipelines.loader.logs import say_once
from userwise.pipelines.loader.workers.lifeline import Lifeline
from userwise.pipelines.loader.workers.pinned import host_register, host_unregister
from userwise.pipelines.loader.workers.ring import MAX_SLOTS, SLOT, Done, Failed, Ready, Ring, Work, send


def worker_main(ds, worker: int, cmd, out, free, nslots: int, read_threads: bool = False,
                 life: Lifeline | None = None) -> None:
    """A persistent worker: waits for an epoch's plan, sends its batches, waits for the next.
    ``ds``: the :class:`~userwise.pipelines.loader.UserwiseDataset` (its ``batches``).

    ``cmd`` brings :class:`~userwise.pipelines.loader.workers.ring.Work` (None: exit), ``out`` takes
    :class:`~userwise.pipelines.loader.workers.ring.Ready` per batch, then ``Done`` (or ``Failed``),
    ``free`` brings slot numbers back. All are one-way pipes with one reader and one writer each:
    messages are pickled and written by the thread that sends them (no feeder thread to
    hand the GIL to between batches, no lock). ``life``: how it ends with its trainer."""
    if life is not None:
        life.attach()
    torch.set_num_threads(1)
    keep_heap()
    # Arrow's decode threads only where cores are left over (fewer workers than cores):
    # otherwise the workers' thread pools would just compete with each other
    ds.set_read_threads(read_threads)
    ring = Ring(nslots, free)
    while True:
        try:
            work: Work | None = cmd.recv()
        except EOFError:  # the trainer is gone
            return
        if work is None:
            return
        last_columns = None
        try:
            # the trainer's plan (made once there; no collective here)
            for b in ds.batches(work.plan, worker=worker, num_workers=work.num_workers, start=work.start,
                                alloc=ring.alloc):
                slot, fresh = ring.sent()
                meta = dict(b.meta)
                meta.pop("roles", None)  # the trainer has them; send the column table only when it changes
                if meta.get("columns") == last_columns:
                    meta.pop("columns")
                else:
                    last_columns = meta["columns"]
                send(out, Ready(b.meta["index"], slot, fresh, b.nbytes, b.spec, meta))
            send(out, Done(worker))
        except SystemExit:  # stopped (SIGTERM): exit, cleaning up on the way
            raise
        except BaseException as e:  # noqa: BLE001 (everything else goes back to the trainer)
            try:
                send(out, Failed(f"{type(e).__name__}: {e}", traceback.format_exc(), isinstance(e, UserwiseError)))
            except OSError:  # the trainer closed the pipe (it stopped the workers)
                return


class WorkerPool:
    """Persistent worker processes (started once, fed one epoch plan per iteration)."""

    def __init__(self, ctx, ds, k: int, nslots: int):
        if not 1 <= nslots <= MAX_SLOTS:  # else handing a slot back could block on a full pipe (ring.MAX_SLOTS)
            raise ArgumentError(f"a worker's ring holds 1..{MAX_SLOTS} slots, not {nslots}")
        self.k, self.nslots = k, nslots
        self.cmd, self.out, self.free, self.ready = [], [], [], []
        self.slots: list[list[torch.Tensor | None]] = [[None] * nslots for _ in range(k)]
        # batches lent to the consumer without a copy: how many per worker, and the slots
        # their finalizers gave back (a deque append is safe from any thread or GC pass;
        # the trainer writes them to the worker's free pipe before it waits on that worker)
        self.lent = [0] * k
        self.returned = [collections.deque() for _ in range(k)]
        self.register = False  # page-lock slots as they arrive (set by the loader on CUDA hosts)
        self.registered: dict[tuple[int, int], int] = {}
        threads = k < cores()
        self.procs = []
        self.busy = False  # an epoch's plans went out and not every worker said done
        method = ctx.get_start_method()
        self.tmp = tempfile.mkdtemp(prefix="userwise-")
        parent = None if method == "forkserver" else os.getpid()
        pdeath = parent is not None and threading.current_thread() is threading.main_thread()
        try:
            self._start(ctx, ds, k, nslots, threads, method, parent, pdeath)
        except BaseException:
            self.close(graceful=False)
            raise

    def _start(self, ctx, ds, k, nslots, threads, method, parent, pdeath) -> None:
        for w in range(k):
            # three one-way pipes per worker: epoch plans in, batch announcements out, free slot
            # numbers in. Each worker's pipes are made just before it starts and the trainer
            # closes the worker's ends right after, so no other worker inherits them: a worker
            # that exits closes its ends for good (the trainer sees EOF, not a silent pipe). A
            # forked worker closes the trainer's ends it inherited (Lifeline.attach)
            cmd_r, cmd_w = ctx.Pipe(duplex=False)
            out_r, out_w = ctx.Pipe(duplex=False)
            free_r, free_w = ctx.Pipe(duplex=False)
            inherited = [cmd_w, out_r, free_w, *self.cmd, *self.out, *self.free] if method == "fork" else []
            life = Lifeline(parent, self.tmp, inherited, pdeath)
            p = ctx.Process(target=worker_main, args=(ds, w, cmd_r, out_w, free_r, nslots, threads, life), daemon=True)
            p.start()
            for c in (cmd_r, out_w, free_r):
                c.close()
            self.procs.append(p)
            self.cmd.append(cmd_w)
            self.out.append(out_r)
            self.free.append(free_w)
            for slot in range(nslots):
                self.give(w, slot)
            ready = select.poll()  # one poll object per announcement pipe (cheaper per batch than Connection.poll)
            ready.register(out_r.fileno(), select.POLLIN)
            self.ready.append(ready)

    def give(self, w: int, slot: int) -> None:
        """Hand a slot number back to worker w. A worker that has exited closed its end
        (BrokenPipeError here): the trainer's next wait on it reports the exit."""
        try:
            self.free[w].send_bytes(SLOT.pack(slot))
        except OSError:
            pass

    def put_slot(self, w: int, slot: int, storage: torch.Tensor) -> None:
        """Worker w's (new) storage for a slot. With ``register`` (CUDA hosts) it is page-locked
        once with cudaHostRegister, so batches in it go to the device without first being
        copied into the pinned pool; a storage it replaces is unregistered first (its slot
        came back, so no copy from it is in flight)."""
        old = self.registered.pop((w, slot), None)
        if old is not None:
            host_unregister(old)
        self.slots[w][slot] = storage
        if self.register:
            if host_register(storage):
                self.registered[(w, slot)] = storage.data_ptr()
            else:
                self.register = False
                say_once("userwise loader: cudaHostRegister refused the workers' shared memory; "
                         "worker batches are copied into pinned buffers instead")

    def reclaim(self, w: int) -> None:
        """Give worker w back the slots of lent batches the consumer has dropped."""
        r = self.returned[w]
        while r:
            self.give(w, r.popleft())
            self.lent[w] -= 1

    def lend(self, w: int, slot: int, n: int) -> torch.Tensor:
        """The batch in worker w's slot as a tensor of its own, without a copy; the slot
        goes back to the worker once every view of it is gone."""
        v = self.slots[w][slot][:n].numpy()  # a fresh ndarray object, kept alive by the tensor's storage
        weakref.finalize(v, self.returned[w].append, slot).atexit = False
        self.lent[w] += 1
        return torch.from_numpy(v)

    def close(self, graceful: bool = True) -> None:
        """Stop the workers: asked to exit when idle (between epochs), terminated (SIGTERM:
        they exit cleanly, Lifeline) when they may be blocked mid-epoch on a full ring
        (their pending batches are discarded), killed should that not end them; then
        remove the pool's temporary folder."""
        graceful = graceful and not self.busy
        if self.registered:  # no copy from a registered slot may still run when it is unregistered
            try:
                torch.cuda.synchronize()
            except Exception:  # noqa: BLE001 (interpreter shutdown)
                pass
            for ptr in self.registered.values():
                host_unregister(ptr)
            self.registered.clear()
        if not graceful:
            for p in self.procs:
                if p.is_alive():
                    p.terminate()
        for c, p in zip(self.cmd, self.procs):
            if graceful and p.is_alive():
                try:
                    c.send(None)
                except (OSError, ValueError):
                    pass
        for p in self.procs:
            p.join(timeout=2)
        for stop in ("terminate", "kill"):
            for p in self.procs:
                if p.is_alive():
                    getattr(p, stop)()
                    p.join(timeout=5)
        for conn in self.cmd + self.out + self.free:
            conn.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def keep_heap() -> bool:
    """Let glibc keep freed memory for reuse in this process instead of returning it.

    By default glibc serves blocks above its mmap threshold with fresh mappings and unmaps
    them on free, so every decoded buffer (megabytes per column) is faulted in page by page
    again, and a heap top above the trim threshold is handed back to the OS. Worker
    processes decode the same sizes over and over: raising both thresholds keeps that
    memory in the heap (less CPU per epoch of long samples, docs/loader.md). Called
    only in the loader's own worker processes; the trainer's process is left as it is.
    Returns False where it does not apply (no glibc)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        return bool(libc.mallopt(m_mmap_threshold, 1 << 30)) and bool(libc.mallopt(m_trim_threshold, 1 << 30))
    except (OSError, AttributeError):  # pragma: no cover (musl, macOS)
        return False


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover (not Linux)
        return os.cpu_count() or 1
