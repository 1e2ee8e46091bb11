"""userwise.pipelines: the library behind the ``userwise`` command.

The data path, in order (each step is a subpackage; its ``__init__`` says more):

1. :mod:`~userwise.pipelines.builder` (Spark + Delta): point-wise impression logs
   become requests, the action stream (events), the user history and user-wise
   samples, with bad rows in quarantine. ``validate`` is its front door
   (no JVM), ``expand`` its way back to point-wise rows.
2. :mod:`~userwise.pipelines.shards`: samples become balanced per-node Parquet
   shard sets with a manifest (preshard, Spark); ``publish`` moves a set into
   place; ``stage`` pulls one node's shards onto local NVMe (no Spark).
3. :mod:`~userwise.pipelines.loader` (PyTorch, never pyspark): one node's staged
   shards stream into training as jagged batches in pinned memory.

Beside the path: :mod:`~userwise.pipelines.runtime` (the Spark session, Delta's
jars, Delta I/O, shipping the project to executors), :mod:`~userwise.pipelines.tools`
(synthetic logs, the demo), and the modules every part shares: ``config`` (the
column roles), ``errors`` (errors a user can act on) and ``cli`` (``userwise``).

Nothing here imports pyspark at package import time.
"""

__version__ = "0.1.0"
