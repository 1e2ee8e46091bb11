"""spark-submit entry point: build the incremental samples of the window ending after one date.

    spark-submit [spark options] --py-files dist/userwise-0.1.0-pyfiles.zip jobs/window.py ARGS

ARGS are those of ``userwise window --help``; this file parses nothing itself.
"""

import sys

from userwise.pipelines.cli import main

if __name__ == "__main__":
    sys.exit(main(["window", *sys.argv[1:]]))
