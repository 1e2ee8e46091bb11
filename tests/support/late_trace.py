"""A serving trace of a ``userwise synth --arrivals`` log, without Spark: the arrival rule
restated by sorting Python tuples, user by user (an independent restatement, as the oracle is).

A user's stream is her impressions with ``click > 0`` or ``like > 0`` (each an event at its
``action_ts``, arriving at ``arrival_ts``) and her action-log events (``ts``, ``arrival_ts``; no
request fields, first among equal keys), in arrival order: (arrival, action time, request time,
request id, position, item, bits). A request at ``t`` sees the events that arrived strictly
before ``t``: ``seq_end`` = their count, ``seq_begin = max(0, seq_end - L)``. One sample per user
holds her whole stream (a pretrain set of one window), ``seq_ts`` the action times.
"""

from __future__ import annotations

import bisect
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import torch

from userwise.pipelines.serve import Trace, nodes_of
from userwise.pipelines.tools import synth
from userwise.pipelines.train import Fields
from userwise.schemas.hashing import event_hashes, rolling_hashes

FIELDS = Fields(item=("seq_item", "imp__item_id"), side=(("seq_category", "imp__category"),
                                                          ("seq_author", "imp__author")),
                action="seq_action", labels=("imp__click", "imp__like"))
_NULL = -(1 << 62)


def _rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    part = ds.partitioning(pa.schema([("date", pa.date32())]), flavor="hive")
    return ds.dataset(str(path), format="parquet", partitioning=part).to_table().to_pylist()


def trace_of_log(out, *, max_seq_len: int, serving_nodes: int = 1) -> Trace:
    """The trace of the synth log in ``out`` (``lean/``, ``actions/`` when written; arrivals
    required), every user's requests in time order."""
    out = Path(out)
    A = synth.ARRIVAL
    imps = _rows(out / "lean")
    events, requests = {}, {}
    for r in imps:
        u = r["user_id"]
        requests.setdefault(u, {}).setdefault((r["request_ts"], r["request_id"]), []).append(r)
        if r["click"] > 0 or r["like"] > 0:
            bits = r["click"] | (r["like"] << 1)
            events.setdefault(u, []).append(((r[A], r["action_ts"], r["request_ts"], r["request_id"], r["position"],
                                              r["item_id"], bits), (r["item_id"], r["category"], r["author"], bits)))
    for r in _rows(out / "actions"):
        events.setdefault(r["uid"], []).append(((r[A], r["ts"], _NULL, "", _NULL, r["iid"], r["bits"]),
                                                (r["iid"], r["cat"], r["auth"], r["bits"])))
    users = sorted(requests)
    ev_fields, ev_ts, seq_off = [], [], [0]
    req_sample, req_begin, req_end, req_time, req_id, imp_off = [], [], [], [], [], [0]
    tgt, labels = [], []
    for s, u in enumerate(users):
        ev = sorted(events.get(u, []))
        arrivals = [k[0] for k, _ in ev]
        ev_fields += [f for _, f in ev]
        ev_ts += [k[1] for k, _ in ev]
        seq_off.append(len(ev_fields))
        for (t, rid), rows in sorted(requests[u].items()):
            end = bisect.bisect_left(arrivals, t)  # arrived strictly before the request
            req_sample.append(s)
            req_end.append(end)
            req_begin.append(max(0, end - max_seq_len))
            req_time.append(t)
            req_id.append(rid)
            for r in sorted(rows, key=lambda r: r["position"]):
                tgt.append((r["item_id"], r["category"], r["author"]))
                labels.append((float(r["click"]), float(r["like"])))
            imp_off.append(len(tgt))
    f = np.asarray(ev_fields, dtype=np.int64).reshape(-1, 4)
    so = np.asarray(seq_off, dtype=np.int64)
    ro = np.concatenate([[0], np.cumsum(np.bincount(req_sample, minlength=len(users)))]).astype(np.int64)
    t = np.asarray(tgt, dtype=np.int64).reshape(-1, 3)
    node_of_sample = np.asarray(nodes_of(np.asarray(users, dtype=np.int64), serving_nodes), dtype=np.int64)
    rs = np.asarray(req_sample, dtype=np.int64)
    rtime, rid = np.asarray(req_time, dtype=np.int64), np.asarray(req_id, dtype=object)
    order = []
    for k in range(serving_nodes):
        idx = np.flatnonzero(node_of_sample[rs] == k)
        order.append(idx[np.lexsort((rid[idx].astype(str), rtime[idx]))])
    lt = lambda x: torch.from_numpy(np.ascontiguousarray(x, dtype=np.int64))  # noqa: E731
    return Trace(root=str(out), fields=FIELDS, max_seq_len=max_seq_len, serving_nodes=serving_nodes,
                 training_nodes=[0], sets=["log"], users=users, sample_ids=np.arange(len(users), dtype=np.int64),
                 seq_offsets=so, ev_item=lt(f[:, 0]), ev_side=lt(f[:, 1:3]), ev_action=lt(f[:, 3]),
                 ev_time=lt(ev_ts), hashes=rolling_hashes(event_hashes(f), so) if len(f) else np.zeros(0, np.int64),
                 req_offsets=ro, req_sample=rs, req_begin=np.asarray(req_begin, dtype=np.int64),
                 req_end=np.asarray(req_end, dtype=np.int64), req_time=rtime, req_id=rid,
                 imp_offsets=np.asarray(imp_off, dtype=np.int64), tgt_item=lt(t[:, 0]), tgt_side=lt(t[:, 1:3]),
                 labels=torch.tensor(labels, dtype=torch.float64).reshape(-1, 2), node_of_sample=node_of_sample,
                 order=order)
