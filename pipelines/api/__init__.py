"""The Spark side as Python functions: what ``userwise build|expand|preshard|publish|stage`` run,
with the command line's words as keyword-only, typed arguments (``build_dir``, ``shards``,
``staged``, ``as_of``, ``incremental_days``, ``window_days``, ...), each returning the report
the command prints (``--json``). The commands are thin adapters over these functions.

Public names::

    from userwise.pipelines.api import build, expand, preshard, publish, stage

Modules:

- ``commands``: the five functions. Importing them starts nothing: ``build``, ``expand`` and
  ``preshard`` import pyspark and start (or reuse) a Spark session when called; ``publish`` and
  ``stage`` never import pyspark.
- ``handlers``: the commands' handlers: each passes its flags to its function and prints the
  report.

A user's fault raises :class:`~userwise.pipelines.errors.UserwiseError` (one line naming the fix),
as the command prints it.
"""

from userwise.pipelines.api.commands import build, expand, preshard, publish, stage

__all__ = ["build", "expand", "preshard", "publish", "stage"]
