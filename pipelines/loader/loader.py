"""The loader trainers use in place of torch's DataLoader.

Persistent worker processes (started once, fed one epoch plan per iteration)
decode buffers in parallel and write each batch into a ring of reused
shared-memory buffers (a buffer's handle crosses once; a batch is announced
by its slot). The main process takes batches in the epoch's order (so
resumption is exact with any number of workers), copies them out of the ring
into a pool of reused pinned buffers and on to the device on a side CUDA
stream, ``prefetch`` batches ahead, so the copy overlaps compute. Without an
accelerator the same code yields host batches.
"""

from __future__ import annotations

import collections
import ctypes
import multiprocessing
import multiprocessing.util
import os
import pickle
import select
import shutil
import signal
import struct
import sys
import tempfile
import threading
import time
import traceback
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.multiprocessing as mp

from userwise.pipelines.errors import UserwiseError
from userwise.pipelines.loader import segcopy
from userwise.pipelines.loader.batch import JaggedBatch, full_device
from userwise.pipelines.loader.dataset import UserwiseDataset, say_once


def shm_alloc(n: int) -> torch.Tensor:
    """A uint8 tensor of n bytes in shared memory (sent between processes as one handle)."""
    return torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(max(1, n)))[:n]


class _Ring:
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
        k = self.k = _SLOT.unpack(self.free.recv_bytes())[0]
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
_SLOT = struct.Struct("<i")


def _send(conn, msg) -> None:
    """One message on a one-way pipe, pickled in the sending thread. Plain messages go
    through the standard pickler; one that carries a shared-memory storage (a fresh ring
    slot) through the multiprocessing pickler, which passes its file descriptor."""
    if msg[0] == "batch" and msg[3] is not None:
        conn.send(msg)
    else:
        conn.send_bytes(pickle.dumps(msg, pickle.HIGHEST_PROTOCOL))


# How often a worker checks that its trainer is still there, where the kernel does not tell it
# (see _Lifeline), and how long it then has to exit cleanly before it exits regardless.
WATCH_S = 0.5
EXIT_GRACE_S = 3.0


class _Lifeline:
    """How a worker process ends with its trainer, however the trainer ends.

    - SIGTERM (the trainer stopping it mid-epoch, or the kernel when the trainer dies,
      by Linux's PR_SET_PDEATHSIG) raises SystemExit, so the worker leaves through
      multiprocessing's normal exit: its finalizers run and remove its temporary files,
      and its shared memory (ring slots: file descriptors of segments unlinked when they
      were made) goes with the process.
    - A watchdog thread compares the parent pid every ``WATCH_S`` seconds, for where the
      kernel does not signal: not Linux, workers started from a trainer thread (the
      kernel's signal follows the thread, so it is only asked for from the main thread),
      a forkserver's children. When the parent is gone it sends the worker SIGTERM, and
      ``EXIT_GRACE_S`` later, should the worker be stuck in native code, removes the
      folder and exits at once.
    - SIGINT is ignored: Ctrl-C reaches the whole process group, and the trainer, not its
      workers, decides what an interrupt stops.
    - A forked worker first closes the trainer's ends of its own and earlier workers'
      pipes it inherited, so that when the trainer goes its pipes are at EOF rather than
      held open by a worker itself.
    - Its multiprocessing temporary folder (it holds the listener socket through which a
      ring slot's file descriptor is passed) is the pool's folder, shared by its workers
      (a socket's path must stay under about 100 bytes, so no deeper), which the trainer
      removes when it stops them, even one it had to kill; a worker whose trainer died
      removes it when it is the last one out.
    """

    def __init__(self, parent: int | None, tmp: str, inherited: list, pdeath: bool):
        self.parent, self.tmp, self.inherited, self.pdeath = parent, tmp, inherited, pdeath

    def __getstate__(self):  # spawn, forkserver: nothing is inherited
        return {**self.__dict__, "inherited": []}

    def attach(self) -> None:
        """Set up the calling worker process (first thing in it)."""
        for c in self.inherited:
            c.close()
        self.inherited = []
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
        os.makedirs(self.tmp, exist_ok=True)  # (a worker that exited first may have removed it)
        multiprocessing.current_process()._config["tempdir"] = self.tmp  # where get_temp_dir() puts its files
        multiprocessing.util.Finalize(None, self.clean, exitpriority=-100)  # after its sockets are closed
        ppid = os.getppid()
        if self.pdeath:
            _die_with_parent(signal.SIGTERM)
        if self.parent is not None and os.getppid() != self.parent:  # the trainer went before the watch began
            raise SystemExit(0)
        threading.Thread(target=self._watch, args=(ppid,), name="userwise-lifeline", daemon=True).start()

    def clean(self) -> None:
        try:
            os.rmdir(self.tmp)  # the last worker out, when the trainer is not there to do it
        except OSError:
            pass

    def _watch(self, ppid: int) -> None:
        while os.getppid() == ppid:
            time.sleep(WATCH_S)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(EXIT_GRACE_S)
        shutil.rmtree(self.tmp, ignore_errors=True)
        os._exit(1)


