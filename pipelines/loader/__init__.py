"""Stream one node's staged user-wise shards into PyTorch training.

Public names::

    from userwise.pipelines.loader import UserwiseDataset, UserwiseLoader, JaggedBatch, expand_batch

- :class:`UserwiseDataset`: iterable dataset over one node's shards (rank /
  worker split, equal batch counts per rank, seeded shuffle, holdout).
- :class:`UserwiseLoader`: use in place of torch's DataLoader (workers,
  pinned pool, side-stream prefetch, ``state_dict`` / ``load_state_dict``,
  ``stats``).
- :class:`JaggedBatch`: one batch in one buffer (``to``, ``pin_memory``,
  ``record_stream``, ``to_kjt``).
- :func:`expand_batch`: a batch back to point-wise rows (pyarrow.Table).

Modules, from the shard files to the trainer:

- ``shards``: one node's staged shards: manifest, verification, row-group metadata.
- ``plan``: the epoch plan, a pure seeded function of row-group sizes (rank split, equal
  batch counts, shuffle, batch cuts).
- ``dataset``: :class:`UserwiseDataset`: plans, reads and assembles one rank's batches.
- ``decode``: shard bytes (Parquet or GDS side files) to flat columns.
- ``layout``: where every array of a batch sits in its buffer, once per schema.
- ``stacked``: a host buffer's columns stacked per group and shuffled once.
- ``program``: the compiled assembler's two kernel calls per batch.
- ``segcopy`` and ``kernels``: the segmented copy (numba, or numpy without it).
- ``assemble``: the host assembler; ``assemble_torch``: the device assembler (GDS path).
- ``batch``: :class:`JaggedBatch` and :func:`expand_batch`.
- ``ring``: a worker's ring of reused shared-memory batch buffers.
- ``lifeline``: how a worker process ends with its trainer, however the trainer ends.
- ``workers``: the persistent worker processes and their pool.
- ``pinned``: the pool of pinned host buffers, and page-locking workers' slots (CUDA).
- ``loader``: :class:`UserwiseLoader` (workers, pinned copies, side-stream prefetch, state).
- ``resume``: the loader's state: what it records, what a loaded state must match, and the
  exact remap of a mid-epoch change of world size or batch cut by the samples consumed.
- ``diagnose``: ``userwise diagnose``, the three-step bottleneck test.

Never imports pyspark.
"""

from userwise.pipelines.loader.batch import JaggedBatch, expand_batch
from userwise.pipelines.loader.dataset import UserwiseDataset
from userwise.pipelines.loader.loader import LoaderStats, UserwiseLoader
from userwise.pipelines.loader.shards import open_node

__all__ = ["UserwiseDataset", "UserwiseLoader", "JaggedBatch", "expand_batch", "LoaderStats", "open_node"]
