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

Never imports pyspark.
"""

from userwise.pipelines.loader.batch import JaggedBatch, expand_batch
from userwise.pipelines.loader.dataset import UserwiseDataset
from userwise.pipelines.loader.loader import LoaderStats, UserwiseLoader
from userwise.pipelines.loader.shards import open_node

__all__ = ["UserwiseDataset", "UserwiseLoader", "JaggedBatch", "expand_batch", "LoaderStats", "open_node"]
