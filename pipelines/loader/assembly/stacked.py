"""A host buffer's columns stacked per group, and shuffled once per buffer.

:func:`stack` arranges decoded host columns by their :class:`buffer_layout.GroupRecipe`:
per group its offsets, its numeric columns in blocks (one per dtype), its
string columns' bytes in one array, its validity rows. :func:`permute` puts a
buffer's samples in shuffled order with one gather per block, after which
every batch is a contiguous range of samples. Lists that are long on average
stay where they are instead (:class:`Runs`): a batch copies its samples' runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from userwise.pipelines.jagged import np_offsets, np_ranges, np_segment_ids
from userwise.pipelines.loader.assembly import segcopy
from userwise.pipelines.loader.assembly.buffer_layout import BatchLayout, GroupRecipe
from userwise.pipelines.loader.assembly.segcopy import seg_copy
from userwise.pipelines.loader.io.decode import Col

# mean list length from which whole runs are copied instead of gathering elements
RUN_COPY_MIN = 32


class Runs:
    """A block of long list columns left in place by :func:`permute`: sample i of the
    permuted buffer is the run ``starts[i]: starts[i] + lengths[i]`` of every array. A batch
    copies its samples' runs straight into its buffer (:func:`segcopy.seg_copy`: one memcpy per
    run, where gather-then-slice makes two copies and an element-wise gather costs more than a
    copy once lists hold a few dozen elements)."""

    def __init__(self, arrays: list[np.ndarray], starts: np.ndarray, lengths: np.ndarray):
        self.arrays, self.starts, self.lengths = arrays, starts, lengths
        self.dtype = arrays[0].dtype

    def __len__(self) -> int:
        return len(self.arrays)

    def copy_into(self, out: np.ndarray, a: int, b: int) -> None:
        st, ln = self.starts[a:b], self.lengths[a:b]
        for r, v in enumerate(self.arrays):
            seg_copy(v, st, ln, out[r])


@dataclass
class HostStrings:
    """The string columns of a group: their bytes one after another in ``data``; row c of
    ``soff`` (columns x elements + 1) the offsets of column c's strings into ``data``."""

    data: np.ndarray
    soff: np.ndarray


@dataclass
class HostGroup:
    """The arrays of one group of a host buffer, as its recipe lists them."""

    recipe: GroupRecipe
    offsets: np.ndarray | None  # int64 list offsets (None: per sample)
    blocks: list  # per recipe block: its rows (1-D arrays; one 2-D array or Runs once permuted)
    strings: HostStrings | None
    valid: list | np.ndarray | None  # validity rows (uint8), per recipe.valid


@dataclass
class Permuted:
    """A buffer's groups in shuffled order, with the derived indices of all its samples."""

    groups: list[HostGroup]
    req_sample: np.ndarray | None  # request -> sample
    imp_req: np.ndarray | None  # impression -> request


def as_numpy(cols: dict[str, Col]) -> dict[str, Col]:
    """Columns with numpy arrays (host torch tensors viewed without copying)."""
    if all(isinstance(x, np.ndarray) or x is None
           for c in cols.values() for x in (c.values, c.offsets, c.str_offsets, c.validity)):
        return cols
    return {n: Col(*(None if x is None else np.asarray(x) for x in (c.values, c.offsets, c.str_offsets, c.validity)),
                   c.arrow) for n, c in cols.items()}


def stack(cols: dict[str, Col], layout: BatchLayout) -> list[HostGroup]:
    """Host (numpy) columns arranged per group of ``layout``."""
    groups = []
    for r in layout.groups:
        off = None if r.offsets_col is None else cols[r.offsets_col].offsets.astype(np.int64, copy=False)
        blocks = [[cols[n].values for n in b.names] for b in r.blocks]
        strings = None
        if r.strings is not None:
            names = r.strings.names
            ds = [cols[n].values for n in names]
            data = np.concatenate(ds) if len(ds) > 1 else ds[0]
            base = 0
            soff = np.empty((len(names), len(cols[names[0]].str_offsets)), np.int64)
            for c, (n, d) in enumerate(zip(names, ds)):
                np.add(cols[n].str_offsets, base, out=soff[c])
                base += len(d)
            strings = HostStrings(data, soff)
        valid = None
        if r.valid is not None:
            valid = [cols[n].validity.astype(np.uint8, copy=False) for n in r.valid.names]
        groups.append(HostGroup(r, off, blocks, strings, valid))
    return groups


