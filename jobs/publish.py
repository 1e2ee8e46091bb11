"""spark-submit entry point: publish a pre-sharded set (manifest in place, marker last).

    spark-submit [spark options] --py-files dist/userwise-0.1.0-pyfiles.zip jobs/publish.py ARGS

ARGS are those of ``python -m userwise.pipelines.shards.publish --help``; this file parses nothing itself.
"""

import sys

from userwise.pipelines.shards.publish import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
