"""Replay a build's requests through the cache and through a full recompute.

:func:`read_trace` turns a shard set (every training node's shards, or one node's
staged copy; no Spark) into a serving trace: every request of every sample with its
user, its time, the events it could see, its candidates (the request's impressions, in
display order) and their labels, routed to serving nodes (:func:`nodes_of`) and, per
node, in time order (request time, then request id).

:func:`replay` serves that trace. Per serving node one :class:`KVStore` (the tiers'
byte limits are arguments); per request, in order:

1. the current chain: the request's sample's stored events up to its ``seq_end``
   (:class:`Chain`, from the sample's rolling hashes, computed once);
2. ``store.acquire(user, chain)``: the held state cut to the prefix the chain verifies
   (all of it, its unfinished last page included, when the request's events extend it;
   nothing when the user's held state belongs to another sample whose events differ: a
   new window or chunk re-anchors the user);
3. ``extend`` by the events the lease lacks, ``store.put``, ``score`` the candidates;
4. the full recompute: :func:`full_scores` over the same events (the training forward of
   a one-request sample), and once per sample the training forward of the sample as the
   loader gives it (``model(UserBatch)`` with the stored pointers of all its requests).

A request of a sample sees ``stored[seq_begin:seq_end]``; its state holds
``stored[0:seq_end]`` (the causal encoder's output at an event depends on the sample's
events up to it), so the state of a user is anchored at its sample's first stored event.
The target attends to the newest ``max_seq_len`` (L) held events, which is training's
span exactly when ``seq_begin = max(0, seq_end - L)``: L is read from the pointers (the
longest span) or given, and a request whose pointer breaks the rule is refused.

The report: logits equal (the largest absolute difference against the full recompute and
against the training forward, and the requests over the tolerance: 1e-9 in float64,
1e-5 in float32), the stores' counts (``KVStore.stats()``: each lookup a full reuse, a
partial reuse or a miss, hits per tier, invalidated), tokens the cache encoded (new events,
and events encoded again) against those the full recompute encodes, resident bytes, per
serving node and in total; wall-clock figures only under ``timing``, so two replays with
the same arguments give the same report outside it.

Example::

    report = replay("shards", serving_nodes=4, dtype="float64", seed=0)
    report["equality"]["over_tolerance"], report["reuse_rate"], report["timing"]["cached_requests_per_s"]
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import math
import os
import re
import secrets
import shutil
import signal
import socket
import stat
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from userwise.pipelines.errors import ArgumentError, ShardError, UserwiseError, expect
from userwise.pipelines.jagged import np_offsets, np_segment_ids
from userwise.pipelines.loader.io.reading import open_parquet, read_row_groups
from userwise.pipelines.loader.io.shards import VERIFY, open_node
from userwise.pipelines.runtime import progress
from userwise.pipelines.runtime.ship import private_tmp
from userwise.pipelines.serve.chain import Chain
from userwise.pipelines.serve.incremental import Candidates, Events, empty_state, extend, full_scores, score
from userwise.pipelines.serve.routing import nodes_of
from userwise.pipelines.serve.store import TIERS, KVStore
from userwise.pipelines.shards import manifest as mf
from userwise.pipelines.train import Fields, ReferenceRanker, Spans, UserBatch
from userwise.schemas.hashing import CHAIN_COLUMNS, chain_checkpoints, event_hashes, rolling_hashes

__all__ = ["Trace", "TraceRequest", "read_trace", "replay", "TOLERANCE", "DTYPES"]

DTYPES = {"float32": torch.float32, "float64": torch.float64}
TOLERANCE = {"float64": 1e-9, "float32": 1e-5}
MB = 1 << 20
# the report's cache counts, as KVStore.stats() gives them (see its docstring)
_COUNTS = ("lookups", "reuse", "reuse_rate", "hits", "hit_rate", "partial_reuses", "misses", "invalidated")


@dataclass(frozen=True)
class TraceRequest:
    """One request of a :class:`Trace`: ``node`` (serving), ``user``, ``time``, ``id``,
    ``sample_id``, ``seq_begin`` / ``seq_end`` (its pointer into the sample's stored events),
    ``events`` (the sample's stored events ``[0, seq_end)``: what its cached state holds; the
    target sees ``events[seq_begin:]``), ``candidates`` (its impressions in display order) and
    ``labels`` (float ``[c, labels]``).

    Example::

        for req in trace.requests(node=0):
            logits = score(model, extend(model, state, req.events[state.length:]), req.candidates)
    """

    node: int
    user: object
    time: int
    id: object
    sample_id: int
    seq_begin: int
    seq_end: int
    events: Events
    candidates: Candidates
    labels: torch.Tensor

    @property
    def visible(self) -> Events:
        """The events its target attends to: ``events[seq_begin:seq_end]``."""
        return self.events[self.seq_begin:]


@dataclass
class Trace:
    """A build's requests as a serving trace (see module doc): samples' stored events flat
    (``ev_*``, cut by ``seq_offsets``) with their rolling hashes, requests flat (``req_*``,
    cut by ``req_offsets``; pointers sample-relative), impressions flat (``tgt_*``,
    ``labels``, cut per request by ``imp_offsets``), ``node_of_sample`` and ``order`` (per
    serving node the request indices in time order).

    Example::

        trace = read_trace("shards", serving_nodes=4)
        trace.max_seq_len, len(trace.order[0]), next(trace.requests(0)).user
    """

    root: str
    fields: Fields
    max_seq_len: int
    serving_nodes: int
    training_nodes: list
    sets: list
    users: list
    sample_ids: np.ndarray
    seq_offsets: np.ndarray
    ev_item: torch.Tensor
    ev_side: torch.Tensor
    ev_action: torch.Tensor
    ev_time: torch.Tensor | None
    hashes: np.ndarray
    req_offsets: np.ndarray
    req_sample: np.ndarray
    req_begin: np.ndarray
    req_end: np.ndarray
    req_time: np.ndarray
    req_id: np.ndarray
    imp_offsets: np.ndarray
    tgt_item: torch.Tensor
    tgt_side: torch.Tensor
    labels: torch.Tensor
    node_of_sample: np.ndarray
    order: list

    @property
    def num_requests(self) -> int:
        return len(self.req_sample)

    def events(self, sample: int, stop: int | None = None) -> Events:
        """The stored events ``[0, stop)`` of a sample (by index; default all of them)."""
        a, b = int(self.seq_offsets[sample]), int(self.seq_offsets[sample + 1])
        b = b if stop is None else a + int(stop)
        return Events(self.ev_item[a:b], self.ev_side[a:b], self.ev_action[a:b],
                      None if self.ev_time is None else self.ev_time[a:b])

    def chain(self, sample: int, n: int, *, block: int, version) -> Chain:
        """The :class:`Chain` of a sample's first ``n`` stored events (equal to
        ``chain_of(trace.events(sample, n), block=block, version=version)``, from the rolling
        hashes computed once)."""
        a = int(self.seq_offsets[sample])
        return Chain.from_hashes(self.hashes[a:a + n], block=block, version=version)

    def request(self, r: int) -> TraceRequest:
        """Request ``r`` (a flat index)."""
        s, e = int(self.req_sample[r]), int(self.req_end[r])
        a, b = int(self.imp_offsets[r]), int(self.imp_offsets[r + 1])
        t = self.req_id[r]
        return TraceRequest(node=int(self.node_of_sample[s]), user=self.users[s], time=int(self.req_time[r]),
                            id=t.item() if isinstance(t, np.generic) else t, sample_id=int(self.sample_ids[s]),
                            seq_begin=int(self.req_begin[r]), seq_end=e, events=self.events(s, e),
                            candidates=Candidates(self.tgt_item[a:b], self.tgt_side[a:b]), labels=self.labels[a:b])

    def requests(self, node: int) -> Iterator[TraceRequest]:
        """A serving node's requests in time order (request time, then request id)."""
        for r in self.order[node]:
            yield self.request(int(r))


