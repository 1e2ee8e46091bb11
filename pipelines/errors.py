"""Every error a user can act on, and the exit codes. The CLI prints an error as one line, no stack trace.

Every error class of the product is defined here, once, under :class:`UserwiseError`, with a
builtin base where callers catch one (an :class:`ArgumentError` is also a ``ValueError``, a
:class:`StorageError` an ``OSError``...); the modules that raise them import them from here.
This module imports nothing of the product's: it is the floor every other layer, ``schemas``
included, stands on (``tests/ops/test_layers.py``; ``tests/ops/test_errors.py`` checks that no
other module defines an error class).
"""

import math
import re

# Exit codes: the one definition, used by console (the report), cli (main, usage errors) and
# :func:`one_line`. ``userwise --help`` lists them (:data:`EXIT_CODES`).
EXIT_OK = 0
"""The command did what it was asked."""
EXIT_INTERNAL = 1
"""An internal error (a bug): ``userwise --debug`` shows its traceback."""
EXIT_USER = 2
"""A failure the user can fix: usage, input, config, paths, disk, a concurrent writer (the
``error:`` line says what to do)."""
EXIT_SPARK = 3
"""A Spark job failed (its log's path is on the ``error:`` line)."""
EXIT_INTERRUPTED = 130
"""Interrupted (Ctrl-C, ``128 + SIGINT``): run the same command again, finished work is kept."""
EXIT_CODES = {EXIT_OK: "done", EXIT_INTERNAL: "internal error (rerun with `userwise --debug ...`)",
              EXIT_USER: "a failure you can fix: usage, input, config, paths, disk, a concurrent writer",
              EXIT_SPARK: "a Spark job failed (its log's path is on the error line)"}
"""The exit codes ``userwise --help`` lists, with what each means (:data:`EXIT_INTERRUPTED` is
the shell's own convention and is not listed)."""


class UserwiseError(Exception):
    """Base class: the message says what is wrong and how to fix it.

    Example::

        try:
            userwise_call()
        except UserwiseError as e:          # every error of the product
            print(f"error: {e}")
    """


class ArgumentError(UserwiseError, ValueError):
    """An argument of a library call that is ill-typed or out of range (also a ``ValueError``,
    so ``except ValueError`` keeps catching it).

    Example::

        raise ArgumentError(f"batch_size={batch_size}: use an integer >= 1")
    """


class ConfigError(UserwiseError, ValueError):
    """A config that cannot work; the message says where and how to fix it (also a ``ValueError``).

    Example::

        raise ConfigError("columns.user", "missing; name the input's user id column")
    """

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"config error at {key}: {message}")

    def __reduce__(self):
        return type(self), (self.key, str(self).removeprefix(f"config error at {self.key}: "))


class SchemaError(UserwiseError, ValueError):
    """A table or file does not have the schema this product expects (also a ``ValueError``).

    Example::

        try:
            check_version(manifest.get("format_version"), path)
        except SchemaError as e:            # also a ValueError
            print(e)
    """


class InputError(UserwiseError):
    """Input data that cannot be used (missing path, unreadable format...)."""


class FileSystemUnavailable(InputError):
    """pyarrow cannot open the input's file system (e.g. s3a://, hdfs:// without libhdfs):
    the build then reads it through Spark's own (Hadoop) file systems."""


class QuarantineLimitError(UserwiseError):
    """Too large a share of the input was rejected."""


class ShardError(UserwiseError):
    """A shard set that is incomplete, corrupt or of another format."""


class StoreGone(ShardError):
    """The source store stopped answering while a node's shards were staged."""


class StorageError(UserwiseError, OSError):
    """A location that no filesystem here can open (also an ``OSError``)."""


class JarsError(UserwiseError, RuntimeError):
    """A set of jars (Delta's, a local store's) that cannot be fetched (also a ``RuntimeError``)."""


class IncompleteError(UserwiseError):
    """The build folder holds no complete state to read."""


class LockedError(UserwiseError):
    """Another job holds the build folder's lock."""


