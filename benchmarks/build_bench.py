"""`userwise build` on a synthetic fat-row log against the I/O floor, side by side.

    .venv/bin/python benchmarks/build_bench.py                      # 200k, 400k, 800k impressions, L=50
    .venv/bin/python benchmarks/build_bench.py --sizes 50000 --reps 1 --no-plot   # a quick check
    .venv/bin/python benchmarks/build_bench.py --scale 5           # 1M, 2M, 4M (a bigger machine)
    .venv/bin/python benchmarks/build_bench.py --days-compare      # one 60-day log, M=2/N=1 vs M=30/N=1 vs M=30/N=30

Per size (``--sizes`` x ``--scale`` impressions, ``--days`` UTC days, L =
``--max-seq-len``), with one shared local SparkSession:

1. ``userwise synth --kinds fat`` writes the fat-row log (not timed);
2. the floor: ``spark.read`` the same log and write it back as Parquet;
   two references, not targets: the floor plus one shuffle by user
   (``shuffle_run``), and the least plan that writes the requests and samples
   tables as Delta (``skeleton_run``: one shuffle, two aggregations, none of
   the build's checks, stitching, pointers or chunks);
3. the build: ``userwise.pipelines.build.range.build(spark, cfg, ...)`` in-process
   (as-of = the day after the log, the last day an incremental window, the
   days before it pretrain);
   floor, references and build alternate, ``--reps`` times; the minimum of each is reported.
   Target: build <= 2x floor, and seconds per impression flat over the sizes.
4. bytes: the fat-row log rewritten in training order (rows shuffled, zstd
   Parquet via pyarrow) vs the samples table's data files; decoded in memory:
   the Arrow size (``Table.nbytes``) of the fat-row table vs the samples table.

Profile: the build module's steps (ingest, pretrain samples, history seed,
history update, window samples, report) are wrapped by name at run time (the
build code is not changed) so each runs under its own Spark job group and is
timed; with the UI on (default) the stage metrics of each step come from the
UI's REST API: jobs, stages, tasks, executor run time, and the slowest stages
with their call sites. A small warm-up build (not timed) runs first.

Days (``--days-compare``, instead of the sizes): one synthetic log of
``--days-span`` days (``--days-impressions``, lean with its action log and fat)
built with M=2/N=1, M=30/N=1 and M=30/N=30, as-of the day after the log: wall
time and Spark jobs (the build's job group, from the status tracker) side by
side, as multiples of M=2/N=1; written to ``--days-json``
(benchmarks/results/build_bench_days.json). Target: M=30/N=1 within 1.3x the
wall time and 10% of the jobs of M=2/N=1.

Output: a table on stdout, ``--json`` (default benchmarks/results/build_bench.json) and
``--plot`` (default benchmarks/results/build_bench.png). Keep sizes small on a shared
machine; the ratios are what matters.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import shutil
import sys
import tempfile
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "benchmarks", "results")  # the latest results the docs show

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402


# ---------------------------------------------------------------------------
# The Spark UI's REST API (shared with skew_report.py)
# ---------------------------------------------------------------------------
def rest(spark, path: str):
    """GET <ui>/api/v1/applications/<app id>/<path> as JSON."""
    sc = spark.sparkContext
    url = sc.uiWebUrl
    if not url:
        raise RuntimeError("the Spark UI is off: make the session with get_spark(ui=True)")
    with urllib.request.urlopen(f"{url}/api/v1/applications/{sc.applicationId}/{path}", timeout=30) as r:
        return json.loads(r.read())


def _ms(ts: str | None) -> float | None:
    """REST time stamps ('2026-01-01T10:00:00.123GMT') to epoch ms."""
    if not ts:
        return None
    import datetime as dt

    return dt.datetime.strptime(ts.replace("GMT", "+0000"), "%Y-%m-%dT%H:%M:%S.%f%z").timestamp() * 1000


def stage_table(spark) -> dict[tuple[int, int], dict]:
    """(stageId, attemptId) -> stage summary for every stage the UI still holds."""
    out = {}
    for s in rest(spark, "stages"):
        sub, done = _ms(s.get("submissionTime")), _ms(s.get("completionTime"))
        out[(s["stageId"], s["attemptId"])] = {
            "stage": s["stageId"], "attempt": s["attemptId"], "status": s["status"], "tasks": s["numTasks"],
            "name": s["name"], "wall_s": (done - sub) / 1000 if sub and done else 0.0,
            "run_s": s.get("executorRunTime", 0) / 1000, "input_records": s.get("inputRecords", 0),
            "shuffle_read_records": s.get("shuffleReadRecords", 0),
            "shuffle_write_bytes": s.get("shuffleWriteBytes", 0), "output_records": s.get("outputRecords", 0),
            "description": s.get("description", ""),
        }
    return out


def group_metrics(spark, group: str) -> dict:
    """Jobs, executed stages, tasks and times of one job group."""
    jobs = [j for j in rest(spark, "jobs") if j.get("jobGroup") == group]
    stages = stage_table(spark)
    ids = {sid for j in jobs for sid in j["stageIds"]}
    ran = [s for (sid, _), s in stages.items() if sid in ids and s["status"] == "COMPLETE"]
    job_s = sum(((_ms(j.get("completionTime")) or 0) - (_ms(j.get("submissionTime")) or 0)) / 1000 for j in jobs)
    return {
        "jobs": len(jobs), "stages": len(ran), "tasks": sum(s["tasks"] for s in ran),
        "job_wall_s": round(job_s, 2), "stage_wall_s": round(sum(s["wall_s"] for s in ran), 2),
        "executor_run_s": round(sum(s["run_s"] for s in ran), 2),
        "stages_by_tasks": {str(n): {"stages": sum(1 for s in ran if s["tasks"] == n),
                                     "wall_s": round(sum(s["wall_s"] for s in ran if s["tasks"] == n), 2)}
                            for n in sorted({s["tasks"] for s in ran})},
        "slowest": [{k: s[k] for k in ("stage", "tasks", "wall_s", "run_s", "name")}
                    for s in sorted(ran, key=lambda s: -s["wall_s"])[:5]],
        # every job: where it was called from and how long it took (what the fixed cost is made of)
        "job_list": [{"name": (j.get("name") or "")[:120], "stages": len(j["stageIds"]),
                      "s": round(((_ms(j.get("completionTime")) or 0) - (_ms(j.get("submissionTime")) or 0)) / 1000, 2)}
                     for j in sorted(jobs, key=lambda j: j["jobId"])],
    }


# ---------------------------------------------------------------------------
# Timing the build's steps without changing the build
# ---------------------------------------------------------------------------
class Steps:
    """Wraps the names pipelines.build calls so that each step is timed under its own job group."""

    # the functions the range build calls by name; those it does not have are left alone
    NAMES = ("ingest_range", "pretrain_samples", "window_samples", "fat_range_samples", "set_samples", "report")
    HISTORY = ("seed", "update", "derive")  # History's methods, each timed as history_<method>

    def __init__(self, spark, ui: bool):
        self.spark, self.ui = spark, ui
        self.rows: list[dict] = []
        self.prefix = ""
        self.active = False

    @contextlib.contextmanager
    def step(self, name: str):
        if self.active:  # a wrapped name called by another: its time is the outer step's
            yield
            return
        self.active = True
        sc = self.spark.sparkContext
        group = f"{self.prefix}{len(self.rows):02d}-{name}"
        sc.setJobGroup(group, name)
        t = time.perf_counter()
        try:
            yield
        finally:
            wall = time.perf_counter() - t
            self.active = False
            sc.setLocalProperty("spark.jobGroup.id", None)
            row = {"step": name, "wall_s": round(wall, 2), "group": group}
            self.rows.append(row)

    def collect(self) -> None:
        """Fill in the REST metrics (call once the build is done)."""
        if not self.ui:
            return
        for row in self.rows:
            row.update(group_metrics(self.spark, row["group"]))

    @contextlib.contextmanager
    def installed(self):
        from userwise.pipelines.build import range as B

        saved = {n: getattr(B, n) for n in self.NAMES if hasattr(B, n)}
        saved["History"] = B.History
        steps = self

        def wrap(name, fn):
            def timed(*a, **k):
                with steps.step(name):
                    return fn(*a, **k)
            return timed

        for n in self.NAMES:
            if n in saved:
                setattr(B, n, wrap(n, saved[n]))

        def timed_method(name):
            def timed(self, *a, **k):
                with steps.step(f"history_{name}"):
                    return getattr(saved["History"], name)(self, *a, **k)
            return timed

        TimedHistory = type("TimedHistory", (saved["History"],),
                            {m: timed_method(m) for m in self.HISTORY if hasattr(saved["History"], m)})
        B.History = TimedHistory
        try:
            yield self
        finally:
            for n, fn in saved.items():
                setattr(B, n, fn)

    def summary(self) -> list[dict]:
        """Steps of one build, summed by name."""
        by: dict[str, dict] = {}
        for r in self.rows:
            a = by.setdefault(r["step"], {"step": r["step"], "calls": 0, "wall_s": 0.0, "jobs": 0, "stages": 0,
                                          "tasks": 0, "executor_run_s": 0.0, "slowest": []})
            a["calls"] += 1
            a["wall_s"] = round(a["wall_s"] + r["wall_s"], 2)
            for k in ("jobs", "stages", "tasks"):
                a[k] += r.get(k, 0)
            a["executor_run_s"] = round(a["executor_run_s"] + r.get("executor_run_s", 0.0), 2)
            for n, v in r.get("stages_by_tasks", {}).items():
                t = a.setdefault("stages_by_tasks", {}).setdefault(n, {"stages": 0, "wall_s": 0.0})
                t["stages"] += v["stages"]
                t["wall_s"] = round(t["wall_s"] + v["wall_s"], 2)
            a["slowest"] = sorted(a["slowest"] + r.get("slowest", []), key=lambda s: -s["wall_s"])[:5]
            a["job_list"] = a.get("job_list", []) + r.get("job_list", [])
        return list(by.values())


# ---------------------------------------------------------------------------
# The measured pieces
# ---------------------------------------------------------------------------
def make_log(out: str, impressions: int, days: int, L: int, seed: int, params=None) -> dict:
    from userwise.pipelines.tools.synth import synth

    return synth(out, days=days, impressions=impressions, max_seq_len=L, kinds=("fat",), seed=seed,
                 params=params, log=io.StringIO())


def floor_run(spark, log_path: str, out: str, transform=lambda df: df) -> float:
    shutil.rmtree(out, ignore_errors=True)
    t = time.perf_counter()
    transform(spark.read.option("basePath", log_path).parquet(log_path)).write.mode("overwrite").parquet(out)
    return time.perf_counter() - t


def shuffle_run(spark, log_path: str, out: str, user_col: str, time_col: str) -> float:
    """A reference, not a target: the floor plus one shuffle of the fat rows by user and a sort
    within each partition (the least any build that groups a user's rows must do)."""
    return floor_run(spark, log_path, out,
                     lambda df: df.repartition(user_col).sortWithinPartitions(user_col, time_col))


def skeleton_run(spark, cfg, log_path: str, out: str) -> float:
    """A reference, not a target: the least plan that writes the two tables every build has to
    aggregate, as Delta, with one shuffle of the fat rows (by user; both aggregations reuse it).
    ``requests``: a request's impressions collected and sorted, its first snapshot, a count;
    ``samples``: a user's requests collected and sorted. None of the build's checks, quarantine,
    stitching, pointers, chunks, history, windows or report: a build that does what the issue's
    point 1 asks does all of this and that work besides (not a proof of a bound: the cheapest
    plan for these two tables we know of)."""
    from pyspark.sql import functions as F

    shutil.rmtree(out, ignore_errors=True)
    t = time.perf_counter()
    user, req = cfg.col("user"), cfg.col("request")
    df = spark.read.option("basePath", log_path).parquet(log_path).repartition(user)
    snap = list(cfg.sequence.values())
    imp = [c for c in df.columns if c not in snap and c not in (user, req)]
    g = df.groupBy(user, req).agg(F.sort_array(F.collect_list(F.struct(*imp))).alias("imps"),
                                  F.first(F.struct(*snap)).alias("snap"), F.count(F.lit(1)).alias("num_imps"))
    g = g.cache()
    try:
        g.write.format("delta").save(os.path.join(out, "requests"))
        s = g.groupBy(user).agg(F.sort_array(F.collect_list(F.struct(req, "imps", "snap"))).alias("requests"))
        s.write.format("delta").save(os.path.join(out, "samples"))
    finally:
        g.unpersist()
    return time.perf_counter() - t


def build_run(spark, cfg, log_path: str, out: str, as_of: str, days: int, steps: Steps | None) -> tuple[float, dict]:
    from userwise.pipelines.build.range import build

    shutil.rmtree(out, ignore_errors=True)
    ctx = steps.installed() if steps else contextlib.nullcontext()
    with ctx:
        t = time.perf_counter()
        rep = build(spark, cfg, log_path, out, as_of, days - 1, 1)
        el = time.perf_counter() - t
    if not rep["reconciled"]:
        raise SystemExit(f"build did not reconcile: {rep}")
    return el, rep


def dir_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        if "_delta_log" in root:
            continue
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files
                     if f.endswith(".parquet") and not f.startswith("."))
    return total


