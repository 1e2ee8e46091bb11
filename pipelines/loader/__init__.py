"""Stream one node's staged user-wise shards into PyTorch training.

Public names::

    from userwise.pipelines.loader import (UserwiseDataset, UserwiseLoader, LoaderStats, JaggedBatch,
                                           expand_batch, IdRouting, RoutedIds, LoaderStateError, WorkerError)

- :class:`UserwiseDataset`: iterable dataset over one node's shards (rank /
  worker split, equal batch counts per rank, seeded shuffle, holdout).
- :class:`UserwiseLoader`: use in place of torch's DataLoader (workers,
  pinned pool, side-stream prefetch, ``state_dict`` / ``load_state_dict``,
  ``stats``).
- :class:`LoaderStats`: a loader's counters (``loader.stats``: batches, samples, events,
  impressions, bytes, the share of time the trainer waited) and their rates.
- :class:`JaggedBatch`: one batch in one buffer (``to``, ``pin_memory``,
  ``record_stream``, ``to_kjt``).
- :func:`expand_batch`: a batch back to point-wise rows (pyarrow.Table).
- :class:`IdRouting`: the dataset's ``ids=``: which id keys the workers deduplicate and route
  over how many ranks, with which hot ids; :class:`RoutedIds`: one key's result in
  ``batch.meta["ids"]``.
- :class:`LoaderStateError`: a saved loader state that does not fit this loader (a
  ``UserwiseError`` and a ``ValueError``, as every error a loader argument can cause:
  :class:`~userwise.pipelines.errors.ArgumentError`).
- :class:`WorkerError`: a worker process failed; it carries the worker's ``error:`` line
  (a ``RuntimeError`` too). Both errors are defined in :mod:`userwise.pipelines.errors`.

Subpackages and modules, from the shard files to the trainer (a subpackage imports only those
listed before it and ``logs``; ``tests/ops/test_layers.py`` checks it):

- ``logs``: the ``userwise.loader`` logger and its once-per-process notices.
- ``io``: one node's staged shards (manifest, verification, row-group metadata), Parquet and
  GDS reads, decoding to flat columns.
- ``planning``: the epoch plan (a pure seeded function of row-group sizes: rank split, equal
  batch counts, shuffle, batch cuts), the cross-node agreement, the loader's state and
  :class:`~userwise.pipelines.loader.planning.epochs.Epochs`, the one owner of a rank's plans,
  cursor and resume (``dataset.epochs``).
- ``assembly``: :class:`JaggedBatch` and :func:`expand_batch`, the buffer layout, the host
  (compiled or numpy) and device assemblers.
- ``workers``: the persistent worker processes, their rings of shared-memory slots and the
  messages on their pipes, how they end with the trainer, pinned memory.
- ``dataset``: :class:`UserwiseDataset`: checks its arguments and turns each buffer of a plan
  into its batches.
- ``loader``: :class:`UserwiseLoader` (workers, pinned copies, side-stream prefetch; its state is
  its dataset's ``epochs``).
- ``diagnose``: ``userwise diagnose``, the three-step bottleneck test.

The jagged-array helpers the loader, the trainer's side and serving share live below every
part, in :mod:`userwise.pipelines.jagged`.

Never imports pyspark.
"""

from userwise.pipelines.errors import LoaderStateError, WorkerError
from userwise.pipelines.loader.assembly.batch import JaggedBatch, expand_batch
from userwise.pipelines.loader.assembly.ids import IdRouting, RoutedIds
from userwise.pipelines.loader.dataset import UserwiseDataset
from userwise.pipelines.loader.loader import LoaderStats, UserwiseLoader

__all__ = ["UserwiseDataset", "UserwiseLoader", "LoaderStats", "JaggedBatch", "expand_batch", "IdRouting", "RoutedIds",
           "LoaderStateError", "WorkerError"]
