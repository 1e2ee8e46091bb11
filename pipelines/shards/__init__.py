"""Step 2 of the data path: samples -> balanced per-node shard sets -> local NVMe.

- ``manifest``: the shard set's manifest: the one reader, writer and verifier.
- ``balance``: a pure, seeded assignment of samples to nodes and ranks by cost.
- ``preshard``: writes the shard sets from a build's samples (Spark reads the table).
- ``gds``: the raw side files for GPUDirect Storage reads.
- ``publish``: moves a finished shard set into place atomically.
- ``stage``: copies one node's shards to local disk, verified and resumable (no Spark).
"""
