"""The buffer layout: where every array of a batch sits in its one buffer, worked out once per schema.

(Not the column layout of :mod:`userwise.schemas.layout`, how a user's input columns land
in our tables, nor the kernels' argument layouts of :mod:`userwise.pipelines.train.kernel_args`.)

A batch is one buffer of ALIGN-aligned arrays (:class:`~userwise.pipelines.loader.JaggedBatch`),
in :func:`layout_key` order: by group (sample, seq, req, imp, then each list with
its own offsets), then by :class:`Part` (offsets, numeric values by dtype,
string bytes, string offsets, validity, derived indices), then by column.
Every assembler writes this order, so host, worker and device batches of the
same samples are the same bytes.

:func:`layout_of` derives from the decoded columns' names and kinds alone
(every buffer of a node has the same ones) the :class:`BatchLayout`: the
arrays in order, which per-batch count gives each one's length, and per group
a :class:`GroupRecipe` saying which columns the host assembler stacks into
one block, which are the group's strings and validity rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import numpy as np

from userwise.pipelines.loader.io.decode import Col, group_of


class Part(IntEnum):
    """What an array of a group holds (its rank inside the group's arrays)."""

    OFFSETS = 0  # the group's list offsets (int64, B + 1)
    VALUES = 1  # a numeric column's values
    BYTES = 2  # a string column's utf-8 bytes
    STR_OFFSETS = 3  # a string column's offsets into its bytes (int64)
    VALIDITY = 4  # a nullable column's validity (uint8)
    DERIVED = 5  # req.sample (request -> sample), imp.req (impression -> request)


GROUP_RANK = {"sample": 0, "seq": 1, "req": 2, "imp": 3, "list": 4}


def layout_key(group: str, group_sub: int, part: Part, dtype: str, col: int) -> tuple:
    """The sort key of an array in the batch buffer: its group (``group_sub``: a list
    column's position, as each such list is a group of its own), its :class:`Part`, its
    dtype (numeric values), then its column's position."""
    return (GROUP_RANK[group], group_sub, part, dtype, col)


# The per-batch counts an array's length is read from: COUNT_B (samples), COUNT_B1
# (samples + 1), then per list group its elements and elements + 1, then per string
# column its bytes.
COUNT_B, COUNT_B1 = 0, 1


@dataclass(frozen=True)
class Entry:
    """One array of the batch."""

    key: tuple  # layout_key
    name: str  # its name in the batch
    dtype: str
    count: int  # which per-batch count is its length


@dataclass(frozen=True)
class Block:
    """Numeric columns of one group and dtype, stacked as the rows of one 2-D array; their
    entries are consecutive, row r at ``at + r``."""

    at: int
    names: tuple[str, ...]


@dataclass(frozen=True)
class StringsRecipe:
    """The string columns of one group: their bytes share one array. Column c's bytes are
    entry ``bytes_at + c``, its offsets entry ``soff_at + c``; its length in bytes is count
    ``first_count + c``."""

    bytes_at: int
    soff_at: int
    names: tuple[str, ...]
    first_count: int


@dataclass(frozen=True)
class ValidRecipe:
    """The validity arrays of one group's nullable columns, stacked; row r is entry ``at + r``."""

    at: int
    names: tuple[str, ...]


@dataclass(frozen=True)
class GroupRecipe:
    """How one group's arrays are built."""

    group: str  # sample, seq, req, imp or list
    sub: int  # a list group: its column's position; else 0
    offsets_col: str | None  # the column whose offsets the group has (None: per sample)
    offsets_at: int | None  # the entry of the group's offsets
    count: int  # the count of its elements (COUNT_B per sample); count + 1: with one more
    blocks: tuple[Block, ...]
    strings: StringsRecipe | None
    valid: ValidRecipe | None


@dataclass(frozen=True)
class BatchLayout:
    """The arrays of a batch in buffer order, and the recipe of every group."""

    columns: dict[str, tuple[str, str]]  # column -> (group, Arrow type name): the batch's meta["columns"]
    entries: tuple[Entry, ...]
    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    itemsize: np.ndarray  # per entry
    count: np.ndarray  # per entry: which count is its length
    ncounts: int  # counts per batch
    groups: tuple[GroupRecipe, ...]  # in layout order
    seq_count: int | None  # the count of the seq group's elements (events), if there is one
    req_count: int | None
    imp_count: int | None
    req_sample_at: int | None  # entry of req.sample (where there are requests)
    imp_req_at: int | None  # entry of imp.req (where there are impressions and req_num_imps)


_LAYOUTS: dict = {}  # BatchLayout per column signature (names, types, which arrays exist)


def layout_of(cols: dict[str, Col]) -> BatchLayout:
    """The :class:`BatchLayout` of host (numpy) columns, derived once per schema."""
    sig = tuple((n, c.arrow, c.values.dtype.str, c.offsets is None, c.str_offsets is None, c.validity is None)
                for n, c in cols.items())
    lay = _LAYOUTS.get(sig)
    if lay is None:
        lay = _derive(cols)
        if len(_LAYOUTS) >= 64:  # a long run over many schemas: start over rather than grow
            _LAYOUTS.clear()
        _LAYOUTS[sig] = lay
    return lay


@dataclass
class _Group:
    """A group's columns while the layout is derived."""

    label: str
    offsets_col: str | None = None
    num: dict | None = None  # dtype name -> [(column position, name)]
    strings: list | None = None  # [(column position, name)]
    valid: list | None = None


def _derive(cols: dict[str, Col]) -> BatchLayout:
    order = {name: i for i, name in enumerate(cols)}
    columns = {}
    groups: dict[tuple, _Group] = {}
    for name, c in cols.items():
        g = group_of(name, c)
        columns[name] = (g, c.arrow)
        G = groups.setdefault((g, order[name] if g == "list" else 0),
                              _Group(g if g != "list" else name, None, {}, [], []))
        if c.offsets is not None and G.offsets_col is None:
            G.offsets_col = name
        if c.str_offsets is not None:
            G.strings.append((order[name], name))
        else:
            G.num.setdefault(c.values.dtype.name, []).append((order[name], name))
        if c.validity is not None:
            G.valid.append((order[name], name))
    entries = []
    recipes = []  # GroupRecipe fields, with layout keys where entry indexes go (known once sorted)
    ncounts = 2
    for gk in sorted(groups, key=lambda k: (GROUP_RANK[k[0]], k[1])):
        G = groups[gk]
        g, sub = gk
        off_key = None
        if G.offsets_col is None:
            n_count, n1_count = COUNT_B, COUNT_B1
        else:
            n_count, n1_count = ncounts, ncounts + 1
            ncounts += 2
            off_key = layout_key(g, sub, Part.OFFSETS, "", 0)
            entries.append(Entry(off_key, f"{G.label}.offsets", "int64", COUNT_B1))
        blocks = []
        for dt, items in G.num.items():
            items.sort()
            for ci, name in items:
                entries.append(Entry(layout_key(g, sub, Part.VALUES, dt, ci), name, dt, n_count))
            blocks.append((layout_key(g, sub, Part.VALUES, dt, items[0][0]), tuple(name for _, name in items)))
        strings = None
        if G.strings:
            G.strings.sort()
            first = ncounts
            for ci, name in G.strings:
                entries.append(Entry(layout_key(g, sub, Part.BYTES, "", ci), name, "uint8", ncounts))
                entries.append(Entry(layout_key(g, sub, Part.STR_OFFSETS, "int64", ci), name + ".soff", "int64",
                                     n1_count))
                ncounts += 1
            c0 = G.strings[0][0]
            strings = (layout_key(g, sub, Part.BYTES, "", c0), layout_key(g, sub, Part.STR_OFFSETS, "int64", c0),
                       tuple(name for _, name in G.strings), first)
        valid = None
        if G.valid:
            G.valid.sort()
            for ci, name in G.valid:
                entries.append(Entry(layout_key(g, sub, Part.VALIDITY, "uint8", ci), name + ".valid", "uint8", n_count))
            valid = (layout_key(g, sub, Part.VALIDITY, "uint8", G.valid[0][0]), tuple(name for _, name in G.valid))
        recipes.append((g, sub, G.offsets_col, off_key, n_count, blocks, strings, valid))
    counts = {g: n for g, _, off, _, n, *_ in recipes if off is not None and g in ("req", "imp", "seq")}
    req_count, imp_count, seq_count = counts.get("req"), counts.get("imp"), counts.get("seq")
    req_key = imp_key = None
    if req_count is not None:
        req_key = layout_key("req", 0, Part.DERIVED, "", 0)
        entries.append(Entry(req_key, "req.sample", "int64", req_count))
        if "req_num_imps" in cols and imp_count is not None:
            imp_key = layout_key("imp", 0, Part.DERIVED, "", 0)
            entries.append(Entry(imp_key, "imp.req", "int64", imp_count))
    entries.sort(key=lambda e: e.key)
    where = {e.key: i for i, e in enumerate(entries)}
    group_recipes = []
    for g, sub, off_col, off_key, n_count, blocks, strings, valid in recipes:
        group_recipes.append(GroupRecipe(
            g, sub, off_col, None if off_key is None else where[off_key], n_count,
            tuple(Block(where[key], names) for key, names in blocks),
            None if strings is None else StringsRecipe(where[strings[0]], where[strings[1]], strings[2], strings[3]),
            None if valid is None else ValidRecipe(where[valid[0]], valid[1])))
    return BatchLayout(
        columns=columns, entries=tuple(entries), names=tuple(e.name for e in entries),
        dtypes=tuple(e.dtype for e in entries),
        itemsize=np.array([np.dtype(e.dtype).itemsize for e in entries], np.int64),
        count=np.array([e.count for e in entries], np.int64), ncounts=ncounts, groups=tuple(group_recipes),
        seq_count=seq_count, req_count=req_count, imp_count=imp_count,
        req_sample_at=None if req_key is None else where[req_key],
        imp_req_at=None if imp_key is None else where[imp_key])


__all__ = ["Part", "GROUP_RANK", "layout_key", "BatchLayout", "GroupRecipe", "Block", "StringsRecipe",
           "ValidRecipe", "Entry", "layout_of", "COUNT_B", "COUNT_B1"]