# -- reading --------------------------------------------------------------------------------
def _flat(t: pa.Table, name: str, dtype=np.int64) -> tuple[np.ndarray, np.ndarray]:
    """(values, lengths) of a list column; null elements read as 0."""
    arr = t.column(name).combine_chunks()
    lengths = pc.list_value_length(arr).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    vals = pc.list_flatten(arr)
    if dtype is not None:
        vals = vals.fill_null(0).to_numpy(zero_copy_only=False).astype(dtype)
    else:
        vals = np.asarray(vals.to_pylist(), dtype=object)
    return vals, lengths


def _ids(values: np.ndarray) -> np.ndarray:
    """Request ids as a sortable array (strings as unicode, ints as int64)."""
    if values.dtype == object and len(values) and all(type(v) is int for v in values):
        return values.astype(np.int64)
    return values.astype(str) if values.dtype == object else values


def _check_build_chains(t: pa.Table, hashes: np.ndarray, seq_offsets: np.ndarray, *, where: str, sample_ids,
                        users) -> None:
    """Every sample's chain as the build wrote it (``chain_checkpoints``, ``chain_end`` at
    ``chain_block``) equals the chain of its stored events as serving computes it (the rolling
    ``hashes`` cut by ``seq_offsets``); else :class:`ShardError` naming the first sample that
    differs (a serving node would never find its cache valid, or would trust another history)."""
    block = t.column("chain_block").to_pylist()
    end = t.column("chain_end").to_pylist()
    cps, n_cps = _flat(t, "chain_checkpoints")
    cps_off = np_offsets(n_cps)
    bad = []
    for s, (a, b) in enumerate(zip(seq_offsets[:-1].tolist(), seq_offsets[1:].tolist())):
        if block[s] is None or block[s] < 1:  # not a block size: no chain can match it
            bad.append(s)
            continue
        want_cps, want_end = chain_checkpoints(hashes[a:b], b - a, block[s])
        if want_end != end[s] or not np.array_equal(want_cps, cps[cps_off[s]:cps_off[s + 1]]):
            bad.append(s)
    if bad:
        s = bad[0]
        raise ShardError(f"{where}: sample {sample_ids[s]} (user {users[s]}): the chain the build wrote differs from "
                         f"the chain of its stored events ({len(bad)} of {len(block)} samples): the events were "
                         "changed after the build, or another userwise version wrote them; rebuild and pre-shard")


def read_trace(shards: str, *, serving_nodes: int = 1, max_seq_len: int | None = None,
               verify: str = "checksum") -> Trace:
    """Read a shard set (its root, or one node's staged copy) into a :class:`Trace` routed
    to ``serving_nodes`` nodes (at most one per user of the trace). ``max_seq_len``: the L
    the model was trained with (default: the longest span of any request, which the pointer
    rule makes L wherever a user has L events); every request must see
    ``[max(0, seq_end - L), seq_end)``. ``verify``: how the shards' files are checked
    against the manifest before they are read, the loader's modes (``checksum``: size and
    sha256, ``size``, ``none``). The shards are read by the loader's reader
    (:func:`~userwise.pipelines.loader.io.shards.open_node`, then
    :func:`~userwise.pipelines.loader.io.reading.read_row_groups`): every footer checked against
    the manifest and every page against its CRC in each mode, so a damaged file is a
    :class:`ShardError` naming it, never a trace of other data.

    Example::

        trace = read_trace("shards", serving_nodes=4)
        for req in trace.requests(0): ...
    """
    if isinstance(serving_nodes, bool) or not isinstance(serving_nodes, (int, np.integer)) or serving_nodes < 1:
        raise ArgumentError(f"serving_nodes={serving_nodes!r}: replay on at least one serving node (an integer)")
    if verify not in VERIFY:
        raise ArgumentError(f"verify must be one of {VERIFY}, got {verify!r}")
    root = os.fspath(shards)
    man = mf.load(root)
    where = mf.join(root, mf.MANIFEST)
    roles = man.get("roles") or {}
    if roles.get("fat"):
        raise UserwiseError(f"{where}: a fat-row build's shard set; replay reads lean builds' sets, whose every "
                            "request sees a slice of its sample's stored sequence (a fat row's override does not)")
    try:
        fields = Fields.from_roles(roles)
    except UserwiseError as e:
        raise UserwiseError(f"{where}: {e}") from None
    staged = man.get("staged_node")
    nodes = [int(staged)] if staged is not None else list(range(int(man["nodes"])))
    seq_cols = [fields.item[0], *[s for s, _ in fields.side], *([fields.action] if fields.action else [])]
    imp_cols = [fields.item[1], *[i for _, i in fields.side], *fields.labels]
    req_cols = ["req_id", "req_time", "req_seq_begin", "req_seq_end", "req_num_imps"]
    tables = []
    for k in nodes:
        if not mf.node_shards(man, k):  # a training node without shards holds no request
            continue
        node = open_node(root, k, verify=verify)  # the loader's checks: files, footers against the manifest
        have = node.schema.names
        chain = [c for c in CHAIN_COLUMNS if c in have]
        want = ["sample_id", "user", *seq_cols, *(["seq_ts"] if "seq_ts" in have else []), *req_cols, *imp_cols,
                *chain]
        missing = [c for c in want if c not in have]
        if missing:
            raise ShardError(f"{where}: no column(s) {missing}: not a lean build's shard set (the manifest's roles "
                             "name them)")
        tables.append(_read_node(node, want))
    if not tables:
        raise ShardError(f"{where}: no shards to replay")
    t = pa.concat_tables(tables, promote_options="default") if len(tables) > 1 else tables[0]
    return _trace(t, root=root, fields=fields, serving_nodes=int(serving_nodes), max_seq_len=max_seq_len,
                  training_nodes=nodes, sets=[x["id"] for x in man["sets"]])


