"""Errors a user can act on. The CLI prints them as one line, no stack trace."""

import re


class UserwiseError(Exception):
    """Base class: the message says what is wrong and how to fix it."""


class InputError(UserwiseError):
    """Input data that cannot be used (missing path, unreadable format...)."""


class QuarantineLimitError(UserwiseError):
    """Too large a share of the input was rejected."""


class ShardError(UserwiseError):
    """A shard set that is incomplete, corrupt or of another format."""


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