def byte_report(log_path: str, build_out: str, workdir: str, seed: int) -> dict:
    """Fat rows in training order vs user-wise samples: on disk and decoded in memory."""
    from userwise.pipelines.build.inputs import arrow_dataset

    fat = arrow_dataset(log_path).to_table()
    perm = np.random.default_rng(seed).permutation(fat.num_rows)
    shuffled = fat.take(pa.array(perm))
    spath = os.path.join(workdir, "fat_training_order.parquet")
    pq.write_table(shuffled, spath, compression="zstd")
    samples_path = os.path.join(build_out, "samples")
    samples = arrow_dataset(samples_path).to_table()
    requests = arrow_dataset(os.path.join(build_out, "requests")).to_table()
    r = {
        "fat_rows": fat.num_rows,
        "samples_rows": samples.num_rows,
        "disk_fat_as_written": dir_bytes(log_path),
        "disk_fat_training_order": os.path.getsize(spath),
        "disk_samples": dir_bytes(samples_path),
        "disk_requests": dir_bytes(os.path.join(build_out, "requests")),
        "mem_fat": fat.nbytes,
        "mem_samples": samples.nbytes,
        "mem_requests": requests.nbytes,
    }
    r["disk_ratio"] = round(r["disk_fat_training_order"] / r["disk_samples"], 2)
    r["mem_ratio"] = round(r["mem_fat"] / r["mem_samples"], 2)
    os.remove(spath)
    return r