def _exit_on_sigterm(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one exit: a second signal does not cut its cleanup short
    raise SystemExit(128 + signum)


def _die_with_parent(sig: int) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent thread exits (Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(1, int(sig), 0, 0, 0) == 0  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # pragma: no cover
        return False


def _worker_main(ds: UserwiseDataset, worker: int, cmd, out, free, nslots: int, read_threads: bool = False,
                 life: _Lifeline | None = None) -> None:
    """A persistent worker: waits for an epoch's plan, sends its batches, waits for the next.

    ``cmd``, ``out`` and ``free`` are one-way pipes with one reader and one writer each:
    messages are pickled and written by the thread that sends them (no feeder thread to
    hand the GIL to between batches, no lock). ``life``: how it ends with its trainer."""
    if life is not None:
        life.attach()
    torch.set_num_threads(1)
    keep_heap()
    # Arrow's decode threads only where cores are left over (fewer workers than cores):
    # otherwise the workers' thread pools would just compete with each other
    ds.read_threads = read_threads
    ring = _Ring(nslots, free)
    while True:
        try:
            msg = cmd.recv()
        except EOFError:  # the trainer is gone
            return
        if msg is None:
            return
        plan, start, k = msg
        ds._plans = {plan.epoch: plan}  # the trainer's plan (computed once there; no collective here)
        last_columns = None
        try:
            for b in ds.batches(worker, k, start, alloc=ring.alloc, epoch=plan.epoch):
                slot, fresh = ring.sent()
                meta = dict(b.meta)
                meta.pop("roles", None)  # the trainer has them; send the column table only when it changes
                if meta.get("columns") == last_columns:
                    meta.pop("columns")
                else:
                    last_columns = meta["columns"]
                _send(out, ("batch", b.meta["index"], slot, fresh, b.nbytes, b.spec, meta))
            _send(out, ("done", worker))
        except SystemExit:  # stopped (SIGTERM): exit, cleaning up on the way
            raise
        except BaseException as e:  # noqa: BLE001 (everything else goes back to the trainer)
            try:
                _send(out, ("error", f"{type(e).__name__}: {e}", traceback.format_exc(), isinstance(e, UserwiseError)))
            except OSError:  # the trainer closed the pipe (it stopped the workers)
                return


class _Pool:
    """Persistent worker processes (started once, fed one epoch plan per iteration)."""

    def __init__(self, ctx, ds, k: int, nslots: int):
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
        threads = k < _cores()
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
            # forked worker closes the trainer's ends it inherited (_Lifeline.attach)
            cmd_r, cmd_w = ctx.Pipe(duplex=False)
            out_r, out_w = ctx.Pipe(duplex=False)
            free_r, free_w = ctx.Pipe(duplex=False)
            inherited = [cmd_w, out_r, free_w, *self.cmd, *self.out, *self.free] if method == "fork" else []
            life = _Lifeline(parent, self.tmp, inherited, pdeath)
            p = ctx.Process(target=_worker_main, args=(ds, w, cmd_r, out_w, free_r, nslots, threads, life), daemon=True)
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
            self.free[w].send_bytes(_SLOT.pack(slot))
        except OSError:
            pass

    def put_slot(self, w: int, slot: int, storage: torch.Tensor) -> None:
        """Worker w's (new) storage for a slot. With ``register`` (CUDA hosts) it is page-locked
        once with cudaHostRegister, so batches in it go to the device without first being
        copied into the pinned pool; a storage it replaces is unregistered first (its slot
        came back, so no copy from it is in flight)."""
        old = self.registered.pop((w, slot), None)
        if old is not None:
            _host_unregister(old)
        self.slots[w][slot] = storage
        if self.register:
            if _host_register(storage):
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
        they exit cleanly, _Lifeline) when they may be blocked mid-epoch on a full ring
        (their pending batches are discarded), killed should that not end them; then
        remove the pool's temporary folder."""
        graceful = graceful and not self.busy
        if self.registered:  # no copy from a registered slot may still run when it is unregistered
            try:
                torch.cuda.synchronize()
            except Exception:  # noqa: BLE001 (interpreter shutdown)
                pass
            for ptr in self.registered.values():
                _host_unregister(ptr)
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


class UserwiseLoader:
    """Iterate a :class:`UserwiseDataset` with worker processes, pinned memory and prefetch.

    Args (keyword-only after ``dataset``):
        num_workers (int): decoding processes (0: decode in the main process).
        device (str | torch.device | None): where batches go (default cuda if available, else cpu).
        prefetch (int): batches copied ahead on the side stream (CUDA; default 2).
        worker_queue (int): batches each worker may hold ready (default 4: fewer leave a worker
            of small batches waiting on the trainer's slot returns; each is one batch of shared
            memory).
        pin_memory (bool | None): default: when the device is CUDA.
        multiprocessing_context (str): default "fork".
        timeout (float): seconds to wait for one batch before failing (default 600).
        zero_copy (bool): with workers, hand each host batch out as a view of the worker's
            shared-memory slot instead of copying it (on CUDA hosts: copy it to the device
            straight from the slot, page-locked once with cudaHostRegister); the slot is
            reused once the batch and every view of it are gone (or its copy completed). A
            consumer that holds on to more than ``worker_queue`` batches of one worker
            gets copies from then on, so the workers never stall. Default True.

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

    def __init__(self, dataset: UserwiseDataset, *, num_workers=0, device=None, prefetch=2, worker_queue=4,
                 pin_memory=None, multiprocessing_context="fork", timeout=600.0, zero_copy=True):
        self.dataset = dataset
        self.num_workers = int(num_workers)
        self.device = full_device(torch.device(device) if device is not None else dataset.device)
        self.prefetch = max(1, int(prefetch))
        self.worker_queue = max(1, int(worker_queue))
        cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self.pin = cuda if pin_memory is None else bool(pin_memory and torch.cuda.is_available())
        self.ctx = mp.get_context(multiprocessing_context)
        self.timeout = float(timeout)
        self.zero_copy = bool(zero_copy)
        if dataset.data_path == "gds" and self.num_workers:
            say_once("userwise loader: the GDS path reads in the main process; num_workers ignored")
            self.num_workers = 0
        self.epoch = dataset.epoch
        self.cursor = 0
        self.stats = LoaderStats()
        self._pool = PinnedPool(self.prefetch + 2) if self.pin else None
        self._workers: _Pool | None = None
        self._last_pinned: list = []

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
            return lambda n: torch.empty(n, dtype=torch.uint8, device=self.dataset.device)
        if self._pool is None:
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
        if self._workers is None:  # started once, kept across epochs
            segcopy.implementation()  # compiled here once; forked workers inherit it
            # one more slot when batches are lent: the consumer usually holds the current one
            self._workers = _Pool(self.ctx, ds, k, self.worker_queue + 1 + int(self.zero_copy))
            self._workers.register = self.zero_copy and self._pool is not None  # CUDA hosts: page-lock slots
            self._finalizer = weakref.finalize(self, self._workers.close)
        pool = self._workers
        pool.busy = True
        for w in range(k):
            try:
                pool.cmd[w].send((plan, start, k))
            except OSError:  # it exited between epochs: the wait for its first batch reports it
                pass
        ds.plan_ahead(epoch + 1)  # while the workers read their first buffers (the trainer waits anyway)
        alloc = self._alloc() or _host_alloc
        # batches are lent straight out of the ring, no copy: host batches, and on CUDA hosts
        # batches in slots page-locked with cudaHostRegister (copied to the device from there)
        lend = self.zero_copy
        roles, columns = ds.shards.roles, [None] * k
        clean = False
        try:
            for j in range(start, plan.num_batches):
                w = int(owner[j])
                pool.reclaim(w)
                msg = self._get(pool, w)
                if msg[0] == "error":
                    if msg[3]:
                        raise UserwiseError(msg[1])
                    raise RuntimeError(f"loader worker {w} failed:\n{msg[2]}")
                if msg[0] != "batch" or msg[1] != j:
                    raise RuntimeError(f"loader worker {w} sent {msg[:2]} where batch {j} was due")
                _, _, slot, fresh, n, spec, meta = msg
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
                    if n:  # numpy copy: no torch intra-op threads (see batch.ranges)
                        np.copyto(dst.numpy(), pool.slots[w][slot][:n].numpy())
                    pool.give(w, slot)
                b = JaggedBatch(dst, spec, meta)
                _count(b)
                yield b
            for w in range(k):
                msg = self._get(pool, w)
                if msg[0] != "done":
                    raise RuntimeError(f"loader worker {w} sent {msg[:2]} after the last batch of the epoch")
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
            return RuntimeError(f"loader worker {w} exited (code {proc.exitcode}) without sending its next batch")

        deadline = time.monotonic() + self.timeout
        while True:
            try:
                if ready.poll(1000):  # readable, or its writer closed
                    return conn.recv()
            except (EOFError, OSError):  # its end of the pipe closed, or a slot it sent went with it
                proc.join(timeout=5)
                if proc.is_alive():
                    raise
                raise exited() from None
            if not proc.is_alive():
                raise exited()
            if time.monotonic() > deadline:
                raise RuntimeError(f"loader worker {w} sent nothing for {self.timeout:.0f}s")

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


def _host_register(t: torch.Tensor) -> bool:
    """Page-lock a host tensor's memory in place (cudaHostRegister); False when refused."""
    try:
        rt = torch.cuda.cudart()
        return rt.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0) == rt.cudaError.success
    except Exception:  # noqa: BLE001 (no driver, old torch)
        return False


def _host_unregister(ptr: int) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:  # noqa: BLE001 (interpreter shutdown)
        pass


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


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover (not Linux)
        return os.cpu_count() or 1


def _host_alloc(n: int) -> torch.Tensor:
    return torch.empty(n, dtype=torch.uint8)


def _count(b: JaggedBatch) -> None:
    """Per-batch totals for the counters (read on the host before any copy)."""
    if "events" in b.meta and "impressions" in b.meta:  # set by the assembler
        return
    b.meta["events"] = int(b["seq.offsets"][-1]) if "seq.offsets" in b and b.num_samples else 0
    b.meta["impressions"] = b.spec_numel("imp.req")