class LoaderStateError(UserwiseError, ValueError):
    """A loader state that does not fit this loader (another seed, shard set, selection...):
    its message names the field and the fix.

    Example::

        try:
            loader.load_state_dict(ckpt["loader"])
        except LoaderStateError as e:      # also a ValueError
            print(f"cannot resume: {e}")
    """


class WorkerError(UserwiseError, RuntimeError):
    """A loader worker process failed (also a ``RuntimeError``): ``worker`` is its index,
    ``error`` its ``error:`` line (``Type: message``, or what went wrong with the process: it
    exited, it fell silent, it sent something out of turn), ``trace`` its traceback ("" when it
    sent none) and ``user`` whether the worker's own error was a :class:`UserwiseError` (then
    the message is that error's line alone, the user's to act on). The traceback rides as a
    note: shown with the Python traceback (``userwise --debug``), not on the one error line.

    Example::

        try:
            for batch in loader:
                step(batch)
        except WorkerError as e:            # also a RuntimeError
            print(f"worker {e.worker}: {e.error}")
    """

    def __init__(self, message: str, worker: int | None = None, error: str = "", trace: str = "",
                 user: bool = False):
        super().__init__(message)
        self.worker, self.error, self.trace, self.user = worker, error or message, trace, user
        if trace:
            self.add_note(f"loader worker {worker}'s traceback:\n{trace.rstrip()}")

    def __reduce__(self):
        return type(self), (str(self), self.worker, self.error, self.trace, self.user)


class StoreError(UserwiseError):
    """A local test store (``tools.hdfs_store``'s MiniDFSCluster, ``tools.s3_store``'s S3
    server) cannot start: no Java, no jars, moto missing, the process exits or never answers."""


# Bounds of what a user sizes or counts: one definition each, shared by the command line's flag types
# (pipelines/cli.py) and the library calls that take the same values.
MAX_MB = float(1 << 20)
"""The most MiB any size in MiB may be (1 TiB): a shard, a row group, a copy range, a cache tier."""
MAX_DAYS = 36_500
"""The most days any day count may be (100 years): a date on the command line lies in
:data:`DATE_RANGE`, so adding or taking this many days from it stays a representable date."""
DATE_RANGE = ("1000-01-01", "9899-12-31")
"""The dates (UTC days) a command takes: four-digit years, at least :data:`MAX_DAYS` from either end of
what Python can represent."""


