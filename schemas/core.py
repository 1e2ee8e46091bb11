"""One schema definition, three forms: Arrow, Spark, Delta.

A :class:`TableSchema` is a list of :class:`Field` whose types are Arrow types.
Arrow is the reference: the Spark ``StructType`` and the Delta schema are
derived from it, never written by hand, so the three cannot drift apart.
Spark is imported lazily: the loader uses these schemas without a JVM.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable

import pyarrow as pa

if TYPE_CHECKING:
    from pyspark.sql import types as T

from userwise.pipelines.errors import SchemaError

FORMAT_VERSION = 4
"""Format version of every table and file this product writes.

Readers refuse a higher version than they understand (see ``check_version``).
4: samples carry the event chain of their stored events (``chain_block``,
``chain_checkpoints``, ``chain_end``; ``schemas.hashing``).
3: the scalar count of stored events is ``num_events``; ``seq_*`` names only per-event lists.
2: the request key and an int64 request time are stored once, as ``req_id`` /
``req_time``, no longer also as ``req__<col>`` (``Layout.derived_request_columns``).
1: the first format.
"""

# The format versions of the records beside the tables, each read by one module that
# refuses a version it does not understand. Every format version is spelled here, once.
COMPLETE_FORMAT = 1
"""``D/_userwise/complete.json``, the complete state (``records.state``)."""
PUBLISHED_FORMAT = 1
"""A published set's marker ``_PUBLISHED.json`` and its record in ``D/_userwise/published/``."""
GDS_INDEX_FORMAT = 1
"""The index of a ``.gds`` side file (``shards.gds``)."""


COMMENT = "comment"
"""The field-metadata key of a column's description (:attr:`Field.doc`): the key Spark and
Delta use for column comments, so ``DESCRIBE TABLE`` shows it and Arrow and delta-rs readers
find it in the field's metadata."""


@dataclass(frozen=True)
class Field:
    """One column: name, Arrow type, nullability and its description (``doc``, carried as the
    column comment in every form).

    Example::

        f = Field("user", pa.int64(), False, "the user id")
        f.to_arrow()                        # the pyarrow field, its description in the metadata
    """

    name: str
    type: pa.DataType
    nullable: bool = True
    doc: str = ""

    @property
    def metadata(self) -> dict[str, str]:
        """The column's metadata in every form (Arrow, Spark, Delta): its description."""
        return {COMMENT: self.doc} if self.doc else {}

    def to_arrow(self) -> pa.Field:
        return pa.field(self.name, self.type, nullable=self.nullable, metadata=self.metadata or None)


def list_of(t: pa.DataType) -> pa.DataType:
    """A list column: the element is never null, the list itself may be.

    Example::

        Field("seq_item", list_of(pa.int64()), False)
    """
    return pa.list_(pa.field("element", t, nullable=True))


@dataclass(frozen=True)
class TableSchema:
    """A named, versioned table schema.

    Example::

        REQ = TableSchema("t", (Field("a", pa.int64(), False),), partition_by=())
        REQ.to_arrow(); REQ.to_spark(); REQ.to_delta()
    """

    name: str
    fields: tuple[Field, ...]
    partition_by: tuple[str, ...] = ()
    doc: str = ""
    order_by: tuple[str, ...] = ()
    """Columns a write orders its rows by, range-partitioned into files: each file holds a
    contiguous run of them, so the files' min/max statistics let readers and ``replaceWhere``
    skip files (``delta_io.replace``), and the number of files follows the data, not the
    number of distinct values."""
    version: int = FORMAT_VERSION
    metadata: dict = field(default_factory=dict, hash=False, compare=False)
    properties: dict = field(default_factory=dict, hash=False, compare=False)
    """Delta table properties the table is written with (``delta_io.replace``)."""

    def __post_init__(self):
        names = [f.name for f in self.fields]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise SchemaError(f"table {self.name!r}: duplicate columns {sorted(dup)}")
        missing = [p for p in self.partition_by + self.order_by if p not in names]
        if missing:
            raise SchemaError(f"table {self.name!r}: partition or order columns {missing} are not fields")

    @property
    def names(self) -> list[str]:
        return [f.name for f in self.fields]

    def field(self, name: str) -> Field:
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(f"table {self.name!r} has no column {name!r}")

    def to_arrow(self) -> pa.Schema:
        meta = {
            b"userwise.table": self.name.encode(),
            b"userwise.format_version": str(self.version).encode(),
        }
        for k, v in self.metadata.items():
            meta[f"userwise.{k}".encode()] = json.dumps(v, sort_keys=True).encode()
        return pa.schema([f.to_arrow() for f in self.fields], metadata=meta)

    def to_spark(self):
        from pyspark.sql import types as T

        return T.StructType(
            [T.StructField(f.name, arrow_to_spark(f.type), f.nullable, f.metadata) for f in self.fields]
        )

    def to_delta(self):
        """The Delta table schema (delta-rs form), derived from Arrow."""
        from deltalake import Schema

        return Schema.from_arrow(pa.schema([f.to_arrow() for f in self.fields]))

    def fingerprint(self) -> str:
        """A stable hash of names, types and nullability (not docs)."""
        return schema_fingerprint(self.to_arrow())


