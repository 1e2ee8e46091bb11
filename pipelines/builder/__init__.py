"""Step 1 of the data path: impression logs -> requests, events, history, samples (Spark + Delta).

Modules, in the order a build runs them:

- ``validate``: checks a config against an input's schema and a sample of rows (no JVM).
- ``inputs``: reads the input log (Parquet, Delta) as a Spark or Arrow dataset.
- ``ingest``: one row per request, the action stream, quarantine of bad rows.
- ``pointer``: the pointer itself: each request's ``[seq_begin, seq_end)`` into one
  stored stream per user and window, chunked by cost.
- ``fat_rows``: legacy logs whose impressions carry a snapshot: stitch, align, overrides.
- ``history``: every window's stream and the history as of any date, derived from the
  events; the history table (newest H events per user) kept by a daily MERGE.
- ``id_stats``: per sample set and id column, each id's lookups, whether it is new, and its
  hot / warm / cold tier (the ``id_stats`` table and the report's ``ids``).
- ``steps``: the chain's steps that the range build and the daily jobs share (ingest a
  range of days; the samples of many sets from one plan).
- ``build``: ``userwise build``: every day before as-of in a fixed number of jobs.
- ``daily``: the daily jobs (requests, history, window, pretrain), one day or set each.
- ``expand``: user-wise samples back to point-wise rows (the lossless round trip).

The build folder's records (``build.json``, the complete state, locks) are
:mod:`userwise.pipelines.records`. Only the Spark steps import pyspark, and only when they run.
"""
