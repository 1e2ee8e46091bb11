"""The loader's reads: one node's staged shards, from the manifest to flat columns.

Modules, in the order a buffer is read:

- ``shards``: one node's staged shards: manifest, verification, row-group metadata
  (:func:`~userwise.pipelines.loader.io.shards.open_node`; replay reads through it too).
- ``reading``: Parquet row groups read as Arrow tables (files kept open per process and
  thread, pages CRC-checked, the read-ahead lanes).
- ``gpudirect``: which data path a dataset reads by (GDS side files straight to the device, or
  Parquet), and the side files' reads.
- ``decode``: shard bytes (Parquet or GDS side files) to flat columns, checked.

Imports the loader's ``logs`` only; never the planning, assembly or workers.
"""
