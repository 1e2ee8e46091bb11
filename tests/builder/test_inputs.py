"""Any log a user has: every input form and type through validate, build and expand.

A corpus of tiny logs, each built once through the CLI: a Delta table read at an older
version, a single Parquet file of 1997 with odd column names and every kind of
timestamp and id, a hive folder whose files also hold the partition column read
through a glob and a list, daily-reset request ids under each ``request_scope``, and
``userwise synth --format delta``. Expanded rows are compared with the oracle
(tests/support/oracle.py) and with the input's own Arrow types; ``validate`` and
``build`` must refuse every config and schema fault with the same ``error:`` line.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import io
import json
import os
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from tests.support import oracle as O
from userwise.pipelines import cli

pytestmark = pytest.mark.spark

DAY0 = dt.date(2026, 3, 1)
OLD0 = dt.date(1997, 3, 1)


# --------------------------------------------------------------------------
# the corpus
# --------------------------------------------------------------------------
def ms(day: dt.date, hour: int = 0, minute: int = 0) -> int:
    return int(dt.datetime(day.year, day.month, day.day, hour, minute, tzinfo=dt.timezone.utc).timestamp()) * 1000


def base(day0: dt.date = DAY0, reset_ids: bool = False) -> pa.Table:
    """4 users x 2 days x 2 requests x 3 impressions; every other impression clicked.
    reset_ids: users 1 and 2 number their requests r0, r1 afresh each day (so they share
    ids within a UTC day); users 3 and 4 have ids of their own."""
    rows = []
    for d in range(2):
        day = day0 + dt.timedelta(days=d)
        for u in (1, 2, 3, 4):
            for k in range(2):
                t = ms(day, 2 + 6 * k + u, 7 * u)
                rid = f"r{k}" if reset_ids and u <= 2 else f"d{d}-u{u}-r{k}"
                for p in range(3):
                    item = 100 + (7 * u + 3 * k + p + d) % 11
                    click = (u + k + p + d) % 2
                    rows.append({"row_uid": len(rows), "date": day, "user_id": u, "request_id": rid,
                                 "request_ts": t, "action_ts": t + 1000 * (p + 1) if click else t,
                                 "item_id": item, "position": p, "click": click, "category": item % 5,
                                 "device": "ios" if u % 2 else "web"})
    t = pa.Table.from_pylist(rows)
    return t.cast(pa.schema([
        ("row_uid", pa.int64()), ("date", pa.date32()), ("user_id", pa.int64()), ("request_id", pa.string()),
        ("request_ts", pa.int64()), ("action_ts", pa.int64()), ("item_id", pa.int64()), ("position", pa.int32()),
        ("click", pa.int8()), ("category", pa.int32()), ("device", pa.string())]))


def config(**over) -> dict:
    cols = {"user": "user_id", "request": "request_id", "request_time": "request_ts", "action_time": "action_ts",
            "item": "item_id", "position": "position", "labels": ["click"], "item_features": ["category"],
            "context_features": ["device"]}
    cols.update(over.pop("columns", {}))
    c = {"columns": cols, "time_unit": "ms", "max_seq_len": 3, "history_length": 6, "max_sample_cost": 40,
         "max_quarantine_share": 0.0}
    c.update(over)
    return c


def odd_types(t: pa.Table) -> pa.Table:
    """The 1997 log with odd names and types: a uint32 user under a dotted name, string items,
    int32 request ids, a zoned ms request time, a zone-less ns action time, features named
    len / item price / action, a context feature named ts, unmapped _user, user, a seconds
    timestamp with a zone, uint64 values past int64 and a large string."""
    n = t.num_rows
    item = t["item_id"].to_pylist()
    rid = [int(r.split("-")[0][1:]) * 100 + int(r.split("-")[1][1:]) * 10 + int(r.split("-")[2][1:])
           for r in t["request_id"].to_pylist()]
    uid = t["row_uid"].to_pylist()
    return pa.table({
        "row_uid": t["row_uid"],
        "user.id": t["user_id"].cast(pa.uint32()),
        "request_id": pa.array(rid, pa.int32()),
        "request_ts": t["request_ts"].cast(pa.timestamp("ms", tz="UTC")),
        "action_ts": pa.array([a * 1_000_000 for a in t["action_ts"].to_pylist()], pa.timestamp("ns")),
        "item id": pa.array([f"i{x}" for x in item]),
        "position": t["position"],
        "click": t["click"],
        "len": t["category"],
        "item price": pa.array([x * 0.5 for x in item]),
        "action": pa.array([x % 3 for x in item], pa.int8()),
        "ts": t["device"],
        "_user": pa.array([f"u{u}" for u in uid]),
        "user": pa.array([2 * u for u in uid], pa.int64()),
        "sec": pa.array([1_000_000_000 + u for u in uid], pa.timestamp("s", tz="Europe/Paris")),
        "big": pa.array([2**63 + u for u in uid], pa.uint64()),
        "ls": pa.array([f"s{u}" for u in uid], pa.large_string()),
    }).slice(0, n)


ODD_CONFIG = config(columns={"user": "user.id", "item": "item id", "item_features": ["len", "item price", "action"],
                             "context_features": ["ts"]})


def write_yaml(cfg: dict, path: Path) -> str:
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return str(path)


def run_cli(argv: list) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main([str(a) for a in argv])
    return rc, out.getvalue(), err.getvalue()


def error_lines(err: str) -> list[str]:
    assert "Traceback" not in err, err
    return [ln for ln in err.splitlines() if ln.startswith("error:")]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    """name -> (input spec, config dict, as-of, oracle input path, rejected row uids)."""
    from deltalake import write_deltalake

    d = tmp_path_factory.mktemp("corpus")
    out = {}
    # Delta, partitioned by date, read at version 0 (version 1 keeps half the rows)
    t = base()
    t = t.set_column(t.schema.get_field_index("request_ts"), pa.field("request_ts", pa.timestamp("us", tz="UTC")),
                     t["request_ts"].cast(pa.timestamp("ms", tz="UTC")).cast(pa.timestamp("us", tz="UTC")))
    write_deltalake(str(d / "delta"), t, partition_by=["date"])
    write_deltalake(str(d / "delta"), t.slice(0, t.num_rows // 2), mode="overwrite")
    pq.write_table(t, d / "delta_v0.parquet")
    out["delta"] = (f"{d / 'delta'}@v0", config(), "2026-03-03", str(d / "delta_v0.parquet"), set())
    # one Parquet file from 1997: odd names and types; the default time range takes it
    odd = odd_types(base(OLD0))
    pq.write_table(odd, d / "odd.parquet")
    # the oracle's own seq_action would meet a feature named action: it reads a renamed copy
    pq.write_table(odd.rename_columns(["f_action" if c == "action" else c for c in odd.column_names]),
                   d / "odd_oracle.parquet")
    ocfg = json.loads(json.dumps(ODD_CONFIG))
    ocfg["columns"]["item_features"] = ["len", "item price", "f_action"]
    out["odd"] = (str(d / "odd.parquet"), ODD_CONFIG, "1997-03-03", (str(d / "odd_oracle.parquet"), ocfg), set())
    # a hive folder whose files hold `date` too, given as a list of a folder and a glob;
    # epoch seconds in int32; request ids that restart every day, unique per user
    r = base(reset_ids=True)
    secs = pa.array([v // 1000 for v in r["request_ts"].to_pylist()], pa.int32())
    asecs = pa.array([v // 1000 for v in r["action_ts"].to_pylist()], pa.int32())
    r = r.set_column(4, "request_ts", secs).set_column(5, "action_ts", asecs)
    for day in (DAY0, DAY0 + dt.timedelta(days=1)):
        part = d / "hive" / f"date={day.isoformat()}"
        part.mkdir(parents=True)
        pq.write_table(r.filter(pa.compute.equal(r["date"], pa.scalar(day, pa.date32()))), part / "part-0.parquet")
    spec = f"{d / 'hive' / 'date=2026-03-01'},{d / 'hive'}/date=2026-03-0[2-9]"
    pq.write_table(r, d / "reset.parquet")
    conflict = {u for u, user in zip(r["row_uid"].to_pylist(), r["user_id"].to_pylist()) if user <= 2}
    for scope in ("global", "day", "user"):
        cfg = config(time_unit="s", request_scope=scope, max_quarantine_share=1.0 if scope != "user" else 0.0)
        out[f"reset-{scope}"] = (spec, cfg, "2026-03-03", str(d / "reset.parquet"),
                                 set() if scope == "user" else conflict)
    out["_dir"] = d
    return out


# --------------------------------------------------------------------------
# validate: every form reads, without a JVM
# --------------------------------------------------------------------------
def test_every_form_validates_and_reads_the_input_own_schema(corpus, tmp_path):
    from userwise.pipelines.builder import inputs

    for name in ("delta", "odd", "reset-user"):
        spec, cfg, *_ = corpus[name]
        rc, out, err = run_cli(["validate", "--config", write_yaml(cfg, tmp_path / f"{name}.yaml"), "--input", spec])
        assert rc == 0, (name, err)
        assert "ok for" in out and "warning:" not in out, (name, out)
    d = corpus["_dir"]
    # the hive folder whose files hold its partition column (pyarrow alone cannot merge them)
    sch = inputs.input_schema(str(d / "hive"))
    assert sch.field("date").type == pa.date32() and sch.names.count("date") == 1
    # a single file keeps every type as written (the seconds timestamp and its zone included)
    odd = inputs.input_schema(str(d / "odd.parquet"))
    assert odd == pq.read_schema(d / "odd.parquet").remove_metadata()
    # time travel: @v0 and --input-version 0 read version 0, the plain path the latest
    assert inputs.arrow_dataset(f"{d / 'delta'}@v0").count_rows() == 48
    assert inputs.arrow_dataset(str(d / "delta")).count_rows() == 24
    rc, out, err = run_cli(["validate", "--config", write_yaml(config(), tmp_path / "c.yaml"),
                            "--input", d / "delta", "--input-version", "0", "--sample-rows", 100])
    assert rc == 0 and "sampled 48 rows" in out, (out, err)
    # a glob of files and a comma list read the same rows
    assert inputs.arrow_dataset(f"{d / 'hive'}/*/*.parquet").count_rows() == 48
    assert inputs.arrow_dataset(corpus["reset-user"][0]).count_rows() == 48


def _validate_warnings(cfg: dict, spec, tmp_path) -> list[str]:
    rc, out, err = run_cli(["validate", "--config", write_yaml(cfg, tmp_path / "w.yaml"), "--input", spec])
    assert rc == 0, err
    return [ln for ln in out.splitlines() if ln.startswith("warning:")]


def test_validate_warns_what_would_be_quarantined_en_masse(corpus, tmp_path):
    d = corpus["_dir"]
    old = _validate_warnings(dict(ODD_CONFIG, min_year=2000), d / "odd.parquet", tmp_path)
    assert len(old) == 1 and "min_year 2000" in old[0] and "100.0%" in old[0] and "bad_time" in old[0], old
    secs = _validate_warnings(config(), d / "reset.parquet", tmp_path)  # epoch seconds read as ms
    assert any("set time_unit: s" in w for w in secs), secs
    shared = _validate_warnings(config(time_unit="s"), d / "reset.parquet", tmp_path)
    assert len(shared) == 1 and "request_scope: user" in shared[0] and "50.0%" in shared[0], shared
    assert _validate_warnings(config(time_unit="s", request_scope="user"), d / "reset.parquet", tmp_path) == []


# --------------------------------------------------------------------------
# build and expand
# --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def built(spark, corpus, tmp_path_factory):
    """name -> (report, expanded folder), each corpus log built and expanded once."""
    cache: dict = {}

    def get(name: str):
        if name not in cache:
            spec, cfg, as_of, *_ = corpus[name]
            d = tmp_path_factory.mktemp(f"build-{name}")
            argv = ["build", "--config", write_yaml(cfg, d / "c.yaml"), "--input", spec, "--build-dir", d / "out",
                    "--as-of", as_of, "--incremental-days", 1, "--window-days", 1, "--report", d / "r.json"]
            rc, _, err = run_cli(argv)
            assert rc == 0, (name, err)
            rc, _, err = run_cli(["expand", "--build-dir", d / "out", "--expanded", d / "x.parquet"])
            assert rc == 0, (name, err)
            cache[name] = (json.loads((d / "r.json").read_text()), d / "x.parquet")
        return cache[name]

    return get


def _oracle(corpus, name) -> pl.DataFrame:
    spec, cfg, as_of, src, rejected = corpus[name]
    if isinstance(src, tuple):  # the renamed copy (odd): rename its answer back
        src, ocfg = src
        want = O.expected_pointwise(src, ocfg, as_of, rejected)
        return want.rename({"f_action": "action", "seq_f_action": "seq__action", "seq_len": "seq__len"})
    return O.expected_pointwise(src, cfg, as_of, rejected)


@pytest.mark.parametrize("name", ["delta", "odd", "reset-user"])
def test_round_trip_matches_the_oracle_and_the_input_types(name, corpus, built):
    report, x = built(name)
    spec, cfg, as_of, src, rejected = corpus[name]
    want = _oracle(corpus, name)
    assert report["reconciled"] and report["impressions_in_samples"] == want.height == 48 - len(rejected)
    got = O.read_parquet_dir(x)
    assert got.columns == want.columns, (got.columns, want.columns)
    diff = O.frame_diff(got, want)
    assert diff == [], "\n".join(diff)
    # the input's own Arrow types, timestamp units and zones included
    from userwise.pipelines.builder import inputs

    own = inputs.input_schema(spec)
    back = pq.read_table(x).schema
    assert back.remove_metadata().field(0).type == own.field(0).type
    for f in own:
        assert back.field(f.name).type == f.type, (f.name, back.field(f.name).type, f.type)


def test_expand_output_is_a_plain_zstd_folder_that_any_reader_reads(built, corpus):
    import duckdb

    _, x = built("odd")
    own = pq.read_schema(corpus["_dir"] / "odd.parquet")
    files = sorted(os.listdir(x))
    assert files and all(f.startswith("part-") and f.endswith(".parquet") for f in files), files
    assert pq.ParquetFile(x / files[0]).metadata.row_group(0).column(0).compression == "ZSTD"
    n = pl.read_parquet(f"{x}/*.parquet").height
    assert n == pq.read_table(x).num_rows == duckdb.sql(f"SELECT count(*) FROM '{x}/*.parquet'").fetchall()[0][0] == 48
    t = pq.read_table(x)
    assert t.schema.field("request_ts").type == pa.timestamp("ms", tz="UTC")
    assert t.schema.field("action_ts").type == pa.timestamp("ns")
    # Parquet has no seconds unit: pyarrow writes and reads the seconds column as ms, zone kept
    assert t.schema.field("sec").type == own.field("sec").type == pa.timestamp("ms", tz="Europe/Paris")
    assert t.schema.field("ls").type == pa.large_string() and t.schema.field("user.id").type == pa.uint32()
    assert t.column("big").to_pylist() == [2**63 + u for u in t.column("row_uid").to_pylist()]


def test_feature_names_equal_to_ours_do_not_collide(built, spark):
    """len, action, ts and user are the user's: stored as seq__len, ev__action, req__ts, imp__user."""
    _, x = built("odd")
    out = Path(x).parent / "out"
    samples = spark.read.format("delta").load(str(out / "samples")).columns
    for c in ("num_events", "seq__len", "seq_action", "seq__action", "req__ts", "imp__user", "imp__%5Fuser",
              "imp__item%20price", "seq_item%20price", "user"):
        assert c in samples, (c, samples)
    events = spark.read.format("delta").load(str(out / "events")).columns
    assert "ev_action" in events and "ev__action" in events and "ev__len" in events


