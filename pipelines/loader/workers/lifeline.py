"""How a loader worker process ends with its trainer, however the trainer ends
(SIGTERM, the kernel's parent-death signal, a watchdog on the parent pid)."""

from __future__ import annotations

import ctypes
import multiprocessing
import multiprocessing.util
import os
import shutil
import signal
import sys
import threading
import time

# How often a worker checks that its trainer is still there, where the kernel does not tell it
# (see Lifeline), and how long it then has to exit cleanly before it exits regardless.
WATCH_S = 0.5
EXIT_GRACE_S = 3.0


class Lifeline:
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
