"""spark-submit entry point: expand user-wise samples back to point-wise rows.

    spark-submit [spark options] --py-files dist/userwise-0.1.0-pyfiles.zip jobs/expand.py ARGS

ARGS are those of ``userwise expand --help``; this file parses nothing itself.
"""

import sys

from userwise.pipelines.cli import main

if __name__ == "__main__":
    sys.exit(main(["expand", *sys.argv[1:]]))
