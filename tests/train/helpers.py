"""What the trainer's tests share: real-shaped batches from shardgen shard sets, and random
synthetic batches with the pointer's edge cases (no history, spans that start after the
sample's first event, requests with the same span, samples with no events)."""

from __future__ import annotations

import numpy as np
import torch

from userwise.pipelines.jagged import pack
from userwise.pipelines.loader import JaggedBatch, UserwiseDataset, UserwiseLoader
from userwise.pipelines.tools.shardgen import write_shard_set
from userwise.pipelines.train import Spans, UserBatch


def shard_set(root: str, *, max_seq_len: int, samples: int = 80, seed: int = 0, **kw) -> str:
    write_shard_set(root, nodes=1, ranks_per_node=1, row_group_rows=16, seed=seed, max_seq_len=max_seq_len,
                    sets=(("incremental", "2026-01-04", "2026-01-05", samples),), **kw)
    return root


def jagged_batches(root: str, batch_size: int = 16, **kw) -> list:
    ds = UserwiseDataset(root, batch_size=batch_size, world_size=1, rank=0, verify="none", **kw)
    return list(UserwiseLoader(ds, num_workers=0))


def with_arrays(batch: JaggedBatch, arrays: dict) -> JaggedBatch:
    """``batch`` with some arrays replaced (any lengths), packed as the loader packs a batch:
    a forged batch for the checks that refuse one."""
    items = [(n, t.dtype, t.numel(), lambda view, t=t: view.copy_(t)) for n in batch.keys()
             for t in [arrays[n] if n in arrays else batch[n]]]
    buf, spec = pack(items, lambda n: torch.empty(n, dtype=torch.uint8, device=batch.device))
    return JaggedBatch(buf, spec, dict(batch.meta))


def synthetic(seed: int, *, samples: int = 6, max_len: int = 5, side: int = 2) -> UserBatch:
    """A random user-wise batch that obeys the pointer: per sample a sorted stream of events,
    requests in time order, ``end`` = events strictly before the request, ``begin =
    max(0, end - max_len)``, the stored range cut to [min begin, max end)."""
    rng = np.random.default_rng(seed)
    so, ro, io, rb, re, ir = [0], [0], [0], [], [], []
    for _ in range(samples):
        n_req = int(rng.integers(1, 5))
        ev_t = np.sort(rng.integers(0, 100, int(rng.integers(0, 4 * max_len))))
        rt = np.sort(rng.integers(0, 110, n_req))
        if n_req > 1 and rng.random() < 0.3:
            rt[1] = rt[0]  # two requests at the same time: the same span
        end = np.searchsorted(ev_t, rt, side="left")
        begin = np.maximum(0, end - max_len)
        lo, hi = int(begin.min()), int(end.max())
        k = rng.integers(1, 4, n_req)
        so.append(so[-1] + hi - lo)
        rb += (begin - lo).tolist()
        re += (end - lo).tolist()
        ir += np.repeat(np.arange(ro[-1], ro[-1] + n_req), k).tolist()
        ro.append(ro[-1] + n_req)
        io.append(io[-1] + int(k.sum()))
    t = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
    sp = Spans.from_arrays(seq_offsets=t(so), req_offsets=t(ro), req_begin=t(rb), req_end=t(re), imp_offsets=t(io),
                           imp_req=t(ir))
    T, N = so[-1], io[-1]
    g = torch.Generator().manual_seed(seed)
    ids = lambda *s: torch.randint(0, 1 << 20, s, generator=g)  # noqa: E731
    return UserBatch(ev_item=ids(T), ev_side=ids(T, side), ev_action=torch.randint(1, 4, (T,), generator=g),
                     tgt_item=ids(N), tgt_side=ids(N, side), labels=torch.randint(0, 2, (N, 2), generator=g).float(),
                     spans=sp)