def _read_node(node, columns: list) -> pa.Table:
    """Every row group of one training node's shards (an opened, verified
    :class:`~userwise.pipelines.loader.io.shards.NodeShards`), as the loader reads them: each page
    checked against its CRC, a failed read a :class:`ShardError` naming the file."""
    files = {}

    def open_file(s: int):
        if s not in files:
            files[s] = open_parquet(node.path(s))
        return files[s]

    return read_row_groups(node, open_file, range(len(node.rg_rows)), columns)


def _trace(t: pa.Table, *, root, fields: Fields, serving_nodes: int, max_seq_len, training_nodes, sets) -> Trace:
    S = t.num_rows
    where = mf.join(root, mf.MANIFEST)
    sample_ids = t.column("sample_id").to_numpy().astype(np.int64)
    users = t.column("user").to_pylist()
    distinct = len(set(users))
    if serving_nodes > max(distinct, 1):
        raise UserwiseError(f"serving_nodes={serving_nodes}: more serving nodes than the {distinct} users of "
                            f"{root}; a node serves whole users, so give at most {max(distinct, 1)}")
    item, n_ev = _flat(t, fields.item[0])
    side = [_flat(t, s)[0] for s, _ in fields.side]
    action = _flat(t, fields.action)[0] if fields.action else np.zeros_like(item)
    ts = _flat(t, "seq_ts")[0] if "seq_ts" in t.column_names else None
    tgt, n_imp = _flat(t, fields.item[1])
    tgt_side = [_flat(t, i)[0] for _, i in fields.side]
    labels = [_flat(t, c, np.float64)[0] for c in fields.labels]
    rid, n_req = _flat(t, "req_id", None)
    rtime, begin, end, nimps = (_flat(t, c)[0] for c in ("req_time", "req_seq_begin", "req_seq_end", "req_num_imps"))
    so, ro = np_offsets(n_ev), np_offsets(n_req)
    req_sample = np_segment_ids(ro)
    per_sample_imps = np.add.reduceat(nimps, ro[:-1]) if len(nimps) else np.zeros(S, np.int64)
    per_sample_imps = np.where(n_req > 0, per_sample_imps, 0)
    bad = np.flatnonzero(per_sample_imps != n_imp)
    if len(bad):
        s = int(bad[0])
        raise ShardError(f"{where}: sample {sample_ids[s]} (user {users[s]}): its requests' req_num_imps add up to "
                         f"{per_sample_imps[s]}, its imp__ lists hold {n_imp[s]}: not a user-wise sample")
    n_of = n_ev[req_sample]
    bad = np.flatnonzero((begin < 0) | (begin > end) | (end > n_of))
    if len(bad):
        r = int(bad[0])
        s = int(req_sample[r])
        raise ShardError(f"{where}: sample {sample_ids[s]} (user {users[s]}), request {rid[r]}: seq [{begin[r]}, "
                         f"{end[r]}) outside its {n_of[r]} stored events")
    longest = int((end - begin).max()) if len(end) else 1
    L = int(max_seq_len) if max_seq_len is not None else max(longest, 1)
    if L < 1:
        raise UserwiseError(f"max_seq_len={max_seq_len}: use the L the model was trained with (>= 1)")
    bad = np.flatnonzero(begin != np.maximum(0, end - L))
    if len(bad):
        r = int(bad[0])
        s = int(req_sample[r])
        raise UserwiseError(
            f"{where}: sample {sample_ids[s]} (user {users[s]}), request {rid[r]}: sees [{begin[r]}, {end[r]}) of its "
            f"stored events, not the newest L={L} before it ([{max(0, int(end[r]) - L)}, {end[r]})); a cache serves "
            f"the newest L held events, so replay needs the pointer rule (give --max-seq-len, the build's L, "
            f"if it is not {L}); {len(bad)} request(s) break it")
    fields_np = np.stack([item, *side, action], 1) if len(item) else np.zeros((0, 2 + len(side)), np.int64)
    hashes = rolling_hashes(event_hashes(fields_np), so) if len(item) else np.zeros(0, np.int64)
    if all(c in t.column_names for c in CHAIN_COLUMNS):
        _check_build_chains(t, hashes, so, where=where, sample_ids=sample_ids, users=users)
    node_of_sample = nodes_of(np.asarray(users, dtype=np.int64) if users and all(type(u) is int for u in users)
                              else users, serving_nodes) if S else np.zeros(0, np.int64)
    ids = _ids(rid)
    req_node = node_of_sample[req_sample]
    order = []
    for k in range(serving_nodes):
        idx = np.flatnonzero(req_node == k)
        o = np.lexsort((ids[idx], rtime[idx]))
        order.append(idx[o])
    lt = lambda x: torch.from_numpy(np.ascontiguousarray(x, dtype=np.int64))  # noqa: E731
    stack = lambda cols, n: torch.stack([lt(c) for c in cols], 1) if cols else torch.zeros(n, 0, dtype=torch.long)  # noqa: E731
    return Trace(root=root, fields=fields, max_seq_len=L, serving_nodes=serving_nodes, training_nodes=training_nodes,
                 sets=sets, users=users, sample_ids=sample_ids, seq_offsets=so, ev_item=lt(item),
                 ev_side=stack(side, len(item)), ev_action=lt(action), ev_time=None if ts is None else lt(ts),
                 hashes=hashes, req_offsets=ro, req_sample=req_sample, req_begin=begin, req_end=end, req_time=rtime,
                 req_id=rid, imp_offsets=np_offsets(nimps), tgt_item=lt(tgt), tgt_side=stack(tgt_side, len(tgt)),
                 labels=torch.from_numpy(np.stack(labels, 1) if labels else np.zeros((len(tgt), 0))),
                 node_of_sample=np.asarray(node_of_sample, dtype=np.int64), order=order)


