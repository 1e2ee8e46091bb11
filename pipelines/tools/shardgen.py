"""Synthetic user-wise samples and shard sets, without Spark (tests, benchmarks, checks).

One generator, :func:`make_samples`, writes rows of the shard schema for the
synthetic log's layout (:func:`layout`, the lean config of ``userwise synth``), or for
the same log with fewer item features or more labels (``item_features``, ``labels``:
samples of other roles, for the trainer's side).
Every sample obeys the pointer semantics (docs/pointer.md): the stored
sequence is sorted by time; request r sees ``seq[begin:end]`` with ``end`` =
the events strictly before its time and ``begin = max(0, end - L)``; the
stored sequence holds exactly ``[min begin, max end)``. ``sample_id`` is
the build's own (:func:`userwise.schemas.hashing.sample_id`), and so is the
event chain of the stored events (``chain_*``, the config's default block).

Sizes: light users' event counts follow a Pareto law (``event_scale``,
capped at ``max_events``); ``heavy`` users come in three chunks each of a cost
in ``[cap/2, cap)`` and the bot (user :data:`BOT`) in ``bot_chunks`` chunks of
a cost near ``cap``.

- :func:`build_samples`: a build's samples table (pretrain + daily windows,
  skewed), the input of preshard tests;
- :func:`long_user_samples`: one heavy user at production length (100K stored
  events, requests across its history at L = 16,000) beside a few light users;
- :func:`write_shard_set`: a shard set written as preshard writes its files
  (deliberately uneven shards, a set per window), its manifest through
  :mod:`userwise.pipelines.shards.manifest`, last;
- :func:`all_rows`: every sample row of a set, read back plainly.

Example::

    write_shard_set("/tmp/S", nodes=1, ranks_per_node=2)
    all_rows("/tmp/S").num_rows   # 280
"""

from __future__ import annotations

import datetime as dt
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from userwise import schemas
from userwise.pipelines import config
from userwise.pipelines.errors import ArgumentError
from userwise.pipelines.shards import manifest as mf
from userwise.pipelines.tools import synth
from userwise.schemas.hashing import CHAIN_COLUMNS, chain_checkpoints, event_hashes, rolling_hashes, sample_id

MS_DAY = 86_400_000
EPOCH = dt.date(1970, 1, 1)
BOT = 999_999
HEAVY = 10_000  # heavy users' ids start here
BUILD_START = dt.date(2026, 1, 2)  # build_samples: the first daily window ends here
CHAIN_BLOCK = config.TOP_KEYS["chain_block"]  # the event chain's block: the config's default

# labels past the synthetic log's two (click, like): 0/1 impression columns of these names
EXTRA_LABELS = ("share", "comment", "follow")

DEFAULT_SETS = (
    ("pretrain", "2025-12-01", "2026-01-03", 120),
    ("incremental", "2026-01-03", "2026-01-04", 70),
    ("incremental", "2026-01-04", "2026-01-05", 90),
)


def layout(item_features: int = 2, labels: int = 2) -> schemas.Layout:
    """The layout of the synthetic lean log (``userwise synth``'s config.yaml). ``item_features``
    (0-2): its first item features (category, author; the others stay unmapped columns);
    ``labels`` (1-5): its first labels (click, like), then :data:`EXTRA_LABELS`."""
    cfg = synth.make_config(20, 0, fat=False, actions=False)
    schema = schemas.SYNTH_IMPRESSIONS.to_arrow()
    if (item_features, labels) != (2, 2):
        cols = cfg["columns"]
        if not 0 <= item_features <= len(cols["item_features"]) or not 1 <= labels <= 2 + len(EXTRA_LABELS):
            raise ArgumentError(f"item_features={item_features}, labels={labels}: the synthetic log has "
                                f"0-{len(cols['item_features'])} item features and 1-{2 + len(EXTRA_LABELS)} labels")
        extra = EXTRA_LABELS[:max(0, labels - 2)]
        cols["item_features"] = cols["item_features"][:item_features]
        cols["labels"] = (cols["labels"] + list(extra))[:labels]
        for name in extra:
            schema = schema.append(pa.field(name, pa.int8(), False))
    return config.parse(cfg).layout(schema)


