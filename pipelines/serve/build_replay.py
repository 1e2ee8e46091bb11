"""Replay a build's requests through the cache and through a full recompute.

:func:`replay` serves a :class:`~userwise.pipelines.serve.trace.Trace` (:func:`read_trace` of
a shard set). Per serving node one :class:`KVStore` (the tiers' byte limits are arguments);
per request, in order:

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

The model is a seeded :class:`ReferenceRanker` sized from the trace's roles, or a
checkpoint's (:meth:`Checkpoint.read <userwise.pipelines.train.Checkpoint.read>`); its size
and working memory are bounded before it is built, and so are the tiers and the disk tier's
folder (one of this run, removed however the run ends).

The report (:mod:`~userwise.pipelines.serve.replay_report`): logits equal (the largest
absolute difference against the full recompute and against the training forward, and the
requests over the tolerance: 1e-9 in float64, 1e-5 in float32), the stores' counts
(``KVStore.stats()`` alone: each lookup a full reuse, a partial reuse or a miss, hits per
tier, invalidated), tokens the cache encoded (new events, and events encoded again) against
those the full recompute encodes, resident bytes, per serving node and in total; wall-clock
figures only under ``timing``, so two replays with the same arguments give the same report
outside it.

Example::

    r = replay("shards", serving_nodes=4, dtype="float64", seed=0)
    r["equality"]["over_tolerance"], r["reuse_rate"], r["timing"]["cached_requests_per_s"]
"""

from __future__ import annotations

import contextlib
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
from typing import Callable

import numpy as np
import torch

from userwise.pipelines.errors import ArgumentError, UserwiseError, expect
from userwise.pipelines.jagged import np_offsets, np_segment_ids
from userwise.pipelines.runtime import progress
from userwise.pipelines.runtime.ship import private_tmp
from userwise.pipelines.serve.chain import chain_of
from userwise.pipelines.serve.incremental import Candidates, Events, empty_state, extend, full_scores, score
from userwise.pipelines.serve.replay_report import node_report, order_summary, report, report_text
from userwise.pipelines.serve.store import TIERS, KVStore
from userwise.pipelines.serve.trace import Trace, read_trace
from userwise.pipelines.train import Checkpoint, ReferenceRanker, Spans, UserBatch

__all__ = ["replay", "TOLERANCE", "DTYPES", "ORDERS"]

DTYPES = {"float32": torch.float32, "float64": torch.float64}
TOLERANCE = {"float64": 1e-9, "float32": 1e-5}
MB = 1 << 20
ORDERS = ("arrival", "action_time", "both")
"""The orders a replay holds each user's events in (``order=``): ``arrival``, as the sample stores
them (the build's arrival order: every request's events a prefix of one stream, the cache append-only);
``action_time``, the same events of each request re-sorted by action time (``seq_ts``; ties in the
stored order), as a store that keeps a stream sorted by action time holds them (a late event lands
mid-stream); ``both``, one after the other over the same trace, the second under ``orders``."""


# -- the model ------------------------------------------------------------------------------
def _model(trace: Trace, *, checkpoint, encoder, window, dim, heads, layers, dtype, seed, device):
    """(model, version, description): a seeded ReferenceRanker sized from the trace's roles,
    or a checkpoint's (:meth:`Checkpoint.read`: ``{"config": {...}, "state_dict": ...}``)."""
    sides, labels = len(trace.fields.side), len(trace.fields.labels)
    if checkpoint is not None:
        ck = Checkpoint.read(checkpoint)  # its config already bounded by its weights
        _check_model(ck.sizes, encoder=ck.config.get("encoder", "sample"), trace=trace, dtype=dtype, device=device,
                     what=ck.path)  # and by this host, before the model is built
        model = ck.model()
        if len(model.side) != sides or model.head[-1].out_features != labels:
            raise UserwiseError(f"{ck.path}: the model has {len(model.side)} side-info features and "
                                f"{model.head[-1].out_features} labels, the shard set {sides} and {labels} "
                                f"({trace.fields}): a checkpoint of another build's model")
        version = ck.version
        desc = {"checkpoint": ck.path}
    else:
        if encoder == "window" and window is None:
            window = trace.max_seq_len
        sz = ReferenceRanker.sizes_of(dict(dim=dim, heads=heads, layers=layers, side_features=sides,
                                           num_labels=labels))
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