# -- the model ------------------------------------------------------------------------------
def _model(trace: Trace, *, checkpoint, encoder, window, dim, heads, layers, dtype, seed, device):
    """(model, version, description): a seeded ReferenceRanker sized from the trace's roles,
    or one loaded from a checkpoint ``{"config": {...}, "state_dict": ...}``."""
    sides, labels = len(trace.fields.side), len(trace.fields.labels)
    if checkpoint is not None:
        path = os.fspath(checkpoint)
        try:
            ck = torch.load(path, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise UserwiseError(f"{path}: no such checkpoint") from None
        except Exception as e:  # noqa: BLE001 (any unreadable file is the user's to fix)
            raise UserwiseError(f"{path}: not a torch checkpoint of plain tensors and values "
                                f"({type(e).__name__}: {' '.join(str(e).split())[:200]})") from None
        sd = ck.get("state_dict", ck.get("model")) if isinstance(ck, dict) else None
        cfg = ck.get("config") if isinstance(ck, dict) else None
        if not isinstance(cfg, dict) or not isinstance(sd, dict):
            raise UserwiseError(f"{path}: a checkpoint for replay holds {{'config': ReferenceRanker's keyword "
                                "arguments, 'state_dict': its weights}}")
        # its config is bounded by its weights (a model of more parameters than the file holds
        # cannot load them) and by this host, before the model is built
        sz = _sizes(cfg, f"{path}: config ")
        held = sum(v.numel() for v in sd.values() if isinstance(v, torch.Tensor))
        params = _params(sz, cfg.get("encoder", "sample"))
        if params > held:
            raise UserwiseError(f"{path}: its config makes a model of at least {params:,} parameters, its weights "
                                f"hold {held:,}: a config of another model")
        _check_model(sz, encoder=cfg.get("encoder", "sample"), trace=trace, dtype=dtype, device=device, what=path)
        try:
            model = ReferenceRanker(**cfg)
            model.load_state_dict(sd)
        except (TypeError, RuntimeError) as e:
            raise UserwiseError(f"{path}: its config and weights do not make a ReferenceRanker "
                                f"({' '.join(str(e).split())[:300]})") from None
        if len(model.side) != sides or model.head[-1].out_features != labels:
            raise UserwiseError(f"{path}: the model has {len(model.side)} side-info features and "
                                f"{model.head[-1].out_features} labels, the shard set {sides} and {labels} "
                                f"({trace.fields}): a checkpoint of another build's model")
        with open(path, "rb") as f:
            version = str(ck.get("version") or "sha256:" + hashlib.sha256(f.read()).hexdigest()[:16])
        desc = {"checkpoint": path}
    else:
        if encoder == "window" and window is None:
            window = trace.max_seq_len
        sz = _sizes(dict(dim=dim, heads=heads, layers=layers, side_features=sides, num_labels=labels), "")
        _check_model(sz, encoder=encoder, trace=trace, dtype=dtype, device=device,
                     what=f"dim={dim}, heads={heads}, layers={layers}")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(seed))
            model = ReferenceRanker(dim=dim, heads=heads, layers=layers, side_features=sides, num_labels=labels,
                                    encoder=encoder, window=window)
        version = f"seed-{int(seed)}"
        desc = {"seed": int(seed)}
    if model.encoder == "request":
        raise UserwiseError("encoder='request' re-encodes each request's span on its own: it is not prefix-stable "
                            "and has no cache to replay; replay a model with encoder 'sample', 'window' or 'none'")
    model = model.to(device=device, dtype=DTYPES[dtype]).eval()
    desc.update(encoder=model.encoder, window=model.window, dim=model.dim, heads=model.heads,
                layers=len(model.blocks), side_features=sides, num_labels=labels, dtype=dtype,
                attention=model.attention, version=version)
    return model, version, desc


# -- the replay -----------------------------------------------------------------------------
def _sample_batch(trace: Trace, s: int, device) -> UserBatch:
    """Sample ``s`` as the loader gives it to training: one sample, all its requests."""
    a, b = int(trace.seq_offsets[s]), int(trace.seq_offsets[s + 1])
    r0, r1 = int(trace.req_offsets[s]), int(trace.req_offsets[s + 1])
    i0, i1 = int(trace.imp_offsets[r0]), int(trace.imp_offsets[r1])
    k = np.diff(trace.imp_offsets[r0:r1 + 1])
    t = lambda x: torch.as_tensor(np.asarray(x, dtype=np.int64), device=device)  # noqa: E731
    sp = Spans.from_arrays(seq_offsets=t([0, b - a]), req_offsets=t([0, r1 - r0]), req_begin=t(trace.req_begin[r0:r1]),
                           req_end=t(trace.req_end[r0:r1]), imp_offsets=t([0, i1 - i0]),
                           imp_req=t(np_segment_ids(np_offsets(k))))
    return UserBatch(ev_item=trace.ev_item[a:b].to(device), ev_side=trace.ev_side[a:b].to(device),
                     ev_action=trace.ev_action[a:b].to(device), tgt_item=trace.tgt_item[i0:i1].to(device),
                     tgt_side=trace.tgt_side[i0:i1].to(device), labels=trace.labels[i0:i1].to(device), spans=sp)


def _sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rate(n: int, s: float) -> float | None:
    return round(n / s, 1) if s > 0 else None