def _ms(d: dt.date) -> int:
    return (d - EPOCH).days * MS_DAY


def _light(rng, n_events: int, t0: int, t1: int, max_seq_len: int):
    """(event times, request times, begin, end) of a user with ``n_events`` events."""
    R = int(rng.integers(1, 6))
    ev_ts = np.sort(rng.integers(t0 - 3 * MS_DAY, t1, n_events)).astype(np.int64)
    rt = np.sort(rng.integers(t0, t1, R)).astype(np.int64)
    end = np.searchsorted(ev_ts, rt, side="left").astype(np.int32)  # strictly before
    begin = np.maximum(0, end - max_seq_len).astype(np.int32)
    lo, hi = int(begin.min()), int(end.max())
    return ev_ts[lo:hi], rt, begin - lo, end - lo


def _sized(rng, cost: int, t0: int, t1: int, max_seq_len: int):
    """(event times, request times, begin, end, impressions per request) of a sample of ``cost``."""
    R = int(rng.integers(2, 6))
    k = (rng.multinomial(max(R, cost // 3) - R, [1 / R] * R) + 1).astype(np.int32)
    L = max(0, cost - int(k.sum()))
    # the first request starts the stored range, the last one ends it
    end = np.sort(rng.integers(0, L + 1, R))
    end[0], end[-1] = min(end[0], max_seq_len, L), L
    end = np.sort(end).astype(np.int32)
    begin = np.maximum(0, end - max_seq_len).astype(np.int32)
    rt = (np.sort(rng.integers(t0, t1 - R, R)) + np.arange(R)).astype(np.int64)  # strictly increasing
    lows = np.r_[t0 - 3 * MS_DAY, rt[:-1]]
    counts = np.diff(np.r_[0, end])
    ev_ts = np.concatenate([np.sort(rng.integers(lo, hi, c)) for lo, hi, c in zip(lows, rt, counts)])
    return ev_ts.astype(np.int64), rt, begin, end, k


def _row(rng, *, user: int, chunk: int, kind: str, ws: dt.date, we: dt.date, ev_ts, rt, begin, end, k,
         null_share: float) -> dict:
    L, R, K = len(ev_ts), len(rt), int(k.sum())
    rids = [f"r{user}-{chunk}-{j}" if chunk else f"r{user}-{j}" for j in range(R)]
    req_day = [EPOCH + dt.timedelta(days=int(t // MS_DAY)) for t in rt]
    return {
        "format_version": schemas.FORMAT_VERSION, "sample_id": sample_id(kind, we, user, chunk), "kind": kind,
        "window_start": ws, "window_end": we, "user": user, "chunk": chunk,
        "num_requests": R, "num_impressions": K, "num_events": L, "cost": L + K,
        "seq_ts": ev_ts, "seq_item": rng.integers(0, 5000, L), "seq_category": rng.integers(0, 50, L).astype(np.int32),
        "seq_author": rng.integers(0, 900, L), "seq_action": rng.integers(1, 4, L),
        "req_id": rids, "req_time": rt, "req_seq_begin": begin, "req_seq_end": end, "req_num_imps": k,
        "req__request_id": rids, "req__request_ts": rt,
        "req__device": [["ios", "android", "web"][j % 3] for j in range(R)],
        "req__hour": rng.integers(0, 24, R).astype(np.int8), "req__age_bucket": np.full(R, user % 7, np.int8),
        "req__country": [("de", "fr", "jp")[user % 3]] * R,
        "imp__date": [req_day[r] for r in range(R) for _ in range(k[r])],
        "imp__action_ts": np.repeat(rt, k) + rng.integers(1, 5000, K),
        "imp__item_id": rng.integers(0, 5000, K), "imp__position": np.concatenate([np.arange(x) for x in k]).astype(np.int32),
        "imp__click": rng.integers(0, 2, K).astype(np.int8), "imp__like": (rng.random(K) < 0.1).astype(np.int8),
        "imp__category": rng.integers(0, 50, K).astype(np.int32), "imp__author": rng.integers(0, 900, K),
        "imp__score": [None if rng.random() < null_share else float(np.float32(rng.random())) for _ in range(K)],
    }


def make_samples(n: int, *, kind: str, window_start: str, window_end: str, seed: int, max_seq_len: int = 20,
                 max_events: int = 120, first_user: int = 0, null_share: float = 0.1, event_scale: float = 8.0,
                 heavy: int = 0, bot_chunks: int = 0, cap: int = 200, item_features: int = 2,
                 labels: int = 2) -> pa.Table:
    """One window's samples (shard schema): ``n`` light users from ``first_user`` on, then
    ``heavy`` users (three chunks each) and the bot (``bot_chunks`` chunks), in
    :func:`layout` ``(item_features, labels)``."""
    lay = layout(item_features, labels)
    schema = schemas.shard_schema(lay).to_arrow()
    extra = EXTRA_LABELS[:max(0, labels - 2)]
    rng = np.random.default_rng(seed)
    ws, we = dt.date.fromisoformat(str(window_start)), dt.date.fromisoformat(str(window_end))
    t0, t1 = _ms(ws), _ms(we)
    cols = {name: [] for name in schema.names}

    def add(row: dict) -> None:
        for name in extra:  # drawn after the row's own values: the synthetic log's rows stay as they are
            row[f"imp__{name}"] = (rng.random(len(row["imp__item_id"])) < 0.3).astype(np.int8)
        for c in cols:
            if c in CHAIN_COLUMNS:  # filled by _chains, for all the rows at once
                continue
            v = row[c]
            cols[c].append(v.tolist() if isinstance(v, np.ndarray) else v)

    # most small, a few heavy
    n_events = np.minimum(rng.pareto(1.2, n) * event_scale, max_events).astype(int)
    for i in range(n):
        ev_ts, rt, begin, end = _light(rng, n_events[i], t0, t1, max_seq_len)
        k = rng.integers(1, 5, len(rt)).astype(np.int32)
        add(_row(rng, user=first_user + i, chunk=0, kind=kind, ws=ws, we=we, ev_ts=ev_ts, rt=rt, begin=begin,
                 end=end, k=k, null_share=null_share))
    plan = [(HEAVY + u, c, int(rng.integers(cap // 2, cap))) for u in range(heavy) for c in range(3)]
    plan += [(BOT, c, cap - int(rng.integers(0, 4))) for c in range(bot_chunks)]
    for user, chunk, cost in plan:
        ev_ts, rt, begin, end, k = _sized(rng, cost, t0, t1, max_seq_len)
        add(_row(rng, user=user, chunk=chunk, kind=kind, ws=ws, we=we, ev_ts=ev_ts, rt=rt, begin=begin, end=end,
                 k=k, null_share=null_share))
    _chains(cols, lay)
    return pa.Table.from_pydict(cols, schema=schema)


def _chains(cols: dict, lay: schemas.Layout) -> None:
    """Fill the event chain columns of the rows in ``cols`` (schemas.hashing), vectorised
    across the samples, as the build computes them."""
    fields = [schemas.SEQ + sf.name for sf in schemas.chain_fields(lay)]
    n = np.array([len(x) for x in cols[fields[0]]], dtype=np.int64)
    off = np.concatenate([[0], np.cumsum(n)])
    flat = [np.concatenate([np.asarray(x, np.int64) for x in cols[f]] + [np.zeros(0, np.int64)]) for f in fields]
    h = rolling_hashes(event_hashes(flat), off)
    block = CHAIN_BLOCK
    cols["chain_block"] = [block] * len(n)
    cols["chain_checkpoints"], cols["chain_end"] = [], []
    for a, b in zip(off[:-1].tolist(), off[1:].tolist()):
        cps, end = chain_checkpoints(h[a:b], b - a, block)
        cols["chain_checkpoints"].append(cps.tolist())
        cols["chain_end"].append(end)


def build_samples(*, seed: int = 0, users: int = 40, heavy: int = 3, bot_chunks: int = 16, windows: int = 3,
                  cap: int = 200, null_share: float = 0.0) -> pa.Table:
    """A build's samples table: a pretrain set and ``windows`` daily windows (the last one
    ends at ``BUILD_START + windows - 1`` days), each with ``users`` light users, ``heavy``
    users in three chunks and the bot in ``bot_chunks`` chunks, costs below ``cap``.
    ``null_share``: the share of null ``imp__score`` elements (none by default: a table
    that travels through pandas into Spark would turn them into NaN)."""
    sets = [("pretrain", dt.date(2025, 12, 1), BUILD_START - dt.timedelta(days=1))]
    sets += [("incremental", BUILD_START + dt.timedelta(days=i - 1), BUILD_START + dt.timedelta(days=i))
             for i in range(windows)]
    parts = [make_samples(users, kind=kind, window_start=ws.isoformat(), window_end=we.isoformat(),
                          seed=seed * 100 + i, max_events=cap // 2, heavy=heavy, bot_chunks=bot_chunks, cap=cap,
                          null_share=null_share)
             for i, (kind, ws, we) in enumerate(sets)]
    return pa.concat_tables(parts)


def long_user_samples(*, events: int = 100_000, max_seq_len: int = 16_000, requests: int = 8,
                      impressions: tuple[int, int] = (4, 40), light: int = 3, seed: int = 0,
                      window_start: str = "2025-11-01", window_end: str = "2026-01-01") -> pa.Table:
    """A set's samples (shard schema, :func:`layout`): one heavy user (:data:`HEAVY`) whose one
    chunk stores ``events`` events and ``requests`` requests spread over its history at L =
    ``max_seq_len`` (the first sees the events before its window, the last all of them; each
    sees ``[max(0, end - L), end)``), ``impressions`` (low, high) per request, then ``light``
    light users. Arrays stay numpy until one :func:`_row`; about 10 MB per 100K events.

    Example::

        t = long_user_samples(events=100_000, max_seq_len=16_000)
        t.column("num_events")[0].as_py()   # 100000
    """
    if not (events >= requests >= 1 and max_seq_len >= 1 and 1 <= impressions[0] <= impressions[1]):
        raise ArgumentError(f"events={events}, requests={requests}, max_seq_len={max_seq_len}, impressions="
                            f"{impressions}: use events >= requests >= 1, max_seq_len >= 1, 1 <= low <= high")
    lay = layout()
    schema = schemas.shard_schema(lay).to_arrow()
    rng = np.random.default_rng(seed)
    ws, we = dt.date.fromisoformat(window_start), dt.date.fromisoformat(window_end)
    t0, t1 = _ms(ws), _ms(we)
    # request r sees the first end[r] events: the first a part of the history, the last all of it
    end = np.unique(np.linspace(max(1, min(max_seq_len, events) // 2), events, requests).astype(np.int64))
    R = len(end)
    # one walk of strictly increasing times through the events and the requests: request r comes
    # after the first end[r] events (strictly after the last it sees) and before the next one;
    # the end[0] events before the first request lie in the week before the window
    n0, rest = int(end[0]), events + R - int(end[0])
    pre = t0 - 7 * MS_DAY + np.cumsum(rng.integers(1, max(2, 7 * MS_DAY // max(1, n0)), n0))
    step = max(2, (t1 - t0) // rest)
    times = np.concatenate([pre, t0 + np.cumsum(rng.integers(1, step, rest)) - 1])
    is_req = np.zeros(events + R, bool)
    is_req[end + np.arange(R)] = True
    rt, ev_ts = times[is_req], times[~is_req]
    begin = np.maximum(0, end - max_seq_len).astype(np.int32)
    k = rng.integers(impressions[0], impressions[1] + 1, R).astype(np.int32)
    row = _row(rng, user=HEAVY, chunk=0, kind="pretrain", ws=ws, we=we, ev_ts=ev_ts, rt=rt, begin=begin,
               end=end.astype(np.int32), k=k, null_share=0.0)
    cols = {c: [v.tolist() if isinstance(v, np.ndarray) else v] for c, v in row.items() if c in schema.names}
    _chains(cols, lay)
    heavy = pa.Table.from_pydict(cols, schema=schema)
    if not light:
        return heavy
    return pa.concat_tables([heavy, make_samples(light, kind="pretrain", window_start=window_start,
                                                 window_end=window_end, seed=seed + 1, max_seq_len=max_seq_len,
                                                 null_share=0.0)])


def write_shard_set(root: str, *, nodes: int = 1, ranks_per_node: int = 2, sets=DEFAULT_SETS, seed: int = 0,
                    row_group_rows: int = 8, gds: bool = False, uneven: bool = True, compression: str = "zstd",
                    dictionary: str = "all", **sample_kw) -> dict:
    """Write a shard set under ``root`` (node=k/shard-NNNNN.parquet, .gds with ``gds``, and
    manifest.json, last); return its manifest. ``sets``: (kind, window_start, window_end,
    samples) per set, in training order; ``sample_kw`` go to :func:`make_samples`."""
    from userwise.pipelines.shards import gds as gdsmod
    from userwise.pipelines.shards import preshard, writer

    schema = schemas.shard_schema(layout(sample_kw.get("item_features", 2), sample_kw.get("labels", 2))).to_arrow()
    slots = nodes * ranks_per_node
    plan, stats = [], []
    first_user = 0
    for si, (kind, ws, we, n) in enumerate(sets):
        t = make_samples(n, kind=kind, window_start=ws, window_end=we, seed=seed * 100 + si, first_user=first_user,
                         **sample_kw)
        first_user += n
        # uneven: slot j gets a weight 1 + j (mod 3), so shard sizes differ
        w = np.array([1 + (j % 3) if uneven else 1 for j in range(slots)], float)
        counts = np.floor(w / w.sum() * t.num_rows).astype(int)
        counts[0] += t.num_rows - counts.sum()
        starts = np.concatenate([[0], np.cumsum(counts)])
        costs = np.asarray(t["cost"])
        plan.append({"id": preshard.set_id(kind, we), "kind": kind,
                     "window_start": ws, "window_end": we, "shards_per_rank": 1, "shard_base": si * slots,
                     "slot_rows": counts.tolist(),
                     "slot_cost": [int(costs[starts[j]:starts[j + 1]].sum()) for j in range(slots)],
                     "max_cost": int(costs.max()) if len(costs) else 0})
        for j in range(slots):
            node, rank = divmod(j, ranks_per_node)
            part = t.slice(starts[j], counts[j])
            shard = si * slots + j
            rel = writer.shard_name(shard, node)
            path = os.path.join(root, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            pq.write_table(part, path, row_group_size=row_group_rows, compression=compression,  # as preshard writes
                           use_dictionary=writer.parse_dictionary(dictionary, part.schema),
                           **writer.PARQUET_OPTIONS)
            imps = int(np.asarray(part["num_impressions"]).sum())
            entry = {
                "shard": shard, "path": rel, "node": node, "rank": rank, "rows": part.num_rows,
                "events": int(np.asarray(part["num_events"]).sum()), "impressions": imps,
                "cost": int(np.asarray(part["cost"]).sum()), "bytes": os.path.getsize(path),
                "row_groups": pq.ParquetFile(path).metadata.num_row_groups, "sha256": mf.file_sha256(path),
                "gds_path": None, "gds_bytes": None, "gds_sha256": None,
            }
            if gds:
                g = rel[: -len(".parquet")] + ".gds"
                info = gdsmod.write_side_file(path, os.path.join(root, g))
                entry.update(gds_path=g, gds_bytes=info["bytes"], gds_sha256=info["sha256"])
            stats.append(entry)
    cfg = {"schema": schema, "layout": "gds" if gds else "parquet", "dictionary": dictionary,
           "compression": writer.parse_compression(compression, schema), "row_group_rows": row_group_rows}
    manifest = preshard.assemble(cfg=cfg, sets=plan, stats=stats, nodes=nodes, ranks_per_node=ranks_per_node,
                                 seed=seed, source={"table": os.path.join(root, "samples"), "version": 0})
    mf.write(root, manifest)
    return manifest


def all_rows(root: str, node: int | None = None) -> pa.Table:
    """Every sample row of a set (of one node), read back plainly (the test oracle)."""
    m = mf.load(root)
    shards = m["shards"] if node is None else mf.node_shards(m, node)
    return pa.concat_tables([pq.read_table(os.path.join(root, s["path"])) for s in shards])
