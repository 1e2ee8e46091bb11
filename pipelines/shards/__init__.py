"""Step 2 of the data path: samples -> balanced per-node shard sets -> local NVMe.

- ``manifest``: the shard set's manifest: the one reader, writer and verifier.
- ``balance``: a pure, seeded assignment of samples to nodes and ranks by cost.
- ``gds``: the raw side files for GPUDirect Storage reads.
- ``writer``: the shard files' writer (row groups, codecs, checksums): what preshard runs on
  Spark's executors, and forget and the synthetic sets beside it.
- ``preshard``: writes the shard sets from a build's samples (the driver's plan: Spark reads
  the table, assigns every sample, and the executors write).
- ``publish``: puts a finished shard set in place and marks it published (marker, then the
  build folder's record, last).
- ``stage``: copies one node's shards to local disk, verified and resumable (no Spark).

The format (``manifest``, ``gds``, ``balance``) is what the loader reads too; preshard alone
imports pyspark, and only when it runs.
"""