@pytest.mark.parametrize("scope", ["global", "day"])
def test_daily_reset_ids_conflict_unless_request_scope_is_user(scope, corpus, built):
    report, x = built(f"reset-{scope}")
    *_, rejected = corpus[f"reset-{scope}"]
    assert report["quarantined"] == {"request_user_conflict": len(rejected)} and len(rejected) == 24
    diff = O.frame_diff(O.read_parquet_dir(x), _oracle(corpus, f"reset-{scope}"))
    assert diff == [], "\n".join(diff)
    user_report, _ = built("reset-user")
    assert user_report["quarantined"] == {} and user_report["impressions_in_samples"] == 48


def test_a_file_system_only_spark_reads_is_read_through_spark(spark, corpus, monkeypatch):
    """Where pyarrow cannot open the input's file system (s3a://, hdfs:// without libhdfs),
    the build resolves and reads the input through Spark's Hadoop file systems."""
    from userwise.pipelines.builder import inputs

    d = corpus["_dir"]
    specs = {f"{d / 'hive'},{d / 'reset.parquet'}": 96, f"{d / 'delta'}@v0": 48}
    want = {spec: inputs.read_spark(spark, spec) for spec in specs}

    def unavailable(path):
        raise inputs.FileSystemUnavailable(f"input {path!r}: no file system")

    monkeypatch.setattr(inputs, "_fs", unavailable)
    key = ["row_uid", "_file", "_row"]
    for spec, n in specs.items():
        got = inputs.read_spark(spark, spec)
        assert sorted(got.columns) == sorted(want[spec].columns), spec
        assert sorted(got.select(*key).collect()) == sorted(want[spec].select(*key).collect())
        assert got.count() == n, spec
    with pytest.raises(inputs.InputError, match="does not exist"):
        inputs.read_spark(spark, str(d / "nope"))


