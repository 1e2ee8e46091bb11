"""The jagged batch: the user-wise structure of several samples in one buffer.

A :class:`JaggedBatch` is one contiguous ``uint8`` tensor plus a small
layout header (name, dtype, byte offset, element count per array), so it
crosses process boundaries, gets pinned and copied to the device in one
piece. Arrays (all flat, batch-relative):

per sample (``B`` samples)
    every scalar column (``sample_id``, ``user``, ``num_events``, ``cost`` ...),
    ``seq.offsets`` (B+1): sample i's stored sequence is ``seq_<f>[seq.offsets[i]:seq.offsets[i+1]]``,
    ``seq_<field>``: the sequence values of each field (parallel).
per request (``R`` requests)
    ``req.offsets`` (B+1) into the request arrays; ``req_seq_begin`` / ``req_seq_end``
    (sample-relative, as stored: request r sees its sample's seq[begin:end]);
    ``req_time``, ``req_num_imps``, ``req__<col>`` (context, user features);
    ``req.sample`` (R): the sample index of each request.
per impression (``N`` impressions)
    ``imp.offsets`` (B+1); ``imp__<col>`` (item, side-info, labels...);
    ``imp.req`` (N): the batch-level index of its request.
strings
    ``<col>`` holds utf-8 bytes and ``<col>.soff`` int64 offsets per string.
nulls
    ``<col>.valid`` (uint8, 1 = valid) only where a column has null elements;
    null values read as 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from userwise.pipelines.errors import ArgumentError
from userwise.pipelines.jagged import (
    np_offsets,
    np_ranges,
    np_request_spans,
    np_segment_ids,
    ranges,
    request_spans,
)
from userwise.schemas.layout import input_name

__all__ = ["JaggedBatch", "expand_batch", "full_device", "as_device"]

_TORCH = {
    "int8": torch.int8, "int16": torch.int16, "int32": torch.int32, "int64": torch.int64,
    "uint8": torch.uint8, "uint16": torch.uint16, "uint32": torch.uint32, "uint64": torch.uint64,
    "float16": torch.float16, "float32": torch.float32, "float64": torch.float64,
}


# The device types batches can go to: the host, or a CUDA device.
DEVICE_TYPES = ("cpu", "cuda")


def as_device(value, what: str = "device", *, available: bool = False) -> torch.device:
    """``value`` (a device string such as ``"cpu"``, ``"cuda"``, ``"cuda:1"``, or a
    ``torch.device``) as a ``torch.device``; an :class:`ArgumentError` naming ``what`` for
    anything else (``"tpu"``, ``3``, a device type the loader cannot put batches on). With
    ``available``, a CUDA device must also be there: CUDA available and its index below the
    device count."""
    if isinstance(value, bool) or not isinstance(value, (str, torch.device)):
        raise ArgumentError(f"{what} must be a device string such as 'cpu' or 'cuda:0', or a torch.device, "
                            f"got {type(value).__name__} {value!r:.80}")
    try:
        d = torch.device(value)
    except (RuntimeError, ValueError) as e:
        why = " ".join(str(e).split())[:200]
        raise ArgumentError(f"{what} {value!r:.80} is not a device ({why}); use 'cpu', 'cuda' or 'cuda:N'") from None
    if d.type not in DEVICE_TYPES:
        raise ArgumentError(f"{what} {value!r:.80}: batches go to {' or '.join(DEVICE_TYPES)} devices only; "
                            "use 'cpu', 'cuda' or 'cuda:N'")
    if available and d.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise ArgumentError(f"{what} {value!r:.80}: no CUDA device is available here; use device='cpu'")
        if d.index is not None and d.index >= n:
            raise ArgumentError(f"{what} {value!r:.80}: this host has {n} CUDA device(s), cuda:0..cuda:{n - 1}")
    return d


def full_device(d: torch.device) -> torch.device:
    """``cuda`` -> ``cuda:<current>`` (as torch's ``.to`` reads it), so it compares equal
    to a tensor's device."""
    if d.type == "cuda" and d.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return d


@dataclass
class JaggedBatch:
    """One batch of user-wise samples (see module doc for the arrays).

    Attributes: ``buffer`` (uint8 tensor holding every array), ``spec``
    (tuple of ``(name, dtype, byte_offset, numel)``), ``meta`` (dict:
    ``set`` id, ``epoch``, ``index`` in the epoch, ``num_samples``,
    ``columns``: name -> (group, arrow element type)).

    Example::

        b = next(iter(loader))
        items = b["seq_item"]; offs = b["seq.offsets"]      # jagged sequence
        imp_req = b["imp.req"]; ends = b["req_seq_end"]     # impression -> request -> history
        b = b.pin_memory().to("cuda", non_blocking=True)
    """

    buffer: torch.Tensor
    spec: tuple
    meta: dict
    _views: dict = field(default_factory=dict, repr=False, compare=False)

    # -- arrays ----------------------------------------------------------
    def __getitem__(self, name: str) -> torch.Tensor:
        v = self._views.get(name)
        if v is None:
            for n, dt, off, numel in self.spec:
                if n == name:
                    t = _TORCH[dt]
                    size = torch.empty((), dtype=t).element_size()
                    v = self.buffer[off: off + numel * size].view(t)
                    self._views[name] = v
                    break
            else:
                raise KeyError(f"batch has no array {name!r}; it has {sorted(self.keys())}")
        return v

    def __contains__(self, name: str) -> bool:
        return any(n == name for n, *_ in self.spec)

    def keys(self) -> list[str]:
        return [n for n, *_ in self.spec]

    def numpy(self, name: str) -> np.ndarray:
        return self[name].cpu().numpy()

    @property
    def num_samples(self) -> int:
        return int(self.meta["num_samples"])

    @property
    def num_requests(self) -> int:
        return int(self.spec_numel("req.sample"))

    @property
    def num_impressions(self) -> int:
        return int(self.spec_numel("imp.req"))

    @property
    def num_events(self) -> int:
        return int(self.spec_numel("seq.offsets") and self._last("seq.offsets"))

    def _last(self, name):
        return int(self[name][-1].item()) if self.spec_numel(name) else 0

    def spec_numel(self, name: str) -> int:
        for n, _, _, numel in self.spec:
            if n == name:
                return numel
        return 0

    @property
    def nbytes(self) -> int:
        return int(self.buffer.numel())

    @property
    def device(self) -> torch.device:
        return self.buffer.device

    def seq_fields(self) -> list[str]:
        return [n for n, (g, _) in self.meta["columns"].items() if g == "seq"]

    # -- memory --------------------------------------------------------------
    def _with(self, buf: torch.Tensor) -> "JaggedBatch":
        return JaggedBatch(buf, self.spec, self.meta)

    def to(self, device, non_blocking: bool = False) -> "JaggedBatch":
        """One copy of the whole buffer (asynchronous from pinned memory with non_blocking)."""
        device = full_device(torch.device(device))
        if self.buffer.device == device:
            return self
        return self._with(self.buffer.to(device, non_blocking=non_blocking))

    def pin_memory(self, device=None) -> "JaggedBatch":
        """Pinned copy (raises without an accelerator, as torch does)."""
        if self.buffer.is_pinned():
            return self
        return self._with(self.buffer.pin_memory())

    def is_pinned(self) -> bool:
        return bool(self.buffer.is_pinned())

    def record_stream(self, stream) -> "JaggedBatch":
        """Mark the buffer as used on ``stream`` (CUDA), so the allocator does not reuse it early."""
        if self.buffer.is_cuda:
            self.buffer.record_stream(stream)
        return self

    def jagged(self, key: str, per: str = "sample") -> tuple[torch.Tensor, torch.Tensor]:
        """One integer column as bags: ``(values, lengths)`` (int64 values, int64 lengths, on
        the batch's device), the bags of :meth:`to_kjt` for ``key`` (``per`` as there, without
        ``vbe``). An :class:`ArgumentError` for a string column, an unknown ``per``, or a key
        ``per`` cannot bag.

        Example::

            v, ln = b.jagged("imp__item_id", per="impression")   # one bag per impression
        """
        cols = self.meta["columns"]
        if key not in cols:
            raise ArgumentError(f"batch has no column {key!r}; it has {sorted(cols)}")
        group, typ = cols[key]
        if typ in _STRINGY:
            raise ArgumentError(f"{key!r} is a string column; a KeyedJaggedTensor needs integer ids")
        v = self[key].long()
        if per == "request":
            if group != "seq":
                raise ArgumentError(f"per='request' needs sequence keys, {key!r} is per {group}")
            b, e = self._request_spans()
            ln = e - b
            return v[ranges(b, ln)], ln
        if per == "sample":
            if group == "sample":  # a scalar per sample: one bag of one value
                return v, torch.ones(len(v), dtype=torch.int64, device=v.device)
            off = self[f"{group}.offsets" if group in ("seq", "req", "imp") else f"{key}.offsets"].long()
            return v, off[1:] - off[:-1]
        if per == "impression":
            # one bag per impression: its own value (imp), its request's (req), its sample's
            # (sample) or the history its request sees (seq), as expand_batch's rows hold them
            idx = self._per_impression_row(key, group)
            if group == "seq":
                b, e = self._request_spans()
                ln = (e - b)[idx]
                return v[ranges(b[idx], ln)], ln
            return v[idx], torch.ones(len(idx), dtype=torch.int64, device=v.device)
        raise ArgumentError(f"per must be 'sample', 'request' or 'impression', got {per!r}")

    def _request_spans(self) -> tuple[torch.Tensor, torch.Tensor]:
        return request_spans(self["seq.offsets"], self["req.sample"], self["req_seq_begin"], self["req_seq_end"])

    def _per_impression_row(self, key: str, group: str) -> torch.Tensor:
        """Each impression's row in ``key``'s own group (int64): itself, its request, its sample."""
        imp_req = self["imp.req"].long()
        if group == "imp":
            return torch.arange(len(imp_req), dtype=torch.int64, device=imp_req.device)
        if group in ("req", "seq"):
            if group == "seq" and (self.meta.get("roles") or {}).get("fat") and "req_snapshot" in self:
                raise ArgumentError(f"per='impression' of sequence key {key!r}: a fat-row batch's requests may "
                                    "see override snapshots; use expand_batch for their histories")
            return imp_req
        if group == "sample":
            return self["req.sample"].long()[imp_req]
        raise ArgumentError(f"per='impression' needs sample, request, impression or sequence keys, {key!r} is a "
                            f"{group} column")

    def to_kjt(self, keys=None, *, per: str = "sample", vbe: bool = False):
        """A TorchRec ``KeyedJaggedTensor`` (values int64, lengths key-major).

        ``keys``: list columns (``seq_item``, ``imp__item_id``, ``req__hour`` ...);
        default: every numeric sequence field. ``per="sample"``: one bag per
        (key, sample); ``per="request"``: for sequence keys, one bag per (key,
        request) holding the history that request sees (seq[begin:end]);
        ``per="impression"``: one bag per (key, impression), the point-wise form: an
        impression key's own value, a request key's (context, user features) or a sample
        key's (``user``) value repeated for each impression, a sequence key's history the
        impression's request sees.

        ``vbe=True`` (with ``per="impression"``): TorchRec's variable-batch form. Each key
        keeps one bag per row of its own group, so request and user features come once per
        request (``req__``, and the history of a sequence key), sample keys once per sample,
        impression keys once per impression (``stride_per_key_per_rank`` ``[[R]]``, ``[[B]]``,
        ``[[N]]``), and ``inverse_indices`` ``(keys, [K, N] int64)`` maps every impression to
        its bag in each key. An ``EmbeddingBagCollection`` looks each bag up once and expands
        the pooled rows to the ``N`` impressions; expanding the bags by ``inverse_indices``
        gives exactly the ``per="impression"`` KJT.

        Example::

            kjt = b.to_kjt(["imp__item_id", "req__hour", "seq_item"], per="impression", vbe=True)
            kjt.stride_per_key()          # [N, R, R]
            pooled = ebc(kjt)             # [N, dims]: request features looked up R times, not N
        """
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        if not isinstance(vbe, bool):
            raise ArgumentError(f"vbe must be True or False, got {vbe!r}")
        if vbe and per != "impression":
            raise ArgumentError(f"vbe=True needs per='impression' (bags once per request, expanded to the "
                                f"impressions), got per={per!r}")
        cols = self.meta["columns"]
        keys = list(keys) if keys is not None else [k for k in self.seq_fields() if cols[k][1] not in _STRINGY]
        if not vbe:
            vals, lens = zip(*(self.jagged(k, per) for k in keys)) if keys else ((), ())
            return KeyedJaggedTensor.from_lengths_sync(keys=keys, values=_cat(vals, self.device),
                                                       lengths=_cat(lens, self.device).int())
        vals, lens, strides, inverse = [], [], [], []
        for k in keys:
            if k not in cols:
                raise ArgumentError(f"batch has no column {k!r}; it has {sorted(cols)}")
            group = cols[k][0]
            inverse.append(self._per_impression_row(k, group))  # also rejects list columns, fat histories
            if group == "seq":  # a request's history, once per request
                v, ln = self.jagged(k, "request")
            else:  # one value per row of its own group: impression, request or sample
                v, _ = self.jagged(k, "sample")
                ln = torch.ones(len(v), dtype=torch.int64, device=v.device)
            vals.append(v)
            lens.append(ln)
            strides.append([len(ln)])
        inv = torch.stack(inverse) if inverse else torch.empty((0, self.num_impressions), dtype=torch.int64)
        return KeyedJaggedTensor(keys=keys, values=_cat(vals, self.device), lengths=_cat(lens, self.device).int(),
                                 stride_per_key_per_rank=strides, inverse_indices=(keys, inv))


def _cat(ts, device) -> torch.Tensor:
    return torch.cat(list(ts)) if ts else torch.empty(0, dtype=torch.int64, device=device)


OVR_PREFIX = "ovr_"
_STRINGY = ("string", "large_string", "binary", "large_binary")


def _arrow_col(b: JaggedBatch, name: str, typ: str, idx: np.ndarray | None, offsets: np.ndarray | None = None):
    """One column's flat values (optionally gathered by ``idx``, grouped into lists by ``offsets``) as Arrow."""
    import pyarrow as pa

    t = pa.type_for_alias(typ) if typ not in ("date32[day]",) else pa.date32()
    valid = b.numpy(name + ".valid").astype(bool) if (name + ".valid") in b else None
    if typ in _STRINGY:
        data = b.numpy(name)
        so = b.numpy(name + ".soff")
        ix = np.arange(len(so) - 1) if idx is None else idx
        ln = so[1:][ix] - so[:-1][ix]
        gat = data[np_ranges(so[:-1][ix], ln)]
        off = np_offsets(ln)
        arr = pa.LargeStringArray.from_buffers(len(ix), pa.py_buffer(off), pa.py_buffer(gat.tobytes()))
        arr = arr.cast(t)
        if valid is not None:
            arr = _mask(arr, valid[ix])
    else:
        v = b.numpy(name)
        v = v if idx is None else v[idx]
        arr = pa.array(v, type=pa.int32() if pa.types.is_date32(t) else t, mask=None if valid is None else ~(valid if idx is None else valid[idx]))
        if pa.types.is_date32(t):
            arr = arr.cast(t)
    if offsets is not None:
        arr = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), arr)
    return arr