# ---------------------------------------------------------------------------
def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [r["impressions"] for r in res["sizes"]]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    a1.plot(sizes, [r["build_s"] for r in res["sizes"]], "o-", label="build")
    a1.plot(sizes, [r["floor_s"] for r in res["sizes"]], "s-", label="floor (read + write Parquet)")
    if all("shuffle_s" in r for r in res["sizes"]):
        a1.plot(sizes, [r["shuffle_s"] for r in res["sizes"]], "^-", label="floor + one shuffle by user")
    if all("skeleton_s" in r for r in res["sizes"]):
        a1.plot(sizes, [r["skeleton_s"] for r in res["sizes"]], "v-",
                label="least plan: requests + samples as Delta")
    a1.plot(sizes, [2 * r["floor_s"] for r in res["sizes"]], ":", color="gray", label="target: 2x floor")
    a1.set_xlabel("impressions (fat rows)")
    a1.set_ylabel("seconds")
    a1.set_yscale("log")
    a1.set_title(f"build vs I/O floor, L={res['args']['max_seq_len']}, local[2]")
    a1.legend()
    b = res["sizes"][-1]["bytes"]
    labels = ["disk", "in memory (Arrow)"]
    fat = [b["disk_fat_training_order"] / 2**20, b["mem_fat"] / 2**20]
    uw = [b["disk_samples"] / 2**20, b["mem_samples"] / 2**20]
    x = np.arange(2)
    a2.bar(x - 0.2, fat, 0.4, label="fat rows (training order)")
    a2.bar(x + 0.2, uw, 0.4, label="user-wise samples")
    for i in range(2):
        a2.text(x[i] - 0.2, fat[i], f"{fat[i]:.1f}", ha="center", va="bottom")
        a2.text(x[i] + 0.2, uw[i], f"{uw[i]:.1f}", ha="center", va="bottom")
    a2.set_xticks(x, labels)
    a2.set_ylabel("MiB")
    a2.set_title(f"bytes at {res['sizes'][-1]['impressions']:,} impressions")
    a2.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)


