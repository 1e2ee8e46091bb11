"""A job's own progress on stderr: one line per step, and a bar while Spark works on a long one.

Each step of a build (``ingest``, ``quarantine``, ``requests``, ``events``, ``samples``,
``history``, ``report``) runs inside :func:`step`, which times it and, when it ends, prints
one line with the rows it produced and its seconds::

    [userwise] requests          1,234,567 rows     12.3 s

The rows are counts the job already has: a number it computed (``step.rows = n``), or
a counter's, such as the rows of the Delta commits the step added to its tables
(``delta_io.commits``: ``numOutputRows`` in each commit's metrics, read from the table's
log): never an extra Spark job. This module imports nothing of the product (the Spark
session and Delta I/O import it), so it sits at the bottom of ``runtime``. While a step runs
longer than :data:`BAR_AFTER_S` seconds and stderr is a terminal, a daemon thread polls
Spark's status tracker and redraws one line with the active stages' finished and total
tasks, at most every :data:`BAR_EVERY_S` seconds.

``userwise <command> --quiet`` (:data:`QUIET`) turns the lines and the bar off; the
report on stdout and error lines stay.
"""

from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager

QUIET = False
BAR_AFTER_S = 2.0
BAR_EVERY_S = 0.5
_WIDTH = 24

_stack: list[str] = []  # the names of the steps running, innermost last
_lock = threading.Lock()


def say(msg: str, prefix: str = "[userwise] ") -> None:
    """One line on stderr (nothing with ``--quiet``)."""
    if QUIET:
        return
    with _lock:
        _clear(sys.stderr)
        print(f"{prefix}{msg}", file=sys.stderr, flush=True)


def line(name: str, rows: int | None, seconds: float) -> str:
    """A step's line (without the ``[userwise]`` prefix)."""
    count = f"{rows:>15,} rows" if rows is not None else " " * 20
    return f"{name:<12}{count} {seconds:>8.1f} s"


class Step:
    """A running step: set ``rows`` to the count it produced (else its counter's, if any)."""

    def __init__(self, name: str, counter=None):
        self.name = name
        self.counter = counter
        self.rows: int | None = None


@contextmanager
def step(name: str, counter=None, started: float | None = None):
    """Time the block as step ``name``; print its line when it ends without an error.

    ``counter``: made before the block, an object whose ``rows()`` counts what the step
    produced unless the block sets ``step.rows`` (``delta_io.commits(path, ...)``: the rows of
    the Delta commits the step adds to its tables). ``started``: the step's start
    (``time.monotonic()``) where its work began before the block (building the plan)."""
    s = Step(name, counter)
    t0 = time.monotonic() if started is None else started
    bar = None
    with _lock:
        _stack.append(name)
        outermost = len(_stack) == 1
    if outermost and not QUIET and isatty(sys.stderr):
        bar = _Bar(t0)
        bar.start()
    try:
        yield s
    finally:
        if bar is not None:
            bar.stop()
        with _lock:
            _stack.pop()
    rows = s.rows if s.rows is not None else (counter.rows() if counter is not None else None)
    say(line(name, rows, time.monotonic() - t0))


# ---------------------------------------------------------------------------
# The bar
# ---------------------------------------------------------------------------
def isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


_drawn = False  # whether the terminal's current line holds the bar


def _clear(stream) -> None:
    global _drawn
    if _drawn:
        stream.write("\r\x1b[K")
        stream.flush()
        _drawn = False


def spark_tasks() -> tuple[int, int, int] | None:
    """(finished tasks, tasks, stages) of the active Spark stages; None without a SparkContext."""
    mod = sys.modules.get("pyspark")
    sc = getattr(getattr(mod, "SparkContext", None), "_active_spark_context", None)
    if sc is None:
        return None
    tracker = sc.statusTracker()
    done = total = stages = 0
    for sid in tracker.getActiveStageIds():
        info = tracker.getStageInfo(sid)
        if info is not None:
            done += info.numCompletedTasks
            total += info.numTasks
            stages += 1
    return done, total, stages


def render(name: str, seconds: float, done: int, total: int, stages: int) -> str:
    filled = int(_WIDTH * done / total) if total else 0
    return (f"[userwise] {name:<12}[{'#' * filled}{'.' * (_WIDTH - filled)}] {done}/{total} tasks"
            f" ({stages} stage{'s' if stages != 1 else ''}) {seconds:>6.0f} s")


class _Bar(threading.Thread):
    """Redraws one line on stderr from Spark's status tracker until stopped."""

    def __init__(self, t0: float, stream=None, poll=None):
        super().__init__(name="userwise-progress", daemon=True)
        self.t0, self.stream, self.poll = t0, stream or sys.stderr, poll or spark_tasks
        self._stop_event = threading.Event()

    def run(self) -> None:
        global _drawn
        last = None
        while not self._stop_event.wait(BAR_EVERY_S):
            now = time.monotonic() - self.t0
            if now < BAR_AFTER_S:
                continue
            try:
                got = self.poll()
            except Exception:  # noqa: BLE001 - the JVM going away ends the bar, never the job
                return
            if not got or not got[1]:
                continue
            with _lock:
                if not _stack or self._stop_event.is_set():
                    return
                text = render(_stack[-1], now, *got)
                if text != last:
                    self.stream.write("\r" + text + "\x1b[K")
                    self.stream.flush()
                    _drawn, last = True, text

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=5)
        with _lock:
            if _drawn:
                _clear(self.stream)
