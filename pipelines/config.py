"""The YAML config: column roles and build limits, validated on load.

Errors name the key, the column and the fix, in one line, e.g.::

    config error at columns.labels[1]: column 'clik' is not in the input; did you mean 'click'?
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import difflib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import yaml

from userwise.pipelines.errors import ConfigError, short
from userwise.schemas import TIME_UNITS, Layout, SeqField
from userwise.schemas.layout import (
    UNITS_PER_SECOND,
    field_name,
    snapshot_element_type,
    source_schema_of,
    storage_name,
    storage_schema,
    storage_type,
)

COLUMN_ROLES = {
    "user": "str",
    "request": "str",
    "request_time": "str",
    "action_time": "str",
    # when each action reached serving (lean input; docs/pointer.md): a request sees the events
    # that had arrived before it, in arrival order
    "arrival_time": "str",
    "item": "str",
    "position": "str",
    "labels": "list",
    "action_labels": "list",
    "item_features": "list",
    "context_features": "list",
    "user_features": "list",
    # the features (of item_features, context_features, user_features) whose values are ids,
    # each looked up in an embedding table: the build counts them (id_stats) like the item
    "id_features": "list",
    "sequence": "dict",
    "actions": "dict",
}
REQUIRED_ROLES = ("user", "request_time", "item", "labels")
REQUEST_SCOPES = ("global", "day", "user")
ACTION_ROLES = {"user": "str", "item": "str", "time": "str", "labels": "str|list", "item_features": "list",
                "arrival": "str"}
NULL_ARRIVALS = ("lag", "quarantine")
TOP_KEYS = {
    "columns": None,
    "time_unit": "ms",
    "max_seq_len": 1000,
    "history_length": 2000,
    # a sample's cost is its stored events + impressions (+ override events, fat rows); a
    # user's requests fill a chunk in order until the next would take it over this cap (a
    # request over the cap alone is a chunk of its own)
    "max_sample_cost": 20000,
    "max_quarantine_share": 0.01,
    "seed": 0,
    # sane time range for request / action times: from January 1st of min_year (UTC) to
    # January 1st of max_year; max_year null: to the end of the day after the run's UTC
    # date (a time further ahead is a broken row). Rows at or after as-of and within the
    # range are left for a later build, so nothing after as-of is ever built.
    "min_year": 1970,
    "max_year": None,
    # how unique request ids are: global (across users; a request is (UTC day, id)),
    # day (the same key: ids restart each UTC day), user (ids unique per user: (day, user, id))
    "request_scope": "global",
    # skew: rows of one user are split by this time bucket before any per-user window
    "skew_bucket_seconds": 3600,
    # how long after its action time an event is visible to serving (lean input): a duration
    # with its unit (500ms, 30s, 5m, 2h, 1d) or 0; a request at t sees the events before t - lag
    "availability_lag": 0,
    # events per block of the event chain every sample carries (schemas.hashing): a serving
    # cache verifies its K/V against it in blocks of this many events (its page size)
    "chain_block": 64,
    # with an arrival column (columns.arrival_time, columns.actions.arrival): how far an arrival
    # may precede its action time (a client clock running ahead) before the row is quarantined
    # (arrival_before_action), and what a null arrival of an action means: lag (it arrived at
    # its action time + availability_lag) or quarantine (null_arrival_time)
    "arrival_skew": "5m",
    "null_arrival": "lag",
    # the id statistics' hot / warm / cold split (id_stats): per id column and set, the
    # most looked-up ids fill the hot budget (kept data-parallel on every GPU), the next the
    # warm one (sharded in GPU memory), the rest are cold (CPU memory or SSD). A budget is a
    # number of ids or bytes with their unit (B, KiB, MiB, GiB, TiB) of rows of embedding_dim
    # values of embedding_bytes each
    "hot_budget": "256MiB",
    "warm_budget": "16GiB",
    "embedding_dim": 128,
    "embedding_bytes": 4,
}
# the units a budget in bytes may be written in
BYTE_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
# the units availability_lag may be written in, in microseconds
DURATION_UNITS = {"us": 1, "ms": 1000, "s": 1_000_000, "m": 60_000_000, "h": 3_600_000_000, "d": 86_400_000_000}


@dataclass(frozen=True)
class ActionsConfig:
    user: str
    item: str
    time: str
    labels: tuple[str, ...] | str  # list of label columns, or one bits column
    item_features: tuple[str, ...] = ()
    arrival: str | None = None  # when each action reached serving (None: action time + lag)


@dataclass(frozen=True)
class Config:
    columns: dict[str, Any]
    time_unit: str = "ms"
    max_seq_len: int = 1000
    history_length: int = 2000
    max_sample_cost: int = 20000
    max_quarantine_share: float = 0.01
    seed: int = 0
    min_year: int = 1970
    max_year: int | None = None
    request_scope: str = "global"
    skew_bucket_seconds: int = 3600
    availability_lag: int | str = 0
    chain_block: int = 64
    arrival_skew: int | str = "5m"
    null_arrival: str = "lag"
    hot_budget: int | str = "256MiB"
    warm_budget: int | str = "16GiB"
    embedding_dim: int = 128
    embedding_bytes: int = 4
    actions: ActionsConfig | None = None
    source: str | None = field(default=None, compare=False)

    # -- role accessors -----------------------------------------------------
    def col(self, role: str) -> str | None:
        return self.columns.get(role)

    def cols(self, role: str) -> tuple[str, ...]:
        return tuple(self.columns.get(role) or ())

    @property
    def fat(self) -> bool:
        return bool(self.columns.get("sequence"))

    @property
    def sequence(self) -> dict[str, str]:
        return dict(self.columns.get("sequence") or {})

    @property
    def action_labels(self) -> tuple[str, ...]:
        return self.cols("action_labels") or self.cols("labels")

    @property
    def id_columns(self) -> tuple[tuple[str, str], ...]:
        """The id columns the build counts (``id_stats``), as (role, column): the item, then
        every feature listed in ``columns.id_features``, by role."""
        ids = set(self.cols("id_features"))
        out = [("item", self.col("item"))]
        for role in ("item_features", "context_features", "user_features"):
            out += [(role[:-1], c) for c in self.cols(role) if c in ids]
        return tuple(out)

    @property
    def budget_ids(self) -> tuple[int, int]:
        """The hot and warm budgets in ids (:func:`budget_ids`)."""
        return (budget_ids(self.hot_budget, self.embedding_dim, self.embedding_bytes, "hot_budget"),
                budget_ids(self.warm_budget, self.embedding_dim, self.embedding_bytes, "warm_budget"))

    @property
    def units_per_second(self) -> int:
        return UNITS_PER_SECOND[self.time_unit]

    @property
    def lag_units(self) -> int:
        """``availability_lag`` in time units: a request at t sees the events before t - lag."""
        return duration_units(self.availability_lag, self.time_unit)

    @property
    def arrivals(self) -> bool:
        """Whether events carry an arrival time (an arrival column of the impressions or of the
        action log): then a request sees the events that had arrived before it, in arrival order."""
        return bool(self.col("arrival_time")) or (self.actions is not None and self.actions.arrival is not None)

    @property
    def skew_units(self) -> int:
        """``arrival_skew`` in time units: how far an arrival may precede its action time."""
        return duration_units(self.arrival_skew, self.time_unit, "arrival_skew")

    def storage(self) -> Config:
        """The same config with every column named by its storage name (as the Spark
        frames and our tables name input columns; schemas.layout.storage_name)."""
        n = storage_name
        cols = {}
        for k, v in self.columns.items():
            if isinstance(v, str):
                cols[k] = n(v)
            elif isinstance(v, dict):
                cols[k] = {r: n(c) for r, c in v.items()}
            else:
                cols[k] = [n(c) for c in v]
        actions = self.actions
        if actions is not None:
            labels = tuple(n(c) for c in actions.labels) if isinstance(actions.labels, tuple) else n(actions.labels)
            actions = ActionsConfig(user=n(actions.user), item=n(actions.item), time=n(actions.time), labels=labels,
                                    item_features=tuple(n(c) for c in actions.item_features),
                                    arrival=None if actions.arrival is None else n(actions.arrival))
        return dataclasses.replace(self, columns=cols, actions=actions)

    def to_dict(self) -> dict:
        out = {k: getattr(self, k) for k in TOP_KEYS if k != "columns"}
        out["columns"] = dict(self.columns)
        if self.actions is not None:
            a = self.actions
            out["columns"]["actions"] = {
                "user": a.user,
                "item": a.item,
                "time": a.time,
                "labels": list(a.labels) if isinstance(a.labels, tuple) else a.labels,
                "item_features": list(a.item_features),
                **({"arrival": a.arrival} if a.arrival is not None else {}),
            }
        return out

    # -- resolution against an input ----------------------------------------
    def layout(self, schema: pa.Schema) -> Layout:
        """Check every mapped column against the input schema and build the layout.

        ``schema``: the input's own schema (names and types as a reader of the input sees
        them), or a layout's storage schema (which carries the input's in its metadata).
        Errors name the input's own columns; the layout holds the storage form."""
        source = source_schema_of(schema)
        check_types(source)
        check_columns(self, source)
        cfg = self.storage()
        schema = storage_schema(source)
        return cfg._layout(schema)

    def _layout(self, schema: pa.Schema) -> Layout:
        f = lambda c: None if c is None else schema.field(c)  # noqa: E731
        mapped = {
            self.col("user"),
            self.col("request"),
            self.col("request_time"),
            self.col("action_time"),
            self.col("arrival_time"),
            self.col("item"),
            self.col("position"),
            *self.cols("labels"),
            *self.cols("item_features"),
            *self.cols("context_features"),
            *self.cols("user_features"),
            *self.sequence.values(),
        }
        passthrough = tuple(x for x in schema if x.name not in mapped)
        snapshot: tuple[SeqField, ...] = ()
        if self.fat:
            # the required roles keep their names (seq_item, seq_time); others are user-named
            snapshot = tuple(
                SeqField(role if role in ("item", "time") else field_name(storage_name(role)),
                         snapshot_element_type(schema.field(c).type, c), c)
                for role, c in self.sequence.items()
            )
        return Layout(
            fat=self.fat,
            time_unit=self.time_unit,
            user=f(self.col("user")),
            request=f(self.col("request")),
            request_time=f(self.col("request_time")),
            action_time=f(self.col("action_time")),
            item=f(self.col("item")),
            position=f(self.col("position")),
            labels=tuple(schema.field(c) for c in self.cols("labels")),
            action_labels=self.action_labels,
            item_features=tuple(schema.field(c) for c in self.cols("item_features")),
            context_features=tuple(schema.field(c) for c in self.cols("context_features")),
            user_features=tuple(schema.field(c) for c in self.cols("user_features")),
            passthrough=passthrough,
            snapshot=snapshot,
            input_schema=schema,
            arrival_time=f(self.col("arrival_time")),
            arrivals=self.arrivals,
        )