def test_synth_delta_output_builds(spark, tmp_path):
    rc, _, err = run_cli(["synth", "--output", tmp_path / "s", "--users", 6, "--days", 2, "--format", "delta",
                          "--kinds", "lean"])
    assert rc == 0, err
    rc, out, err = run_cli(["build", "--config", tmp_path / "s" / "config.yaml", "--input", tmp_path / "s" / "lean",
                            "--build-dir", tmp_path / "out", "--as-of", "2026-01-03", "--incremental-days", 1,
                            "--window-days", 1, "--report", tmp_path / "r.json"])
    assert rc == 0, err
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["reconciled"] and rep["impressions_in_samples"] == rep["rows_read"] > 0


# --------------------------------------------------------------------------
# validate is the build's front door: the same error, first
# --------------------------------------------------------------------------
def _fault_cases(d: Path) -> dict:
    good = str(d / "delta_v0.parquet")
    f16 = d / "f16.parquet"
    if not f16.exists():
        t = pq.read_table(good)
        pq.write_table(t.append_column("half", pa.array([1.5] * t.num_rows, pa.float16())), f16)
    price = d / "price.parquet"
    if not price.exists():
        t = pq.read_table(good)
        pq.write_table(t.append_column("price", pa.array([0.5] * t.num_rows)), price)
    other = d / "other.parquet"
    if not other.exists():
        pq.write_table(pq.read_table(good).drop_columns(["device"]), other)
    cols = config()["columns"]
    return {
        "unknown key": (dict(config(), colour=1), good),
        "missing role": (dict(config(), columns={k: v for k, v in cols.items() if k != "item"}), good),
        "typo": (config(columns={"item": "item_idd"}), good),
        "time not a time": (config(columns={"request_time": "device"}), good),
        "label not numeric": (config(columns={"labels": ["device"]}), good),
        "id of a float": (config(columns={"user": "price"}), str(d / "price.parquet")),
        "scope": (config(request_scope="session"), good),
        "max_year": (config(max_year=1960), good),
        "unsupported type": (config(), str(f16)),
        "no such input": (config(), str(d / "nope")),
        "glob matches nothing": (config(), str(d / "nope-*")),
        "version of parquet": (config(), f"{good}@v3"),
        "list of other columns": (config(), f"{good},{other}"),
        "fat rows with an action log": (config(columns={"sequence": {"item": "device", "time": "device"}}), good),
    }