def schema_list(schema: pa.Schema) -> list:
    """The schema as ``[[name, type, nullable], ...]`` (the shard manifest's ``schema``)."""
    return [[f.name, str(f.type), f.nullable] for f in schema]


def list_fingerprint(desc: list) -> str:
    """The fingerprint of a schema list (:func:`schema_list`): sha256/16 of its JSON."""
    desc = [[n, t, bool(nl)] for n, t, nl in desc]
    return hashlib.sha256(json.dumps(desc).encode()).hexdigest()[:16]


def schema_fingerprint(schema: pa.Schema) -> str:
    """Hash of column names, types and nullability: equal iff readers see the same layout.

    Example::

        schema_fingerprint(pq.read_schema(path)) == manifest["schema_fingerprint"]
    """
    return list_fingerprint(schema_list(schema))


def arrow_to_spark(t: pa.DataType):
    """The Spark type of an Arrow type (imports pyspark: Spark's side only).

    Example::

        arrow_to_spark(list_of(pa.int64()))   # ArrayType(LongType(), True)
    """
    from pyspark.sql import types as T

    if pa.types.is_boolean(t):
        return T.BooleanType()
    if pa.types.is_int8(t):
        return T.ByteType()
    if pa.types.is_int16(t):
        return T.ShortType()
    if pa.types.is_int32(t):
        return T.IntegerType()
    if pa.types.is_int64(t):
        return T.LongType()
    if pa.types.is_float32(t):
        return T.FloatType()
    if pa.types.is_float64(t):
        return T.DoubleType()
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return T.StringType()
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return T.BinaryType()
    if pa.types.is_date32(t):
        return T.DateType()
    if pa.types.is_timestamp(t):
        return T.TimestampType() if t.tz else T.TimestampNTZType()
    if pa.types.is_decimal(t):
        return T.DecimalType(t.precision, t.scale)
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return T.ArrayType(arrow_to_spark(t.value_type), t.value_field.nullable)
    if pa.types.is_struct(t):
        return T.StructType(
            [T.StructField(f.name, arrow_to_spark(f.type), f.nullable) for f in t]
        )
    if pa.types.is_map(t):
        return T.MapType(arrow_to_spark(t.key_type), arrow_to_spark(t.item_type))
    raise SchemaError(f"no Spark type for Arrow type {t}")


def spark_to_arrow(dt: T.DataType) -> pa.DataType:
    """Inverse of :func:`arrow_to_spark` (timestamps come back as UTC micros).

    Example::

        spark_to_arrow(df.schema["user"].dataType)   # pa.int64()
    """
    from pyspark.sql import types as T

    simple = {
        T.BooleanType: pa.bool_(),
        T.ByteType: pa.int8(),
        T.ShortType: pa.int16(),
        T.IntegerType: pa.int32(),
        T.LongType: pa.int64(),
        T.FloatType: pa.float32(),
        T.DoubleType: pa.float64(),
        T.StringType: pa.string(),
        T.BinaryType: pa.binary(),
        T.DateType: pa.date32(),
        T.TimestampType: pa.timestamp("us", tz="UTC"),
        T.TimestampNTZType: pa.timestamp("us"),
    }
    for k, v in simple.items():
        if isinstance(dt, k):
            return v
    if isinstance(dt, T.DecimalType):
        return pa.decimal128(dt.precision, dt.scale)
    if isinstance(dt, T.ArrayType):
        return pa.list_(pa.field("element", spark_to_arrow(dt.elementType), dt.containsNull))
    if isinstance(dt, T.StructType):
        return pa.struct([pa.field(f.name, spark_to_arrow(f.dataType), f.nullable) for f in dt])
    if isinstance(dt, T.MapType):
        return pa.map_(spark_to_arrow(dt.keyType), spark_to_arrow(dt.valueType))
    raise SchemaError(f"no Arrow type for Spark type {dt}")


def check_version(found: int | str | None, what: str) -> None:
    """Refuse data written by a newer format than this code understands (a :class:`SchemaError`
    naming ``what``).

    Example::

        check_version(manifest.get("format_version"), f"{root}/manifest.json")
    """
    try:
        v = int(found) if found is not None else None
    except (TypeError, ValueError):
        v = None
    if v is None:
        raise SchemaError(f"{what}: no userwise format version; was it written by userwise?")
    if v > FORMAT_VERSION:
        raise SchemaError(
            f"{what}: format version {v} is newer than this reader's {FORMAT_VERSION}; upgrade userwise"
        )


def fields(*items: Iterable[Field] | Field) -> tuple[Field, ...]:
    out: list[Field] = []
    for it in items:
        if isinstance(it, Field):
            out.append(it)
        else:
            out.extend(it)
    return tuple(out)