SECONDS_PER_DAY = 86400


def duration_units(value: Any, time_unit: str, key: str = "availability_lag") -> int:
    """A duration of the config (``availability_lag``: ``0`` or a whole number with its unit,
    one of :data:`DURATION_UNITS`: ``500ms``, ``30s``, ``5m``, ``2h``, ``1d``) in ``time_unit``
    units. ConfigError when it is not one, or not a whole number of time units.

    Example::

        duration_units("30s", "ms")    # 30000
    """
    if value == 0 and not isinstance(value, bool):
        return 0
    m = re.fullmatch(r"\s*(\d+)\s*([a-z]+)\s*", value) if isinstance(value, str) else None
    if m is None or m.group(2) not in DURATION_UNITS:
        raise ConfigError(key, f"expected 0 or a duration with its unit "
                          f"({', '.join(DURATION_UNITS)}), e.g. 30s or 500ms; found {value!r}")
    micros = int(m.group(1)) * DURATION_UNITS[m.group(2)]
    per = 1_000_000 // UNITS_PER_SECOND[time_unit]  # microseconds per time unit
    if micros % per:
        raise ConfigError(key, f"{value!r} is not a whole number of time_unit {time_unit}; "
                          f"write it in {time_unit} or a larger unit")
    return micros // per


def budget_ids(value: Any, dim: int, value_bytes: int, key: str = "hot_budget") -> int:
    """A budget of the id statistics' split in ids: a whole number is ids; a string is bytes
    with their unit (:data:`BYTE_UNITS`), rows of ``dim`` values of ``value_bytes`` bytes each
    (rounded down). ConfigError naming ``key`` when it is neither.

    Example::

        budget_ids("1MiB", 128, 4)     # 2048 rows of 512 bytes
    """
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    m = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]+)\s*", value) if isinstance(value, str) else None
    if m is None or m.group(2) not in BYTE_UNITS:
        raise ConfigError(key, f"expected a number of ids or bytes with their unit ({', '.join(BYTE_UNITS)}), "
                          f"e.g. 100000 or 256MiB; found {short(value)}")
    return int(m.group(1)) * BYTE_UNITS[m.group(2)] // (dim * value_bytes)