def _mb(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and 0 < x <= MAX_MB


_KINDS = {
    "int": ("an integer", lambda x: isinstance(x, int) and not isinstance(x, bool)),
    "int>=0": ("an integer >= 0", lambda x: isinstance(x, int) and not isinstance(x, bool) and x >= 0),
    "int>=1": ("an integer >= 1", lambda x: isinstance(x, int) and not isinstance(x, bool) and x >= 1),
    "number": ("a number", lambda x: isinstance(x, (int, float)) and not isinstance(x, bool) and x == x),
    "mb": (f"a finite number of MiB above 0 and at most {MAX_MB:.0f}", _mb),
    "str": ("a string", lambda x: isinstance(x, str)),
    "bool": ("true or false", lambda x: isinstance(x, bool)),
    "list": ("a list", lambda x: isinstance(x, list)),
    "dict": ("a mapping", lambda x: isinstance(x, dict)),
}


def short(value, n: int = 80) -> str:
    """``repr(value)``, cut to ``n`` characters."""
    r = repr(value)
    return r if len(r) <= n else r[: n - 3] + "..."


def expect(value, kind: str, what: str, *, nullable: bool = False, error: type = ArgumentError, fix: str = ""):
    """``value`` when it is of ``kind`` (``int``, ``int>=0``, ``int>=1``, ``number``, ``mb``, ``str``,
    ``bool``, ``list``, ``dict``; an integer numpy scalar counts as an int), else ``error``
    naming ``what``. The one type check of arguments, manifests and loader states.

    Example::

        batch_size = expect(batch_size, "int>=1", "batch_size")   # 2.5 -> ArgumentError
    """
    if value is None and nullable:
        return value
    if hasattr(value, "dtype") and getattr(value, "shape", None) == () and kind.startswith("int"):
        try:
            import numpy as np

            if np.issubdtype(value.dtype, np.integer):
                value = int(value)
        except ImportError:
            pass
    desc, ok = _KINDS[kind]
    if not ok(value):
        raise error(f"{what} must be {desc}{' or None' if nullable else ''}, got {short(value)}"
                    + (f"; {fix}" if fix else ""))
    return value


_OS_HINTS = {
    28: "the disk is full: free space there (or pick another destination) and run the command again; "
        "finished work is kept",
    13: "permission denied: check the folder's owner and mode",
    30: "the file system is read-only: choose a writable folder",
    2: "no such file or folder: check the path",
    20: "a path component is a file, not a folder: check the path",
    21: "a folder where a file was expected: check the path",
    122: "the disk quota is exceeded: free space and run the command again",
}


def one_line(exc: BaseException, log_path: str | None = None) -> tuple[int, str]:
    """The exit code and the one ``error:`` line the CLI prints for ``exc``.

    :data:`EXIT_USER`: a failure the user can fix (bad input, config, path, disk, a concurrent writer:
    a :class:`UserwiseError`, or an ``OSError`` the user can act on);
    :data:`EXIT_SPARK`: a Spark job failed (Spark's or Py4J's own error; its log's path is named);
    :data:`EXIT_INTERNAL`: an internal error, a :class:`WorkerError` from a worker's bug or death
    included (the traceback is shown with ``userwise --debug``).
    """
    code, line = _one_line(exc, log_path)
    return code, _cut(line)


# An error line is read by a person: a message that quotes a huge value (a config's expanded
# alias, a long list) is cut to this many characters.
MAX_LINE = 600


def _cut(line: str, n: int = MAX_LINE) -> str:
    """``line`` cut in the middle to about ``n`` characters: its start says what, its end the fix."""
    if len(line) <= n:
        return line
    head, tail = (n * 2) // 3, n // 4
    return f"{line[:head]} [... {len(line) - head - tail} characters cut ...] {line[-tail:]}"


def _one_line(exc: BaseException, log_path: str | None) -> tuple[int, str]:
    where = f" (Spark's log: {log_path})" if log_path else ""
    if isinstance(exc, WorkerError) and not exc.user:  # a worker's bug or death, not the user's error
        return EXIT_INTERNAL, (f"internal error ({' '.join(str(exc).split())}){where}; rerun with `userwise --debug ...` for the worker's "
                               "traceback and report it")
    if isinstance(exc, UserwiseError):  # one line, even where it quotes a library's message
        return EXIT_USER, " ".join(str(exc).split())
    if isinstance(exc, OSError) and exc.errno in _OS_HINTS:
        target = exc.filename or ""
        return EXIT_USER, f"{_OS_HINTS[exc.errno]}" + (f": {target}" if target else "")
    name = type(exc).__name__
    mod = type(exc).__module__ or ""
    if mod.startswith(("pyspark", "py4j")):
        msg = _spark_message(exc)
        return EXIT_SPARK, f"Spark failed: {msg}{where}; rerun with `userwise --debug ...` for the full trace"
    first = (str(exc).strip().splitlines() or [""])[0][:300]
    return EXIT_INTERNAL, (f"internal error ({name}: {first}){where}; rerun with `userwise --debug ...` for the "
                           "traceback and report it")


def _spark_message(exc: BaseException) -> str:
    """The first meaningful line of a Spark/Py4J error: its condition and message, no Java trace."""
    text = str(exc)
    java = getattr(exc, "java_exception", None)
    if java is not None:
        try:
            text = java.getMessage() or text
        except Exception:  # the JVM may be gone
            pass
    first = None
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("at ", "JVM stacktrace", "Traceback", "An error occurred")):
            first = line.removesuffix("Traceback (most recent call last):").strip()
            break
    # a Python worker's exception (an executor's missing module, say): its traceback's last line says what
    raised = [ln for ln in text.splitlines() if _RAISED.match(ln)] if "Traceback (most recent call last)" in text else []
    if first and raised:
        return f"{first.rstrip(':')}: {raised[-1].strip()}"[:400]
    return first[:400] if first else type(exc).__name__


_RAISED = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Warning)(: |$)")
