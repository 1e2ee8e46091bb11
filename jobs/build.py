"""spark-submit entry point: build requests, history, samples and quarantine for a date range.

    spark-submit [spark options] --py-files dist/userwise-0.1.0-pyfiles.zip jobs/build.py ARGS

ARGS are those of ``userwise build --help``; this file parses nothing itself.
"""

import sys

from userwise.pipelines.cli import main

if __name__ == "__main__":
    sys.exit(main(["build", *sys.argv[1:]]))
