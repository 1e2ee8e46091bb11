"""What the jobs run on: where files live, progress, the Spark session, jars, Delta I/O, shipping.

Modules, lowest first (each imports only those above it):

- ``storage``: a local path or a store's URL (HDFS, S3, GCS) as one pyarrow filesystem.
- ``progress``: a job's own progress lines on stderr, and a bar while Spark works.
- ``jars``: fetches and caches the jars beside pyspark (Delta's; Maven, else Spark's resolver).
- ``spark``: one configured Spark session (local by default, spark-submit's otherwise).
- ``delta_io``: every Delta read and write (versions, replaceWhere, MERGE, VACUUM); also a
  pyarrow dataset over a Delta table without Spark, and the rows a commit added.
- ``ship``: the wheel and ``--py-files`` zip that spark-submit sends to executors.
"""
