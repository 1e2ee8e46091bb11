"""Tools beside the data path.

- ``synth``: synthetic impression logs, action logs and their configs (``userwise synth``).
- ``shardgen``: synthetic user-wise samples and shard sets without Spark (tests, benchmarks).
- ``hdfs_store``: a real HDFS on one machine (a MiniDFSCluster): the tests' store and
  ``make demo-remote``'s.
- ``s3_store``: an S3 API server on loopback (moto's server mode): the S3 tests' store.
- ``demo``: ``make demo``: the whole product on the embedded default, as a user runs it.
"""