def _node(trace: Trace, node: int, model, version, store: KVStore, *, page_size: int, tol: float, device,
          max_requests) -> tuple[dict, dict]:
    """Serve one node's requests in order: (report, timing)."""
    L, P = trace.max_seq_len, page_size
    order = trace.order[node] if max_requests is None else trace.order[node][:int(max_requests)]
    held_high = {}  # per sample: the most events a state of it has held (re-encoded below it)
    trained = {}  # per sample: the training forward's logits of all its impressions
    tok = {"full": 0, "encoded": 0, "new": 0, "reencoded": 0}
    diff = diff_train = 0.0
    over = over_train = 0
    loss_sum, loss_n = 0.0, 0
    t_cached = t_full = 0.0
    peak = {t: 0 for t in TIERS}
    users, imps, no_history = set(), 0, 0
    last_sample = {}
    for r in order:
        r = int(r)
        s, n = int(trace.req_sample[r]), int(trace.req_end[r])
        user = trace.users[s]
        users.add(user)
        a, b = int(trace.imp_offsets[r]), int(trace.imp_offsets[r + 1])
        cands = Candidates(trace.tgt_item[a:b], trace.tgt_side[a:b])
        events = trace.events(s, n)
        imps += b - a
        # the cache: lookup by the current chain, extend by what the lease lacks, store, score
        _sync(device)
        t0 = time.perf_counter()
        if n == 0:  # no history: nothing to look up or to hold
            have = 0
            cached = score(model, empty_state(model, max_seq_len=L, page_size=P), cands)
        else:
            cur = trace.chain(s, n, block=P, version=version)
            with store.acquire(user, cur) as lease:
                st = lease.state if lease.state is not None else empty_state(model, max_seq_len=L, page_size=P)
                have = st.length
                st = extend(model, st, events[have:])
                store.put(user, cur, st)
                cached = score(model, st, cands)
        _sync(device)
        t_cached += time.perf_counter() - t0
        # the full recompute over the same events
        t0 = time.perf_counter()
        full = full_scores(model, events, cands, L)
        _sync(device)
        t_full += time.perf_counter() - t0
        # bookkeeping (untimed)
        no_history += n == 0
        tok["full"] += n
        again = max(0, min(n, held_high.get(s, 0)) - have)  # events a state of this sample had held
        tok["encoded"] += n - have
        tok["reencoded"] += again
        tok["new"] += n - have - again
        held_high[s] = max(held_high.get(s, 0), n)
        if s not in trained:
            if last_sample.get(user) is not None:
                trained.pop(last_sample[user], None)  # a user's earlier sample is not looked at again
            with torch.no_grad():
                trained[s] = model(_sample_batch(trace, s, device)).cpu()
            last_sample[user] = s
        i0 = int(trace.imp_offsets[int(trace.req_offsets[s])])
        train = trained[s][a - i0:b - i0]
        c64, f64, tr64 = cached.cpu().double(), full.cpu().double(), train.double()
        d = float((c64 - f64).abs().max()) if b > a else 0.0
        dt_ = float((c64 - tr64).abs().max()) if b > a else 0.0
        if not (d <= tol):  # NaN counts as over
            over += 1
        if not (dt_ <= tol):
            over_train += 1
        diff = max(diff, d) if not math.isnan(d) else math.inf
        diff_train = max(diff_train, dt_) if not math.isnan(dt_) else math.inf
        if b > a and trace.labels.shape[1]:
            y = trace.labels[a:b].double()
            loss_sum += float(torch.nn.functional.binary_cross_entropy_with_logits(c64, y, reduction="sum"))
            loss_n += y.numel()
        res = store.stats()["resident_bytes"]
        for t in TIERS:
            peak[t] = max(peak[t], res[t])
    st = store.stats()
    rep = {
        "node": node, "users": len(users), "requests": len(order), "impressions": imps,
        "requests_without_history": no_history,
        "equality": {"max_abs_diff": diff, "over_tolerance": over, "max_abs_diff_training": diff_train,
                     "over_tolerance_training": over_train},
        **{k: st[k] for k in _COUNTS},
        "tokens": {**tok, "recomputed_fraction": tok["encoded"] / tok["full"] if tok["full"] else 0.0},
        "resident_bytes": st["resident_bytes"], "peak_resident_bytes": peak,
        "offloaded": {k: st[f"offloaded_{k}"] for k in ("device_to_host", "device_to_disk", "host_to_disk")},
        "dropped": st["dropped"], "not_stored": st["not_stored"],
        "loss": {"sum": loss_sum, "count": loss_n},
    }
    timing = {"node": node, "cached_s": t_cached, "full_s": t_full}
    return rep, timing


