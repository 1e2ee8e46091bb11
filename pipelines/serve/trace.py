"""A build's requests as a serving trace.

:func:`read_trace` turns a shard set (every training node's shards, or one node's
staged copy; no Spark) into a :class:`Trace`: every request of every sample with its
user, its time, the events it could see, its candidates (the request's impressions, in
display order) and their labels, routed to serving nodes (:func:`nodes_of`) and, per
node, in time order (request time, then request id). The shards are read through the
loader's verified reader (files against the manifest, footers, every page's CRC).

A request of a sample sees ``stored[seq_begin:seq_end]``; its state holds
``stored[0:seq_end]`` (the causal encoder's output at an event depends on the sample's
events up to it), so the state of a user is anchored at its sample's first stored event.
The target attends to the newest ``max_seq_len`` (L) held events, which is training's
span exactly when ``seq_begin = max(0, seq_end - L)``: L is read from the pointers (the
longest span) or given, and a request whose pointer breaks the rule is refused.

Example::

    trace = read_trace("shards", serving_nodes=4)
    for req in trace.requests(node=0):
        req.user, req.events, req.candidates
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from userwise.pipelines.errors import ArgumentError, ShardError, UserwiseError
from userwise.pipelines.jagged import np_offsets, np_segment_ids
from userwise.pipelines.loader.io.reading import open_parquet, read_row_groups
from userwise.pipelines.loader.io.shards import VERIFY, open_node
from userwise.pipelines.serve.chain import Chain
from userwise.pipelines.serve.incremental import Candidates, Events
from userwise.pipelines.serve.routing import nodes_of
from userwise.pipelines.shards import manifest as mf
from userwise.pipelines.train import Fields
from userwise.schemas.hashing import CHAIN_COLUMNS, chain_checkpoints, event_hashes, rolling_hashes

__all__ = ["Trace", "TraceRequest", "read_trace"]


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
        raise ArgumentError(f"serving_nodes={serving_nodes}: more serving nodes than the {distinct} users of "
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
        raise ArgumentError(f"max_seq_len={max_seq_len}: use the L the model was trained with (>= 1)")
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
