"""spark-submit entry point: MERGE one date's actions into the user history.

    spark-submit [spark options] --py-files dist/userwise-0.1.0-pyfiles.zip jobs/history.py ARGS

ARGS are those of ``userwise history --help``; this file parses nothing itself.
"""

import sys

from userwise.pipelines.cli import main

if __name__ == "__main__":
    sys.exit(main(["history", *sys.argv[1:]]))