def day_start(date, ups: int) -> int:
    """Epoch time (time units) of a UTC date's midnight."""
    return (date - dt.date(1970, 1, 1)).days * SECONDS_PER_DAY * ups


def time_range(cfg: Config, today: dt.date | None = None) -> tuple[int, int, str]:
    """The sane time range in time units and its description: [min_year, max_year), or,
    when max_year is null, from min_year to the end of the day after ``today`` (UTC, the
    run's date): a time more than a day ahead of the clock is a broken row, while rows
    at or after as-of but not that far ahead are left for a later build."""
    ups = cfg.units_per_second
    lo = day_start(dt.date(cfg.min_year, 1, 1), ups)
    if cfg.max_year is not None:
        return lo, day_start(dt.date(cfg.max_year, 1, 1), ups), \
            f"outside [min_year {cfg.min_year}, max_year {cfg.max_year})"
    today = today or dt.datetime.now(dt.timezone.utc).date()
    end = today + dt.timedelta(days=2)
    return lo, day_start(end, ups), \
        f"before min_year {cfg.min_year} or after {today + dt.timedelta(days=1)} (a day ahead of the clock)"


def _expect(key: str, value: Any, kind: str) -> None:
    ok = {
        "str": isinstance(value, str) and value != "",
        "list": isinstance(value, list) and all(isinstance(v, str) and v for v in value),
        "dict": isinstance(value, dict),
        "str|list": (isinstance(value, str) and value != "")
        or (isinstance(value, list) and all(isinstance(v, str) for v in value)),
    }[kind]
    if not ok:
        want = {"str": "a column name", "list": "a list of column names", "dict": "a mapping",
                "str|list": "a column name or a list of column names"}[kind]
        raise ConfigError(key, f"expected {want}, found {value!r}")