def replay(shards, *, serving_nodes: int = 1, checkpoint=None, encoder: str = "sample", window: int | None = None,
           dim: int = 32, heads: int = 2, layers: int = 2, dtype: str = "float32", seed: int = 0,
           max_seq_len: int | None = None, page_size: int = 64, device_bytes: int = 256 * MB,
           host_bytes: int = 1024 * MB, disk_bytes: int = 0, cache_dir=None, device=None,
           max_requests: int | None = None, verify: str = "checksum",
           make_store: Callable[..., KVStore] | None = None) -> dict:
    """Replay a shard set's requests (``shards``: its root, or a :class:`Trace`) on
    ``serving_nodes`` nodes through the cache and a full recompute; the report (see module
    doc; docs/serving.md lists its fields). ``verify``: :func:`read_trace`'s.

    The model: loaded from ``checkpoint`` (a torch file ``{"config": ReferenceRanker's keyword
    arguments, "state_dict": its weights}``, optionally ``"version"``), else a
    :class:`ReferenceRanker` of ``dim``, ``heads``, ``layers``, ``encoder`` (``window``:
    default L) with weights drawn from ``seed``, its side-info features and labels from the
    shard set's roles; cast to ``dtype`` (``"float32"`` or ``"float64"``) on ``device``
    (``"cpu"`` or ``"cuda"``; default CUDA when there is one). Each node's :class:`KVStore` has
    pages of ``page_size`` events and ``device_bytes``, ``host_bytes`` and ``disk_bytes``;
    ``make_store(node=..., **kwargs)`` builds it instead (a test's broken cache).
    ``max_requests``: the first requests of each node only.

    Sizes are bounded before anything is built: the device and host tiers by the memory the
    device and the host have (:class:`KVStore`'s check), serving nodes by the trace's users,
    the model (at most :data:`MAX_LAYERS` layers; a checkpoint's config by its weights) and
    its working memory by the memory available, the disk tier by the free space of its folder.

    The disk tier's files live in a folder of this run only, ``userwise-replay-HOST-PID-XXXXXXXX``
    (0700) under ``cache_dir`` (default ``<tmp>/userwise-<uid>/replay``: this user's alone, 0700,
    owner checked; never a shared temporary folder itself), removed when the run ends, fails or is interrupted; a folder a
    killed run left (its process gone) is removed by the next replay on the same folder.

    Example::

        r = replay("shards", serving_nodes=2, dtype="float64", device_bytes=1 << 20, host_bytes=4 << 20)
        assert r["equality"]["over_tolerance"] == 0
    """
    if dtype not in DTYPES:
        raise ArgumentError(f"dtype={dtype!r}: use float32 or float64")
    expect(page_size, "int>=1", "page_size")
    for name, v in (("device_bytes", device_bytes), ("host_bytes", host_bytes), ("disk_bytes", disk_bytes)):
        if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or not math.isfinite(v) \
                or v < 0:
            raise ArgumentError(f"{name}={v!r}: a tier's byte limit is a finite number >= 0")
    device_bytes, host_bytes, disk_bytes = int(device_bytes), int(host_bytes), int(disk_bytes)
    expect(max_requests, "int>=1", "max_requests", nullable=True)
    if not -(1 << 63) <= expect(seed, "int", "seed") < 1 << 64:
        raise ArgumentError(f"seed={seed}: a seed is an integer in [-2**63, 2**64)")
    wall0 = time.perf_counter()
    dev = _device(device)
    # the store's own check of the tiers (within what the device and the host have), before anything is read
    for flags, host in (("--device-mb", 0), ("--host-mb" if dev.type == "cuda" else "--device-mb + --host-mb",
                                              host_bytes)):
        try:
            KVStore(page_size=page_size, device_bytes=device_bytes, host_bytes=host, device=dev)
        except ArgumentError as e:
            raise UserwiseError(f"{flags}: {e}") from None
    trace = shards if isinstance(shards, Trace) else read_trace(shards, serving_nodes=serving_nodes,
                                                                max_seq_len=max_seq_len, verify=verify)
    model, version, desc = _model(trace, checkpoint=checkpoint, encoder=encoder, window=window, dim=dim, heads=heads,
                                  layers=layers, dtype=dtype, seed=seed, device=dev)
    desc["max_seq_len"] = trace.max_seq_len
    tol = TOLERANCE[dtype]
    read_s = time.perf_counter() - wall0
    nodes, timing = [], []
    with _scratch(cache_dir if disk_bytes else None, disk_bytes) as run:
        for k in range(trace.serving_nodes):
            folder = os.path.join(run, f"node-{k}") if run is not None else None
            kw = dict(page_size=page_size, device_bytes=device_bytes, host_bytes=host_bytes, disk_bytes=disk_bytes,
                      folder=folder, device=dev, max_seq_len=trace.max_seq_len)
            store = make_store(node=k, **kw) if make_store is not None else KVStore(**kw)
            try:
                rep, tm = _node(trace, k, model, version, store, page_size=page_size, tol=tol, device=dev,
                                max_requests=max_requests)
            finally:  # a node's files go when it is done: the disk holds one node's at a time
                close = getattr(store, "close", None)
                if callable(close):
                    close()
                del store
                if folder is not None:
                    shutil.rmtree(folder, ignore_errors=True)
            nodes.append(rep)
            timing.append(tm)
            progress.say(f"replay: serving node {k}: {rep['requests']:,} requests, {tm['cached_s']:.1f} s cached, "
                         f"{tm['full_s']:.1f} s full recompute")
    return _report(trace, nodes, timing, desc=desc, tol=tol, cache=dict(
        page_size=page_size, device_bytes=device_bytes, host_bytes=host_bytes, disk_bytes=disk_bytes),
        read_s=read_s, wall_s=time.perf_counter() - wall0, device=dev)


# -- bounds ---------------------------------------------------------------------------------
# The deepest model replay builds (a seeded one or a checkpoint's config): each layer is a
# few Python modules, so a depth like 100,000 takes minutes and gigabytes before the first
# request, whatever its width.
MAX_LAYERS = 1024


