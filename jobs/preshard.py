"""spark-submit entry point: pre-shard samples into per-node shard sets with a manifest.

    spark-submit [spark options] --py-files dist/userwise-0.1.0-pyfiles.zip jobs/preshard.py ARGS

ARGS are those of ``userwise preshard --help``; this file parses nothing itself.
"""

import sys

from userwise.pipelines.cli import main

if __name__ == "__main__":
    sys.exit(main(["preshard", *sys.argv[1:]]))
