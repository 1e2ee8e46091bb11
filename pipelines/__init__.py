"""userwise.pipelines: the library behind the ``userwise`` command.

The data path, in order (each step is a subpackage; its ``__init__`` says more):

1. :mod:`~userwise.pipelines.builder` (Spark + Delta): point-wise impression logs
   become requests, the action stream (events), the user history and user-wise
   samples, with bad rows in quarantine. ``validate`` is its front door
   (no JVM), ``expand`` its way back to point-wise rows.
2. :mod:`~userwise.pipelines.shards`: samples become balanced per-node Parquet
   shard sets with a manifest (preshard, Spark); ``publish`` puts a set in
   place; ``stage`` pulls one node's shards onto local NVMe (no Spark).
3. :mod:`~userwise.pipelines.loader` (PyTorch, never pyspark): one node's staged
   shards stream into training as jagged batches in pinned memory.
4. :mod:`~userwise.pipelines.train` (PyTorch): the trainer's half of the pointer:
   leak-free masks, kernel layouts and a reference model over those batches.
5. :mod:`~userwise.pipelines.serve` (PyTorch, never pyspark): what training learned,
   served from a per-user K/V cache that equals a full recompute and is never stale.

Below the steps: :mod:`~userwise.pipelines.runtime` (storage, progress, the Spark
session, Delta's jars, Delta I/O, shipping the project to executors) and
:mod:`~userwise.pipelines.records` (the build folder's records: build.json, the
complete state, writer locks, published records). Above them:
:mod:`~userwise.pipelines.manage` (backfill, forget: both steps at once),
:mod:`~userwise.pipelines.tools` (synthetic logs and samples, local stores, the demo) and
:mod:`~userwise.pipelines.api` (``build``, ``expand``, ``preshard``, ``publish`` and ``stage`` as
keyword-only Python functions in the command line's words, which the commands call).
The modules every part shares: ``errors`` (every error a user can act on and the exit
codes, below every other module, ``schemas`` included), ``console`` (a command's report on
stdout, text or JSON), ``jagged`` (the jagged-array
helpers the loader, the trainer's side and serving share: offsets, ranges, positions, request
spans, packing arrays into one batch buffer), ``config`` (the column roles) and ``cli`` (the
``userwise`` command). ``tests/ops/test_layers.py``
holds the order in which they may import each other.

Nothing here imports pyspark at package import time.
"""


def __getattr__(name: str):
    """``__version__``: the installed distribution's (:func:`runtime.ship.version`)."""
    if name == "__version__":
        from userwise.pipelines.runtime.ship import version

        return version()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
