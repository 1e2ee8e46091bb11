"""`userwise validate`: check a config against an input's schema and a sample of rows."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from userwise.pipelines import config as C
from userwise.pipelines.build.inputs import arrow_dataset, input_schema


def sample_problems(cfg: C.Config, table: pa.Table) -> list[str]:
    """Row-level problems in a sample (the build quarantines such rows)."""
    out = []
    for role in ("user", "request_time", "item"):
        c = cfg.col(role)
        n = table[c].null_count
        if n:
            out.append(f"{n} of {table.num_rows} sampled rows have a null {role} ({c!r}); they will be quarantined")
    for c in cfg.cols("labels"):
        col = table[c]
        if pa.types.is_floating(col.type):
            bad = pc.sum(pc.invert(pc.is_finite(col.fill_null(0)))).as_py() or 0
            if bad:
                out.append(f"{bad} sampled rows have a NaN or infinite label {c!r}; they will be quarantined")
    return out


def cli(args) -> int:
    cfg = C.load(args.config)
    schema = input_schema(args.input)
    layout = cfg.layout(schema)
    if args.actions:
        C.check_actions_columns(cfg, input_schema(args.actions))
    dset = arrow_dataset(args.input)
    sample = dset.head(args.sample_rows)
    problems = sample_problems(cfg, sample)
    print(f"config {args.config}: ok for {args.input} ({'fat rows' if layout.fat else 'lean log'}, "
          f"{len(schema)} columns, {len(layout.passthrough)} carried through unmapped)")
    for p in problems:
        print(f"warning: {p}")
    print(f"sampled {sample.num_rows} rows; {len(problems)} warnings")
    return 0