def _unknown(key: str, got: str, allowed) -> ConfigError:
    hint = difflib.get_close_matches(got, list(allowed), n=1)
    fix = f"did you mean {hint[0]!r}?" if hint else f"allowed keys: {', '.join(sorted(allowed))}"
    return ConfigError(f"{key}.{got}" if key else got, f"unknown key; {fix}")


def parse(raw: Any, source: str | None = None) -> Config:
    """Validate a config mapping (from YAML) without looking at any input."""
    if not isinstance(raw, dict):
        raise ConfigError("<top>", f"expected a mapping at the top of the file, found {type(raw).__name__}")
    for k in raw:
        if k not in TOP_KEYS:
            raise _unknown("", k, TOP_KEYS)
    cols = raw.get("columns")
    if not isinstance(cols, dict):
        raise ConfigError("columns", "missing: map your columns onto roles (user, request_time, item, labels)")
    for k, v in cols.items():
        if k not in COLUMN_ROLES:
            raise _unknown("columns", k, COLUMN_ROLES)
        _expect(f"columns.{k}", v, COLUMN_ROLES[k])
    for r in REQUIRED_ROLES:
        if not cols.get(r):
            raise ConfigError(f"columns.{r}", f"required role is missing; add `{r}: <your column>`")
    opts = {k: raw.get(k, TOP_KEYS[k]) for k in TOP_KEYS if k != "columns"}
    if opts["time_unit"] not in TIME_UNITS:
        raise ConfigError("time_unit", f"{opts['time_unit']!r} is not one of {', '.join(TIME_UNITS)}")
    for k in ("max_seq_len", "history_length", "max_sample_cost", "seed", "min_year", "max_year",
              "skew_bucket_seconds", "chain_block", "embedding_dim", "embedding_bytes"):
        if k == "max_year" and opts[k] is None:
            continue
        if not isinstance(opts[k], int) or isinstance(opts[k], bool) or opts[k] < 0:
            raise ConfigError(k, f"expected a non-negative integer, found {short(opts[k])}")
        hi = MAX_LENGTH if k in ("max_seq_len", "history_length", "max_sample_cost") else MAX_INT
        if opts[k] > hi:
            raise ConfigError(k, f"{short(opts[k], 40)} is too large: give at most {hi:,}")
    if not 1 <= opts["min_year"] <= 9999:
        raise ConfigError("min_year", f"{opts['min_year']} is not a year (1..9999)")
    if opts["max_year"] is not None and not opts["min_year"] < opts["max_year"] <= 9999:
        raise ConfigError("max_year", f"{opts['max_year']} must be a year after min_year {opts['min_year']}, "
                          "or null for no fixed end")
    if opts["request_scope"] not in REQUEST_SCOPES:
        raise ConfigError("request_scope", f"{opts['request_scope']!r} is not one of {', '.join(REQUEST_SCOPES)}")
    if opts["max_seq_len"] < 1:
        raise ConfigError("max_seq_len", "must be at least 1")
    if opts["history_length"] < opts["max_seq_len"]:
        raise ConfigError(
            "history_length",
            f"{opts['history_length']} < max_seq_len {opts['max_seq_len']}: the history must hold at least L events",
        )
    if opts["max_sample_cost"] <= opts["max_seq_len"]:
        raise ConfigError(
            "max_sample_cost",
            f"{opts['max_sample_cost']} must be above max_seq_len {opts['max_seq_len']} "
            "(a chunk must fit one full sequence plus impressions)",
        )
    share = opts["max_quarantine_share"]
    if not isinstance(share, (int, float)) or isinstance(share, bool) or not 0 <= share <= 1:
        raise ConfigError("max_quarantine_share", f"expected a share in [0, 1], found {share!r}")
    if opts["skew_bucket_seconds"] < 1:
        raise ConfigError("skew_bucket_seconds", "must be at least 1")
    if opts["chain_block"] < 1:
        raise ConfigError("chain_block", "must be at least 1 (events per block of the event chain)")
    for k in ("embedding_dim", "embedding_bytes"):
        if opts[k] < 1:
            raise ConfigError(k, "must be at least 1")
    for k in ("hot_budget", "warm_budget"):
        budget_ids(opts[k], opts["embedding_dim"], opts["embedding_bytes"], k)
    features = {c for r in ("item_features", "context_features", "user_features") for c in cols.get(r) or ()}
    for i, c in enumerate(cols.get("id_features") or ()):
        if c not in features:
            raise ConfigError(f"columns.id_features[{i}]", f"{c!r} is not one of item_features, context_features "
                              "or user_features; list a feature column (the item is always counted)")
    lag = duration_units(opts["availability_lag"], opts["time_unit"])
    duration_units(opts["arrival_skew"], opts["time_unit"], "arrival_skew")
    if opts["null_arrival"] not in NULL_ARRIVALS:
        raise ConfigError("null_arrival", f"{short(opts['null_arrival'])} is not one of {', '.join(NULL_ARRIVALS)}")
    seq = cols.get("sequence")
    if seq is not None:
        if not seq:
            raise ConfigError("columns.sequence", "empty; map at least `item` and `time` to snapshot list columns")
        for role in ("item", "time"):
            if role not in seq:
                raise ConfigError(f"columns.sequence.{role}", "required for fat rows: the snapshot's list column")
        for role, c in seq.items():
            _expect(f"columns.sequence.{role}", c, "str")
        if lag:
            raise ConfigError("availability_lag", "fat rows carry their own snapshots: what each request saw is "
                              "its snapshot, so a lag has nothing to move; remove availability_lag (or set it to 0)")
        if cols.get("arrival_time"):
            raise ConfigError("columns.arrival_time", "fat rows carry their own snapshots: what each request saw is "
                              "its snapshot, so an arrival time has nothing to decide; remove arrival_time")
    actions = None
    a = cols.get("actions")
    if a is not None:
        for k, v in a.items():
            if k not in ACTION_ROLES:
                raise _unknown("columns.actions", k, ACTION_ROLES)
            _expect(f"columns.actions.{k}", v, ACTION_ROLES[k])
        for r in ("user", "item", "time", "labels"):
            if not a.get(r):
                raise ConfigError(f"columns.actions.{r}", "required role of the action log is missing")
        labels = a["labels"]
        afeat = tuple(a.get("item_features") or ())
        if len(afeat) != len(cols.get("item_features") or ()):
            raise ConfigError(
                "columns.actions.item_features",
                f"{len(afeat)} columns for {len(cols.get('item_features') or ())} item_features: "
                "list one action-log column per impression item feature, in the same order",
            )
        if isinstance(labels, list):
            n_act = len(cols.get("action_labels") or cols.get("labels"))
            if len(labels) != n_act:
                raise ConfigError(
                    "columns.actions.labels",
                    f"{len(labels)} columns for {n_act} action labels: list them in the same order, "
                    "or give one integer column of action bits",
                )
        actions = ActionsConfig(
            user=a["user"], item=a["item"], time=a["time"],
            labels=tuple(labels) if isinstance(labels, list) else labels, item_features=afeat,
            arrival=a.get("arrival"),
        )
        if seq is not None:
            raise ConfigError("columns.actions", "an action log is for lean input; fat rows carry their sequence")
    for lbl in cols.get("action_labels") or ():
        if lbl not in cols["labels"]:
            raise ConfigError("columns.action_labels", f"{lbl!r} is not one of columns.labels")
    columns = {k: v for k, v in cols.items() if k != "actions"}
    return Config(columns=columns, actions=actions, source=source, **opts)


