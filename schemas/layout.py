"""The column layout: how a user's input columns land in our tables (names, levels, roles).

(Not the loader's buffer layout, :mod:`userwise.pipelines.loader.assembly.buffer_layout`, where a
batch's arrays sit in its buffer, nor the kernels' argument layouts,
:mod:`userwise.pipelines.train.kernel_args`.)

Real logs name and type their columns differently. A :class:`Layout` is the
config's role mapping resolved against the input's Arrow schema: every input
column gets a role and a level (per request, per impression, or the fat-row
snapshot), keeping its own name and type so the round trip is exact.

Naming in our tables (one rule, used by every table):
- ``req__<col>``: an input column stored once per request (context and user
  features, and the request time when it is not plain int64), original name
  and type. The request key and an int64 request time are not stored twice:
  they are ``req_id`` / ``req_time`` themselves (same values, same type), and
  readers give them back under their input names
  (:attr:`Layout.derived_request_columns`).
- ``imp__<col>``: an input column stored once per impression (item, position,
  action time, labels, item features and every unmapped column).
- ``seq_<field>``: a sequence field (lean: ``ts``, ``item``, ``action`` and one
  per item feature; fat: one per configured snapshot role).

User-named columns never collide with ours:
- ``<col>`` above is the input column's *storage name* (:func:`storage_name`):
  the input name itself unless it holds a character that Spark column paths or
  Delta refuse (space, ``.``, ``,;{}()=``, tab, newline, backtick), a ``%``, or
  starts with ``_`` (our working columns' prefix); those characters are written
  ``%XX`` (the name is percent-encoded, :func:`input_name` reverses it).
- a feature or snapshot role whose name is one of ours (:data:`RESERVED`:
  ``ts``, ``item``, ``action``, ``len``, ...) gets a leading ``_`` in its
  field name (``seq__len``, ``ev__action``); storage names never start with
  ``_``, so the two sets of names are disjoint.

The layout keeps both forms of the input's schema: :attr:`Layout.input_schema`
holds the storage names and the types Spark stores (timestamps as UTC
microseconds, unsigned integers widened, nanosecond timestamps as int64), and
:attr:`Layout.source_schema` the input's own names and types, which ``expand``
gives back.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass

import pyarrow as pa

REQ = "req__"
IMP = "imp__"
SEQ = "seq_"
OVR = "ovr_"
EV = "ev_"
SNAP = "snap_"

UNITS_PER_SECOND = {"s": 1, "ms": 1000, "us": 1_000_000}
"""The config's ``time_unit`` values and their units per second: every time in our tables is an
integer epoch in one of them (Arrow timestamps of the input also come in ``ns``)."""
TIME_UNITS = tuple(UNITS_PER_SECOND)

# Names of our own sequence and event fields (after seq_, ev_, ovr_, snap_) and of the
# samples' num_events: a user's feature or snapshot role of one of these names is stored as _<name>.
RESERVED = frozenset({"ts", "item", "action", "len", "time", "req", "req_time", "req_id", "pos", "offsets",
                      "user", "date", "kind", "chunk", "arrival"})
# Characters a storage name writes as %XX: Spark column paths (., `), Delta's refused
# characters (space , ; { } ( ) newline tab =) and the escape itself.
_ESCAPE = frozenset(" ,;{}()\n\t=.`%")
SOURCE_KEY = b"userwise.source_schema"


def storage_name(name: str) -> str:
    """The input column's name in our tables and Spark frames (see the module docstring)."""
    out = "".join(f"%{ord(ch):02X}" if ch in _ESCAPE else ch for ch in name)
    return "%5F" + out[1:] if out.startswith("_") else out


def input_name(storage: str) -> str:
    """Inverse of :func:`storage_name`."""
    from urllib.parse import unquote

    return unquote(storage)


def field_name(name: str) -> str:
    """A user-named sequence / event field (a feature's storage name, a snapshot role)."""
    return "_" + name if name in RESERVED or name.startswith("_") else name


