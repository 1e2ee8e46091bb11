"""spark-submit entry point: run the daily chain day by day over a date range.

    spark-submit [spark options] --py-files dist/userwise-0.1.0-pyfiles.zip jobs/backfill.py ARGS

ARGS are those of ``userwise backfill --help``; this file parses nothing itself.
"""

import sys

from userwise.pipelines.cli import main

if __name__ == "__main__":
    sys.exit(main(["backfill", *sys.argv[1:]]))
