"""Stream one node's staged user-wise shards into PyTorch training.

Public names::

    from userwise.pipelines.loader import UserwiseDataset, UserwiseLoader, JaggedBatch, expand_batch, LoaderStateError

- :class:`UserwiseDataset`: iterable dataset over one node's shards (rank /
  worker split, equal batch counts per rank, seeded shuffle, holdout).
- :class:`UserwiseLoader`: use in place of torch's DataLoader (workers,
  pinned pool, side-stream prefetch, ``state_dict`` / ``load_state_dict``,
  ``stats``).
- :class:`JaggedBatch`: one batch in one buffer (``to``, ``pin_memory``,
  ``record_stream``, ``to_kjt``).
- :func:`expand_batch`: a batch back to point-wise rows (pyarrow.Table).
- :class:`LoaderStateError`: a saved loader state that does not fit this loader (a
  ``UserwiseError`` and a ``ValueError``, as every error a loader argument can cause:
  :class:`~userwise.pipelines.errors.ArgumentError`).

Modules, from the shard files to the trainer:

- ``shards``: one node's staged shards: manifest, verification, row-group metadata.
- ``plan``: the epoch plan, a pure seeded function of row-group sizes (rank split, equal
  batch counts, shuffle, batch cuts).
- ``distributed``: the local rank and world size, and the one all-reduce by which the ranks
  of several nodes agree on an epoch's batch counts.
- ``epochs``: :class:`~userwise.pipelines.loader.epochs.Epochs`, the one owner of a rank's epoch
  plans (the current one and one made ahead), the cursor and resume (``dataset.epochs``).
- ``dataset``: :class:`UserwiseDataset`: checks its arguments and turns each buffer of a plan
  into its batches.
- ``reading``: Parquet row groups read as Arrow tables (files kept open per process and
  thread, pages CRC-checked, the read-ahead lanes).
- ``gpudirect``: which data path a dataset reads by (GDS side files straight to the device, or
  Parquet), and the side files' reads.
- ``decode``: shard bytes (Parquet or GDS side files) to flat columns.
- ``jagged``: the small jagged-array helpers the loader and the trainer's side share (ranges,
  offsets from lengths, positions in segments, request spans, packing at the batch alignment).
- ``buffer_layout``: where every array of a batch sits in its one buffer, once per schema.
- ``stacked``: a host buffer's columns stacked per group and shuffled once.
- ``program``: the compiled assembler's two kernel calls per batch.
- ``segcopy`` and ``kernels``: the segmented copy (numba, or numpy without it).
- ``assemble``: the host assembler; ``assemble_torch``: the device assembler (GDS path).
- ``batch``: :class:`JaggedBatch` and :func:`expand_batch`.
- ``ring``: a worker's ring of reused shared-memory batch buffers, and the messages on its pipes
  (``Work``, ``Ready``, ``Done``, ``Failed``).
- ``lifeline``: how a worker process ends with its trainer, however the trainer ends.
- ``workers``: the persistent worker processes and their pool.
- ``pinned``: the pool of pinned host buffers, and page-locking workers' slots (CUDA).
- ``loader``: :class:`UserwiseLoader` (workers, pinned copies, side-stream prefetch; its state is
  its dataset's ``epochs``).
- ``resume``: the loader's state: what it records, what a loaded state must match, and the
  exact remap of a mid-epoch change of world size or batch cut by the samples consumed.
- ``diagnose``: ``userwise diagnose``, the three-step bottleneck test.
- ``logs``: the ``userwise.loader`` logger and its once-per-process notices.

Never imports pyspark.
"""

from userwise.pipelines.loader.batch import JaggedBatch, expand_batch
from userwise.pipelines.loader.dataset import UserwiseDataset
from userwise.pipelines.loader.loader import UserwiseLoader
from userwise.pipelines.loader.resume import LoaderStateError

__all__ = ["UserwiseDataset", "UserwiseLoader", "JaggedBatch", "expand_batch", "LoaderStateError"]
