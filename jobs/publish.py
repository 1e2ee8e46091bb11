"""spark-submit entry point: publish a pre-sharded set (the set in place, its record last).

    spark-submit [spark options] --py-files dist/userwise-0.1.0-pyfiles.zip jobs/publish.py ARGS

ARGS are those of ``userwise publish --help``; this file parses nothing itself.
"""

import sys

from userwise.pipelines.cli import main

if __name__ == "__main__":
    sys.exit(main(["publish", *sys.argv[1:]]))