def _device(device) -> torch.device:
    """``device`` (default CUDA when there is one, else the CPU) as a torch device that exists here."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ArgumentError(f"device={device!r}: not a device; use 'cpu' or 'cuda'") from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise ArgumentError(f"device={device!r}: replay runs on 'cpu' or 'cuda'")
    if not torch.cuda.is_available():
        raise UserwiseError(f"device={device!r} (--device): no CUDA device here; use --device cpu, or leave it out "
                            "(CUDA when there is one)")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise UserwiseError(f"device={device!r}: this host has {torch.cuda.device_count()} CUDA device(s)")
    return dev


def _host_memory() -> tuple[int | None, int | None]:
    """(total, available) bytes of this host's memory, a cgroup's limit counted; None where unknown."""
    total = avail = None
    try:
        with open("/proc/meminfo") as f:
            info = {}
            for line in f:
                name, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    info[name] = int(parts[0]) * 1024
        total, avail = info.get("MemTotal"), info.get("MemAvailable")
    except OSError:
        pass
    if total is None:
        total = _sysconf_bytes("SC_PHYS_PAGES")
    if avail is None:
        avail = _sysconf_bytes("SC_AVPHYS_PAGES")
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit.isdigit():
            total = min(total, int(limit)) if total is not None else int(limit)
            avail = min(avail, int(limit)) if avail is not None else int(limit)
    except OSError:
        pass
    return total, avail


def _sysconf_bytes(name: str) -> int | None:
    try:
        return os.sysconf(name) * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _mib(n: int) -> str:
    return f"{n / MB:,.0f} MiB"


def _sizes(cfg: dict, where: str) -> dict:
    """The sizes a :class:`ReferenceRanker` of keyword arguments ``cfg`` is built with (its
    defaults where ``cfg`` has none), each checked to be an integer."""
    defaults = {k: v.default for k, v in inspect.signature(ReferenceRanker.__init__).parameters.items()
                if v.default is not inspect.Parameter.empty}
    out = {}
    for k in ("dim", "heads", "layers", "side_features", "num_labels", "item_buckets", "side_buckets",
              "action_buckets"):
        kind = "int>=1" if k in ("dim", "heads", "item_buckets", "side_buckets", "action_buckets") else "int>=0"
        out[k] = expect(cfg.get(k, defaults[k]), kind, f"{where}{k}", error=UserwiseError)
    return out


def _params(sz: dict, encoder: str) -> int:
    """A lower bound of the parameters of a :class:`ReferenceRanker` of sizes ``sz``: its
    embeddings, blocks, target projections and head (Python integers: never overflows)."""
    d = sz["dim"]
    blocks = sz["layers"] if encoder != "none" else 0
    emb = (sz["item_buckets"] + sz["side_features"] * sz["side_buckets"] + sz["action_buckets"]) * d
    return emb + blocks * (12 * d * d + 13 * d) + 3 * (d * d + d) + 2 * d * d + d + (d + 1) * sz["num_labels"]


def _check_model(sz: dict, *, encoder: str, trace: Trace, dtype: str, device: torch.device, what: str) -> int:
    """At most :data:`MAX_LAYERS` layers, and the model with its working memory (the K/V of
    the longest sample's events in every layer, a block's activations) within the memory
    available where it runs; returns its parameters (a lower bound)."""
    d, layers = sz["dim"], sz["layers"]
    if layers > MAX_LAYERS:
        raise UserwiseError(f"{what}: {layers:,} layers; replay builds models of at most {MAX_LAYERS:,} layers "
                            "(--layers)")
    params = _params(sz, encoder)
    elem = torch.finfo(DTYPES[dtype]).bits // 8
    n = int(np.diff(trace.seq_offsets).max()) if len(trace.seq_offsets) > 1 else 0
    m = int(np.diff(trace.imp_offsets[trace.req_offsets]).max()) if len(trace.req_offsets) > 1 else 0
    work = (3 * 2 * layers * n * d + 16 * (n + m) * d) * elem
    _, host_avail = _host_memory()
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        needs = [("this host's", params * 4, host_avail), (f"{device}'s", params * elem + work, free)]
    else:
        needs = [("this host's", params * 4 + (params * elem if elem != 4 else 0) + work, host_avail)]
    for where, need, avail in needs:
        if avail is not None and need > avail:
            raise UserwiseError(f"{what}: a model of {params:,} parameters ({layers:,} layers of dim {d:,}) and its "
                                f"working memory over samples of up to {n:,} events need about {_mib(need)} of "
                                f"{where} memory, {_mib(avail)} are available; use a smaller --dim or --layers")
    return params


# -- the disk tier's folder -----------------------------------------------------------------
_RUN = re.compile(r"^userwise-replay-(?P<host>[A-Za-z0-9_.]+)-(?P<pid>[0-9]+)-[0-9a-f]{8}$")


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname())[:64] or "host"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True
    return True


def _sweep(root: str) -> None:
    """Remove the run folders under ``root`` that a replay on this host, of this user, left
    when it was killed (its process is gone); never another user's, a link, or a live run's."""
    me, uid = _host(), os.getuid()
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        m = _RUN.match(name)
        if not m or m["host"] != me:
            continue
        path = os.path.join(root, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == uid and not _alive(int(m["pid"])):
            shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def _scratch(cache_dir, disk_bytes: int):
    """The folder of this run's disk tier (None without one): a new 0700 folder under
    ``cache_dir`` or this user's private temporary folder, removed on the way out (an error
    or an interrupt included); stale folders of killed runs there are removed first."""
    if not disk_bytes:
        yield None
        return
    if cache_dir is None:  # this user's folder alone (0700, owner checked), never the shared one itself
        root = os.fspath(private_tmp("replay"))
    else:
        root = os.fspath(cache_dir)
        try:
            os.makedirs(root, mode=0o700, exist_ok=True)
        except FileExistsError:
            raise UserwiseError(f"{root}: a file, not a folder; give --cache-dir a folder") from None
    _sweep(root)
    free = shutil.disk_usage(root).free
    if disk_bytes > free:
        raise UserwiseError(f"disk_bytes (--disk-mb) = {_mib(disk_bytes)}: more than the {_mib(free)} free at {root}; "
                            "give less, or another --cache-dir")
    while True:
        run = os.path.join(root, f"userwise-replay-{_host()}-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            os.mkdir(run, 0o700)
            break
        except FileExistsError:
            continue
    try:
        yield run
    finally:
        shutil.rmtree(run, ignore_errors=True)


def _report(trace: Trace, nodes: list, timing: list, *, desc, tol, cache, read_s, wall_s, device) -> dict:
    total = lambda key: sum(n[key] for n in nodes)  # noqa: E731
    lookups = total("lookups")
    counts = {k: ({t: sum(n[k][t] for n in nodes) for t in nodes[0][k]} if nodes and isinstance(nodes[0][k], dict)
                  else total(k)) for k in _COUNTS if not k.endswith("_rate")}
    counts["reuse_rate"] = {k: v / max(lookups, 1) for k, v in counts["reuse"].items()}  # as stats() gives them
    counts["hit_rate"] = {t: v / max(lookups, 1) for t, v in counts["hits"].items()}
    tok = {k: sum(n["tokens"][k] for n in nodes) for k in ("full", "encoded", "new", "reencoded")}
    tok["recomputed_fraction"] = tok["encoded"] / tok["full"] if tok["full"] else 0.0
    eq = {"tolerance": tol,
          "max_abs_diff": max((n["equality"]["max_abs_diff"] for n in nodes), default=0.0),
          "over_tolerance": sum(n["equality"]["over_tolerance"] for n in nodes),
          "max_abs_diff_training": max((n["equality"]["max_abs_diff_training"] for n in nodes), default=0.0),
          "over_tolerance_training": sum(n["equality"]["over_tolerance_training"] for n in nodes)}
    eq["equal"] = eq["over_tolerance"] == 0 and eq["over_tolerance_training"] == 0
    loss_sum, loss_n = sum(n["loss"]["sum"] for n in nodes), sum(n["loss"]["count"] for n in nodes)
    for n in nodes:
        c = n.pop("loss")
        n["logloss"] = c["sum"] / c["count"] if c["count"] else None
    cached_s, full_s = sum(t["cached_s"] for t in timing), sum(t["full_s"] for t in timing)
    requests = total("requests")
    for t, n in zip(timing, nodes):
        t.update(cached_requests_per_s=_rate(n["requests"], t["cached_s"]),
                 full_requests_per_s=_rate(n["requests"], t["full_s"]),
                 cached_s=round(t["cached_s"], 3), full_s=round(t["full_s"], 3))
    return {
        "shards": trace.root, "training_nodes": trace.training_nodes, "sets": trace.sets,
        "serving_nodes": trace.serving_nodes, "model": desc, "cache": cache,
        "samples": len(trace.sample_ids), "users": total("users"), "requests": requests,
        "impressions": total("impressions"), "requests_without_history": total("requests_without_history"),
        "equality": eq, **counts, "tokens": tok,
        "resident_bytes": {t: sum(n["resident_bytes"][t] for n in nodes) for t in TIERS},
        "logloss": loss_sum / loss_n if loss_n else None,
        "nodes": nodes,
        "timing": {"device": str(device), "cached_s": round(cached_s, 3), "full_s": round(full_s, 3),
                   "cached_requests_per_s": _rate(requests, cached_s), "full_requests_per_s": _rate(requests, full_s),
                   "speedup": round(full_s / cached_s, 2) if cached_s > 0 else None, "read_s": round(read_s, 3),
                   "wall_s": round(wall_s, 3), "nodes": timing},
    }


# -- the command ----------------------------------------------------------------------------
def cli(args) -> int:
    """``userwise replay``: the report (text or ``--json``); exit 2 with an ``error:`` line,
    after the report, when any request's cached logits differ from the full recompute or the
    training forward by more than the tolerance."""
    from userwise.pipelines import console

    tiers = {t: _bytes_of(getattr(args, f"{t}_mb"), f"--{t}-mb") for t in TIERS}
    with _terminate_as_interrupt():  # a SIGTERM cleans up as Ctrl-C does: the disk tier's folder goes
        r = replay(args.shards, serving_nodes=args.serving_nodes, checkpoint=args.checkpoint, encoder=args.encoder,
                   window=args.window, dim=args.dim, heads=args.heads, layers=args.layers, dtype=args.dtype,
                   seed=args.seed, max_seq_len=args.max_seq_len, page_size=args.page_size,
                   device_bytes=tiers["device"], host_bytes=tiers["host"], disk_bytes=tiers["disk"],
                   cache_dir=args.cache_dir, device=args.device, max_requests=args.max_requests,
                   verify=args.verify)
    console.emit(r, report_text)
    eq = r["equality"]
    if not eq["equal"]:
        raise UserwiseError(
            f"{eq['over_tolerance']} of {r['requests']} requests' cached logits differ from the full recompute by up "
            f"to {eq['max_abs_diff']:.3g} ({eq['over_tolerance_training']} from the training forward, up to "
            f"{eq['max_abs_diff_training']:.3g}; tolerance {eq['tolerance']:g}): the cache served K/V that do not "
            "encode the request's events (a stale entry, or a model that is not prefix-stable)")
    return 0


def _bytes_of(mib, flag: str) -> int:
    """A ``--*-mb`` flag's MiB as bytes: a finite number >= 0, else one error line."""
    b = float(mib) * MB
    if not math.isfinite(b) or b < 0:
        raise UserwiseError(f"{flag} {mib}: give a number of MiB >= 0")
    return int(b)


