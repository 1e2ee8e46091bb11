"""Tools beside the data path: synthetic logs (``userwise synth``), synthetic user-wise
samples and shard sets (``shardgen``, for tests and benchmarks) and the demo (``make demo``)."""