def test_a_dominant_quarantine_reason_names_its_config_key():
    from userwise.pipelines.builder import ingest

    assert ingest.limit_hint({"bad_time": 97, "null_user": 3}) == \
        "; 97% of them are bad_time: check min_year, max_year and time_unit"
    assert "request_scope" in ingest.limit_hint({"request_user_conflict": 24})
    assert ingest.limit_hint({"bad_time": 5, "null_user": 5}) == ""  # none dominates


def test_validate_and_build_refuse_every_fault_with_the_same_line(spark, corpus, tmp_path):
    cases = _fault_cases(corpus["_dir"])
    for name, (cfg, spec) in cases.items():
        c = write_yaml(cfg, tmp_path / "f.yaml")
        extra = ["--actions", spec] if name == "fat rows with an action log" else []
        rc_v, _, err_v = run_cli(["validate", "--config", c, "--input", spec, *extra])
        rc_b, _, err_b = run_cli(["build", "--config", c, "--input", spec, "--build-dir", tmp_path / "o",
                                  "--as-of", "2026-03-03", "--incremental-days", 1, "--window-days", 1, *extra])
        lv, lb = error_lines(err_v), error_lines(err_b)
        assert rc_v == rc_b == 2 and len(lv) == 1 and lv == lb, (name, err_v, err_b)
        assert not (tmp_path / "o" / "samples").exists(), name
