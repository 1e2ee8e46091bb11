"""spark-submit entry point used by the tests: prove the shipped code imports on executors.

Each task imports ``userwise.schemas`` on its executor and reports the file it came
from and the executor's host/pid; the driver prints one JSON line and writes it to
argv[1] (a path only the driver needs to see).
"""

import json
import os
import sys

# Python puts this file's folder first on the import path, where requests.py would shadow
# the `requests` library (WebHDFS and the object stores import it): take the folder off.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

from userwise.pipelines.runtime.spark import get_spark  # noqa: E402


def _probe(_):
    import os

    import userwise.schemas as s

    yield {"file": s.__file__, "pid": os.getpid(), "tables": len(dir(s))}


if __name__ == "__main__":
    spark = get_spark(app="userwise-probe")
    sc = spark.sparkContext
    got = sc.parallelize(range(4), 4).mapPartitions(_probe).collect()
    out = {"master": sc.master, "executors": got,
           "py_files_on_driver": [p for p in sys.path if p.endswith(".zip")]}
    print(json.dumps(out))
    with open(sys.argv[1], "w") as fh:
        json.dump(out, fh)
    spark.stop()