def _mask(arr, valid: np.ndarray):
    import pyarrow as pa
    import pyarrow.compute as pc

    return pc.if_else(pa.array(valid), arr, pa.scalar(None, arr.type))


def expand_batch(batch: JaggedBatch):
    """Point-wise rows of a batch, one per impression (pure numpy + Arrow).

    Columns: the user column (its input name), every ``req__`` column
    repeated per impression (and ``req_id`` / ``req_time`` under the request
    key's and request time's input names, roles ``request_derived``) and every
    ``imp__`` column, all under the input's own names (the stored names decoded by
    ``schemas.layout.input_name``), then per impression its visible history
    ``seq_<field>`` = the stored seq[begin:end] of its request. For fat-row
    builds the history columns take the snapshot columns' input names, and a
    request's override (``req_snapshot`` 1) or null snapshot (2) comes back
    as given, exactly as ``userwise expand`` writes it.
    Rows come in batch order (samples, requests, impressions in stored order).

    Example::

        rows = expand_batch(next(iter(loader)))     # a pyarrow.Table, one row per impression
        rows.column("seq_item")                     # each impression's visible history
    """
    import pyarrow as pa

    b = batch.to("cpu")
    cols = b.meta["columns"]
    roles = b.meta.get("roles") or {}
    imp_req = b.numpy("imp.req").astype(np.int64)
    req_sample = b.numpy("req.sample").astype(np.int64)
    imp_sample = req_sample[imp_req]
    out = {}
    user_name = roles.get("user") or "user"
    if "user" in cols:
        out[user_name] = _arrow_col(b, "user", cols["user"][1], imp_sample)
    for name, (group, typ) in cols.items():
        if group == "req" and name.startswith("req__"):
            out[name[5:]] = _arrow_col(b, name, typ, imp_req)
    for name, canon in (roles.get("request_derived") or {}).items():  # the request key / time: stored once
        if canon in cols and name not in out:
            out[name] = _arrow_col(b, canon, cols[canon][1], imp_req)
    for name, (group, typ) in cols.items():
        if group == "imp" and name.startswith("imp__"):
            out[name[5:]] = _arrow_col(b, name, typ, None)
    order = [c for c in roles.get("input_columns", []) if c in out]
    table = {c: out[c] for c in order + [c for c in out if c not in order]}
    so = b.numpy("seq.offsets").astype(np.int64)
    begin, end = np_request_spans(so, req_sample, b.numpy("req_seq_begin"), b.numpy("req_seq_end"))
    begin, end = begin[imp_req], end[imp_req]
    fat = bool(roles.get("fat")) and "req_snapshot" in b
    null = None
    if fat:
        # Fat rows: a request's snapshot is a slice of the stored stream (0), an override
        # kept whole (1, in ovr_<field>) or null (2); see schemas.tables.samples_schema.
        kind = b.numpy("req_snapshot").astype(np.int64)[imp_req]
        ro = b.numpy("req.offsets").astype(np.int64)
        oro = b.numpy("ovr_req.offsets").astype(np.int64)
        ovr_sample = np_segment_ids(oro)
        req_ovr = np.full(len(req_sample), -1, np.int64)  # batch request -> batch override index
        req_ovr[ro[ovr_sample] + b.numpy("ovr_req").astype(np.int64)] = np.arange(len(ovr_sample))
        o = req_ovr[imp_req]
        is_ovr = kind == 1
        if (o[is_ovr] < 0).any():
            raise ArgumentError("the batch holds an override request without an ovr_req entry: not a batch the "
                                "loader assembled")
        oo = b.numpy("ovr_offsets").astype(np.int64)  # per sample: len(overrides) + 1 offsets
        ooo = b.numpy("ovr_offsets.offsets").astype(np.int64)
        vbase = b.numpy(f"{OVR_PREFIX}{roles['seq_fields'][0]}.offsets").astype(np.int64)
        oi = np.where(is_ovr, ooo[imp_sample] + o - oro[imp_sample], 0)  # this override's entry in ovr_offsets
        base = int(so[-1]) + vbase[imp_sample]  # override values follow the stored values (see below)
        begin = np.where(is_ovr, base + oo[oi], np.where(kind == 2, 0, begin))
        end = np.where(is_ovr, base + oo[np.where(is_ovr, oi + 1, 0)], np.where(kind == 2, 0, end))
        null = kind == 2
    ln = end - begin
    gidx = np_ranges(begin, ln)
    hoff = np_offsets(ln).astype(np.int32)
    names = (roles.get("sequence") or {}) if fat else {}
    for name, (group, typ) in cols.items():
        if group != "seq":
            continue
        vals = _arrow_col(b, name, typ, None)
        if fat:
            vals = pa.concat_arrays([vals, _arrow_col(b, OVR_PREFIX + name[len("seq_"):], typ, None)])
        arr = pa.ListArray.from_arrays(pa.array(hoff), vals.take(pa.array(gidx)),
                                       mask=None if null is None else pa.array(null))
        table[names.get(name[len("seq_"):], name)] = arr
    order = [c for c in roles.get("input_columns", []) if c in table]  # fat: snapshots sit among the inputs
    out = {}
    for c in order + [c for c in table if c not in order]:  # storage names -> the input's own names
        out[c if input_name(c) in out else input_name(c)] = table[c]
    return pa.table(out)
