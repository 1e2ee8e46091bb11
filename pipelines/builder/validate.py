"""`userwise validate`: the build's front door, without a JVM.

It refuses, with the build's own one-line error, everything the build would refuse
for the config, the inputs, the column names or types (the same functions check
both: ``config.parse``, ``inputs.resolve``, ``Config.layout``), and warns, from a
sample of rows, about what the build would quarantine en masse: rows with a null
key or a bad label, times outside the sane range, a ``time_unit`` that does not fit
the data, request ids shared by users within a day, and bad arrival times (null, out of
range, too early for their action or request: :func:`arrival_problems`).
"""

from __future__ import annotations

import datetime as dt

import pyarrow as pa
import pyarrow.compute as pc

from userwise.pipelines import config as C
from userwise.pipelines import console
from userwise.pipelines.builder.inputs import arrow_dataset, input_schema
from userwise.pipelines.errors import UserwiseError
from userwise.schemas.layout import UNITS_PER_SECOND

UNITS = UNITS_PER_SECOND
_TS_PER_SECOND = {**UNITS_PER_SECOND, "ns": 1_000_000_000}  # Arrow timestamps' units


def _epoch(col: pa.ChunkedArray, time_unit: str) -> pa.ChunkedArray:
    """A time column in time units (int64): an integer as it is, a timestamp converted."""
    t = col.type
    if pa.types.is_dictionary(t):
        col, t = col.cast(t.value_type), t.value_type
    if pa.types.is_timestamp(t):
        raw = col.cast(pa.timestamp(t.unit)).cast(pa.int64())
        num, den = UNITS[time_unit], _TS_PER_SECOND[t.unit]
        return pc.multiply(raw, num // den) if num >= den else pc.divide(raw, den // num)
    return col.cast(pa.int64())


def _plausible_year(v: float, ups: int) -> float:
    return 1970 + v / ups / (365.2425 * 86400)


def _unit_hint(cfg: C.Config, col: pa.ChunkedArray, name: str) -> str | None:
    """A time_unit that fits an integer time column better than the configured one."""
    if not pa.types.is_integer(col.type):
        return None
    vals = col.drop_null()
    if not len(vals):
        return None
    med = float(pc.approximate_median(vals).as_py())
    this_year = dt.date.today().year
    fits = [u for u, ups in UNITS.items() if 1971 <= _plausible_year(med, ups) <= this_year + 1]
    if cfg.time_unit in fits or not fits:
        return None
    u = fits[0]
    return (f"{name!r} looks like epoch {'seconds' if u == 's' else u} (its median {int(med)} is the year "
            f"{int(_plausible_year(med, UNITS[u]))} in {u}, {int(_plausible_year(med, cfg.units_per_second))} "
            f"in time_unit {cfg.time_unit}): set time_unit: {u}")


def sample_problems(cfg: C.Config, table: pa.Table) -> list[str]:
    """What the build would quarantine, seen in a sample of rows (``table``: input names)."""
    out = []
    n_rows = table.num_rows
    if not n_rows:
        return out
    for role in ("user", "request_time", "item"):
        c = cfg.col(role)
        n = table[c].null_count
        if n:
            out.append(f"{n} of {n_rows} sampled rows have a null {role} ({c!r}); they will be quarantined")
    for c in cfg.cols("labels"):
        col = table[c]
        if pa.types.is_floating(col.type):
            bad = pc.sum(pc.invert(pc.is_finite(col.fill_null(0)))).as_py() or 0
            if bad:
                out.append(f"{bad} sampled rows have a NaN or infinite label {c!r}; they will be quarantined")
    ups = cfg.units_per_second
    lo, hi, where = C.time_range(cfg)
    rt_name = cfg.col("request_time")
    seen = None  # rows already warned about (an action time is checked where the request time is fine)
    for role in ("request_time", "action_time"):
        c = cfg.col(role)
        if c is None or (role == "action_time" and c == rt_name):
            continue
        hint = _unit_hint(cfg, table[c], c)
        if hint:
            out.append(hint)
        t = _epoch(table[c], cfg.time_unit)
        bad = pc.or_(pc.less(t, lo), pc.greater_equal(t, hi))
        bad = bad.fill_null(False)
        if seen is not None:
            bad = pc.and_(bad, pc.invert(seen))
        seen = bad
        k = pc.sum(bad.cast(pa.int64())).as_py() or 0
        if k:
            out.append(f"{k / n_rows:.1%} of sampled rows ({k} of {n_rows}) have a {role} ({c!r}) {where}; "
                       "they will be quarantined as bad_time: set min_year/max_year (or time_unit) "
                       "to fit the log")
    out += arrival_problems(cfg, table)
    req = cfg.col("request")
    if req and cfg.request_scope != "user":
        rt = _epoch(table[rt_name], cfg.time_unit)
        day = pc.floor(pc.divide(rt.cast(pa.float64()), 86400 * ups))
        t = pa.table({"d": day, "r": table[req], "u": table[cfg.col("user")]}).drop_null()
        g = t.group_by(["d", "r"]).aggregate([("u", "count_distinct"), ("u", "count")])
        shared = g.filter(pc.greater(g["u_count_distinct"], 1))
        k = pc.sum(shared["u_count"]).as_py() or 0
        if k:
            out.append(f"{k / n_rows:.1%} of sampled rows ({k} of {n_rows}) are in requests whose id {req!r} is used "
                       f"by more than one user within a UTC day; they will be quarantined as request_user_conflict: "
                       f"if ids are unique per user only (e.g. they restart every local day), set request_scope: user")
    return out


def arrival_problems(cfg: C.Config, table: pa.Table) -> list[str]:
    """The arrival column's values the build would quarantine (or fill), on the sampled rows
    that are actions (an action label > 0): null (``null_arrival``), outside the sane range
    (``bad_time``), earlier than the action time less ``arrival_skew`` (``arrival_before_action``)
    or than the row's own request (``arrival_before_request``)."""
    col = cfg.col("arrival_time")
    if col is None or not table.num_rows:
        return []
    n_rows = table.num_rows
    act = None
    for c in cfg.action_labels:
        pos = pc.greater(table[c].cast(pa.float64()), 0).fill_null(False)
        act = pos if act is None else pc.or_(act, pos)
    arv = _epoch(table[col], cfg.time_unit)
    at_col = cfg.col("action_time") or cfg.col("request_time")
    at, rt = _epoch(table[at_col], cfg.time_unit), _epoch(table[cfg.col("request_time")], cfg.time_unit)
    lo, hi, where = C.time_range(cfg)
    null = pc.and_(act, pc.is_null(arv))
    bad = pc.and_(act, pc.or_(pc.less(arv, lo), pc.greater_equal(arv, hi)).fill_null(False))
    early = pc.and_(act, pc.less(arv, pc.subtract(at, cfg.skew_units)).fill_null(False))
    before = pc.and_(act, pc.less(arv, rt).fill_null(False))
    count = lambda m: pc.sum(m.cast(pa.int64())).as_py() or 0  # noqa: E731
    out = []
    k = count(null)
    if k:
        fate = ("they will arrive at their action time + availability_lag (null_arrival: lag)"
                if cfg.null_arrival == "lag" else "they will be quarantined as null_arrival_time")
        out.append(f"{k} of {n_rows} sampled rows are actions with a null arrival_time ({col!r}); {fate}")
    for m, what, reason in ((bad, where, "bad_time"),
                            (early, f"more than arrival_skew ({cfg.arrival_skew}) before their action time",
                             "arrival_before_action"),
                            (before, "before their own request time", "arrival_before_request")):
        k = count(m)
        if k:
            out.append(f"{k / n_rows:.1%} of sampled rows ({k} of {n_rows}) are actions with an arrival_time ({col!r}) "
                       f"{what}; they will be quarantined as {reason}: check the arrival column (and arrival_skew)")
    return out


def check(cfg: C.Config, input_path: str, actions_path: str | None = None):
    """What ``validate`` and the build's commands check before any Spark: the config against
    the input's schema (names, roles, types) and the action log's; returns (schema, layout).
    Raises the one-line error a build would."""
    if cfg.fat and actions_path:  # the build's own check (range.build)
        raise UserwiseError("--actions is for lean input; fat rows carry their own sequence")
    schema = input_schema(input_path)
    layout = cfg.layout(schema)
    if actions_path:
        a_schema = input_schema(actions_path)
        C.check_types(a_schema)
        C.check_actions_columns(cfg, a_schema)
    return schema, layout


def front_door(cfg: C.Config, input_path: str, actions_path: str | None = None) -> None:
    """The build's commands run :func:`check` first, without a JVM, where pyarrow reads the
    input (local paths); inputs on file systems only Spark reads are checked by the build."""
    paths = [p for p in (input_path, actions_path) if p]
    if all("://" not in p or p.startswith("file:") for p in paths):
        check(cfg, input_path, actions_path)


def cli(args) -> int:
    cfg = C.load(args.config)
    schema, layout = check(cfg, args.input, args.actions)
    dset = arrow_dataset(args.input)
    sample = dset.head(args.sample_rows)
    sample = sample.cast(pa.schema([pa.field(f.name, t.type, f.nullable)
                                    for f, t in zip(sample.schema, schema)])) if sample.schema != schema else sample
    problems = sample_problems(cfg, sample)
    rep = {"config": args.config, "input": args.input, "ok": True, "kind": "fat rows" if layout.fat else "lean log",
           "columns": len(schema), "unmapped": len(layout.passthrough), "sampled_rows": sample.num_rows,
           "warnings": problems}
    console.emit(rep, lambda r: "\n".join(
        [f"config {r['config']}: ok for {r['input']} ({r['kind']}, {r['columns']} columns, {r['unmapped']} "
         "carried through unmapped)"] + [f"warning: {p}" for p in r["warnings"]]
        + [f"sampled {r['sampled_rows']} rows; {len(r['warnings'])} warnings"]))
    return 0
