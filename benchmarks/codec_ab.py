"""The tables' Parquet codec: whole builds with snappy and with zstd, alternating (not part of the tests).

    python benchmarks/codec_ab.py [--impressions 800000] [--reps 4] [--workdir DIR] [--json out.json]

One local Spark session (``get_spark``), one synthetic fat-row log (``userwise synth
--kinds fat``, 2 days, L=50, as ``build_bench.py`` writes it); after a tiny warm-up build,
the whole build runs ``--reps`` times with each codec (``delta_io.CODEC``), in
alternating order, and reports the median build time and the bytes of every table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import build_bench as bb  # noqa: E402

CODECS = ("snappy", "zstd")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="whole builds with snappy vs zstd tables, alternating")
    p.add_argument("--impressions", type=int, default=800000, help="synth's target impressions")
    p.add_argument("--reps", type=int, default=4, help="builds per codec")
    p.add_argument("--workdir", default=None)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    from userwise.pipelines import config as C
    from userwise.pipelines.build.range import du
    from userwise.pipelines.runtime import delta_io
    from userwise.pipelines.runtime.spark import get_spark

    work = a.workdir or tempfile.mkdtemp(prefix="codec-ab-")
    spark = get_spark(ui=False)
    as_of = "2026-01-03"
    warm = os.path.join(work, "warm")
    bb.make_log(warm, 2000, 2, 50, 0)
    bb.build_run(spark, C.load(os.path.join(warm, "config_fat.yaml")), os.path.join(warm, "fat"),
                 os.path.join(work, "warm-build"), as_of, 2, None)
    s = bb.make_log(os.path.join(work, "log"), a.impressions, 2, 50, 0)
    log_path = os.path.join(work, "log", "fat")
    cfg = C.load(os.path.join(work, "log", "config_fat.yaml"))
    times: dict = {c: [] for c in CODECS}
    sizes: dict = {}
    try:
        for k in range(a.reps):
            for codec in CODECS if k % 2 == 0 else CODECS[::-1]:
                delta_io.CODEC = codec
                out = os.path.join(work, f"build-{codec}")
                el, rep = bb.build_run(spark, cfg, log_path, out, as_of, 2, None)
                times[codec].append(el)
                sizes[codec] = {t: du(os.path.join(out, t)) for t in delta_io.TABLES
                                if os.path.isdir(os.path.join(out, t))}
                print(f"{codec}: build {el:.1f} s, samples {sizes[codec].get('samples', 0):,} bytes", flush=True)
    finally:
        delta_io.CODEC = "zstd"
    res = {"impressions": sum(s["rows"]["fat"].values()), "input_bytes": bb.dir_bytes(log_path),
           "codecs": {c: {"build_s": times[c], "median_s": statistics.median(times[c]), "bytes": sizes[c]}
                      for c in CODECS}}
    for c in CODECS:
        r = res["codecs"][c]
        print(f"{c:>6}: median build {r['median_s']:.1f} s; samples {r['bytes']['samples']:,} bytes "
              f"(input / samples {res['input_bytes'] / r['bytes']['samples']:.2f}x); requests "
              f"{r['bytes']['requests']:,}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