def storage_type(t: pa.DataType) -> pa.DataType | None:
    """The Arrow form of what Spark reads (and our tables store) for an input type;
    None for a type the build cannot carry."""
    if pa.types.is_dictionary(t):
        return storage_type(t.value_type)
    if pa.types.is_boolean(t) or pa.types.is_int8(t) or pa.types.is_int16(t) or pa.types.is_int32(t) \
            or pa.types.is_int64(t) or pa.types.is_float32(t) or pa.types.is_float64(t) \
            or pa.types.is_date32(t) or pa.types.is_decimal128(t):
        return t
    unsigned = {pa.uint8(): pa.int16(), pa.uint16(): pa.int32(), pa.uint32(): pa.int64(),
                pa.uint64(): pa.decimal128(20, 0)}
    if t in unsigned:
        return unsigned[t]
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return pa.string()
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return pa.binary()
    if pa.types.is_date64(t):
        return pa.date32()
    if pa.types.is_timestamp(t):
        if t.unit == "ns":  # Spark reads Parquet nanoseconds as int64 (nanosAsLong)
            return pa.int64()
        return pa.timestamp("us", tz="UTC") if t.tz else pa.timestamp("us")
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        v = storage_type(t.value_type)
        return None if v is None else pa.list_(pa.field("element", v, True))
    if pa.types.is_struct(t):
        fs = [(f, storage_type(f.type)) for f in t]
        if any(v is None for _, v in fs):
            return None
        return pa.struct([pa.field(f.name, v, f.nullable) for f, v in fs])
    if pa.types.is_map(t):
        k, v = storage_type(t.key_type), storage_type(t.item_type)
        return None if k is None or v is None else pa.map_(k, v)
    return None


def source_schema_of(schema: pa.Schema) -> pa.Schema:
    """The input's own schema: carried in a storage schema's metadata, else ``schema`` itself."""
    md = schema.metadata or {}
    if SOURCE_KEY in md:
        return pa.ipc.read_schema(pa.py_buffer(base64.b64decode(md[SOURCE_KEY])))
    return schema


def storage_schema(source: pa.Schema) -> pa.Schema:
    """Storage names and types for an input schema (every type supported: see
    config.check_types), the source schema kept in its metadata."""
    if SOURCE_KEY in (source.metadata or {}):
        return source
    fields = [pa.field(storage_name(f.name), storage_type(f.type), f.nullable) for f in source]
    plain = pa.schema([pa.field(f.name, f.type, f.nullable) for f in source])
    md = {SOURCE_KEY: base64.b64encode(plain.serialize().to_pybytes())}
    return pa.schema(fields, metadata=md)


@dataclass(frozen=True)
class SeqField:
    """One field of a stored sequence: its short name and element type.

    Example::

        [sf.name for sf in layout.seq_fields]   # ['ts', 'item', 'category', 'author', 'action']
    """

    name: str  # ts, item, action, or a feature / snapshot role name
    type: pa.DataType
    source: str | None = None  # the input column it comes from (fat: the snapshot list column)


