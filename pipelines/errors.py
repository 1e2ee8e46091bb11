"""Errors a user can act on. The CLI prints them as one line, no stack trace."""

import math
import re


class UserwiseError(Exception):
    """Base class: the message says what is wrong and how to fix it."""


class InputError(UserwiseError):
    """Input data that cannot be used (missing path, unreadable format...)."""


class QuarantineLimitError(UserwiseError):
    """Too large a share of the input was rejected."""


class ShardError(UserwiseError):
    """A shard set that is incomplete, corrupt or of another format."""


class ArgumentError(UserwiseError, ValueError):
    """An argument of a library call that is ill-typed or out of range (also a ``ValueError``,
    so ``except ValueError`` keeps catching it)."""


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

    2: a failure the user can fix (bad input, config, path, disk, a concurrent writer);
    3: a Spark job failed (Spark's or Py4J's own error; its log's path is named);
    1: an internal error (the traceback is shown with ``userwise --debug``).
    The codes are :mod:`userwise.pipelines.console`'s.
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
    if isinstance(exc, UserwiseError):  # one line, even where it quotes a library's message
        return 2, " ".join(str(exc).split())
    if isinstance(exc, OSError) and exc.errno in _OS_HINTS:
        target = exc.filename or ""
        return 2, f"{_OS_HINTS[exc.errno]}" + (f": {target}" if target else "")
    name = type(exc).__name__
    mod = type(exc).__module__ or ""
    if mod.startswith(("pyspark", "py4j")):
        msg = _spark_message(exc)
        return 3, f"Spark failed: {msg}{where}; rerun with `userwise --debug ...` for the full trace"
    first = (str(exc).strip().splitlines() or [""])[0][:300]
    return 1, (f"internal error ({name}: {first}){where}; rerun with `userwise --debug ...` for the "
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
