"""spark-submit entry point: build the requests, events and quarantine of one UTC date.

    spark-submit [spark options] --py-files dist/userwise-0.1.0-pyfiles.zip jobs/requests.py ARGS

ARGS are those of ``userwise requests --help``; this file parses nothing itself.
"""

import sys

from userwise.pipelines.cli import main

if __name__ == "__main__":
    sys.exit(main(["requests", *sys.argv[1:]]))