DAY_RUNS = ((2, 1), (30, 1), (30, 30))


def days_compare(spark, work: str, impressions: int, span: int, L: int, seed: int, kinds: list[str],
                 runs=DAY_RUNS, bot_factor: float | None = None, prime: bool = True) -> list[dict]:
    """One synthetic log of ``span`` days built with each (M, N) of ``runs``: wall time and
    Spark jobs (the job group's ids from the status tracker) side by side, per input kind.
    As-of is the day after the log, so every run reads the same rows."""
    import datetime as dt

    from userwise.pipelines import config as C
    from userwise.pipelines.build.range import build
    from userwise.pipelines.tools.synth import SynthParams, synth

    log_dir = os.path.join(work, "days-log")
    params = dataclasses.replace(SynthParams(), bot_factor=bot_factor) if bot_factor else None
    want = tuple(dict.fromkeys([*kinds, *(["actions"] if "lean" in kinds else [])]))
    s = synth(log_dir, days=span, impressions=impressions, max_seq_len=L, kinds=want, seed=seed,
              params=params, log=io.StringIO())
    as_of = (dt.date.fromisoformat(s["args"]["start"]) + dt.timedelta(days=span)).isoformat()
    sc = spark.sparkContext
    rows = []
    for kind in kinds:
        cfg = C.load(os.path.join(log_dir, "config.yaml" if kind == "lean" else "config_fat.yaml"))
        actions = os.path.join(log_dir, "actions") if kind == "lean" else None
        n_in = sum(s["rows"][kind].values())
        if prime:
            # The first build over a folder pays for what Spark caches about it (about 70 more
            # Spark jobs here on a 60-day log, a few seconds); not measured, so the runs
            # compare what M and N cost.
            out = os.path.join(work, f"days-{kind}-prime")
            build(spark, cfg, os.path.join(log_dir, kind), out, as_of, *runs[0], actions)
            shutil.rmtree(out, ignore_errors=True)
        for m, n in runs:
            group = f"days-{kind}-{m}-{n}"
            out = os.path.join(work, f"days-{kind}-{m}-{n}")
            shutil.rmtree(out, ignore_errors=True)
            sc.setJobGroup(group, group)
            t = time.perf_counter()
            try:
                rep = build(spark, cfg, os.path.join(log_dir, kind), out, as_of, m, n, actions)
            finally:
                sc.setLocalProperty("spark.jobGroup.id", None)
            wall = time.perf_counter() - t
            if not rep["reconciled"]:
                raise SystemExit(f"build M={m} N={n} did not reconcile: {rep}")
            row = {"kind": kind, "M": m, "N": n, "impressions": n_in, "wall_s": round(wall, 2),
                   "jobs": len(sc.statusTracker().getJobIdsForGroup(group)), "sets": len(rep["sets"]),
                   "samples": rep["samples"], "bytes_out": rep["bytes_out"]}
            rows.append(row)
            print(f"  {kind} M={m:>2} N={n:>2}: {wall:7.1f} s, {row['jobs']:>4} Spark jobs, "
                  f"{row['sets']} sets, {row['samples']:,} samples", flush=True)
            shutil.rmtree(out, ignore_errors=True)
    for kind in kinds:
        by = {(r["M"], r["N"]): r for r in rows if r["kind"] == kind}
        ref = by.get(runs[0])
        for r in by.values():
            r["wall_vs_first"] = round(r["wall_s"] / ref["wall_s"], 2)
            r["jobs_vs_first"] = round(r["jobs"] / ref["jobs"], 2)
    print(f"\n{'kind':>5} {'M':>3} {'N':>3} {'sets':>5} {'wall s':>8} {'x first':>8} {'jobs':>5} {'x first':>8} "
          f"{'samples':>9} {'bytes out':>11}")
    for r in rows:
        print(f"{r['kind']:>5} {r['M']:>3} {r['N']:>3} {r['sets']:>5} {r['wall_s']:>8.1f} {r['wall_vs_first']:>7.2f}x "
              f"{r['jobs']:>5} {r['jobs_vs_first']:>7.2f}x {r['samples']:>9,} {r['bytes_out']:>11,}")
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="200000,400000,800000", help="comma list of target impressions")
    p.add_argument("--scale", type=float, default=1.0, help="multiply every size (bigger machines)")
    p.add_argument("--days", type=int, default=2, help="UTC days of log: the last one is an incremental window")
    p.add_argument("--max-seq-len", type=int, default=50)
    p.add_argument("--reps", type=int, default=1, help="floor/build pairs per size (the minimum is reported)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bot-factor", type=float, default=None,
                   help="the bot's rate as a multiple of the median user (default: synth's, 300)")
    p.add_argument("--workdir", default=None)
    p.add_argument("--keep", action="store_true", help="keep the work folder")
    p.add_argument("--no-ui", action="store_true", help="no Spark UI: no per-step stage metrics")
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE",
                   help="extra Spark conf for the session (experiments, e.g. "
                        "spark.databricks.delta.snapshotPartitions=2)")
    p.add_argument("--json", default=os.path.join(RESULTS, "build_bench.json"))
    p.add_argument("--plot", default=os.path.join(RESULTS, "build_bench.png"))
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--days-compare", action="store_true",
                   help="instead of the sizes: one log of --days-span days built with M=2/N=1, M=30/N=1 "
                        "and M=30/N=30, wall time and Spark jobs side by side")
    p.add_argument("--days-span", type=int, default=60)
    p.add_argument("--days-impressions", type=int, default=200000)
    p.add_argument("--days-kinds", default="lean,fat", help="comma list of lean, fat")
    p.add_argument("--days-json", default=os.path.join(RESULTS, "build_bench_days.json"))
    args = p.parse_args(argv)
    if args.days < 2:
        raise SystemExit("--days must be at least 2 (pretrain days + one incremental window)")
    sizes = [int(int(s) * args.scale) for s in args.sizes.split(",")]

    import datetime as dt

    from userwise.pipelines import config as C
    from userwise.pipelines.runtime.spark import get_spark
    from userwise.pipelines.tools.synth import SynthParams

    work = args.workdir or tempfile.mkdtemp(prefix="build-bench-")
    os.makedirs(work, exist_ok=True)
    ui = not args.no_ui
    conf = {"spark.ui.retainedJobs": "20000", "spark.ui.retainedStages": "50000"}
    conf.update(kv.split("=", 1) for kv in args.conf)
    spark = get_spark(ui=ui, conf=conf)
    as_of = (dt.date(2026, 1, 1) + dt.timedelta(days=args.days)).isoformat()
    print(f"build bench: sizes {sizes}, {args.days} days, L={args.max_seq_len}, "
          f"master {spark.sparkContext.master}, workdir {work}", flush=True)

    if args.days_compare:
        if args.days_span < 31:
            raise SystemExit("--days-span must be at least 31 (M = 30 days plus pretrain)")
        kinds = [k for k in args.days_kinds.split(",") if k]
        if not kinds or set(kinds) - {"lean", "fat"}:
            raise SystemExit(f"--days-kinds {args.days_kinds}: use a comma list of lean, fat")
        if not args.no_warmup:
            t = time.perf_counter()
            days_compare(spark, os.path.join(work, "warm"), 2000, 31, args.max_seq_len, args.seed, kinds,
                         runs=((2, 1),), bot_factor=5.0, prime=False)
            print(f"warm-up (not counted): {time.perf_counter() - t:.1f} s", flush=True)
        print(f"days: {args.days_impressions:,} impressions over {args.days_span} days", flush=True)
        rows = days_compare(spark, work, args.days_impressions, args.days_span, args.max_seq_len, args.seed, kinds,
                            bot_factor=args.bot_factor)
        res = {"args": vars(args), "days": rows, "master": spark.sparkContext.master, "cpus": os.cpu_count(),
               "load_avg": os.getloadavg()}
        os.makedirs(os.path.dirname(os.path.abspath(args.days_json)), exist_ok=True)
        with open(args.days_json, "w") as f:
            json.dump(res, f, indent=1, default=str)
        print(f"\nwrote {args.days_json}")
        if not args.keep and not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
        return 0

    if not args.no_warmup:
        # JVM, Delta and codegen warm-up on a tiny log (bot at 5x the median instead of 300x): not timed.
        wlog = os.path.join(work, "warm", "log")
        make_log(wlog, 2000, args.days, args.max_seq_len, args.seed,
                 params=dataclasses.replace(SynthParams(), bot_factor=5.0))
        cfg = C.load(os.path.join(wlog, "config_fat.yaml"))
        floor_run(spark, os.path.join(wlog, "fat"), os.path.join(work, "warm", "floor"))
        t = time.perf_counter()
        build_run(spark, cfg, os.path.join(wlog, "fat"), os.path.join(work, "warm", "build"), as_of, args.days, None)
        print(f"warm-up build (not counted): {time.perf_counter() - t:.1f} s", flush=True)
        shutil.rmtree(os.path.join(work, "warm"), ignore_errors=True)

    rows = []
    for n in sizes:
        d = os.path.join(work, f"n{n}")
        params = dataclasses.replace(SynthParams(), bot_factor=args.bot_factor) if args.bot_factor else None
        s = make_log(os.path.join(d, "log"), n, args.days, args.max_seq_len, args.seed, params=params)
        log_path = os.path.join(d, "log", "fat")
        cfg = C.load(os.path.join(d, "log", "config_fat.yaml"))
        rows_in = sum(s["rows"]["fat"].values())
        floors, shuffles, skeletons, builds, steps, rep = [], [], [], [], None, None
        for k in range(args.reps):
            floors.append(floor_run(spark, log_path, os.path.join(d, "floor")))
            shuffles.append(shuffle_run(spark, log_path, os.path.join(d, "shuffle"), cfg.col("user"),
                                        cfg.col("request_time")))
            skeletons.append(skeleton_run(spark, cfg, log_path, os.path.join(d, "skeleton")))
            st = Steps(spark, ui)
            st.prefix = f"n{n}-r{k}-"
            el, rep = build_run(spark, cfg, log_path, os.path.join(d, "build"), as_of, args.days, st)
            builds.append(el)
            st.collect()
            if steps is None or el <= min(builds):
                steps = st
        b = byte_report(log_path, os.path.join(d, "build"), d, args.seed)
        row = {
            "impressions": rows_in, "target": n, "users": s["users"],
            "bot_impressions": None, "floor_s": round(min(floors), 2), "build_s": round(min(builds), 2),
            "floor_all_s": [round(x, 2) for x in floors], "build_all_s": [round(x, 2) for x in builds],
            "shuffle_s": round(min(shuffles), 2), "shuffle_all_s": [round(x, 2) for x in shuffles],
            "skeleton_s": round(min(skeletons), 2), "skeleton_all_s": [round(x, 2) for x in skeletons],
            "samples": rep["samples"], "requests": rep["requests"], "steps": steps.summary(), "bytes": b,
        }
        import pyarrow.compute as pc

        from userwise.pipelines.build.inputs import arrow_dataset

        uid = arrow_dataset(log_path).to_table(columns=["user_id"])["user_id"]
        row["bot_impressions"] = int(pc.sum(pc.equal(uid, s["bot_user_id"])).as_py())
        row["ratio"] = round(row["build_s"] / row["floor_s"], 1)
        row["build_us_per_imp"] = round(row["build_s"] / rows_in * 1e6, 1)
        row["floor_us_per_imp"] = round(row["floor_s"] / rows_in * 1e6, 1)
        rows.append(row)
        row["shuffle_ratio"] = round(row["shuffle_s"] / row["floor_s"], 2)
        row["skeleton_ratio"] = round(row["skeleton_s"] / row["floor_s"], 2)
        print(f"  {rows_in:>9,} impressions: floor {row['floor_s']:7.1f} s, one shuffle {row['shuffle_s']:7.1f} s, "
              f"least plan {row['skeleton_s']:7.1f} s ({row['skeleton_ratio']:.2f}x), "
              f"build {row['build_s']:7.1f} s, build/floor {row['ratio']:.1f}x", flush=True)
        if not args.keep:
            shutil.rmtree(d, ignore_errors=True)

    res = {"args": vars(args), "sizes": rows, "master": spark.sparkContext.master,
           "cpus": os.cpu_count(), "load_avg": os.getloadavg()}
    base = rows[0]["build_us_per_imp"]
    for r in rows:
        r["per_imp_vs_smallest"] = round(r["build_us_per_imp"] / base, 2)
    print()
    print(f"{'impressions':>12} {'bot share':>9} {'floor s':>8} {'least plan s':>12} {'build s':>8} "
          f"{'build/floor':>11} {'us/imp build':>12} {'vs smallest':>11} {'us/imp floor':>12}")
    for r in rows:
        print(f"{r['impressions']:>12,} {r['bot_impressions'] / r['impressions']:>9.1%} {r['floor_s']:>8.1f} "
              f"{r['skeleton_s']:>12.1f} {r['build_s']:>8.1f} {r['ratio']:>10.1f}x {r['build_us_per_imp']:>12.1f} "
              f"{r['per_imp_vs_smallest']:>11.2f} {r['floor_us_per_imp']:>12.1f}")
    print("\nsteps of the build (largest size):")
    print(f"{'step':>16} {'calls':>5} {'wall s':>7} {'share':>6} {'jobs':>5} {'stages':>6} {'tasks':>6} {'exec s':>7}")
    last = rows[-1]
    for st in last["steps"]:
        print(f"{st['step']:>16} {st['calls']:>5} {st['wall_s']:>7.1f} {st['wall_s'] / last['build_s']:>6.0%} "
              f"{st['jobs']:>5} {st['stages']:>6} {st['tasks']:>6} {st['executor_run_s']:>7.1f}")
    tot: dict[str, list] = {}
    for st in last["steps"]:
        for n, v in st.get("stages_by_tasks", {}).items():
            t = tot.setdefault(n, [0, 0.0])
            t[0] += v["stages"]
            t[1] += v["wall_s"]
    if tot:
        print("stage wall time by tasks per stage: " + ", ".join(
            f"{n} tasks: {v[0]} stages {v[1]:.0f} s" for n, v in sorted(tot.items(), key=lambda kv: -kv[1][1])))
    b = last["bytes"]
    print("\nbytes (largest size):")
    print(f"  on disk:   fat rows as written {b['disk_fat_as_written']:,}, fat rows in training order "
          f"{b['disk_fat_training_order']:,}, user-wise samples {b['disk_samples']:,}  -> {b['disk_ratio']}x")
    print(f"  in memory: fat rows {b['mem_fat']:,}, user-wise samples {b['mem_samples']:,}  -> {b['mem_ratio']}x")
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(res, f, indent=1, default=str)
    print(f"\nwrote {args.json}")
    if not args.no_plot:
        plot(res, args.plot)
        print(f"wrote {args.plot}")
    if not args.keep and not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
