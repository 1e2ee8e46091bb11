"""What a command prints on stdout: its report, as text or as one JSON object.

Every ``userwise`` command ends by calling :func:`emit` with its report (a dict). By default
the report is text for a person (the command's own rendering, else one ``key: value`` line
per entry); with ``userwise <command> --json`` (:data:`JSON`) it is one JSON object on one
line, for scripts. Progress and warnings go to stderr, never here, so stdout holds the
report alone (``--quiet``, ``runtime.progress.QUIET``, silences the progress; the report and
error lines stay).

The exit codes (``userwise --help`` lists them) are defined once, beside the errors that give
them: :data:`userwise.pipelines.errors.EXIT_CODES`.
"""

from __future__ import annotations

import json
import sys

JSON = False


def as_json(report) -> str:
    return json.dumps(report, sort_keys=True, default=str, separators=(",", ":"))


def as_text(report) -> str:
    """A report for a person: one ``key: value`` line per entry (nested values as JSON)."""
    if not isinstance(report, dict):
        return str(report)
    width = max((len(str(k)) for k in report), default=0)
    return "\n".join(f"{k:<{width}}  {v if isinstance(v, (str, int, float)) or v is None else as_json(v)}"
                     for k, v in report.items())


def emit(report, text=None, out=None) -> None:
    """Print the command's report: one JSON object with ``--json``, else ``text`` (a string or
    a function of the report), else :func:`as_text`."""
    out = out or sys.stdout
    if JSON:
        print(as_json(report), file=out, flush=True)
        return
    if callable(text):
        text = text(report)
    print(text if text is not None else as_text(report), file=out, flush=True)