def _action_time_view(trace: Trace, s: int, n: int, *, block: int, version):
    """Sample ``s``'s first ``n`` stored events sorted by action time (stable: ties keep the stored
    order), and their chain; ``None`` when that is the stored order itself."""
    a = int(trace.seq_offsets[s])
    perm = np.argsort(trace.ev_time[a:a + n].numpy(), kind="stable")
    if not len(perm) or (perm == np.arange(n)).all():
        return None
    idx = torch.from_numpy(perm + a)
    ev = Events(trace.ev_item[idx], trace.ev_side[idx], trace.ev_action[idx], trace.ev_time[idx])
    return ev, chain_of(ev, block=block, version=version)


def _late_events(trace: Trace) -> int:
    """Stored events that arrived after an event of a later action time (in the stored order, an
    action time below the largest before it in its sample): those a store sorted by action time
    inserts mid-stream. 0 without action times."""
    if trace.ev_time is None or not len(trace.ev_time):
        return 0
    so = np.asarray(trace.seq_offsets, dtype=np.int64)
    t = np.asarray(trace.ev_time.numpy())[int(so[0]):int(so[-1])]
    if len(t) < 2:
        return 0
    # one pass over all samples: each event's key is its sample's index times n plus the dense
    # rank of its time, so every key of a sample is above every key of the samples before it
    # and the running max never reaches back into them (a sample's first event is never late)
    n, lens = len(t), np.diff(so)
    _, rank = np.unique(t, return_inverse=True)
    key = np.repeat(np.arange(len(lens), dtype=np.int64), lens) * n + rank.astype(np.int64)
    return int((key[1:] < np.maximum.accumulate(key)[:-1]).sum())


def _node(trace: Trace, node: int, model, version, store: KVStore, *, page_size: int, tol: float, device,
          max_requests, hold: str = "arrival") -> tuple[dict, dict]:
    """Serve one node's requests in order, each user's events held in ``hold`` order (``arrival``: as
    stored; ``action_time``: each request's events re-sorted by action time, its logits compared
    with the full recompute only): (report, timing)."""
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
        view = _action_time_view(trace, s, n, block=P, version=version) if hold == "action_time" and n else None
        if view is not None:
            events = view[0]
        imps += b - a
        # the cache: lookup by the current chain, extend by what the lease lacks, store, score
        _sync(device)
        t0 = time.perf_counter()
        if n == 0:  # no history: nothing to look up or to hold
            have = 0
            cached = score(model, empty_state(model, max_seq_len=L, page_size=P), cands)
        else:
            cur = view[1] if view is not None else trace.chain(s, n, block=P, version=version)
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
        c64, f64 = cached.cpu().double(), full.cpu().double()
        d = float((c64 - f64).abs().max()) if b > a else 0.0
        if not (d <= tol):  # NaN counts as over
            over += 1
        diff = max(diff, d) if not math.isnan(d) else math.inf
        if hold == "arrival":  # the training forward holds the stored order: compared under it only
            if s not in trained:
                if last_sample.get(user) is not None:
                    trained.pop(last_sample[user], None)  # a user's earlier sample is not looked at again
                with torch.no_grad():
                    trained[s] = model(_sample_batch(trace, s, device)).cpu()
                last_sample[user] = s
            i0 = int(trace.imp_offsets[int(trace.req_offsets[s])])
            tr64 = trained[s][a - i0:b - i0].double()
            dt_ = float((c64 - tr64).abs().max()) if b > a else 0.0
            if not (dt_ <= tol):
                over_train += 1
            diff_train = max(diff_train, dt_) if not math.isnan(dt_) else math.inf
        else:
            diff_train = over_train = None
        if b > a and trace.labels.shape[1]:
            y = trace.labels[a:b].double()
            loss_sum += float(torch.nn.functional.binary_cross_entropy_with_logits(c64, y, reduction="sum"))
            loss_n += y.numel()
        res = store.stats()["resident_bytes"]
        for t in TIERS:
            peak[t] = max(peak[t], res[t])
    rep = node_report(node, store.stats(), users=len(users), requests=len(order), impressions=imps,
                      requests_without_history=no_history,
                      equality={"max_abs_diff": diff, "over_tolerance": over, "max_abs_diff_training": diff_train,
                                "over_tolerance_training": over_train},
                      tokens=tok, peak_resident_bytes=peak, loss={"sum": loss_sum, "count": loss_n})
    timing = {"node": node, "cached_s": t_cached, "full_s": t_full}
    return rep, timing


