"""Evidence that one bot user does not sink one task: per-stage task skew of a lean build.

    .venv/bin/python benchmarks/skew_report.py                    # 60k impressions, 2 days
    .venv/bin/python benchmarks/skew_report.py --impressions 2000000 --days 3   # a bigger machine

1. ``userwise synth --kinds lean`` (one bot user at 300x the median user's rate:
   at small sizes about half of all impressions);
2. ``userwise build`` in-process with the Spark UI on (``get_spark(ui=True)``);
3. from the UI's REST API on localhost (``/stages`` and
   ``/stages/<id>/<attempt>/taskSummary?quantiles=0.5,1.0``), per stage with at
   least two tasks: records per task (input + shuffle read) and duration,
   median vs max, and the largest task's share of the stage's records, next to
   the bot's share of the impressions. A stage that groups or windows by user
   alone would put the bot in one task: that task's share would be at least
   the bot's share.
4. the physical plan of the pretrain samples: its exchanges, windows and
   aggregations, which name the keys each step groups by (lean input: each
   user's events and each (user, set)'s request keys, narrow rows; the wide
   columns grouped by chunk; fat rows: windows by (user, time bucket ``_sk``)).

AQE partition coalescing is turned off for this run (``--coalesce`` keeps it):
at test sizes it folds every shuffle into one task, which hides the layout
the skew handling produces. Output: a table on stdout and ``--json``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from build_bench import rest  # noqa: E402


def task_skew(spark, min_tasks: int = 2) -> list[dict]:
    rows = []
    for s in rest(spark, "stages?status=complete"):
        if s["numTasks"] < min_tasks:
            continue
        q = rest(spark, f"stages/{s['stageId']}/{s['attemptId']}/taskSummary?quantiles=0.5,1.0")
        inp = q.get("inputMetrics", {}).get("recordsRead", [0, 0])
        shr = q.get("shuffleReadMetrics", {}).get("readRecords", [0, 0])
        rec_med, rec_max = inp[0] + shr[0], inp[1] + shr[1]
        total = s.get("inputRecords", 0) + s.get("shuffleReadRecords", 0)
        dur = q.get("duration", [0, 0])
        rows.append({
            "stage": s["stageId"], "attempt": s["attemptId"], "tasks": s["numTasks"], "name": s["name"],
            "records": total, "rec_median": rec_med, "rec_max": rec_max,
            "max_share": round(rec_max / total, 3) if total else 0.0,
            "dur_median_ms": dur[0], "dur_max_ms": dur[1],
        })
    return rows


def plan_excerpt(plan: str) -> list[str]:
    keep = ("Exchange hashpartitioning", "Window [", "Aggregate(keys")
    return [ln.rstrip() for ln in plan.splitlines() if any(k in ln for k in keep)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--impressions", type=int, default=60_000)
    p.add_argument("--days", type=int, default=2)
    p.add_argument("--max-seq-len", type=int, default=50)
    p.add_argument("--min-records", type=int, default=1000, help="list stages with at least this many records")
    p.add_argument("--coalesce", action="store_true", help="keep AQE partition coalescing on")
    p.add_argument("--workdir", default=None)
    p.add_argument("--json", default=os.path.join(HERE, "results", "skew_report.json"))
    p.add_argument("--plan", default=None, help="also write the whole physical plan to this file")
    args = p.parse_args(argv)

    import datetime as dt

    import pyarrow.compute as pc

    from userwise.pipelines import config as C
    from userwise.pipelines.builder import steps
    from userwise.pipelines.builder.build import build
    from userwise.pipelines.builder.inputs import arrow_dataset
    from userwise.pipelines.records import build_record
    from userwise.pipelines.runtime.spark import get_spark
    from userwise.pipelines.tools.synth import synth

    work = args.workdir or tempfile.mkdtemp(prefix="skew-report-")
    log_dir, out = os.path.join(work, "log"), os.path.join(work, "build")
    s = synth(log_dir, days=args.days, impressions=args.impressions, max_seq_len=args.max_seq_len,
              kinds=("lean",), log=io.StringIO())
    lean = os.path.join(log_dir, "lean")
    uid = arrow_dataset(lean).to_table(columns=["user_id"])["user_id"]
    n_imps = len(uid)
    bot = s["bot_user_id"]
    bot_imps = int(pc.sum(pc.equal(uid, bot)).as_py())
    per_user = pc.value_counts(uid.drop_null())
    counts = sorted((int(c) for c in per_user.field("counts").to_pylist()), reverse=True)
    median_user = counts[len(counts) // 2]

    # 8 shuffle partitions (an even spread is 12.5% per task), whatever the local default
    conf = {"spark.ui.retainedJobs": "20000", "spark.ui.retainedStages": "50000",
            "spark.sql.shuffle.partitions": "8"}
    if not args.coalesce:
        conf["spark.sql.adaptive.coalescePartitions.enabled"] = "false"
    spark = get_spark(ui=True, conf=conf)
    cfg = C.load(os.path.join(log_dir, "config.yaml"))
    as_of = dt.date(2026, 1, 1) + dt.timedelta(days=args.days)
    t = time.perf_counter()
    rep = build(spark, cfg, lean, out, as_of.isoformat(), args.days - 1, 1)
    took = time.perf_counter() - t
    rows = task_skew(spark)

    # The sample step's plan: the pretrain samples of the build just made (not written).
    _, layout, _ = build_record.load(out)
    boundary = as_of - dt.timedelta(days=args.days - 1)
    df = steps.samples_frame(spark, cfg, layout, out, [("pretrain", None, boundary)])
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        df.explain()
    plan = buf.getvalue()
    excerpt = plan_excerpt(plan)
    if args.plan:
        with open(args.plan, "w") as f:
            f.write(plan)

    big = [r for r in rows if r["records"] >= args.min_records]
    worst = max(big, key=lambda r: r["max_share"], default=None)
    res = {
        "impressions": n_imps, "users": s["users"], "bot_user_id": bot, "bot_impressions": bot_imps,
        "bot_share": round(bot_imps / n_imps, 3), "median_user_impressions": median_user,
        "bot_vs_median_user": round(bot_imps / median_user, 1), "build_s": round(took, 1),
        "coalesce": args.coalesce, "shuffle_partitions": spark.conf.get("spark.sql.shuffle.partitions"),
        "stages": rows, "plan_excerpt": excerpt, "reconciled": rep["reconciled"],
        "stages_listed": len(big),
        "stages_max_share_above_bot_share": sum(1 for r in big if r["max_share"] >= bot_imps / n_imps),
        "worst_stage": worst,
    }
    print(f"lean log: {n_imps:,} impressions, {s['users']} users; bot user {bot}: {bot_imps:,} impressions "
          f"({res['bot_share']:.1%} of all, {res['bot_vs_median_user']}x the median user's {median_user})")
    print(f"build: {took:.0f} s, reconciled {rep['reconciled']}, shuffle partitions "
          f"{res['shuffle_partitions']}, AQE coalescing {'on' if args.coalesce else 'off'}")
    print(f"\nstages with >= {args.min_records} records (input + shuffle read), by largest task share:")
    print(f"{'stage':>5} {'tasks':>5} {'records':>9} {'med/task':>8} {'max/task':>8} {'max share':>9} "
          f"{'med ms':>7} {'max ms':>7}  name")
    for r in sorted(big, key=lambda r: -r["max_share"]):
        print(f"{r['stage']:>5} {r['tasks']:>5} {r['records']:>9,} {r['rec_median']:>8,.0f} {r['rec_max']:>8,.0f} "
              f"{r['max_share']:>9.1%} {r['dur_median_ms']:>7.0f} {r['dur_max_ms']:>7.0f}  {r['name'][:60]}")
    print(f"\n{res['stages_max_share_above_bot_share']} of {len(big)} stages have a task holding at least the "
          f"bot's share ({res['bot_share']:.1%}) of the stage's records")
    print("\nphysical plan of the pretrain samples (exchanges, windows and aggregations):")
    print("\n".join(excerpt))
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(res, f, indent=1, default=str)
    print(f"\nwrote {args.json}")
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
