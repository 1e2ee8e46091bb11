"""The loader's batches: decoded columns cut into jagged batches, one buffer each.

Modules:

- ``batch``: ``JaggedBatch`` (one buffer plus its layout, ``to_kjt`` with TorchRec's
  variable-batch form) and ``expand_batch``.
- ``ids``: a batch's ids deduplicated and bucketed by owner for row-wise sharding, hot ids
  flagged (``IdRouting``, ``route_ids``; the dataset's ``ids=`` runs it in the workers).
- ``buffer_layout``: where every array of a batch sits in its one buffer, once per schema.
- ``stacked``: a host buffer's columns stacked per group and shuffled once.
- ``program``: the compiled assembler's two kernel calls per batch.
- ``segcopy`` and ``kernels``: the segmented copy (numba, or numpy without it).
- ``assemble``: the host assembler (and an empty batch from the layout alone);
  ``assemble_torch``: the device assembler (GDS path). Both give the same bytes.

Imports the loader's ``io`` (decoded columns) and ``logs`` only.
"""