def load(path: str | Path) -> Config:
    """Read a config file: a local path or a store's URL (hdfs://, s3://, ...)."""
    from userwise.pipelines.runtime import storage

    p = str(path)
    try:
        data = storage.read_bytes(p)
    except OSError as e:
        raise ConfigError("<file>", f"{p} cannot be read: {e}") from None
    if data is None:
        raise ConfigError("<file>", f"{p} does not exist")
    try:
        raw = safe_yaml(data.decode(), p)
    except UnicodeDecodeError as e:
        raise ConfigError("<file>", f"{p} is not valid UTF-8 text: {e}") from None
    return parse(raw, source=p)


# A config file is a few dozen values; aliases may repeat a block, but never expand it into more
# than this many values (a "billion laughs" file of 735 bytes expands to 9**9).
YAML_MAX_VALUES = 10_000
MAX_INT = (1 << 63) - 1
"""The largest integer a config key takes (Spark's and Arrow's long)."""
MAX_LENGTH = (1 << 31) - 1
"""The largest length or cost (max_seq_len, history_length, max_sample_cost): Spark's longest array."""
# ... and nests a few levels deep: deeper is refused before the parser's recursion could give out.
YAML_MAX_DEPTH = 100


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader that refuses a document nested deeper than :data:`YAML_MAX_DEPTH`."""

    def compose_node(self, parent, index):
        self._depth = getattr(self, "_depth", 0) + 1
        try:
            if self._depth > YAML_MAX_DEPTH:
                raise _TooDeep()
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


class _TooDeep(Exception):
    pass


def safe_yaml(text: str, where: str = "<file>"):
    """``yaml.safe_load(text)``, bounded: a document whose aliases expand to more than
    :data:`YAML_MAX_VALUES` values (or refer to themselves), that nests deeper than
    :data:`YAML_MAX_DEPTH`, or holds a value Python cannot build (an integer of thousands of
    digits) is refused before anything is built from it, with :class:`ConfigError` naming ``where``. Every YAML file the product
    reads (the config, the Airflow settings) is read through it.

    Example::

        safe_yaml("a: &x [1, 2]\nb: *x")     # {'a': [1, 2], 'b': [1, 2]}
    """
    loader = _BoundedLoader(text)
    try:
        try:
            node = loader.get_single_node()
        except yaml.YAMLError as e:
            raise ConfigError("<file>", f"{where} is not valid YAML: {' '.join(str(e).split())[:300]}") from None
        except _TooDeep:
            raise ConfigError("<file>", f"{where}: its YAML nests more than {YAML_MAX_DEPTH} levels deep; a config "
                                        "is a few levels deep: write the values out flat") from None
        if node is None:
            return None
        sizes: dict[int, int] = {}

        def size(n, path: frozenset) -> int:
            if id(n) in sizes:
                return sizes[id(n)]
            if id(n) in path:
                raise ConfigError("<file>", f"{where}: a YAML alias refers to its own anchor; write the value out")
            inner = path | {id(n)}
            if isinstance(n, yaml.MappingNode):
                k = 1 + sum(size(a, inner) + size(b, inner) for a, b in n.value)
            elif isinstance(n, yaml.SequenceNode):
                k = 1 + sum(size(a, inner) for a in n.value)
            else:
                k = 1
            if k > YAML_MAX_VALUES:
                raise ConfigError("<file>", f"{where}: its YAML aliases expand to more than {YAML_MAX_VALUES} values "
                                            "(an alias bomb?); write the values out or use fewer aliases")
            sizes[id(n)] = k
            return k

        size(node, frozenset())
        try:
            return loader.construct_document(node)
        except (ValueError, OverflowError) as e:  # a 5,000-digit integer, a date that is not one
            why = " ".join(str(e).split(";")[0].split())[:200]  # not Python's advice on its own limits
            raise ConfigError("<file>", f"{where}: a value cannot be read ({why}); "
                                        "write a number or date within its range, or quote it as a string") from None
    finally:
        loader.dispose()


def _numeric(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t) or pa.types.is_decimal(t)


def _time_like(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_timestamp(t)


def _id_like(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_string(t) or pa.types.is_large_string(t)


def _plain(t: pa.DataType) -> pa.DataType:
    return t.value_type if pa.types.is_dictionary(t) else t


def check_types(schema: pa.Schema) -> None:
    """Every input column has a type the build can store and give back."""
    for f in schema:
        if storage_type(f.type) is None:
            raise ConfigError(
                "<input>", f"column {f.name!r} is {f.type}, which the build cannot carry; cast it to a "
                "supported type (integers, floats, decimals, booleans, strings, binary, dates, timestamps, "
                "lists, structs and maps of these)")


def _missing(key: str, col: str, schema: pa.Schema) -> ConfigError:
    hint = difflib.get_close_matches(col, schema.names, n=1)
    fix = f"did you mean {hint[0]!r}?" if hint else f"the input has: {', '.join(schema.names)}"
    return ConfigError(key, f"column {col!r} is not in the input; {fix}")


def check_columns(cfg: Config, schema: pa.Schema) -> None:
    """Every mapped column exists, with a type its role can use."""
    names = set(schema.names)
    singles = ["user", "request", "request_time", "action_time", "arrival_time", "item", "position"]
    for role in singles:
        c = cfg.col(role)
        if c is not None and c not in names:
            raise _missing(f"columns.{role}", c, schema)
    for role in ("labels", "action_labels", "item_features", "context_features", "user_features"):
        for i, c in enumerate(cfg.cols(role)):
            if c not in names:
                raise _missing(f"columns.{role}[{i}]", c, schema)
    for role, c in cfg.sequence.items():
        if c not in names:
            raise _missing(f"columns.sequence.{role}", c, schema)
        t = schema.field(c).type
        if not (pa.types.is_list(t) or pa.types.is_large_list(t)):
            raise ConfigError(f"columns.sequence.{role}", f"column {c!r} is {t}, not a list column")
    for i, c in enumerate(cfg.cols("labels")):
        t = schema.field(c).type
        if not _numeric(t):
            raise ConfigError(
                f"columns.labels[{i}]", f"column {c!r} is {t}, not numeric; map a numeric column or cast it"
            )
    for role in ("request_time", "action_time", "arrival_time"):
        c = cfg.col(role)
        if c is not None and not _time_like(_plain(schema.field(c).type)):
            raise ConfigError(
                f"columns.{role}", f"column {c!r} is {schema.field(c).type}; expected integer epoch "
                f"({cfg.time_unit}) or a timestamp",
            )
    for role in ("user", "request", "item"):
        c = cfg.col(role)
        if c is not None and not _id_like(_plain(schema.field(c).type)):
            raise ConfigError(f"columns.{role}", f"column {c!r} is {schema.field(c).type}; an id must be an integer "
                              "or a string column")
    for i, c in enumerate(cfg.cols("id_features")):
        t = _plain(schema.field(c).type)
        if pa.types.is_list(t) or pa.types.is_large_list(t):
            t = _plain(t.value_type)
        if not _id_like(t):
            raise ConfigError(f"columns.id_features[{i}]", f"column {c!r} is {schema.field(c).type}; an id feature "
                              "must be an integer or string column, or a list of them")
    if cfg.col("position") and not pa.types.is_integer(schema.field(cfg.col("position")).type):
        raise ConfigError("columns.position", f"column {cfg.col('position')!r} must be an integer column")
    used: dict[str, str] = {}
    for role in singles:
        c = cfg.col(role)
        if c is None:
            continue
        if c in used and not (role == "action_time" and used[c] == "request_time"):
            raise ConfigError(f"columns.{role}", f"column {c!r} is already mapped to {used[c]}")
        used.setdefault(c, role)


def check_actions_columns(cfg: Config, schema: pa.Schema) -> None:
    """The action log's mapped columns exist with usable types (``schema``: the log's own
    schema, or its storage form as a Spark frame names it)."""
    a = cfg.actions
    if a is None:
        raise ConfigError("columns.actions", "--actions was given but the config has no `actions:` section")
    if not all(c in schema.names for c in (a.user, a.item, a.time)) and \
            all(storage_name(c) in schema.names for c in (a.user, a.item, a.time)):
        a = cfg.storage().actions
    for role in ("user", "item", "time", "arrival"):
        c = getattr(a, role)
        if c is not None and c not in schema.names:
            raise _missing(f"columns.actions.{role}", c, schema)
    if a.arrival is not None and not _time_like(_plain(schema.field(a.arrival).type)):
        raise ConfigError("columns.actions.arrival", f"column {a.arrival!r} is {schema.field(a.arrival).type}; "
                          f"expected integer epoch ({cfg.time_unit}) or a timestamp")
    labels = a.labels if isinstance(a.labels, tuple) else (a.labels,)
    for i, c in enumerate(labels):
        if c not in schema.names:
            raise _missing(f"columns.actions.labels[{i}]", c, schema)
        if not _numeric(schema.field(c).type):
            raise ConfigError(f"columns.actions.labels[{i}]", f"column {c!r} is not numeric")
    for i, c in enumerate(a.item_features):
        if c not in schema.names:
            raise _missing(f"columns.actions.item_features[{i}]", c, schema)