def take_rows(arrays: list[np.ndarray], e: np.ndarray) -> np.ndarray:
    """Stack ``[a[e] for a in arrays]`` into one 2-D array (gathered straight into place)."""
    out = np.empty((len(arrays), len(e)), arrays[0].dtype)
    for r, a in enumerate(arrays):
        np.take(a, e, out=out[r], mode="clip")
    return out


def permute(groups: list[HostGroup], layout: BatchLayout, rni: np.ndarray | None, perm) -> Permuted:
    """``groups`` (as :func:`stack` made them) with their samples in ``perm`` order: one
    gather per block for the whole buffer (or :class:`Runs` for long lists), string bytes
    copied run by run. ``rni``: the buffer's req_num_imps (int64), for imp.req."""
    perm = np.asarray(perm, dtype=np.int64)
    B = len(perm)
    out = []
    req_e = None
    nb = segcopy.batch_kernels()
    for G in groups:
        r = G.recipe
        runs = None
        if G.offsets is None:
            e, new = perm, None
            st, ln = perm, np.ones(B, np.int64)
        else:
            off = G.offsets
            st = off[perm]
            ln = off[perm + 1] - st
            new = np_offsets(ln)
            if r.group != "req" and B and new[-1] >= RUN_COPY_MIN * B and not G.strings and not G.valid:
                runs = (st, ln)
            elif nb is not None:
                e = np.empty(int(new[-1]), np.int64)
                nb.ranges(st, ln, e)
            else:
                e = np_ranges(st, ln)
            if r.group == "req":
                req_e = e
        if runs is None:
            blocks = [take_rows(V, e) for V in G.blocks]
        else:  # long lists stay where they are: each batch copies its samples' runs (one copy, not two)
            blocks = [Runs(V, *runs) for V in G.blocks]
        strings = None
        if G.strings is not None and nb is not None:  # compiled: one block copy per (sample, column)
            data, soff = G.strings.data, G.strings.soff
            data2 = np.empty(len(data), np.uint8)  # the runs are distinct samples: at most every byte
            soff2 = np.empty((len(soff), len(e) + 1), np.int64)
            n = nb.perm_strings(data, soff, st, ln, data2, soff2)
            strings = HostStrings(data2[:n], soff2)
        elif G.strings is not None:
            data, soff = G.strings.data, G.strings.soff
            s0 = soff[:, e]
            sl = soff[:, e + 1] - s0
            snew = np.zeros((len(soff), len(e) + 1), np.int64)
            np.cumsum(sl, axis=1, out=snew[:, 1:])
            base = np.concatenate([[0], np.cumsum(snew[:, -1])[:-1]])
            data2 = np.empty(int(snew[:, -1].sum()), np.uint8)
            seg_copy(data, s0.ravel(), sl.ravel(), data2)  # one run per string
            strings = HostStrings(data2, snew + base[:, None])
        valid = None if G.valid is None else take_rows(G.valid, e)
        out.append(HostGroup(r, new, blocks, strings, valid))
    req_sample = imp_req = None
    if layout.req_sample_at is not None:
        roff = next(G.offsets for G in out if G.recipe.group == "req")
        req_sample = np_segment_ids(roff)
        if layout.imp_req_at is not None:
            imp_req = np.repeat(np.arange(len(req_e), dtype=np.int64), rni[req_e])
    return Permuted(out, req_sample, imp_req)


__all__ = ["RUN_COPY_MIN", "Runs", "HostGroup", "HostStrings", "Permuted", "as_numpy", "stack", "permute",
           "take_rows"]
