"""spark-submit entry point: build the pretrain samples (requests before as-of minus M days).

    spark-submit [spark options] --py-files dist/userwise-0.1.0-pyfiles.zip jobs/pretrain.py ARGS

ARGS are those of ``userwise pretrain --help``; this file parses nothing itself.
"""

import sys

from userwise.pipelines.cli import main

if __name__ == "__main__":
    sys.exit(main(["pretrain", *sys.argv[1:]]))
