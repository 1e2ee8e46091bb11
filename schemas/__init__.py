"""The one source of truth for every table and file schema.

Each schema is defined once with Arrow types; ``to_spark()`` and
``to_delta()`` derive the other forms. Import without Spark: the loader does.

Public names::

    from userwise.schemas import (ACTION_BITS, action_bits, decode_action, FORMAT_VERSION,
    COMPLETE_FORMAT, PUBLISHED_FORMAT, GDS_INDEX_FORMAT, Field, SchemaError, TableSchema,
    arrow_to_spark, check_version, list_of, schema_fingerprint, spark_to_arrow, EV, IMP, OVR,
    REQ, SEQ, SNAP, TIME_UNITS, Layout, SeqField, BUILD_TABLES, HISTORY_LOG, ID_STATS, MANIFEST_KEYS,
    MANIFEST_SET_KEYS, MANIFEST_SHARD, QUARANTINE, SYNTH_ACTIONS, SYNTH_FAT_IMPRESSIONS,
    SYNTH_IMPRESSIONS, SYNTH_SNAPSHOT, chain_fields, event_fields, events_schema,
    history_schema, requests_schema, samples_schema, shard_schema, sort_key, FIXED_TABLES,
    REASONS)

Modules:

- ``core``: :class:`TableSchema` and :class:`Field` (Arrow, with the Spark and Delta forms
  derived), the format versions of every table, file and record, schema fingerprints.
- ``layout``: the column layout: how a user's input columns land in our tables (storage
  names, prefixes, roles).
- ``tables``: every table and file the product reads or writes (build tables, quarantine,
  samples, id statistics, shards, the manifest's keys, the synthetic logs).
- ``labels``: action bits: which label each bit of an action mask stands for.
- ``reasons``: the one vocabulary of quarantine reasons.
- ``hashing``: Spark's ``xxhash64`` in Python, for ids the build makes (``sample_id``), the
  shard assignment's tie-breaks and the event chain every sample carries.
"""

from userwise.schemas.core import (
    COMPLETE_FORMAT,
    FORMAT_VERSION,
    GDS_INDEX_FORMAT,
    PUBLISHED_FORMAT,
    Field,
    SchemaError,
    TableSchema,
    arrow_to_spark,
    check_version,
    list_of,
    schema_fingerprint,
    spark_to_arrow,
)
from userwise.schemas.labels import ACTION_BITS, action_bits, decode_action
from userwise.schemas.layout import EV, IMP, OVR, REQ, SEQ, SNAP, TIME_UNITS, Layout, SeqField
from userwise.schemas.reasons import REASONS
from userwise.schemas.tables import (
    BUILD_TABLES,
    HISTORY_LOG,
    ID_STATS,
    MANIFEST_KEYS,
    MANIFEST_SET_KEYS,
    MANIFEST_SHARD,
    QUARANTINE,
    SYNTH_ACTIONS,
    SYNTH_FAT_IMPRESSIONS,
    SYNTH_IMPRESSIONS,
    SYNTH_SNAPSHOT,
    chain_fields,
    event_fields,
    events_schema,
    history_schema,
    requests_schema,
    samples_schema,
    shard_schema,
    sort_key,
)

FIXED_TABLES = (SYNTH_IMPRESSIONS, SYNTH_FAT_IMPRESSIONS, SYNTH_ACTIONS, QUARANTINE, HISTORY_LOG, ID_STATS, MANIFEST_SHARD)

__all__ = [
    "ACTION_BITS", "action_bits", "decode_action",
    "FORMAT_VERSION", "COMPLETE_FORMAT", "PUBLISHED_FORMAT", "GDS_INDEX_FORMAT", "Field", "SchemaError", "TableSchema", "arrow_to_spark", "check_version", "list_of",
    "schema_fingerprint", "spark_to_arrow",
    "EV", "IMP", "OVR", "REQ", "SEQ", "SNAP", "TIME_UNITS", "Layout", "SeqField",
    "BUILD_TABLES", "HISTORY_LOG", "ID_STATS", "MANIFEST_KEYS", "MANIFEST_SET_KEYS", "MANIFEST_SHARD", "QUARANTINE", "SYNTH_ACTIONS",
    "SYNTH_FAT_IMPRESSIONS", "SYNTH_IMPRESSIONS", "SYNTH_SNAPSHOT", "chain_fields", "event_fields", "events_schema",
    "history_schema", "requests_schema", "samples_schema", "shard_schema", "sort_key",
    "FIXED_TABLES", "REASONS",
]