@dataclass(frozen=True)
class Layout:
    """A config's column roles resolved against an input's Arrow schema (see the module doc):
    every input column's role and level, the stored sequence's fields, the names in our tables.

    Example::

        lay = config.load("config.yaml").layout(pq.read_schema("impressions/"))
        lay.roles()["labels"], [sf.name for sf in lay.seq_fields]
    """

    fat: bool
    time_unit: str
    user: pa.Field
    request: pa.Field | None
    request_time: pa.Field
    action_time: pa.Field | None
    item: pa.Field
    position: pa.Field | None
    labels: tuple[pa.Field, ...]
    action_labels: tuple[str, ...]
    item_features: tuple[pa.Field, ...]
    context_features: tuple[pa.Field, ...]
    user_features: tuple[pa.Field, ...]
    passthrough: tuple[pa.Field, ...]
    snapshot: tuple[SeqField, ...]  # fat only: role -> list column
    input_schema: pa.Schema
    # lean only: the impressions' arrival column (when an action reached serving), and
    # whether events carry an arrival time at all (this column or the action log's)
    arrival_time: pa.Field | None = None
    arrivals: bool = False

    # -- levels -------------------------------------------------------------
    @property
    def request_columns(self) -> tuple[pa.Field, ...]:
        """Input columns stored once per request, in input order."""
        keep = {f.name for f in (self.request, self.request_time) if f is not None}
        keep |= {f.name for f in self.context_features + self.user_features}
        return tuple(f for f in self.input_schema if f.name in keep)

    @property
    def derived_request_columns(self) -> dict[str, str]:
        """Request-level input columns not stored as ``req__<col>``, by input name -> the
        canonical column that holds them exactly: the request key is ``req_id`` (its own
        type, its own values); a request time typed int64 is ``req_time`` (taken as is).
        A time of any other type (a timestamp, an int32) keeps its ``req__``
        copy: ``req_time`` is its conversion to time units, not the input's value."""
        out = {}
        if self.request is not None:
            out[self.request.name] = "req_id"
        if pa.types.is_int64(self.source_type(self.request_time.name)) and self.request_time.name not in out:
            out[self.request_time.name] = "req_time"
        return out

    @property
    def stored_request_columns(self) -> tuple[pa.Field, ...]:
        """The request columns stored as ``req__<col>``: :attr:`request_columns` less the
        derived ones (which every request-level check still covers)."""
        derived = self.derived_request_columns
        return tuple(f for f in self.request_columns if f.name not in derived)

    @property
    def source_schema(self) -> pa.Schema:
        """The input's own names and types, in input order (what ``expand`` gives back)."""
        return source_schema_of(self.input_schema)

    def source_type(self, name: str) -> pa.DataType:
        """The input's own type of the column stored as ``name``."""
        return self.source_schema.field(self.input_schema.get_field_index(name)).type

    @property
    def snapshot_columns(self) -> tuple[str, ...]:
        return tuple(s.source for s in self.snapshot)

    @property
    def impression_columns(self) -> tuple[pa.Field, ...]:
        """Input columns stored once per impression, in input order."""
        skip = {self.user.name} | {f.name for f in self.request_columns} | set(self.snapshot_columns)
        return tuple(f for f in self.input_schema if f.name not in skip)

    @property
    def action_bits(self) -> tuple[str, ...]:
        """The action labels' input names in bit order, bit 0 first: bit i of an action mask
        (``imp_action``, ``ev_action``, ``seq_action``) is set when label i is > 0."""
        return tuple(input_name(c) for c in self.action_labels)

    @property
    def request_key_type(self) -> pa.DataType:
        # Without a request column a request is (user, request_time): the key is the time.
        return self.request.type if self.request is not None else pa.int64()

    @property
    def seq_fields(self) -> tuple[SeqField, ...]:
        """The fields of the stored sequence, in storage order."""
        if self.fat:
            return self.snapshot
        out = [SeqField("ts", pa.int64()), SeqField("item", self.item.type)]
        out += [SeqField(field_name(f.name), f.type, f.name) for f in self.item_features]
        out.append(SeqField("action", pa.int64()))
        if self.arrivals:
            out.append(SeqField("arrival", pa.int64()))
        return tuple(out)

    def to_json(self) -> str:
        return json.dumps(self.roles(), sort_keys=True)

    def roles(self) -> dict:
        """Roles by original column name: what readers (the loader) need."""
        n = lambda f: None if f is None else f.name  # noqa: E731
        return {
            "fat": self.fat,
            "time_unit": self.time_unit,
            "user": n(self.user),
            "request": n(self.request),
            "request_time": n(self.request_time),
            "action_time": n(self.action_time),
            "item": n(self.item),
            "position": n(self.position),
            "labels": [f.name for f in self.labels],
            "action_labels": list(self.action_labels),
            "item_features": [f.name for f in self.item_features],
            "context_features": [f.name for f in self.context_features],
            "user_features": [f.name for f in self.user_features],
            "passthrough": [f.name for f in self.passthrough],
            "sequence": {s.name: s.source for s in self.snapshot} if self.fat else None,
            "seq_fields": [s.name for s in self.seq_fields],
            "input_columns": self.input_schema.names,
            "request_derived": self.derived_request_columns,
            # only with an arrival column, so a layout without one keeps today's roles
            **({"arrival_time": n(self.arrival_time), "arrivals": True} if self.arrivals else {}),
        }


def snapshot_element_type(t: pa.DataType, col: str) -> pa.DataType:
    if not (pa.types.is_list(t) or pa.types.is_large_list(t)):
        raise TypeError(f"snapshot column {col!r} must be a list column, found {t}")
    return t.value_type
