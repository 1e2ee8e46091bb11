"""The loader's plans: which samples each rank's batches hold, epoch by epoch, and resume.

Modules:

- ``plan``: the epoch plan, a pure seeded function of row-group sizes (rank split, equal
  batch counts, shuffle, batch cuts), and ``PlanSettings``, what decides it.
- ``distributed``: the local rank and world size, and the one all-reduce by which the ranks
  of several nodes agree on an epoch's batch counts.
- ``resume``: the loader's state: what it records, what a loaded state must match, and the
  exact remap of a mid-epoch change of world size or batch cut by the samples consumed.
- ``epochs``: ``Epochs``, the one owner of a rank's epoch plans (the current one and one
  made ahead), the cursor and resume (``dataset.epochs``).

Imports the loader's ``io`` (the shards' metadata) only.
"""
