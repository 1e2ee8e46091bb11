"""Action bits: which label each bit of an action mask stands for.

An impression is an action when any of its action labels (config
``columns.action_labels``, default ``columns.labels``) is > 0, and its action
mask has bit i set when action label i is > 0; an action log's rows carry the
same bits (its label columns in the same order, or one bits column taken as
is). The masks are ``imp_action`` (requests), ``ev_action`` (events, history)
and ``seq_action`` (samples). Every table that holds one records the label
names in bit order, bit 0 first, as a JSON list in its Delta table property
:data:`ACTION_BITS`.

Example::

    labels = action_bits("D")             # ['click', 'like'] (D's samples)
    decode_action(3, labels)              # ['click', 'like']
    decode_action(2, labels)              # ['like']

Reading needs delta-rs only (no Spark): the loader side may import this module.
"""

from __future__ import annotations

import json
from typing import Iterable, Sequence

from userwise.schemas.core import SchemaError

ACTION_BITS = "userwise.action_bits"
"""The table property that names the action bits (a JSON list of label names, bit 0 first)."""


def action_bits_property(labels: Iterable[str]) -> dict[str, str]:
    """The table property recording ``labels`` as the action bits, bit 0 first."""
    return {ACTION_BITS: json.dumps(list(labels))}


def action_bits(path: str) -> list[str]:
    """The label names of the action bits, bit 0 first, of the Delta table at ``path`` or of
    the build folder ``path`` (its samples, else its requests), read from the Delta log.

    Raises :class:`SchemaError` when ``path`` is neither a table nor a build folder, or its
    table records no action bits (a table without a mask column).

    Example::

        action_bits("D")                  # ['click', 'like']: bit 0 is click
    """
    from deltalake import DeltaTable

    if DeltaTable.is_deltatable(path):
        targets = [path]
    else:
        root = path.rstrip("/")
        targets = [t for t in (root + "/samples", root + "/requests") if DeltaTable.is_deltatable(t)]
        if not targets:
            raise SchemaError(f"{path}: neither a Delta table nor a build folder (no samples or requests table)")
    for t in targets:
        conf = DeltaTable(t).metadata().configuration
        if ACTION_BITS in conf:
            return list(json.loads(conf[ACTION_BITS]))
    raise SchemaError(f"{targets[0]}: no table property {ACTION_BITS}; the table holds no action mask "
                      "(imp_action, ev_action, seq_action) or was not written by userwise")


def decode_action(mask: int, labels: Sequence[str]) -> list[str]:
    """The names of the labels whose bit is set in ``mask`` (``labels`` in bit order).

    Example::

        decode_action(3, ["click", "like"])    # ['click', 'like']
    """
    return [name for i, name in enumerate(labels) if (int(mask) >> i) & 1]
