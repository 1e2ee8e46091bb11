"""How a user's input columns land in our tables.

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
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pyarrow as pa

REQ = "req__"
IMP = "imp__"
SEQ = "seq_"
OVR = "ovr_"
EV = "ev_"
SNAP = "snap_"

TIME_UNITS = ("s", "ms", "us")


@dataclass(frozen=True)
class SeqField:
    """One field of a stored sequence: its short name and element type."""

    name: str  # ts, item, action, or a feature / snapshot role name
    type: pa.DataType
    source: str | None = None  # the input column it comes from (fat: the snapshot list column)


@dataclass(frozen=True)
class Layout:
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
        if pa.types.is_int64(self.request_time.type) and self.request_time.name not in out:
            out[self.request_time.name] = "req_time"
        return out

    @property
    def stored_request_columns(self) -> tuple[pa.Field, ...]:
        """The request columns stored as ``req__<col>``: :attr:`request_columns` less the
        derived ones (which every request-level check still covers)."""
        derived = self.derived_request_columns
        return tuple(f for f in self.request_columns if f.name not in derived)

    @property
    def snapshot_columns(self) -> tuple[str, ...]:
        return tuple(s.source for s in self.snapshot)

    @property
    def impression_columns(self) -> tuple[pa.Field, ...]:
        """Input columns stored once per impression, in input order."""
        skip = {self.user.name} | {f.name for f in self.request_columns} | set(self.snapshot_columns)
        return tuple(f for f in self.input_schema if f.name not in skip)

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
        out += [SeqField(f.name, f.type, f.name) for f in self.item_features]
        out.append(SeqField("action", pa.int64()))
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
        }


def snapshot_element_type(t: pa.DataType, col: str) -> pa.DataType:
    if not (pa.types.is_list(t) or pa.types.is_large_list(t)):
        raise TypeError(f"snapshot column {col!r} must be a list column, found {t}")
    return t.value_type