@contextlib.contextmanager
def _terminate_as_interrupt():
    """SIGTERM raises KeyboardInterrupt while the block runs (in the main thread), so the
    ``finally`` blocks that remove the run's files run on a ``kill`` as on Ctrl-C."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def report_text(r: dict) -> str:
    """The report for a person: the totals, then one line per serving node."""
    eq, hr, rr, tk, tm, m = r["equality"], r["hit_rate"], r["reuse_rate"], r["tokens"], r["timing"], r["model"]
    pct = lambda x: f"{100 * x:.1f}%"  # noqa: E731
    mib = lambda b: f"{b / MB:.1f} MiB"  # noqa: E731
    lines = [
        f"replayed {r['requests']:,} requests ({r['impressions']:,} impressions, {r['users']:,} users, "
        f"{r['samples']:,} samples) of {r['shards']} on {r['serving_nodes']} serving node(s)",
        f"model: {m['encoder']} encoder, {m['layers']} layers, dim {m['dim']}, {m['dtype']}, L={m['max_seq_len']}, "
        f"version {m['version']}",
        f"logits equal: {'yes' if eq['equal'] else 'NO'} (max |cached - full recompute| {eq['max_abs_diff']:.3g}, "
        f"|cached - training| {eq['max_abs_diff_training']:.3g}, tolerance {eq['tolerance']:g}; "
        f"{eq['over_tolerance']} over)",
        f"reuse: full {pct(rr['full'])} (device {pct(hr['device'])}, host {pct(hr['host'])}, disk "
        f"{pct(hr['disk'])}), partial {pct(rr['partial'])}, miss {pct(rr['miss'])} of {r['lookups']:,} lookups "
        f"({r['invalidated']:,} invalidated; {r['requests_without_history']:,} requests without history)",
        f"tokens recomputed: {pct(tk['recomputed_fraction'])} ({tk['encoded']:,} encoded of the {tk['full']:,} a full "
        f"recompute encodes: {tk['new']:,} new, {tk['reencoded']:,} encoded again)",
        f"resident: device {mib(r['resident_bytes']['device'])}, host {mib(r['resident_bytes']['host'])}, disk "
        f"{mib(r['resident_bytes']['disk'])}",
        f"requests per second: cached {tm['cached_requests_per_s']}, full recompute {tm['full_requests_per_s']} "
        f"({tm['speedup']}x) on {tm['device']}",
    ]
    for n in r["nodes"]:
        h = n["hit_rate"]
        lines.append(f"  node {n['node']}: {n['requests']:,} requests, {n['users']:,} users, full reuse "
                     f"{pct(n['reuse_rate']['full'])} (device/host/disk {pct(h['device'])}/{pct(h['host'])}/"
                     f"{pct(h['disk'])}), partial {pct(n['reuse_rate']['partial'])}, recomputed "
                     f"{pct(n['tokens']['recomputed_fraction'])}, peak resident "
                     f"{mib(sum(n['peak_resident_bytes'].values()))}, max diff {n['equality']['max_abs_diff']:.3g}")
    return "\n".join(lines)
