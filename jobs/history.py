"""spark-submit entry point: MERGE one date's actions into the user history.

    spark-submit [spark options] --py-files dist/userwise-0.1.0-pyfiles.zip jobs/history.py ARGS

ARGS are those of ``userwise history --help``; this file parses nothing itself.
"""

import os
import sys

# Python puts this file's folder first on the import path, where requests.py would shadow
# the `requests` library (WebHDFS and the object stores import it): take the folder off.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

from userwise.pipelines.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["history", *sys.argv[1:]]))
