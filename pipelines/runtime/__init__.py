"""What the Spark steps run on: the session, Delta's jars, Delta I/O, shipping the project.

- ``spark``: one configured Spark session (local by default, spark-submit's otherwise).
- ``jars``: fetches and caches Delta's jars (Spark's resolver, else Maven).
- ``delta_io``: every Delta read and write (versions, replaceWhere, MERGE); also a
  pyarrow dataset over a Delta table without Spark.
- ``ship``: the wheel and ``--py-files`` zip that spark-submit sends to executors.
"""