def replay(shards: str | Trace, *, serving_nodes: int = 1, checkpoint: str | os.PathLike | None = None, encoder: str = "sample", window: int | None = None,
           dim: int = 32, heads: int = 2, layers: int = 2, dtype: str = "float32", seed: int = 0,
           max_seq_len: int | None = None, page_size: int = 64, device_bytes: int = 256 * MB,
           host_bytes: int = 1024 * MB, disk_bytes: int = 0, cache_dir: str | None = None,
           device: str | torch.device | None = None,
           max_requests: int | None = None, verify: str = "checksum",
           make_store: Callable[..., KVStore] | None = None, order: str = "arrival") -> dict:
    """Replay a shard set's requests (``shards``: its root, or a :class:`Trace`) on
    ``serving_nodes`` nodes through the cache and a full recompute; the report (see module
    doc; docs/serving.md lists its fields). ``verify``: :func:`read_trace`'s.

    The model: loaded from ``checkpoint`` (a file :meth:`ReferenceRanker.save` writes, read by
    :meth:`Checkpoint.read`: ``{"config": ReferenceRanker's keyword arguments, "state_dict": its
    weights}``, optionally ``"version"``), else a
    :class:`ReferenceRanker` of ``dim``, ``heads``, ``layers``, ``encoder`` (``window``:
    default L) with weights drawn from ``seed``, its side-info features and labels from the
    shard set's roles; cast to ``dtype`` (``"float32"`` or ``"float64"``) on ``device``
    (``"cpu"`` or ``"cuda"``; default CUDA when there is one). Each node's :class:`KVStore` has
    pages of ``page_size`` events and ``device_bytes``, ``host_bytes`` and ``disk_bytes``;
    ``make_store(node=..., **kwargs)`` builds it instead (a test's broken cache).
    ``max_seq_len``: L, the newest events a request sees (default: the longest span of the
    pointers). ``max_requests``: the first requests of each node only.

    ``order`` (:data:`ORDERS`): how each user's events are held. ``arrival`` (the default) as
    the samples store them, the build's arrival order; ``action_time``: each request's events
    re-sorted by action time (``seq_ts``), as a store sorted by action time holds them, so an
    event that arrived late lands mid-stream and the chain cuts the held state there (the
    report's logits are then compared with the full recompute of those events only);
    ``both``: the arrival order's report, and under ``orders`` each order's cost
    (:func:`~userwise.pipelines.serve.replay_report.order_summary`: full reuse, invalidated,
    tokens encoded again, cached against the full recompute) from two passes over the same
    requests with fresh caches, and the trace's ``late_events``.

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
    if order not in ORDERS:
        raise ArgumentError(f"order={order!r}: use one of {', '.join(ORDERS)}")
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
            raise ArgumentError(f"{flags}: {e}") from None
    trace = shards if isinstance(shards, Trace) else read_trace(shards, serving_nodes=serving_nodes,
                                                                max_seq_len=max_seq_len, verify=verify)
    model, version, desc = _model(trace, checkpoint=checkpoint, encoder=encoder, window=window, dim=dim, heads=heads,
                                  layers=layers, dtype=dtype, seed=seed, device=dev)
    desc["max_seq_len"] = trace.max_seq_len
    tol = TOLERANCE[dtype]
    if order != "arrival" and trace.ev_time is None:
        raise UserwiseError(f"order={order!r}: {trace.root} holds no action times (seq_ts); replay it in arrival "
                            "order, or pre-shard a build that keeps seq_ts")
    read_s = time.perf_counter() - wall0
    cache = dict(page_size=page_size, device_bytes=device_bytes, host_bytes=host_bytes, disk_bytes=disk_bytes)
    holds = ("arrival", "action_time") if order == "both" else (order,)
    reports = {}
    for hold in holds:
        nodes, timing = [], []
        with _scratch(cache_dir if disk_bytes else None, disk_bytes) as run:
            for k in range(trace.serving_nodes):
                folder = os.path.join(run, f"node-{k}") if run is not None else None
                kw = dict(page_size=page_size, device_bytes=device_bytes, host_bytes=host_bytes,
                          disk_bytes=disk_bytes, folder=folder, device=dev, max_seq_len=trace.max_seq_len)
                store = make_store(node=k, **kw) if make_store is not None else KVStore(**kw)
                try:
                    rep, tm = _node(trace, k, model, version, store, page_size=page_size, tol=tol, device=dev,
                                    max_requests=max_requests, hold=hold)
                finally:  # a node's files go when it is done: the disk holds one node's at a time
                    close = getattr(store, "close", None)
                    if callable(close):
                        close()
                    del store
                    if folder is not None:
                        shutil.rmtree(folder, ignore_errors=True)
                nodes.append(rep)
                timing.append(tm)
                progress.say(f"replay ({hold} order): serving node {k}: {rep['requests']:,} requests, "
                             f"{tm['cached_s']:.1f} s cached, {tm['full_s']:.1f} s full recompute")
        reports[hold] = report(trace, nodes, timing, desc=desc, tol=tol, cache=cache, read_s=read_s,
                               wall_s=time.perf_counter() - wall0, device=dev)
    r = reports[holds[0]]
    r["order"] = order
    if order == "both":
        late = _late_events(trace)
        r["orders"] = {h: order_summary(reports[h], late_events=late) for h in holds}
        r["equality"]["equal"] = all(o["equality"]["equal"] for o in r["orders"].values()) and \
            r["equality"]["equal"]
        r["timing"]["wall_s"] = round(time.perf_counter() - wall0, 3)
    return r


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
        raise ArgumentError(f"device={device!r}: this host has {torch.cuda.device_count()} CUDA device(s)")
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


def _check_model(sz: dict, *, encoder: str, trace: Trace, dtype: str, device: torch.device, what: str) -> int:
    """At most :data:`MAX_LAYERS` layers, and the model with its working memory (the K/V of
    the longest sample's events in every layer, a block's activations) within the memory
    available where it runs; returns its parameters (a lower bound)."""
    d, layers = sz["dim"], sz["layers"]
    if layers > MAX_LAYERS:
        raise ArgumentError(f"{what}: {layers:,} layers; replay builds models of at most {MAX_LAYERS:,} layers "
                            "(--layers)")
    params = ReferenceRanker.min_parameters(sz, encoder)
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
                   verify=args.verify, order=getattr(args, "order", "arrival"))
    console.emit(r, report_text)
    eq = r["equality"]
    if not eq["equal"]:
        over = eq["over_tolerance"] + sum(o["equality"]["over_tolerance"] for k, o in (r.get("orders") or {}).items()
                                          if k != "arrival")
        worst = max([eq["max_abs_diff"]] + [o["equality"]["max_abs_diff"] for o in (r.get("orders") or {}).values()])
        training = (f" ({eq['over_tolerance_training']} from the training forward, up to "
                    f"{eq['max_abs_diff_training']:.3g})" if eq["over_tolerance_training"] is not None else "")
        raise UserwiseError(
            f"{over} request(s)' cached logits differ from the full recompute by up to {worst:.3g}{training}; "
            f"tolerance {eq['tolerance']:g}: the cache served K/V that do not encode the request's events (a stale "
            "entry, or a model that is not prefix-stable)")
    return 0


def _bytes_of(mib, flag: str) -> int:
    """A ``--*-mb`` flag's MiB as bytes: a finite number >= 0, else one error line."""
    b = float(mib) * MB
    if not math.isfinite(b) or b < 0:
        raise ArgumentError(f"{flag} {mib}: give a number of MiB >= 0")
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
